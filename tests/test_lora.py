"""LoRA adapters (lightllm/models/lora.py) through the engine: greedy output under each adapter
equal to PEFT's on transformers on the same weights, a batch mixing adapters (and the base model)
equal to each request alone, and a prefix cache that never gives one adapter's KV to another.
Tiny random fp32 Llama, tiny random adapters (B random and non-zero: PEFT starts B at zero)."""

import json

import pytest
from helpers.models import assert_idle, make_model, make_runner, random_prompts
from helpers.lora import ALL_TARGETS, make_adapter, peft_greedy

from lightllm.engine.core import EngineCore
from lightllm.engine.request import FinishReason, GenerateReq, Req, SamplingParams
from lightllm.engine.scheduler import Scheduler
from lightllm.common.lora_files import LoraAdapterError, read_adapter
from lightllm.models import read_config
from lightllm.models.lora import module_shapes
from lightllm import kernels as lora_lib

NEW_TOKENS = 8
# name -> (rank, alpha, target modules, rslora)
ADAPTERS = {"all_r8": (8, 16, ALL_TARGETS, False), "attn_r4_rslora": (4, 8, ["q_proj", "v_proj", "o_proj"], True),
            "mlp_r2": (2, 5, ["gate_proj", "up_proj", "down_proj"], False)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_base")
    make_model("llama_gqa_llama3_rope", out, seed=3)
    return out


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    out = {}
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        out[name] = tmp_path_factory.mktemp(name)
        make_adapter(model_dir, out[name], *spec, seed=seed)
    return out


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(11, lengths=(5, 14, 9))


@pytest.fixture(scope="module")
def expected(model_dir, adapters, prompts):
    """PEFT's greedy tokens per adapter name (None: the base model), per prompt."""
    out = {None: peft_greedy(model_dir, None, prompts, NEW_TOKENS)}
    for name, path in adapters.items():
        out[name] = peft_greedy(model_dir, path, prompts, NEW_TOKENS)
        assert out[name] != out[None], f"adapter {name} changes nothing: the test would not see it"
    return out


@pytest.fixture(scope="module")
def runner(model_dir, adapters):
    modules = tuple(f"{name}={path}" for name, path in adapters.items())  # ids 1, 2, 3
    return make_runner(model_dir, tokens=512, max_req_total_len=64, lora_modules=modules, max_loras=2,
                       max_lora_rank=8)


IDS = {name: i for i, name in enumerate([None, *ADAPTERS])}  # adapter name -> its engine id


def engine(runner, chunk: int, prefix_cache: bool = True) -> EngineCore:
    scheduler = Scheduler(runner.max_total_token_num, chunk, runner.req_table.max_reqs, prefix_cache=prefix_cache,
                          max_loras=2, lora_ids=(1, 2, 3))
    return EngineCore(scheduler, runner, eos_token_ids=[])


def run(core, requests, first_id):
    """requests: (prompt, adapter name); all at once; the greedy tokens of each."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    got = {}
    for i, (prompt, name) in enumerate(requests):
        for out in core.add(GenerateReq(first_id + i, prompt, params, lora_id=IDS[name])):
            got.setdefault(out.req_id, []).append(out)
    for out in core.drain():
        got.setdefault(out.req_id, []).append(out)
    assert all(got[first_id + i][-1].finish_reason is FinishReason.LENGTH for i in range(len(requests)))
    return [[o.token_id for o in got[first_id + i]] for i in range(len(requests))]


def test_each_adapter_alone_matches_peft(runner, prompts, expected):
    core = engine(runner, chunk=64, prefix_cache=False)
    for k, name in enumerate([None, *ADAPTERS]):
        for j, prompt in enumerate(prompts):
            assert run(core, [(prompt, name)], first_id=100 * k + 10 * j) == [expected[name][j]], name
    assert_idle(core)


@pytest.mark.parametrize("padded", [True, False], ids=["graph_buckets", "eager"])
def test_mixed_batch_matches_each_alone(runner, model_dir, adapters, prompts, expected, padded):
    """Every prompt under every adapter and the base, at once: more adapters than the runner's 2 slots,
    so they take turns (LRU over the slots), chunks of a few prompt tokens beside decodes; through the
    graphs' padded metadata (run eagerly on the CPU) and through the eager step's own."""
    if not padded:
        modules = tuple(f"{name}={path}" for name, path in adapters.items())
        runner = make_runner(model_dir, tokens=512, max_req_total_len=64, lora_modules=modules, max_loras=2,
                             max_lora_rank=8, cuda_graph=False)
    requests = [(p, name) for name in [None, *ADAPTERS] for p in prompts]
    core = engine(runner, chunk=7)
    got = run(core, requests, first_id=1000)
    assert got == [expected[name][j] for name in [None, *ADAPTERS] for j in range(len(prompts))]
    assert_idle(core)


@pytest.mark.parametrize("padded", [True, False], ids=["graph_buckets", "eager"])
def test_steps_without_adapter_rows_launch_no_lora(runner, model_dir, adapters, prompts, expected, padded, monkeypatch):
    """A request on the base model alone runs no shrink or expand in its decode steps (graphs: the
    decode buckets captured without LoRA) nor, eager, in its prefill (a mixed step's graph runs
    them whatever its rows), and still equals PEFT's base; beside an adapter's request every step
    runs them."""
    import lightllm.models.lora as lora_module

    if not padded:
        modules = tuple(f"{name}={path}" for name, path in adapters.items())
        runner = make_runner(model_dir, tokens=512, max_req_total_len=64, lora_modules=modules, max_loras=2,
                             max_lora_rank=8, cuda_graph=False)
    calls = []
    monkeypatch.setattr(lora_module, "lora_shrink", lambda *args: calls.append(1) or real_shrink(*args))
    real_shrink = lora_lib.lora_shrink
    core = engine(runner, chunk=64, prefix_cache=False)
    projections = 4 * read_config(model_dir).num_layers  # q/k/v, o, gate/up, down
    assert run(core, [(prompts[0], None)], first_id=3000) == [expected[None][0]]
    assert len(calls) == (projections if padded else 0)  # the prefill step; no decode step
    calls.clear()
    assert run(core, [(prompts[0], None), (prompts[1], "mlp_r2")], first_id=3010) == [expected[None][0],
                                                                                       expected["mlp_r2"][1]]
    assert len(calls) == NEW_TOKENS * projections  # one prefill step, then the decode steps
    assert_idle(core)


def test_prefix_cache_keeps_adapters_apart(runner, prompts, expected):
    """The same prompt under the base, then adapter A, then B: none may reuse another's KV (each
    equals PEFT's); the same adapter again reuses its own."""
    core = engine(runner, chunk=64)
    prompt = prompts[1]
    order = [None, "all_r8", "attn_r4_rslora", "all_r8"]
    outs = []
    for i, name in enumerate(order):
        params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        got = core.add(GenerateReq(2000 + i, prompt, params, lora_id=IDS[name])) + core.drain()
        outs.append(got)
        assert [o.token_id for o in got] == expected[name][1], name
    cached = [got[0].cached_tokens for got in outs]
    assert cached[:3] == [0, 0, 0] and cached[3] == len(prompt) - 1
    assert_idle(core)


def test_unknown_adapter_is_refused(runner, prompts):
    core = engine(runner, chunk=64)
    (out,) = core.add(GenerateReq(3000, prompts[0], SamplingParams(), lora_id=9))
    assert out.finish_reason is FinishReason.ERROR and "unknown LoRA adapter" in out.error


def test_adapter_checks(model_dir, adapters, tmp_path):
    cfg = module_shapes(read_config(str(model_dir)))
    spec = read_adapter(adapters["attn_r4_rslora"], cfg, max_rank=8)
    assert spec.rank == 4 and spec.scaling == pytest.approx(8 / 2) and len(spec.modules) == 2 * 3
    with pytest.raises(LoraAdapterError, match="max_lora_rank"):
        read_adapter(adapters["all_r8"], cfg, max_rank=4)
    with pytest.raises(LoraAdapterError, match="no adapter_config.json"):
        read_adapter(tmp_path, cfg, max_rank=8)
    config = json.loads((adapters["mlp_r2"] / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(LoraAdapterError, match="use_dora"):
        read_adapter(tmp_path, cfg, max_rank=8)


def test_admission_holds_no_more_adapters_than_slots():
    """Slots 2: requests of adapters 1, 2, 3 and the base arrive; the admission order is cut before
    the third adapter (the base request behind it waits too: no overtaking), and admits it once
    the running requests of one adapter end."""
    scheduler = Scheduler(10_000, 64, 16, policy="fcfs", max_loras=2, lora_ids=(1, 2, 3))
    for req_id, lora in enumerate([1, 2, 1, 3, 0]):
        scheduler.add(Req(GenerateReq(req_id, [5, 6, 7], SamplingParams(max_new_tokens=2), lora_id=lora),
                          frozenset()))
    plan = scheduler.schedule()
    assert [(c.req_id, c.lora) for c in plan.chunks] == [(0, 1), (1, 2), (2, 1)]
    for req in [r for r in scheduler.running if r.lora_id == 1]:
        scheduler.abort(req.req_id)
    assert [(c.req_id, c.lora) for c in scheduler.schedule().chunks] == [(3, 3), (4, 0)]


def test_unloading_ends_the_adapters_waiting_requests():
    scheduler = Scheduler(10_000, 64, 16, max_loras=1, lora_ids=(1,))
    scheduler.add(Req(GenerateReq(0, [5, 6], SamplingParams(), lora_id=1), frozenset()))
    scheduler.add(Req(GenerateReq(1, [5, 6], SamplingParams()), frozenset()))
    (out,) = scheduler.drop_lora(1)
    assert (out.req_id, out.finish_reason) == (0, FinishReason.ERROR) and "unloaded" in out.error
    plan = scheduler.schedule()
    assert [c.req_id for c in plan.chunks] == [1] and [type(op).__name__ for op in plan.ops] == ["DropLora"]
    assert 1 not in scheduler.lora_ids


def test_bench_adapters_are_servable_and_spread_over_requests(model_dir, tmp_path, capsys):
    """lightllm.tools.bench_lora's random adapters pass the server's checks; the benchmark client
    names adapter i mod (N + 1) in request i, the base model last."""
    from benchmark.lib.serving_client import payload
    from benchmark.lib.sharegpt import SampledRequest
    from benchmark.serving.benchmark_serving import spread_over_adapters
    from lightllm.tools.bench_lora import main

    main(["--model", str(model_dir), "--out", str(tmp_path), "--count", "2", "--rank", "4"])
    modules, names = capsys.readouterr().out.splitlines()
    assert modules == f"--lora_modules lora-0={tmp_path / 'lora-0'} lora-1={tmp_path / 'lora-1'}"
    shapes = module_shapes(read_config(str(model_dir)))
    for name in ("lora-0", "lora-1"):
        spec = read_adapter(tmp_path / name, shapes, max_rank=4)
        assert spec.rank == 4 and set(spec.modules) == set(shapes)
    requests = [SampledRequest("x", [1], 3) for _ in range(4)]
    spread_over_adapters(requests, names.removeprefix("--lora-adapters ").split(","))
    assert [payload(r)["parameters"].get("adapter_id") for r in requests] == ["lora-0", "lora-1", None, "lora-0"]


@pytest.mark.parametrize("family,targets", [
    ("qwen2_bias_tied", ALL_TARGETS),  # q/k/v biases, tied head
    ("gemma2_window_16", ALL_TARGETS),  # sandwich norms, sliding window, soft caps, GELU
    ("qwen3_moe", ["q_proj", "k_proj", "v_proj", "o_proj"]),  # attention only: experts are not served yet
])
def test_other_families_match_peft(family, targets, tmp_path):
    model_dir, adapter = tmp_path / "model", tmp_path / "adapter"
    make_model(family, model_dir, seed=7)
    make_adapter(model_dir, adapter, 4, 8, targets, seed=8)
    if family == "qwen3_moe":  # experts in layer 0, a dense MLP in layer 1: only the dense one is adaptable
        shapes = module_shapes(read_config(str(model_dir)))
        assert "model.layers.1.mlp.down_proj" in shapes and "model.layers.0.mlp.down_proj" not in shapes
    prompts = random_prompts(9, lengths=(7, 12))
    expected = peft_greedy(model_dir, adapter, prompts, NEW_TOKENS)
    assert expected != peft_greedy(model_dir, None, prompts, NEW_TOKENS)
    runner = make_runner(model_dir, tokens=256, max_req_total_len=64, lora_modules=(f"x={adapter}",), max_loras=1,
                         max_lora_rank=4)
    core = EngineCore(Scheduler(256, 64, runner.req_table.max_reqs, max_loras=1, lora_ids=(1,)), runner,
                      eos_token_ids=[])
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    outs = [o for i, p in enumerate(prompts) for o in core.add(GenerateReq(i, p, params, lora_id=1))] + core.drain()
    assert [[o.token_id for o in outs if o.req_id == i] for i in range(len(prompts))] == expected


@pytest.mark.parametrize("settings,error", [
    (dict(lora_modules=("a",)), "NAME=DIR"),
    (dict(lora_modules=("a=/x", "a=/y")), "twice"),
    (dict(lora_modules=("a=/x",), max_loras=0), "--max_loras of at least 1"),
    (dict(max_loras=2, quantization="fp8"), "fp8"),
])
def test_lora_settings_are_checked(settings, error):
    from lightllm.engine.config import EngineConfig

    with pytest.raises(ValueError, match=error):
        EngineConfig(**settings).check()
    assert EngineConfig(lora_modules=("a=/x",)).lora_slots == 4 and EngineConfig().lora_slots == 0


def test_a_family_whose_forward_serves_no_adapter_is_refused(tmp_path):
    """Gemma 4's forward never groups a step's rows by adapter: with slots, every adapter would be
    silently unused, so the runner refuses --max_loras for it."""
    make_model("gemma4", tmp_path)
    with pytest.raises(ValueError, match="not served for Gemma4Model"):
        make_runner(tmp_path, max_loras=1)
    assert make_runner(tmp_path).loras is None  # and serves without slots


def test_adapters_given_at_start_are_resident_before_their_first_request(model_dir, adapters, prompts, expected,
                                                                         monkeypatch):
    """The adapters of --lora_modules go into the free slots at start (as many as there are), so
    that their first request's step copies nothing in; one past the slots is copied in by its
    first request, and each still answers as PEFT does."""
    import lightllm.models.lora as lora_module

    modules = tuple(f"{name}={path}" for name, path in adapters.items())  # ids 1, 2, 3; two slots
    runner = make_runner(model_dir, tokens=512, max_req_total_len=64, lora_modules=modules, max_loras=2,
                         max_lora_rank=8)
    assert sorted(runner.loras.table.owner) == [1, 2] and runner.loras.table.users == [0, 0]
    loads = []
    real_load = lora_module.LoraSlots.load
    monkeypatch.setattr(lora_module.LoraSlots, "load",
                        lambda self, slot, form: loads.append(slot) or real_load(self, slot, form))
    core = engine(runner, chunk=64)
    names = list(ADAPTERS)
    assert run(core, [(prompts[0], names[0]), (prompts[1], names[1])], first_id=5000) == [
        expected[names[0]][0], expected[names[1]][1]]
    assert loads == []
    assert run(core, [(prompts[2], names[2])], first_id=5010) == [expected[names[2]][2]]
    assert len(loads) == 1
    assert_idle(core)
