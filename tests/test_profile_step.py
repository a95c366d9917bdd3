"""test/benchmark/engine/profile_step.py runs end to end on the CPU (tiny model) and reports what it
promises: per decode batch the step one in flight, alone, and the host's launch time against
the floor, then the eager steps."""

import re

from benchmark.engine import profile_step


def profile_tiny(tmp_path, *args: str) -> str:
    """profile_step.py's report on the tiny model on the CPU, run with these extra arguments."""
    from lightllm.tools.bench_model import write_bench_model

    model = write_bench_model(tmp_path / "tiny", "tiny", seed=0)
    out = tmp_path / "profile.md"
    assert profile_step.main([
        "--model", str(model), "--device", "cpu", "--dtype", "float32", "--context", "16", "--warmup", "1",
        "--mixed-chunk", "8", "--max-req-total-len", "512", "--running-max-req-size", "4", *args,
        "--out-md", str(out)]) == 0
    return out.read_text()


def test_profile_step_reports_every_measure(tmp_path):
    text = profile_tiny(tmp_path, "--batches", "1,3", "--iters", "2", "--host-steps", "2", "--mixed-decodes", "2",
                        "--max-total-token-num", "2048")
    number = r"\d+\.\d+"
    for batch in (1, 3):
        section = text.split(f"### Decode, batch {batch}, context 16")[1].split("###")[0]
        for measure in ("engine step, one in flight", "engine step alone", "host launch of a step"):
            assert re.search(rf"\| {measure}[^|]*\| {number} \|", section), (batch, measure)
        floor, measured = re.search(rf"one in flight[^|]*\| ({number}) \| ({number}) \|", section).groups()[::-1]
        assert 0 < float(floor) and 0 < float(measured)
    assert re.search(rf"\| prefill 1 x 128 \| {number} \|", text)
    assert re.search(rf"\| mixed: 2 decodes \+ 1 x 8 \| {number} \|", text)


def test_profile_step_cuts_the_mixed_steps_prompt_tokens_into_prompts(tmp_path):
    text = profile_tiny(tmp_path, "--batches", "1", "--iters", "1", "--host-steps", "1", "--mixed-decodes", "2",
                        "--mixed-prompts", "4", "--running-max-req-size", "8", "--max-total-token-num", "1024")
    assert re.search(r"\| mixed: 2 decodes \+ 4 x 2 \| \d+\.\d+ \|", text)


def test_profile_step_fits_the_mixed_step_to_the_request_rows(tmp_path):
    """--mixed-decodes beyond the rows --running-max-req-size leaves: the mixed step takes every
    row but the chunk's, instead of failing with OutOfRowsError after the decode sections."""
    text = profile_tiny(tmp_path, "--batches", "1", "--iters", "1", "--host-steps", "1", "--mixed-decodes", "64",
                        "--max-total-token-num", "4096")
    assert re.search(r"\| mixed: 3 decodes \+ 1 x 8 \| \d+\.\d+ \|", text)


def test_fp8_kernels_are_labelled_by_their_place_in_the_layer():
    names = ["_rms_norm_kernel", "_quantize_rows_kernel", "_fp8_gemm_small_m_kernel",
             "_rotary_kv_kernel", "_decode_split_kernel",
             "_quantize_rows_kernel", "_fp8_gemm_small_m_kernel", "_rms_norm_kernel", "_quantize_rows_kernel",
             "sm90_xmma_gemm_e4m3", "_silu_and_mul_kernel", "_quantize_rows_kernel", "_fp8_gemm_small_m_kernel",
             "sm90_xmma_splitKreduce", "_rms_norm_kernel", "nvjet_sm90_tst_lm"]
    labels = [g for g, _, _ in profile_step.label_kernels([(n, i, i + 1) for i, n in enumerate(names)], 1)]
    assert [g for g in labels if g.startswith("GEMM") and "split" not in g] == [
        "GEMM qkv", "GEMM o", "GEMM gate_up", "GEMM down", "GEMM lm_head"]
    assert labels.count("fp8 input quantisation") == 4 and labels.count("GEMM split-K reduction") == 1


def test_an_eager_mixed_steps_gemms_are_labelled_across_its_memsets():
    """An eager step has memsets between the kernels (about 4 a layer in the burst step); they do not
    hide a GEMM's neighbours."""
    names = ["_rms_norm_kernel", "Memset (Device)", "nvjet_qkv", "_rotary_kv_kernel", "_decode_split_kernel",
             "Memset (Device)", "_extend_kernel", "Memset (Device)", "nvjet_o", "_rms_norm_kernel", "nvjet_gate_up",
             "_silu_and_mul_kernel", "Memset (Device)", "nvjet_down", "_rms_norm_kernel", "nvjet_lm"]
    labels = [g for g, _, _ in profile_step.label_kernels([(n, i, i + 1) for i, n in enumerate(names)], 1)]
    assert [g for g in labels if g.startswith("GEMM")] == ["GEMM qkv", "GEMM o", "GEMM gate_up", "GEMM down",
                                                           "GEMM lm_head"]


def test_a_hybrid_layers_kernels_are_labelled_by_their_place():
    """Qwen3.5's decode: a linear layer's in_proj (before its gates and conv) and out_proj (after the
    gated norm), then an attention layer's and the MLPs' as for the dense families."""
    names = ["_rms_norm_kernel", "nvjet_in", "_linear_gates_kernel", "_causal_conv1d_step_kernel",
             "_gated_delta_rule_step_kernel", "_gated_rms_norm_kernel", "nvjet_out", "_rms_norm_kernel", "nvjet_gu",
             "_silu_and_mul_kernel", "nvjet_down", "_rms_norm_kernel", "nvjet_qkv", "_rms_norm_kernel",
             "_rotary_kv_kernel", "_decode_split_kernel", "sigmoid_mul", "nvjet_o", "_rms_norm_kernel", "nvjet_lm"]
    labels = [g for g, _, _ in profile_step.label_kernels([(n, i, i + 1) for i, n in enumerate(names)], 1)]
    assert [g for g in labels if g.startswith("GEMM")] == ["GEMM in_proj", "GEMM out_proj", "GEMM gate_up",
                                                           "GEMM down", "GEMM qkv", "GEMM o", "GEMM lm_head"]
    assert {"linear gates", "causal conv", "delta rule step (states)", "gated norm"} <= set(labels)
    # a prompt chunk's: the state movers around fla's kernels are theirs, not fla's
    groups = [profile_step.group_of(n) for n in ("_chunk_states_in_kernel", "chunk_fwd_kernel_o",
                                                 "_chunk_states_out_kernel", "_causal_conv1d_blocks_kernel")]
    assert groups == ["chunk states in/out (fla path)", "fla chunk kernels", "chunk states in/out (fla path)",
                      "causal conv"]


def test_a_hybrid_models_projections_are_its_checkpoints(tmp_path):
    """projection_params counts what a hybrid checkpoint holds: every 2-D projection of its layers
    (linear layers' in/out projections, gated attention's doubled q, the MLPs), the embedding and
    LM head apart; and its KV bytes come from the attention layers only."""
    from safetensors import safe_open

    from lightllm.models import read_config
    from lightllm.tools.bench_model import write_bench_model
    from benchmark.engine.static_benchmark import kv_bytes_per_token, projection_params

    model = write_bench_model(tmp_path / "tiny", "tiny-qwen3.5", seed=0)
    cfg = read_config(model)
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        held = sum(f.get_slice(name).get_shape()[0] * f.get_slice(name).get_shape()[1] for name in f.keys()
                   if ".layers." in name and name.endswith("proj.weight") or "in_proj_" in name)
    assert projection_params(cfg) == held
    assert kv_bytes_per_token(cfg, 2) == 2 * (cfg.num_layers - len(cfg.linear_attn.layers)) * cfg.num_kv_heads * cfg.head_dim * 2


def test_fp8_weight_bytes_count_projections_at_one_byte(tmp_path):
    import dataclasses

    from lightllm.models import read_config
    from lightllm.tools.bench_model import write_bench_model
    from benchmark.engine.static_benchmark import weight_bytes

    cfg = read_config(write_bench_model(tmp_path / "tiny", "tiny", seed=0))
    fp8 = dataclasses.replace(cfg, quantization="fp8")
    d, kv = cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    projections = cfg.num_layers * (cfg.hidden_size * (cfg.num_heads * d * 2 + 2 * kv)
                                    + 3 * cfg.hidden_size * cfg.intermediate_size)
    assert weight_bytes(cfg, 2) - weight_bytes(fp8, 2) == projections


def test_the_tp_profile_groups_kernels_with_the_all_reduce_apart():
    """allreduce_bench's by-group table: an all-reduce after the o and down projections neither
    takes a GEMM's label nor hides the neighbours that name it; each group sums its kernels."""
    from benchmark.kernels import allreduce_bench

    names = ["_rms_norm_kernel", "nvjet_qkv", "_rotary_kv_kernel", "_decode_split_kernel", "nvjet_o",
             "one_shot_all_reduce_kernel", "_rms_norm_kernel", "nvjet_gate_up", "_silu_and_mul_kernel", "nvjet_down", "one_shot_all_reduce_kernel", "_rms_norm_kernel", "nvjet_lm", "ncclAllGather"]
    kernels = [(n, 10.0 * i, 10.0 * i + 2) for i, n in enumerate(names)]
    row = allreduce_bench.step_breakdown(kernels, steps=2, step_ms=0.2)
    groups = row["groups"]
    for gemm in ("qkv", "o", "gate_up", "down", "lm_head"):
        assert groups[f"GEMM {gemm}"] == 1.0  # one 2 us kernel over 2 steps
    assert groups["all-reduce"] == 2.0 and groups["all-gather"] == 1.0
    assert groups["rms norm (+ residual)"] == 3.0 and groups["attention (decode)"] == 1.0
    assert sum(groups.values()) == len(names)
    table = allreduce_bench.group_table([{"mode": "symmetric", "batch": 1, **row}])
    assert "| GEMM o | 1 |" in table and f"| all kernels | {len(names)} |" in table


def test_the_roofline_prices_a_step_from_its_shape(tmp_path):
    """step_work's GEMMs read the projections' weights once (projection_params) and do two FLOPs a
    weight a token; a group's floor is the larger of its bytes at the bandwidth and its FLOPs at peak,
    and its 'of peak' is that floor over its time."""
    from lightllm.models import read_config
    from lightllm.tools.bench_model import write_bench_model
    from benchmark.engine.static_benchmark import projection_params

    cfg = read_config(write_bench_model(tmp_path / "tiny", "tiny", seed=0))
    one = profile_step.step_work(cfg, 2, 2, [10], [])
    many = profile_step.step_work(cfg, 2, 2, [10] * 3, [(0, 5), (4, 8)])
    gemms = ("GEMM qkv", "GEMM o", "GEMM gate_up", "GEMM down")
    tokens = 3 + 5 + 8
    assert sum(many[g][1] for g in gemms) == 2 * tokens * projection_params(cfg)
    weights = projection_params(cfg) * 2
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    activations = cfg.num_layers * ((h + q + 2 * kv) + (q + h) + (h + 2 * i) + (i + h)) * 2  # one token in and out
    assert sum(one[g][0] for g in gemms) == weights + activations
    assert many["GEMM lm_head"][1] == 2 * 5 * cfg.hidden_size * cfg.vocab_size  # a logit row a request
    assert "attention (extend)" not in one and many["attention (decode)"][1] == 3 * one["attention (decode)"][1]
    # prompt (4 cached, 8 new) attends to more keys than (0, 8): the causal pairs
    kv_heads = cfg.num_heads * cfg.head_dim * 4.0 * cfg.num_layers
    assert many["attention (extend)"][1] == kv_heads * (5 * (0 + 3) + 8 * (4 + 4.5))
    roof = profile_step.Roofline(bandwidth=1e9, peak=1e12)
    qkv_bytes, qkv_flops = one["GEMM qkv"]
    floor_us, bound = roof.floor_us(qkv_bytes, qkv_flops)
    assert bound == "memory" and floor_us == 1e6 * qkv_bytes / 1e9
    # one step of two kernels: the qkv GEMM took twice its floor, a copy has no floor (all of it lost)
    kernels = [("_rms_norm_kernel", 0.0, 1.0), ("nvjet_qkv", 1.0, 1.0 + 2 * floor_us), ("_rotary_kv_kernel", 0.0, 1.0),
               ("Memcpy DtoD", 0.0, 5.0)]
    lines = profile_step.kernel_table(kernels, 1, 1.0, "t", 1, one, roof, "decode 1 x 10")
    qkv_row = next(line for line in lines if line.startswith("| GEMM qkv |"))
    assert qkv_row.endswith("| 50% | memory |"), qkv_row
    (step, _, _, floor_ms, losses), = roof.rows
    assert step == "decode 1 x 10" and losses[0][1] in ("GEMM qkv", "copies")
    assert abs(floor_ms - (floor_us + roof.floor_us(*one["rms norm (+ residual)"])[0]
                           + roof.floor_us(*one["rotary + kv write"])[0]) / 1000) < 1e-9
    assert "| decode 1 x 10 |" in "\n".join(profile_step.roofline_table(roof))
