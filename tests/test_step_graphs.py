"""Mixed steps (decodes beside prompt chunks) padded to token buckets, the CUDA-graph path run
eagerly on the CPU, against the same steps unpadded.

A schedule with chunked prompts, decodes beside them, a prefix-cache hit and several chunks in
one step runs twice on the same tiny model: with cuda_graph (every mixed step padded to its
bucket, its extend attention given a padded block table) and without. After every step both
runners must hold the same tokens, the same token table, the same request rows, the same cache
nodes and the same K/V in every slot but the scratch slot; the logits agree to 1e-5 (CPU
matmuls block by row count, so the last bits move with the padded size).
"""

import gc
import weakref

import pytest
import torch
from helpers.models import make_model, make_runner, random_prompts

from lightllm.engine.cuda_graph import MAX_GRAPH_CHUNKS, MIXED_TOKEN_ROWS, StepGraphs, mixed_buckets, no_collection
from lightllm.engine.plan import Chunk, Evict, Insert, Release, StepPlan
from lightllm.engine.request import SamplingParams

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_k=20, seed=3, max_new_tokens=64)


class _Held:
    """Stands for a dropped runner: reachable only through a reference cycle."""


def test_no_collection_collects_first_then_holds_the_collector_off():
    """What a capture runs under (tests/gpu/test_gpu_model.py shows the capture it protects)."""
    def dropped_in_a_cycle():
        held = _Held()
        held.cycle = held
        return weakref.ref(held)

    thresholds = gc.get_threshold()
    gc.set_threshold(10)
    try:
        before = dropped_in_a_cycle()
        with no_collection():
            assert before() is None, "garbage from before is collected first"
            assert not gc.isenabled()
            during = dropped_in_a_cycle()
            kept = [[] for _ in range(1000)]  # past the threshold: the collector would run here
            assert during() is not None, "collected inside"
            del kept
        assert gc.isenabled()
        gc.collect()
        assert during() is None
        gc.disable()
        with no_collection():
            pass
        assert not gc.isenabled(), "a collector held off before stays off"
    finally:
        gc.enable()
        gc.set_threshold(*thresholds)


def test_mixed_buckets():
    assert mixed_buckets(16) == [16]
    assert mixed_buckets(100) == [16, 32, 64, 100]
    big = mixed_buckets(2048)
    assert big[:5] == [16, 32, 64, 128, 192] and 1024 in big and big[-2:] == [1920, 2048]
    assert big == sorted(set(big))
    burst = mixed_buckets(8704)  # a burst step: 8192 prompt tokens beside 512 decodes
    assert burst[:len(big)] == big and 4096 in burst and burst[-3:] == [7680, 8192, 8704]
    assert all(b - a == 512 for a, b in zip(burst[burst.index(4096):], burst[burst.index(4096) + 1:]))


def schedule(prompts):
    """The plans, in order: (decodes, chunks, ops). Request 3's prompt starts with request 0's
    first 16 tokens, cached as node 1 after request 0's prefill."""
    p0, p1, p2, p3 = prompts
    p3 = p0[:16] + p3
    return [
        ([], [Chunk(0, p0, 0, True, SAMPLED), Chunk(1, p1[:6], 0, False, GREEDY)], []),
        ([0], [Chunk(1, p1[6:], 6, True), Chunk(2, p2[:20], 0, False, GREEDY)], []),
        ([0, 1], [Chunk(2, p2[20:], 20, True)], [Insert(0, 0, 16, 1)]),
        ([0, 1, 2], [Chunk(3, p3[16:], 16, True, GREEDY, prefix=(1,))], []),
        ([3, 2, 1, 0], [], []),
        ([3, 2, 1], [], [Release(0, 16)]),
        ([], [], [Release(1), Release(2), Release(3, 16), Evict(1)]),
    ]


def state(runner):
    table, rows = runner.token_table, runner.req_table
    return (table.mem_state.tolist(), rows.req_to_token[: rows.padding_row].tolist(),
            {node: slots.tolist() for node, slots in runner.nodes.items()})


def run(runner, plans, captured_logits):
    steps = []
    for i, (decodes, chunks, ops) in enumerate(plans):
        captured_logits.clear()
        results = runner.step(StepPlan(100 + i, decodes, chunks, ops=ops, sync=True))
        tokens = [t.token_id for r in results for t in r.tokens]
        kv = [c[: runner.token_table.size].clone() for c in runner.token_table.k + runner.token_table.v]
        steps.append((tokens, list(captured_logits), state(runner), kv))
    return steps


@pytest.mark.parametrize("name", ["llama_gqa_llama3_rope", "qwen2_bias_tied"])
def test_padded_mixed_steps_equal_unpadded(name, tmp_path, captured_logits, monkeypatch):
    make_model(name, tmp_path)
    plans = schedule(random_prompts(9, lengths=(21, 9, 33, 5)))
    replays = []
    original = StepGraphs.run_mixed
    monkeypatch.setattr(StepGraphs, "run_mixed", lambda self, meta, layout, *a: replays.append(layout.tokens)
                        or original(self, meta, layout, *a))
    runs = {}
    for graphs in (False, True):
        runner = make_runner(tmp_path, cuda_graph=graphs)
        gen = torch.Generator().manual_seed(5)
        for cache in runner.token_table.k + runner.token_table.v:  # random contents: stray writes show
            cache.copy_(torch.randn(cache.shape, generator=gen))
        runs[graphs] = run(runner, plans, captured_logits)
        assert runner.stats()["tokens_used"] == 0
    assert replays == [32, 32, 16, 16], "every step with chunks ran padded to its bucket"
    for (tokens, logits, plain_state, plain_kv), (p_tokens, p_logits, padded_state, padded_kv) in zip(
            runs[False], runs[True]):
        assert p_tokens == tokens
        assert padded_state == plain_state
        for plain, padded in zip(logits, p_logits):
            assert padded.shape == plain.shape  # the padding rows' logits are dropped
            torch.testing.assert_close(padded, plain, atol=1e-5, rtol=1e-5)
        for plain, padded in zip(plain_kv, padded_kv):
            torch.testing.assert_close(padded, plain, atol=1e-5, rtol=1e-5)


def test_steps_past_the_graphs_run_eagerly_and_equal(tmp_path, captured_logits, monkeypatch):
    """More chunks than a graph holds, more tokens than the largest bucket, or prompt logprobs:
    eager, with the same tokens as a runner without graphs."""
    make_model("llama_gqa_llama3_rope", tmp_path)
    replays = []
    original = StepGraphs.run_mixed
    monkeypatch.setattr(StepGraphs, "run_mixed", lambda self, *a: replays.append(1) or original(self, *a))
    many = random_prompts(4, lengths=[2] * (MAX_GRAPH_CHUNKS + 1))  # within the largest bucket's tokens
    long = random_prompts(5, lengths=(3 * MAX_GRAPH_CHUNKS,))  # past them
    logprobs = SamplingParams(prompt_logprobs=2)
    plans = [([], [Chunk(i, p, 0, True, GREEDY) for i, p in enumerate(many)], []),
             ([], [Chunk(100, long[0], 0, True, GREEDY)], [Release(i) for i in range(len(many))]),
             ([], [Chunk(101, many[0] * 3, 0, True, logprobs)], [Release(100)]),
             ([], [], [Release(101)])]
    tokens = {}
    for graphs in (False, True):
        runner = make_runner(tmp_path, tokens=4 * MAX_GRAPH_CHUNKS, max_req_total_len=4 * MAX_GRAPH_CHUNKS,
                             running_max_req_size=MAX_GRAPH_CHUNKS + 8, cuda_graph=graphs,
                             cuda_graph_max_tokens=2 * MAX_GRAPH_CHUNKS + 16)
        tokens[graphs] = [t for t, *_ in run(runner, plans, captured_logits)]
        assert runner.stats()["tokens_used"] == 0
    assert replays == [] and tokens[True] == tokens[False]
    assert [len(t) for t in tokens[True]] == [len(many), 1, 1, 0]


def test_an_eager_steps_decodes_take_their_graph_buckets_attention_plan(tmp_path, captured_logits, monkeypatch):
    """Decode attention compiles one kernel per launch plan: an eager step's decodes are planned
    for the decode graph they would replay (its bucket, max_req_total_len), whose kernel the
    capture compiled, and for their own batch and lengths only where there are no graphs."""
    from lightllm.models import layers

    make_model("llama_gqa_llama3_rope", tmp_path)
    planned = []
    attention = layers.decode_attention
    monkeypatch.setattr(layers, "decode_attention",
                        lambda *a, plan_for=None, **k: planned.append((a[0].shape[0], plan_for)) or attention(*a, **k))
    many = random_prompts(6, lengths=[2] * (MAX_GRAPH_CHUNKS + 1))
    plans = [([], [Chunk(i, p, 0, True, GREEDY) for i, p in enumerate(random_prompts(7, lengths=(9, 4, 6)))], []),
             ([0, 1, 2], [Chunk(10 + i, p, 0, True, GREEDY) for i, p in enumerate(many)], []),  # too many chunks
             ([], [], [Release(i) for i in [0, 1, 2] + [10 + i for i in range(len(many))]])]
    layer_count = make_runner(tmp_path).model.config.num_layers
    for graphs in (False, True):
        planned.clear()
        runner = make_runner(tmp_path, tokens=4 * MAX_GRAPH_CHUNKS, max_req_total_len=4 * MAX_GRAPH_CHUNKS,
                             running_max_req_size=MAX_GRAPH_CHUNKS + 8, cuda_graph=graphs,
                             cuda_graph_max_tokens=2 * MAX_GRAPH_CHUNKS + 16)
        run(runner, plans, captured_logits)
        eager = (3, (runner.graphs.bucket(3), 4 * MAX_GRAPH_CHUNKS) if graphs else None)
        # the other steps ran padded (graphs) or without decodes; a padded step's decodes are the graph's own plan
        assert [p for p in planned if p[0] == 3] == [eager] * layer_count
        assert all(plan is None for n, plan in planned if n != 3)
        assert runner.stats()["tokens_used"] == 0


def test_every_layout_warms_up_on_padding_alone(tmp_path):
    """Capture warms each bucket up from its own padding-only metadata (the layouts read one
    static buffer at different offsets): every token on the padding row, every chunk empty,
    every block slot padding, so the warm-up touches nothing but the scratch slot."""
    make_model("llama_gqa_llama3_rope", tmp_path)
    graphs = make_runner(tmp_path).graphs
    assert graphs.chunk_tiers == (MAX_GRAPH_CHUNKS,)  # no recurrent state: one chunk tier
    for layout in graphs.mixed:
        graphs._pad_only(layout)
        v = layout.views(graphs.mixed_meta)
        ids, positions, rows, lora_slots = v["tokens"].view(MIXED_TOKEN_ROWS, -1).tolist()
        decode_rows, decode_lens = v["decodes"].view(2, -1).tolist()
        assert len(decode_rows) == min(layout.tokens, graphs.buckets[-1])  # the most decodes a step holds
        assert set(rows) == set(decode_rows) == {graphs.padding_row} and set(ids) == set(positions) == {0}
        assert set(decode_lens) == {1} and set(v["ext_cu_q"].tolist()) == {0} and set(lora_slots) == {-1}
        assert set(v["q_blocks"].view(2, -1)[0].tolist()) == {-1}


def test_each_graph_is_replayed_once_after_capture_on_its_own_padding():
    """Capture ends by replaying every graph once (its first launch uploads it, which serving steps
    must not pay), each right after its own padding-only metadata is written."""
    from lightllm.engine.cuda_graph import first_replays

    events = []

    class Graph:
        def __init__(self, name):
            self.name = name

        def replay(self):
            events.append(("replay", self.name))

    first_replays([(lambda n=n: events.append(("pad", n)), Graph(n)) for n in ("mixed 64", "decode 8", "decode 1")])
    assert events == [(kind, n) for n in ("mixed 64", "decode 8", "decode 1") for kind in ("pad", "replay")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton compiles kernels on CUDA only")
def test_eager_steps_compile_no_decode_attention_after_capture(tmp_path):
    """On the GPU: after the graphs are captured, eager steps whose decodes differ in count and
    lengths from every captured one launch decode attention without compiling it (a kernel per
    plan: compiled while serving, a step's launch waited 0.3-0.6 s on an H200)."""
    from lightllm.kernels._triton import NEW_SPECIALISATIONS

    make_model("llama_gqa_llama3_rope", tmp_path)
    runner = make_runner(tmp_path, tokens=4096, max_req_total_len=512, running_max_req_size=MAX_GRAPH_CHUNKS + 8,
                         device="cuda", cuda_graph_max_tokens=2 * MAX_GRAPH_CHUNKS + 16)
    captured = len(NEW_SPECIALISATIONS["kernels"])
    step_id, rid = 0, 100
    for decodes, length in ((1, 17), (3, 85), (5, 200), (2, 9)):
        prompts = random_prompts(decodes, lengths=[length] * decodes)
        first = [Chunk(rid + i, p, 0, True, GREEDY) for i, p in enumerate(prompts)]
        many = [Chunk(rid + decodes + i, p, 0, True, GREEDY)
                for i, p in enumerate(random_prompts(step_id, lengths=[2] * (MAX_GRAPH_CHUNKS + 1)))]
        steps = (([], first, []), ([c.req_id for c in first], many, []),  # the second eager: too many chunks
                 ([], [], [Release(c.req_id) for c in first + many]))
        for decoding, chunks, ops in steps:
            runner.step(StepPlan(step_id, decoding, chunks, ops=ops, sync=True))
            step_id += 1
        rid += 1000
    assert "_decode_split_kernel" not in NEW_SPECIALISATIONS["kernels"][captured:]
    assert runner.stats()["tokens_used"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton compiles kernels on CUDA only")
def test_sampling_compiles_nothing_after_the_start(tmp_path):
    """On the GPU: the runner's start compiles the greedy and the seeded-draw kernels, and every
    step's sampling inputs start on 16 bytes, so steps of greedy and of sampled requests, odd and
    even in number, compile neither again (each compile held a first request 0.3-0.6 s)."""
    from lightllm.kernels._triton import NEW_SPECIALISATIONS

    make_model("llama_gqa_llama3_rope", tmp_path)
    runner = make_runner(tmp_path, tokens=2048, max_req_total_len=128, running_max_req_size=16, device="cuda")
    started = len(NEW_SPECIALISATIONS["kernels"])
    sampled = SamplingParams(do_sample=True, temperature=0.8, seed=3)
    step_id, rid = 0, 100
    for params, count in ((sampled, 1), (sampled, 2), (sampled, 3), (GREEDY, 1), (GREEDY, 2)):
        chunks = [Chunk(rid + i, p, 0, True, params) for i, p in enumerate(random_prompts(count, lengths=[9] * count))]
        ids = [c.req_id for c in chunks]
        for plan in (StepPlan(step_id, [], chunks, sync=True), StepPlan(step_id + 1, ids, [], sync=True),
                     StepPlan(step_id + 2, [], [], ops=[Release(i) for i in ids], sync=True)):
            runner.step(plan)
        step_id, rid = step_id + 3, rid + 100
    new = NEW_SPECIALISATIONS["kernels"][started:]
    assert "_random_uniform_kernel" not in new and "_greedy_sample_kernel" not in new, new
    assert runner.stats()["tokens_used"] == 0
