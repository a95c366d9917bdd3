"""The scheduler without a model: the peak formula, and the KV budget under any mix of chunks,
decodes, EOS and aborts, with one step in flight or none (hypothesis drives the mixes)."""

import itertools
import logging
import random
import re

import numpy as np
import pytest
from hypothesis import given, settings
from helpers.fake_runner import EOS, FakeRunner
from hypothesis import strategies as st

from lightllm.engine.core import EngineCore
from lightllm.engine.plan import StepPlan, StepResult
from lightllm.engine.scheduler import AGING_STEPS, BURST_BACKLOG_STEPS, POLICIES, Scheduler, peak_token_usage
from lightllm.engine.request import FinishReason, GenerateReq, SamplingParams
from lightllm.engine.spec.config import SpeculativeConfig
from lightllm.engine.spec.controller import Speculator
from lightllm.server.io_struct import RouterStats
from lightllm.server.router.stats import ThroughputLog
from seeds import fresh_rng  # noqa: E402


def simulated_peak(held: list[int], left: list[int]) -> int:
    """Step the batch one token at a time; a request frees its tokens right after its last step."""
    held, left = list(held), list(left)
    peak = sum(held)
    while held:
        held = [h + 1 for h in held]
        left = [n - 1 for n in left]
        peak = max(peak, sum(held))
        keep = [i for i, n in enumerate(left) if n > 0]
        held, left = [held[i] for i in keep], [left[i] for i in keep]
    return peak


def test_peak_formula_matches_step_simulation():
    rng = np.random.default_rng()
    for _ in range(300):
        n = int(rng.integers(1, 12))
        held = rng.integers(1, 60, n)
        left = rng.integers(1, 40, n)
        assert peak_token_usage(held, left) == simulated_peak(held.tolist(), left.tolist())
    assert peak_token_usage(np.array([], dtype=int), np.array([], dtype=int)) == 0


requests = st.lists(st.tuples(st.integers(1, 60), st.integers(1, 40), st.integers(0, 30)), min_size=1, max_size=30)


def shared_prompt(rng: random.Random, length: int) -> list[int]:
    """One of four long prefixes cut at a random point, then a few random tokens from a small
    vocabulary: prompts share prefixes of every length and end inside each other's nodes."""
    stems = [[10 + stem] * 40 + list(range(60)) for stem in range(4)]
    cut = rng.randrange(length + 1)
    return (stems[rng.randrange(4)][:cut] + [rng.randrange(3, 9) for _ in range(length)])[:length]


class RandomSpeculator(Speculator):
    """Drafts of random length (EOS among them now and then) wherever the scheduler allows them:
    the budget must hold whatever the controller asks and the runner accepts."""

    def __init__(self, rng: random.Random, max_rows: int):
        super().__init__(SpeculativeConfig("ngram", num_speculative_tokens=6), vocab_size=128, max_rows=max_rows)
        self.rng = rng
        self.source.propose = lambda req_id, k: [rng.choice([EOS, 7, 100]) for _ in range(k)]

    def allocate(self, alphas, limits, tokens, outputs):
        return [self.rng.randint(0, min(k, self.k_max)) for k in limits] if self.rng.random() < 0.7 else None


def check_preemptions(scheduler: Scheduler) -> None:
    """Each admission that preempts (the priority policy) lets the most urgent waiting request in,
    and preempts only running requests strictly less urgent than it (each waits again, or starts
    again at once where the new order proves that it fits: a prefilling request's growth is
    bounded by the prompts ahead of it)."""
    admit = scheduler._admit

    def checked():
        before, running = scheduler.num_preemptions, {r: r.preemptions for r in scheduler.running}
        ready = [r for r in scheduler.waiting.values() if r.grammar_ready]
        first = min(ready, key=lambda r: (r.priority, r.preemptions == 0, r.arrival_seq)) if ready else None
        admit()
        if scheduler.num_preemptions > before:
            preempted = [r for r, count in running.items() if r.preemptions > count]
            assert first in scheduler.running, "preempted for a request that was not admitted"
            assert len(preempted) == scheduler.num_preemptions - before
            assert all(r.priority > first.priority and r.resumed == r.output_count for r in preempted)

    scheduler._admit = checked


@settings(max_examples=80, deadline=None)
@given(requests, st.integers(1, 70), st.integers(0, 200), st.booleans(), st.sampled_from([0.0, 0.05]),
       st.one_of(st.integers(1, 16), st.just(32)), st.sampled_from(POLICIES), st.booleans(), st.sampled_from([0, 3]),
       st.sampled_from([1, 2, 8]), st.booleans(), st.randoms(use_true_random=False))
def test_kv_budget_holds_and_every_request_ends(reqs, chunk, extra_budget, overlap, eos_rate, max_running, policy,
                                                prefix_cache, admission_wait_steps, burst, speculate, rng):
    budget = max(p + n for p, n, _ in reqs) + extra_budget
    runner = FakeRunner(budget, eos_rate, rng)
    scheduler = Scheduler(budget, chunk, max_running, policy, prefix_cache=prefix_cache,
                          admission_wait_steps=admission_wait_steps, burst_chunk_budget=burst * chunk,
                          speculator=RandomSpeculator(rng, 4 * max_running) if speculate else None)
    core = EngineCore(scheduler, runner, eos_token_ids=[EOS], overlap=overlap)
    check_preemptions(scheduler)
    arrivals = sorted(((at, i) for i, (_, _, at) in enumerate(reqs)), reverse=True)
    aborted = {i for i in range(len(reqs)) if rng.random() < 0.1}
    outs: dict[int, list] = {}
    for step in itertools.count():
        while arrivals and arrivals[-1][0] <= step:
            _, i = arrivals.pop()
            prompt_len, max_new, _ = reqs[i]
            core.add(GenerateReq(i, shared_prompt(rng, prompt_len), SamplingParams(max_new_tokens=max_new),
                                 priority=rng.randrange(-2, 3)))
        if step == 15:
            for i in aborted:
                core.abort(i)
        for out in core.step():
            outs.setdefault(out.req_id, []).append(out)
        if scheduler.cache is not None:
            scheduler.cache.check()
        if not arrivals and not core.has_work:
            break
        assert step < 5000, "the engine stalled"
    # Idle: nothing is any request's; what is used is exactly what is cached, and a flush frees it.
    assert runner.own == {} and runner.used == scheduler.slots_used == scheduler.cached_tokens
    assert scheduler.tokens_used == 0  # nothing referenced: all of it could be evicted
    assert scheduler.flush_cache() == runner.used
    core.drain()
    assert runner.used == 0 and scheduler.slots_used == 0 and runner.nodes == {}
    for i, (_, max_new, _) in enumerate(reqs):
        got = outs.get(i, [])
        if i in aborted and (not got or got[-1].finish_reason is None):
            continue
        assert got and all(o.finish_reason is None for o in got[:-1])
        last = got[-1].finish_reason
        assert (last is FinishReason.LENGTH and len(got) == max_new) or (last is FinishReason.EOS and len(got) <= max_new)
        assert all(o.token_id != EOS for o in got[:-1])  # nothing after the end of a run is emitted
    assert runner.peak <= budget


class PlanRecorder(FakeRunner):
    def __init__(self, *args):
        super().__init__(*args)
        self.chunk_tokens: list[int] = []

    def step(self, plan: StepPlan) -> list[StepResult]:
        if not plan.empty:
            self.chunk_tokens.append(sum(len(c.token_ids) for c in plan.chunks))
        return super().step(plan)


def chunk_tokens_per_step(burst_budget: int, arrivals: dict[int, list[int]]) -> list[tuple[int, int]]:
    """(prompt tokens planned, backlog before the plan) of every step of a scheduler with chunk
    budget 64 serving prompts of the given lengths arriving at the given steps, 4 tokens each."""
    scheduler = Scheduler(100_000, 64, 1000, "fcfs", prefix_cache=False, burst_chunk_budget=burst_budget)
    runner = PlanRecorder(100_000, 0.0, random.Random(0))
    core = EngineCore(scheduler, runner, eos_token_ids=[EOS], overlap=False)
    backlogs, next_id = [], 0
    for step in itertools.count():
        for n in arrivals.get(step, []):
            core.add(GenerateReq(next_id, [5] * n, SamplingParams(max_new_tokens=4)))
            next_id += 1
        planned = len(runner.chunk_tokens)
        backlog = (sum(r.prompt_len for r in scheduler.waiting.values())
                   + sum(r.prompt_left for r in scheduler.running))
        core.step()
        backlogs += [backlog] * (len(runner.chunk_tokens) - planned)
        if not core.has_work and step >= max(arrivals):
            return list(zip(runner.chunk_tokens, backlogs))


def test_a_burst_is_prefilled_in_steps_of_the_burst_budget_until_its_backlog_is_short():
    """A burst of 40 prompts of 50 tokens (2000 > BURST_BACKLOG_STEPS steps x 64): steps of 256
    prompt tokens while more than that waits, then 64; the same work in fewer steps. Prompts of
    50 tokens arriving every other step never leave the chunk budget."""
    bursting = chunk_tokens_per_step(256, {0: [50] * 40})
    plain = chunk_tokens_per_step(64, {0: [50] * 40})  # burst budget = chunk budget: off
    assert sum(t for t, _ in bursting) == sum(t for t, _ in plain) == 2000
    for tokens, backlog in bursting:
        assert tokens == min(backlog, 256 if backlog > BURST_BACKLOG_STEPS * 64 else 64)
    assert max(t for t, _ in bursting) == 256 and max(t for t, _ in plain) == 64
    assert len([t for t, _ in bursting if t]) < len([t for t, _ in plain if t])
    steady = chunk_tokens_per_step(256, {2 * i: [50] for i in range(20)})
    assert max(t for t, _ in steady) <= 64


def admitted_order(scheduler: Scheduler) -> list[int]:
    return [req.req_id for req in scheduler.running]


def test_lpt_admits_long_generations_first_and_ages_the_rest():
    rng = fresh_rng()
    lengths = [rng.randrange(1, 500) for _ in range(20)]
    core = EngineCore(Scheduler(100_000, 64, 1000, "lpt"), FakeRunner(100_000, 0.0, rng), eos_token_ids=[EOS])
    for i, n in enumerate(lengths):
        core.add(GenerateReq(i, [5] * 8, SamplingParams(max_new_tokens=n)))
    core.step()
    order = admitted_order(core.scheduler)
    assert [lengths[i] for i in order] == sorted(lengths, reverse=True)
    # One running slot: a short request that has waited AGING_STEPS steps goes before a longer,
    # younger one.
    core = EngineCore(Scheduler(100_000, 64, 1, "lpt"), FakeRunner(100_000, 0.0, rng), eos_token_ids=[EOS])
    core.add(GenerateReq(0, [5], SamplingParams(max_new_tokens=AGING_STEPS + 10)))
    core.add(GenerateReq(1, [5], SamplingParams(max_new_tokens=2)))
    outs = []
    for _ in range(AGING_STEPS + 5):
        outs += core.step()
    core.add(GenerateReq(2, [5], SamplingParams(max_new_tokens=AGING_STEPS)))
    outs += core.drain()
    first_token = {}
    for n, out in enumerate(outs):
        first_token.setdefault(out.req_id, n)
    assert first_token[0] < first_token[1] < first_token[2]


def admission_steps(wait: int) -> tuple[list[tuple[int, int]], dict[int, int]]:
    """32 running slots, 32 requests ending one a step, 24 more waiting: (step, free slots before)
    of each admission after the first, and each request's token count."""
    core = EngineCore(Scheduler(100_000, 4096, 32, "fcfs", admission_wait_steps=wait),
                      FakeRunner(100_000, 0.0, random.Random(0)), eos_token_ids=[EOS])
    for i in range(56):
        core.add(GenerateReq(i, [5] * 4, SamplingParams(max_new_tokens=i + 2 if i < 32 else 40)))
    admissions, tokens = [], {}
    for step in range(400):
        waiting, room = len(core.scheduler.waiting), 32 - len(core.scheduler.running)
        for out in core.step():
            tokens[out.req_id] = tokens.get(out.req_id, 0) + 1
        if step and len(core.scheduler.waiting) < waiting:
            admissions.append((step, room))
        if not core.has_work:
            break
    return admissions, tokens


def test_admission_wait_gathers_freed_slots_into_fewer_prefill_steps():
    eager, tokens_eager = admission_steps(0)
    gathered, tokens = admission_steps(4)
    assert tokens == tokens_eager == {i: (i + 2 if i < 32 else 40) for i in range(56)}  # everyone served in full
    assert len(gathered) <= len(eager) / 2  # one slot frees a step: admitted every step without the wait
    # An admission comes 4 steps after the last, or once 32 / 16 = 2 slots are free, never earlier.
    for (before, _), (step, room) in zip(gathered, gathered[1:]):
        assert step - before >= 4 or room >= 2


def test_fcfs_admits_in_arrival_order():
    rng = fresh_rng()
    core = EngineCore(Scheduler(100_000, 64, 1000, "fcfs"), FakeRunner(100_000, 0.0, rng), eos_token_ids=[EOS])
    for i in range(10):  # a request's priority counts only under the "priority" policy
        core.add(GenerateReq(i, [5] * 8, SamplingParams(max_new_tokens=rng.randrange(1, 100)),
                             priority=rng.randrange(-3, 4)))
    core.step()
    assert admitted_order(core.scheduler) == list(range(10))


def test_priority_admits_the_lowest_value_first_then_in_arrival_order():
    rng = fresh_rng()
    priorities = [rng.randrange(-3, 4) for _ in range(20)]
    core = EngineCore(Scheduler(100_000, 64, 1000, "priority"), FakeRunner(100_000, 0.0, rng), eos_token_ids=[EOS])
    for i, priority in enumerate(priorities):
        core.add(GenerateReq(i, [5] * 8, SamplingParams(max_new_tokens=rng.randrange(1, 100)), priority=priority))
    core.step()
    assert admitted_order(core.scheduler) == sorted(range(20), key=lambda i: (priorities[i], i))
    # One running slot: requests that arrive while it is taken are admitted by their priority,
    # a later arrival before earlier ones of a higher value; the running one, of a higher value
    # than them all, is preempted for the first of them, and resumes last with its 30 tokens.
    core = EngineCore(Scheduler(100_000, 64, 1, "priority"), FakeRunner(100_000, 0.0, rng), eos_token_ids=[EOS])
    core.add(GenerateReq(0, [5], SamplingParams(max_new_tokens=30, ignore_eos=True), priority=9))
    core.step()
    for req_id, priority in ((1, 2), (2, 0), (3, -1), (4, 0)):
        core.add(GenerateReq(req_id, [5], SamplingParams(max_new_tokens=3, ignore_eos=True), priority=priority))
    order, tokens = [r.req_id for r in core.scheduler.running], {}
    while core.has_work:
        for out in core.step():
            tokens[out.req_id] = tokens.get(out.req_id, 0) + 1
        order += [r.req_id for r in core.scheduler.running if r.req_id not in order]
    assert order == [0, 3, 2, 4, 1] and core.scheduler.num_preemptions == 1
    assert tokens == {0: 30, 1: 3, 2: 3, 3: 3, 4: 3}


def test_cached_tokens_nobody_references_never_keep_a_request_out():
    """Unreferenced cached tokens count as free: a request that fits once they are evicted is
    admitted at once, and the eviction makes its room."""
    budget = 100
    rng = random.Random(0)
    runner = FakeRunner(budget, 0.0, rng)
    scheduler = Scheduler(budget, 16, 8)
    core = EngineCore(scheduler, runner, eos_token_ids=[EOS])
    for i in range(3):  # distinct prompts: 3 x 30 prompt + 4 fed-back output tokens stay cached
        core.add(GenerateReq(i, [20 + i] * 30, SamplingParams(max_new_tokens=5)))
    core.drain()
    assert scheduler.cached_tokens > 60 and scheduler.tokens_used == 0
    core.add(GenerateReq(10, [7] * 10, SamplingParams(max_new_tokens=40)))
    core.step()
    core.add(GenerateReq(11, [8] * 20, SamplingParams(max_new_tokens=20)))
    core.step()
    assert [req.req_id for req in scheduler.running] == [10, 11]
    core.drain()
    assert scheduler.cache.evicted_tokens > 0 and runner.peak <= budget


def test_requests_arriving_together_compute_a_shared_prefix_once():
    runner = FakeRunner(10_000, 0.0, random.Random(0))
    scheduler = Scheduler(10_000, 4096, 16)
    core = EngineCore(scheduler, runner, eos_token_ids=[EOS])
    system = list(range(100, 140))
    for i in range(4):
        core.add(GenerateReq(i, system + [10 + i] * 5, SamplingParams(max_new_tokens=3)))
    outs = core.drain()
    assert len(outs) == 12
    assert scheduler.prefix_hit_tokens == 3 * len(system)  # the first computes it; three take it
    assert scheduler.prompt_computed_tokens == 4 * (len(system) + 5) - 3 * len(system)


def test_a_shared_prefix_is_cut_where_it_ends_and_its_followers_start_the_next_step():
    """Requests admitted together, four system prompts of 40 tokens with four 6-token questions each,
    the prompts' leaders arriving first and a step budget of 64: each leader's chunks end where its
    prompt parts from its followers' (one cut, though two questions start with the leader's first
    tokens, as tokens merging across a prompt's end do), so that they take all 40 tokens from the
    cache, and they start the step after the leader's chunk reaching the cut, before any prompt not
    yet cached starts (the budget does not take them all)."""
    runner = FakeRunner(10_000, 0.0, random.Random(0))
    plans = []
    step = runner.step
    runner.step = lambda plan: plans.append(plan) or step(plan)
    scheduler = Scheduler(10_000, 64, 16)
    core = EngineCore(scheduler, runner, eos_token_ids=[EOS])
    systems = [list(range(1000 * g, 1000 * g + 40)) for g in range(4)]
    # request 4f + g: group g's; leaders 0-3; follower f's question starts with f - 1 of its leader's tokens
    prompts = {4 * f + g: systems[g] + [10 * g + 5] * max(0, f - 1) + [10 * g + f + 5] * (6 - max(0, f - 1))
               for f in range(4) for g in range(4)}
    for i in sorted(prompts):
        core.add(GenerateReq(i, prompts[i], SamplingParams(max_new_tokens=3)))
    assert len(core.drain()) == 3 * len(prompts)
    first = {}  # req id -> step of its first chunk
    reaches_cut = {}  # leader -> step of its chunk that ends at 40
    for n, plan in enumerate(plans):
        for chunk in plan.chunks:
            end = chunk.start + len(chunk.token_ids)
            assert not chunk.start < 40 < end, (n, chunk.req_id, chunk.start, end)  # never across a cut
            first.setdefault(chunk.req_id, n)
            if end == 40:
                reaches_cut[chunk.req_id] = n
            if chunk.req_id >= 4 and chunk.first:
                assert chunk.start == 40  # a follower computes none of its prompt's 40 tokens
    assert scheduler.prefix_hit_tokens == 12 * 40
    assert sorted(reaches_cut) == [0, 1, 2, 3]
    for g in range(4):
        assert {first[4 * f + g] for f in range(1, 4)} == {reaches_cut[g] + 1}, (g, first, reaches_cut)


def test_the_throughput_log_rates_the_prompt_tokens_computed_not_those_arrived(caplog):
    """The router's log gives prompt tokens a second from the scheduler's counter of tokens put in
    chunks: a window in which prompts only arrived, or were taken from the cache, logs none."""
    log = ThroughputLog(interval=0.0)
    rates = []

    def window(generated: int, computed_counter: int) -> None:
        log.count(generated_tokens=generated)
        with caplog.at_level(logging.INFO, logger="lightllm.server.router.stats"):
            caplog.clear()
            log.maybe_log(RouterStats(0, 0, 0, 1000, prompt_computed_tokens=computed_counter))
        prompt, generation = re.search(r"prompt ([\d.]+) tok/s, generation ([\d.]+) tok/s", caplog.text).groups()
        rates.append((float(prompt), float(generation)))

    window(10, 500)  # 500 prompt tokens computed beside 10 generated
    window(5, 500)  # none computed since
    window(0, 800)
    # each rate is printed to 0.1 tok/s: 50 times the generation rate is known to within 2.5 (the
    # window is a fraction of a millisecond here, so the rates are millions and only a relative
    # bound of 1e-6 on them fails on the rounding alone)
    assert rates[0][0] == pytest.approx(50 * rates[0][1], rel=1e-6, abs=50 * 0.05 + 0.05)
    assert rates[1][0] == 0.0 and rates[1][1] > 0
    assert rates[2][0] > 0 and rates[2][1] == 0.0
