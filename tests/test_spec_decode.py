"""Speculative decoding: verification in the model runner is exact (greedy tokens and seeded
samples are those without drafts; a rejected draft's token is drawn from the target's
distribution), the KV budget holds whatever is accepted, and the controller speculates only
where its measurements say it pays."""

import itertools
import random

import numpy as np
import pytest
import torch
from helpers.models import make_model, make_runner
from helpers.spec import OracleDraft, speculating_engine
from hypothesis import given, settings
from hypothesis import strategies as st

from lightllm.engine.plan import Chunk, StepPlan
from lightllm.engine.request import GenerateReq, SamplingParams
from lightllm.engine.scheduler import peak_token_usage, peak_with_drafts
from lightllm.engine.spec.config import SpeculativeConfig
from lightllm.engine.spec.controller import Speculator

VOCAB = 101
_steps = itertools.count(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_model("llama_gqa_llama3_rope", path)
    return path


def prefill(runner, req_id, prompt, params):
    (result,) = runner.step(StepPlan(next(_steps), [], [Chunk(req_id, prompt, 0, True, params)], sync=True))
    return [t.token_id for t in result.tokens]


def decode(runner, req_ids, drafts=None):
    (result,) = runner.step(StepPlan(next(_steps), list(req_ids), drafts=drafts or {}, sync=True))
    return result.tokens


def plain_run(runner, prompt, n, params):
    out = prefill(runner, 0, prompt, params)
    while len(out) < n:
        out += [t.token_id for t in decode(runner, [0])]
    runner.free([0])
    return out


def drafted_run(runner, prompt, n, params, truth, wrong, rng):
    """Up to 5 drafts a step: the true continuation, each token wrong with probability `wrong`."""
    out = prefill(runner, 0, prompt, params)
    while len(out) < n:
        k = min(rng.randint(0, 5), n - len(out) - 1)
        drafts = [t if rng.random() >= wrong else (t + 1) % VOCAB for t in truth[len(out): len(out) + k]]
        tokens = decode(runner, [0], {0: drafts} if drafts else {})
        assert 1 <= len(tokens) <= len(drafts) + 1
        out += [t.token_id for t in tokens]
    runner.free([0])
    assert runner.token_table.used_count == 0  # rejected drafts' slots came back
    return out


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["padded", "eager"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(do_sample=True, seed=42, top_k=20, top_p=0.9),
                                      SamplingParams(watermark=True),
                                      SamplingParams(do_sample=True, seed=42, top_k=20, watermark=True)],
                         ids=["greedy", "seeded", "greedy-watermark", "seeded-watermark"])
def test_verified_tokens_are_the_tokens_without_drafts(model_dir, cuda_graph, sampling):
    """Greedy: every accepted run is the target's own argmax chain. Seeded sampling: a row `j`
    drafts ahead draws the random numbers of that later token, so the tokens are the same too.
    Watermarked: a draft's row favours the green list after the draft before it (the first row,
    after the request's last token), as the token would without drafts."""
    runner = make_runner(model_dir, tokens=512, cuda_graph=cuda_graph, max_req_total_len=128)
    prompt = [5, 7, 9, 11, 13]
    truth = plain_run(runner, prompt, 40, sampling)
    rng = random.Random(0)
    for wrong in (0.0, 0.3, 1.0):
        assert drafted_run(runner, prompt, 40, sampling, truth, wrong, rng) == truth


def test_drafts_beside_chunks_and_other_decodes(model_dir):
    """A mixed step: one request verifies drafts while another decodes and a third prefills."""
    runner = make_runner(model_dir, tokens=512, max_req_total_len=128)
    greedy = SamplingParams()
    prompts = {0: [3, 4, 5], 1: [9, 8, 7, 6], 2: list(range(20, 40))}
    truth = {i: plain_run(runner, p, 12, greedy) for i, p in prompts.items()}
    got = {0: prefill(runner, 0, prompts[0], greedy), 1: prefill(runner, 1, prompts[1], greedy)}
    drafts = {0: truth[0][1:4], 1: [truth[1][1], (truth[1][2] + 1) % VOCAB]}
    (result,) = runner.step(StepPlan(next(_steps), [0, 1], [Chunk(2, prompts[2], 0, True, greedy)], drafts=drafts,
                                     sync=True))
    for t in result.tokens:
        got.setdefault(t.req_id, []).append(t.token_id)
    assert got[0] == truth[0][:5] and got[1] == truth[1][:3] and got[2] == truth[2][:1]
    while any(len(v) < 12 for v in got.values()):
        for t in decode(runner, [i for i in got if len(got[i]) < 12]):
            got[t.req_id].append(t.token_id)
    assert got == truth
    runner.free([0, 1, 2])
    assert runner.token_table.used_count == 0


def test_a_verified_position_samples_the_target_distribution(model_dir):
    """Rejection sampling against a point mass: the token at a draft's position is the draft with
    probability p(draft) and otherwise drawn from p without it, so it is distributed as p.
    Chi-square against the target's probabilities (temperature 1.5) over 600 seeds."""
    runner = make_runner(model_dir, tokens=512, max_req_total_len=64)
    prompt = [11, 12, 13, 14]
    (result,) = runner.step(StepPlan(next(_steps), [], [Chunk(9, prompt, 0, True, SamplingParams(top_logprobs=VOCAB))],
                                     sync=True))
    runner.free([9])
    logprobs = torch.full((VOCAB,), float("-inf"))
    for token, lp in result.tokens[0].top:
        logprobs[token] = lp
    probs = torch.softmax(logprobs / 1.5, -1).numpy()
    draft = int(np.argsort(-probs)[1])  # likely, but not the likeliest
    counts = np.zeros(VOCAB)
    for seed in range(600):
        prefill(runner, 3, prompt[:-1], SamplingParams(do_sample=True, temperature=1.5, seed=seed))
        runner.last_token[runner.reqs[3].row] = prompt[-1]  # the verify step feeds the prompt's last token
        counts[decode(runner, [3], {3: [draft]})[0].token_id] += 1
        runner.free([3])
    expected = probs * counts.sum()
    keep = expected >= 5
    rest_seen, rest_expected = counts[~keep].sum(), max(expected[~keep].sum(), 1e-9)
    chi2 = (((counts[keep] - expected[keep]) ** 2) / expected[keep]).sum() + (rest_seen - rest_expected) ** 2 / rest_expected
    dof = int(keep.sum())
    assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)  # about 5 sigma of the statistic's spread
    assert 0.5 < counts[draft] / expected[draft] < 1.5


# ---- the KV budget ----

@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 30), st.integers(0, 8)), min_size=1, max_size=8),
       st.randoms(use_true_random=False))
def test_peak_with_drafts_bounds_every_outcome(reqs, rng):
    """Whatever each request accepts (none, all, or in between), the usage from the step on
    (its drafts' slots all held during it) never exceeds the bound; without drafts it is the
    plain bound."""
    held = np.array([h for h, _, _ in reqs])
    left = np.array([n for _, n, _ in reqs])
    drafts = np.array([min(k, n - 1) for _, n, k in reqs])
    bound = peak_with_drafts(held, left, drafts)
    assert peak_with_drafts(held, left, np.zeros_like(drafts)) == peak_token_usage(held, left)
    assert held.sum() + drafts.sum() <= bound  # the step itself
    for choice in range(12):
        accepted = [d if choice == 0 else 0 if choice == 1 else rng.randint(0, d) for d in drafts.tolist()]
        after_held, after_left = held + accepted, left - accepted
        for t in range(int(left.max()) + 1):
            usage = sum(h + t for h, lft in zip(after_held, after_left) if lft >= t)
            assert usage <= bound, (t, accepted)


# ---- the controller ----

def make_speculator():
    """The per-step choice alone (the run-level guard is tested in test_spec_guard.py)."""
    spec = Speculator(SpeculativeConfig("ngram", num_speculative_tokens=6), vocab_size=VOCAB, max_rows=64)
    spec.guard = None
    return spec


def test_controller_speculates_only_where_it_pays():
    spec = make_speculator()
    for _ in range(5):  # plain steps cost the same at 1 and 20 tokens (a memory-bound decode)
        spec.measured(False, 1, 0.010)
        spec.measured(False, 20, 0.011)
    assert spec.allocate([0.0], [6], 1, 1) is None  # nothing is ever accepted: plain
    chosen = spec.allocate([0.8], [6], 1, 1)
    assert chosen is not None and chosen[0] >= 4
    # two requests: the one whose drafts are accepted gets them
    low, high = spec.allocate([0.05, 0.9], [6, 6], 2, 2)
    assert high > low
    # steps with drafts turn out to cost 3x: speculation at 0.5 no longer pays
    for _ in range(60):
        spec.measured(True, 7, 0.030)
    assert spec.allocate([0.5], [6], 1, 1) is None


def test_small_choice_is_the_vectorised_one():
    """A choice over a few candidate drafts (batch 1 or a few requests) runs in plain Python:
    the same drafts per request as numpy's over random cost curves, acceptances and sizes, its
    expected rates equal but for the last bit (numpy's vectorised power)."""
    from lightllm.engine.spec.controller import SMALL_CHOICE_ROWS

    rng = random.Random(0)
    compared = 0
    for _ in range(1500):
        k = rng.randint(1, 8)
        spec = Speculator(SpeculativeConfig("ngram", num_speculative_tokens=k), vocab_size=VOCAB, max_rows=64)
        spec.measured(False, rng.randint(1, 400), rng.uniform(0.001, 0.03))
        for _ in range(rng.randint(0, 12)):  # both curves, from one point to many, small counts and large
            spec.measured(rng.random() < 0.5, rng.choice([rng.randint(1, 10), rng.randint(1, 400)]),
                          rng.uniform(0.001, 0.03))
        n = rng.randint(1, 4)
        alphas = [rng.choice([rng.random(), 0.0, 1.0, 0.5]) for _ in range(n)]
        limits = [rng.randint(0, 8) for _ in range(n)]
        if not any(limits) or sum(min(x, k) for x in limits) > SMALL_CHOICE_ROWS:
            continue
        args = alphas, limits, rng.randint(1, 40), rng.randint(1, 300), rng.randint(1, 20)
        counts, rate, plain = spec._choose(*args)
        small_counts, small_rate, small_plain = spec._choose_small(*args)
        assert small_counts == counts, args
        assert small_rate == pytest.approx(rate, rel=1e-12) and small_plain == plain, args
        compared += 1
    assert compared > 1000


def test_shadow_drafts_measure_acceptance_without_speculating():
    spec = make_speculator()
    req = spec.start(1, [1, 2, 3, 4, 1, 2, 3])
    prior = req.alpha(spec.global_alpha)
    def see(token):
        spec.observe(1, req, [token])
        spec.shadow_drafts([(1, req)])

    for token in [4, 1, 2, 3] * 5:  # the prompt's loop goes on: the proposals keep matching
        see(token)
    assert req.alpha(spec.global_alpha) > max(prior, 0.8)
    rng = random.Random(0)
    for _ in range(100):  # random tokens of a small alphabet: the n-grams recur, their continuations not
        see(rng.choice([1, 2, 3]))
    assert req.alpha(spec.global_alpha) < 0.6
    for token in range(50, 60):  # tokens never seen: nothing to propose, so nothing to verify
        see(token)
    assert req.shadow == []


def test_shadow_drafts_a_step_are_bounded_and_taken_in_turns():
    from lightllm.engine.spec.controller import SHADOW_PROPOSALS_A_STEP

    spec = make_speculator()
    reqs = [(i, spec.start(i, [1, 2, 1, 2, 1])) for i in range(3 * SHADOW_PROPOSALS_A_STEP)]
    calls = []
    propose = spec.source.propose
    spec.source.propose = lambda req_id, k: calls.append(req_id) or propose(req_id, k)
    spec.shadow_drafts(reqs)
    assert len(calls) == SHADOW_PROPOSALS_A_STEP
    spec.shadow_drafts(reqs)  # the first ones have drafts now: the others' turn
    spec.shadow_drafts(reqs)
    assert sorted(calls) == list(range(len(reqs)))


# ---- the engine: against transformers, and against itself without drafts ----

@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("chunk", [4, 64])
def test_greedy_with_drafts_equals_transformers(tmp_path, chunk, overlap):
    from helpers.models import Client, assert_idle, hf_greedy, random_prompts

    hf_model = make_model("llama_gqa_llama3_rope", tmp_path)
    runner = make_runner(tmp_path, tokens=512, max_req_total_len=96)
    prompts = random_prompts(chunk, lengths=(3, 17, 9, 30))
    expected = hf_greedy(hf_model, prompts, 24)
    OracleDraft.ORACLE = {tuple(p): expected[i] for i, p in enumerate(prompts)}
    core = speculating_engine(runner, chunk, "helpers.spec:OracleDraft", overlap=overlap)
    got = Client(core).run(prompts + prompts[:1], SamplingParams(max_new_tokens=24))  # the last: a cached prompt
    assert got == [expected[i] for i in range(len(prompts))] + [expected[0]]
    spec = core.scheduler.speculator
    assert spec.num_accepted_tokens > 0 and spec.num_draft_tokens > spec.num_accepted_tokens  # both outcomes ran
    assert_idle(core)


def test_the_step_in_flight_is_collected_only_for_a_step_with_drafts(tmp_path):
    """Before a step that would speculate the engine collects the step in flight (drafts continue
    the latest tokens), a wait the overlap would have hidden. The choice is made on the step the
    plan will make, prompt chunks included: here a step with a chunk has no measured cost near its
    size, so it runs plain, and collecting the chunk before it would be a bubble for nothing."""
    from helpers.models import assert_idle, hf_greedy, random_prompts

    from lightllm.engine.spec.controller import StepCosts

    hf_model = make_model("llama_gqa_llama3_rope", tmp_path)
    runner = make_runner(tmp_path, tokens=1024, max_req_total_len=160)
    prompts = random_prompts(5, lengths=(5, 9, 7, 60, 61, 62))
    expected = hf_greedy(hf_model, prompts, 40)
    OracleDraft.ORACLE = {tuple(p): expected[i] for i, p in enumerate(prompts)}
    core = speculating_engine(runner, 16, "helpers.spec:OracleDraft")  # a long prompt: 4 chunks
    spec = core.scheduler.speculator
    spec.costs = StepCosts()
    for drafted in (False, True):
        for tokens in (1, 2, 4):  # steps of the decodes alone are known; nothing near one with a chunk
            spec.costs.measured(drafted, tokens, 0.01)
    seen = {"collections": 0, "for nothing": 0, "drafted": 0}
    run = core._run

    def counting(plan, *args):
        if plan.step_id >= 0:
            seen["collections"] += core._flushed
            seen["for nothing"] += core._flushed and not plan.drafts
            seen["drafted"] += bool(plan.drafts)
        return run(plan, *args)

    core._run = counting
    got = {}
    for i, prompt in enumerate(prompts):  # the long prompts arrive while the short ones decode
        core.add(GenerateReq(i, prompt, SamplingParams(max_new_tokens=40)))
        for _ in range(6 if i >= 2 else 0):
            for out in core.step():
                got.setdefault(out.req_id, []).append(out.token_id)
    for out in core.drain():
        got.setdefault(out.req_id, []).append(out.token_id)
    assert got == expected
    assert seen["drafted"] and seen["collections"], seen
    assert seen["for nothing"] == 0, seen
    assert_idle(core)


PASSAGE = ("The lighthouse keeper rang the bell at noon, counted the boats in the harbour, wrote their names "
           "in the blue ledger and climbed the stairs again to polish the great lamp before dusk.")


def passage_ids(model_dir) -> list[int]:
    """The passage's distinct tokens: a request allowed only these copies it in a shuffled order."""
    from transformers import AutoTokenizer

    return sorted(set(AutoTokenizer.from_pretrained(model_dir, local_files_only=True).encode(PASSAGE)))


@pytest.fixture(scope="module")
def default_runs(default_model_dir):
    """The same requests through LLM without speculation, with ngram and with suffix (chunked
    prefill of 32, the prefix cache on): token ids, text, finish, logprobs, and the counters."""
    from lightllm.llm import LLM
    from lightllm.llm import SamplingParams as Params

    copy = [{"role": "user", "content": f"Repeat exactly, word for word:\n{PASSAGE}"}]
    quote = [{"role": "user", "content": f"Here is a text: {PASSAGE}"}, {"role": "assistant", "content": PASSAGE},
             {"role": "user", "content": "Quote your previous answer again."}]
    requests = [(copy, Params(max_tokens=40, temperature=0)),
                (quote, Params(max_tokens=40, temperature=0, logprobs=3)),
                (copy, Params(max_tokens=40, temperature=0, stop=["harbour"])),
                (copy, Params(max_tokens=24, temperature=0.8, seed=7, n=2)),
                (copy, Params(max_tokens=24, temperature=0, logit_bias={9: 5.0}, min_tokens=5)),
                (quote, Params(max_tokens=20, temperature=0, presence_penalty=0.5)),
                (copy, Params(max_tokens=24, temperature=0.7, seed=3, allowed_token_ids=passage_ids(default_model_dir))),
                (copy, Params(max_tokens=40, temperature=0, bad_words=["stairs"]))]  # one token: it speculates
    runs = {}
    for method in (None, "ngram", "suffix", "draft_model"):
        config = None if method is None else {"method": method, "num_speculative_tokens": 6}
        if method == "draft_model":  # the model as its own draft: real weights, drafts mostly accepted
            config["model"] = str(default_model_dir)
        # 8 rows hold 8 of the 9 requests at once, and make the start's profile step 7 decodes, not 127
        llm = LLM(default_model_dir, max_total_token_num=4096, chunked_prefill_size=32, running_max_req_size=8,
                  speculative_config=config)
        if method is not None:
            # The run-level guard's epochs follow this machine's timing: on a loaded CPU its first
            # held-off epoch outlasted a 40-token request, and the batch's load change started
            # another. Under test here is what drafts leave of the output (the guard: test_spec_guard).
            llm.engine.scheduler.speculator.guard = None
        try:
            outs = [llm.chat(messages, params, use_tqdm=False)[0] for messages, params in requests[:1]]
            outs += llm.chat([m for m, _ in requests], [p for _, p in requests], use_tqdm=False)
            spec = llm.engine.scheduler.speculator
            runs[method] = ([(c.token_ids, c.text, c.finish_reason, c.logprobs) for o in outs for c in o.outputs],
                            None if spec is None else spec.stats())
        finally:
            llm.shutdown()
    return runs


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_default_model_output_is_unchanged_by_speculation(default_runs, method):
    """Greedy and seeded outputs, stop strings, logit_bias with min_tokens, allowed_token_ids,
    a one-token bad word, penalties (which do not speculate), n > 1 and logprobs: the same with
    drafts as without, and drafts did run."""
    plain, _ = default_runs[None]
    got, stats = default_runs[method]
    # the copy requests were verified in runs; a draft model as large as its target (on a CPU) is
    # dropped by the controller once its calls are measured, after its first proposals (a probe)
    assert stats["num_accepted_tokens"] > (0 if method == "draft_model" else 20)
    for (ids, text, finish, logprobs), (ids0, text0, finish0, logprobs0) in zip(got, plain):
        assert (ids, text, finish) == (ids0, text0, finish0)
        if logprobs0 is not None:  # the target's logprobs, as without drafts (fp32 on the CPU)
            for pos, pos0 in zip(logprobs, logprobs0):
                assert pos.keys() == pos0.keys()
                assert all(abs(pos[t].logprob - pos0[t].logprob) < 1e-3 for t in pos)


def test_server_streams_the_same_tokens_and_reports_drafts(default_server, default_model_dir, tmp_path):
    """A server with --speculative_config: /info shows it, a copy request streams the tokens the
    plain server streams (several per event batch at times), and /metrics counts the drafts. The
    draft is a draft model (the model drafting for itself), which the workers run across their rpyc
    seam; the draft-free sources share everything else with it and are covered through LLM above."""
    import json

    from server_utils import sse_events, start_server

    config = {"method": "draft_model", "num_speculative_tokens": 6, "model": str(default_model_dir)}
    # One request at a time, its prompt one chunk at either budget: 256 tokens and 8 rows (not 2048
    # and 128) cut the start-up's profile step, a full chunk beside a full batch of decodes, from
    # ~20 s to about one on 2 cores.
    server = start_server(["--model_dir", str(default_model_dir), "--speculative_config", json.dumps(config),
                           "--chunked_prefill_size", "256", "--running_max_req_size", "8"], tmp_path / "server.log")
    try:
        assert server.post("/info", b"").status_code == 405
        import requests

        assert requests.get(f"{server.url}/info", timeout=10).json()["speculative_config"] == config
        body = {"inputs": f"Repeat exactly, word for word: {PASSAGE}\nRepeated: {PASSAGE[:40]}",
                "parameters": {"max_new_tokens": 32}}
        plain = [e["token"]["id"] for e in sse_events(default_server.stream(body)) if "token" in e]
        assert len(plain) == 32
        # The run-level guard holds speculation off in its first epoch, which lasts until the plain
        # steps' rate is known to 3% (at most 24 steps' time): on a loaded CPU that outlasted the
        # first request. The copy is asked again, the same tokens each time, until drafts ran.
        for _ in range(6):
            assert [e["token"]["id"] for e in sse_events(server.stream(body)) if "token" in e] == plain
            metrics = server.metrics()
            if metrics["lightllm:spec_decode_num_accepted_tokens_total"] > 0:
                break
        assert metrics["lightllm:spec_decode_num_accepted_tokens_total"] > 0
        assert (metrics["lightllm:spec_decode_num_accepted_tokens_total"]
                == sum(v for k, v in metrics.items() if k.startswith("lightllm:spec_decode_num_accepted_tokens_per_pos")))
    finally:
        assert server.stop() == 0


def test_dummy_echo_weights_answer_each_token_with_itself(tmp_path):
    """load_format dummy_echo: the benchmarks' controlled draft replays an earlier run's greedy
    output, which must not depend on the kernels' rounding; the echo model repeats its last token."""
    make_model("llama_gqa_llama3_rope", tmp_path)
    runner = make_runner(tmp_path, tokens=256, load_format="dummy_echo", max_req_total_len=64)
    out = plain_run(runner, [5, 17, 33], 6, SamplingParams())
    assert out == [33] * 6
