"""The MTP layer a Qwen3.5 checkpoint ships (`mtp.*`, random here beside a tiny random model, fp32)
as the draft of `{"method": "mtp"}`: its chain of drafts after a chunked prefill is the layer's as
transformers' own modules compute it from the target's final hidden states; greedy tokens with its
drafts (mostly rejected: random weights) are transformers' through the engine, with chunked
prefill and the prefix cache's snapshots; an echo target with an echo MTP layer (dummy_echo) has
every draft accepted; a server with the mtp method answers /generate as without it."""

import pytest
import torch
from helpers.models import assert_idle, hf_greedy, make_runner
from helpers.mtp import add_mtp, reference_chain
from test_hybrid_models import make_hybrid
from test_hybrid_spec import spec_hybrid_engine

from lightllm.engine.plan import Chunk, DraftRequest, StepPlan
from lightllm.engine.request import GenerateReq, SamplingParams
from lightllm.models import ModelConfigError

K = 4  # as spec_hybrid_engine drafts
MTP = f'{{"method": "mtp", "num_speculative_tokens": {K}}}'
PROMPTS = [[(5 * i + 2) % 101 for i in range(23)], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
NEW = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(model dir, transformers model, the mtp tensors, transformers' greedy tokens of PROMPTS)."""
    path = tmp_path_factory.mktemp("qwen3_5_mtp")
    hf_model = make_hybrid("qwen3_5", path)
    with torch.no_grad():  # a final norm far from a uniform scale: a feature taken before it would differ
        gen = torch.Generator().manual_seed(9)
        hf_model.model.norm.weight.copy_(torch.randn(hf_model.config.hidden_size, generator=gen))
    hf_model.save_pretrained(path)
    mtp = add_mtp(path)
    expected = hf_greedy(hf_model, PROMPTS, NEW)
    return path, hf_model, mtp, [expected[i] for i in range(len(PROMPTS))]


def test_the_proposals_are_the_mtp_layer_of_transformers_modules(checkpoint):
    path, hf_model, mtp, _ = checkpoint
    runner = make_runner(path, tokens=256, max_req_total_len=64, running_max_req_size=2, speculative_config=MTP)
    prompt, greedy = PROMPTS[0], SamplingParams()
    runner.step(StepPlan(1, [], [Chunk(0, prompt[:13], 0, False, greedy)], sync=True))
    (result,) = runner.step(StepPlan(2, [], [Chunk(0, prompt[13:], 13, True)], sync=True))
    sequence = prompt + [result.tokens[0].token_id]
    (drafts, draft_len), = runner.draft([DraftRequest(0, 0, tuple(sequence), K)])
    assert draft_len == len(prompt)
    assert list(drafts) == reference_chain(hf_model, mtp, sequence, K)


def test_greedy_with_mtp_drafts_equals_transformers(checkpoint):
    path, _, _, expected = checkpoint
    runner = make_runner(path, tokens=512, max_req_total_len=64, running_max_req_size=2, state_snapshot_slots=4,
                         speculative_config=MTP)
    core = spec_hybrid_engine(runner, "mtp", drafter=runner.draft)
    for i, prompt in enumerate(PROMPTS + PROMPTS[:1]):  # the last: resumed from a snapshot
        core.add(GenerateReq(i, prompt, SamplingParams(max_new_tokens=NEW)))
    got = {}
    for out in core.drain():
        got.setdefault(out.req_id, []).append(out)
    assert [[o.token_id for o in got[i]] for i in range(3)] == expected + expected[:1]
    assert got[2][0].cached_tokens == 16
    spec = core.scheduler.speculator
    assert spec.num_draft_tokens > spec.num_accepted_tokens  # drafts ran, and were rejected
    assert_idle(core)


def test_an_echo_mtp_layer_over_an_echo_target_has_every_draft_accepted(checkpoint):
    path = checkpoint[0]
    runner = make_runner(path, tokens=256, max_req_total_len=64, running_max_req_size=2, speculative_config=MTP,
                         load_format="dummy_echo")
    core = spec_hybrid_engine(runner, "mtp", drafter=runner.draft)
    core.add(GenerateReq(0, PROMPTS[1], SamplingParams(max_new_tokens=NEW)))
    tokens = [o.token_id for o in core.drain()]
    assert tokens == [PROMPTS[1][-1]] * NEW  # an echo target answers each token with itself
    spec = core.scheduler.speculator
    assert spec.num_accepted_tokens == spec.num_draft_tokens > NEW // 2


def test_a_target_without_mtp_layers_is_refused(tmp_path):
    make_hybrid("qwen3_5", tmp_path)
    with pytest.raises(ModelConfigError, match="MTP layers"):
        make_runner(tmp_path, speculative_config=MTP)


def drafted_greedy(runner, prompt: list[int], new: int) -> tuple[list[int], list[tuple[int, ...]]]:
    """Prefill, then at every step the MTP layer's drafts (K, fewer near the end), verified:
    (the tokens, the drafts proposed at each step)."""
    (result,) = runner.step(StepPlan(1, [], [Chunk(0, prompt, 0, True, SamplingParams())], sync=True))
    tokens, proposed, draft_len = [result.tokens[0].token_id], [], 0
    while len(tokens) < new:
        sequence = prompt + tokens
        (drafts, draft_len), = runner.draft([DraftRequest(0, draft_len, tuple(sequence[draft_len:]), K)])
        drafts = drafts[: new - len(tokens) - 1]
        proposed.append(drafts)
        (result,) = runner.step(StepPlan(len(proposed) + 1, [0], drafts={0: list(drafts)}, sync=True))
        tokens += [t.token_id for t in result.tokens]
    runner.free([0])
    return tokens, proposed


def _tp_worker(rank, port, model_dir, out_file):
    from test_tp import leave_together

    runner = make_runner(model_dir, tokens=256, max_req_total_len=64, running_max_req_size=2,
                         speculative_config=MTP, tp_rank=rank, tp=2, nccl_port=port)
    result = drafted_greedy(runner, PROMPTS[0], NEW)
    if rank == 0:
        torch.save(result, out_file)
    leave_together()


def test_tp2_drafts_and_tokens_are_tp1s(checkpoint, tmp_path):
    """Two gloo ranks (each half of the heads of the linear layers, of the attention and of the MTP
    layer's attention; the verify commit on each rank's share of the states) propose tp 1's drafts
    and keep tp 1's tokens, which are transformers'."""
    import torch.multiprocessing as mp
    from test_tp import free_port

    path, _, _, expected = checkpoint
    runner = make_runner(path, tokens=256, max_req_total_len=64, running_max_req_size=2, speculative_config=MTP)
    tp1 = drafted_greedy(runner, PROMPTS[0], NEW)
    assert tp1[0] == expected[0] and any(tp1[1])
    mp.spawn(_tp_worker, args=(free_port(), path, tmp_path / "tp2.pt"), nprocs=2, join=True)
    assert torch.load(tmp_path / "tp2.pt") == tp1


def test_a_server_with_the_mtp_method_answers_as_transformers(tmp_path_factory):
    """bench_model's tiny-qwen3.5 with MTP layers written beside it (random: the point is that greedy
    text is unchanged): the worker loads the layer, /info shows the config, /generate's greedy text
    is transformers'. (Whether the controller drafts in so short a run depends on its timing; the
    engine tests above draft at every step.)"""
    import json

    import requests
    from server_utils import start_server
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightllm.tools.bench_model import write_bench_model

    model_dir = write_bench_model(tmp_path_factory.mktemp("tiny-qwen3.5"), "tiny-qwen3.5")
    add_mtp(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    model.generation_config.eos_token_id = None
    prompt, new = "the river runs over the stone light and the cache of every batch", 32
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    server = start_server(["--model_dir", str(model_dir), "--speculative_config", MTP],
                          tmp_path_factory.mktemp("server") / "server.log")
    try:
        server.wait_for_log_line("loaded the MTP layer", timeout=10)
        assert requests.get(f"{server.url}/info", timeout=10).json()["speculative_config"] == json.loads(MTP)
        assert server.generate(prompt, max_new_tokens=new, ignore_eos=True)["generated_text"] == [expected]
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("preset", ["qwen3.5-27b", "qwen3.5-35b-a3b"])
def test_the_presets_mtp_layer_asks_for_a_decoder_layers_tensors(preset, default_model_dir, tmp_path):
    """At the published shapes (meta device, tp 2): the MTP layer asks for fc [H, 2H], its three
    norms, and under mtp.layers.0 exactly what the model asks for of a full-attention layer (the
    MoE's experts and shared expert included)."""
    from test_model_families import MetaWeights

    from lightllm.models import read_config
    from lightllm.models.mtp import MtpHead
    from lightllm.models.qwen3_next import HybridModel
    from lightllm.tools.bench_model import write_bench_model
    from lightllm.utils.dist import TPGroup

    cfg = read_config(write_bench_model(tmp_path / preset, preset, tokenizer_dir=default_model_dir))
    model_weights, mtp_weights = MetaWeights(), MetaWeights()
    target = HybridModel(cfg, model_weights, TPGroup(1, 2), 256, torch.device("meta"))
    MtpHead(cfg, mtp_weights, TPGroup(1, 2), target)
    full = next(i for i in range(cfg.num_layers) if i not in cfg.linear_attn.layers)
    layer = f"{cfg.linear_attn.weight_prefix}.layers.{full}."  # model.language_model: as published
    expected = {f"mtp.layers.0.{n[len(layer):]}": s for n, s in model_weights.shapes().items() if n.startswith(layer)}
    hidden = cfg.hidden_size
    expected["mtp.fc.weight"] = (hidden, 2 * hidden)
    expected.update({f"mtp.{n}.weight": (hidden,) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")})
    assert mtp_weights.shapes() == expected
