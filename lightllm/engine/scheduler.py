"""The scheduler: admission, prefill chunks, the prefix cache and step plans. CPU bookkeeping only.

Every step runs every decoding request once plus prefill chunks of admitted requests, in
admission order, up to `chunk_budget` prompt tokens, or `burst_chunk_budget` while a burst's
prompts wait (`step_budget`). Admission proves that the KV budget holds
whatever happens next (see `peak_token_usage`): an admitted request's whole prompt is reserved
at once, so a partly prefilled request never waits for room.

With the prefix cache (`lightllm/common/radix_cache.py`) a request starts from the longest
cached prefix of its prompt (matched again at its first chunk, so that requests admitted
together share what the first of them computed; one whose first chunk would start like a chunk
already planned in the step waits a step for it, `SHARE_PROBE`); each chunk goes into the cache one step after
it is scheduled, and an ended request's tokens stay cached instead of being freed. Cached tokens
no running request references count as free: they are evicted, least recently used first, when
a step needs their room.

With a host tier (`host_cache_tokens`) evicted nodes move to host memory instead; a request
whose match reaches them locks its path and loads them back (`_load_host`) when it is admitted
or takes more cached tokens before its first chunk, after evicting room for them: the Load ops
precede its first chunk in the plan, and the requests admitted together evict their room before
any of them loads (a step's Offloads, then its Loads, consecutive: one batch each in the runner).
Admission charges a matched path's host-resident tokens like its device ones, so loads in flight
are inside the proof.

For a model with recurrent state (`snapshot_interval` > 0) a request resumes only where the tree
holds a snapshot of the state: its match is cut back to the deepest one (`RadixCache.resumable`),
and its first chunk names the snapshot slot the runner copies into its state slot. Its chunks end
at multiples of `snapshot_interval` (but for the prompt's last one, where the step takes the rest)
and at its cuts, where a shared prefix ends (`_plan_cuts`), and a chunk that ends on one, once it
joins the cache, leaves a snapshot on its node (taken from the request's state slot before the
request's next chunk runs); so does a request that ends, at the end of what it cached, where a
slot is free.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import numpy as np

from lightllm.common.radix_cache import Match, RadixCache
from lightllm.engine.plan import (Adopt, Chunk, DropGrammar, DropLora, LoadGrammar, LoadLora, Release, Reset, StepPlan,
                                  StepResult)
from lightllm.engine.request import FinishReason, Req, ReqStatus, TokenOut

logger = logging.getLogger(__name__)

POLICIES = ("lpt", "fcfs", "priority")
# Under "lpt", a request that has waited this many steps is admitted before any younger one.
AGING_STEPS = 256

# With admission_wait_steps, free slots are gathered while fewer than max_running / this are free.
ADMISSION_ROOM_DIVISOR = 16

# The step's prompt-token budget is burst_chunk_budget while more than this many steps' worth of
# chunk_budget waits to be prefilled (admitted or not): a burst's prompts are prefilled in fewer,
# larger steps, each of which pays the running batch's decode once, so its last first token
# comes sooner; at a steady rate the backlog stays below and every step stays short. 2 rather
# than 8: with 8 the burst's last 8 steps of prompts, whose requests are its TTFT tail, went at
# the small budget (simulated H100, 1000 at once: P99 TTFT 7.65 s against 7.30 at 2, budget 4096).
BURST_BACKLOG_STEPS = 2

# The burst budget where --burst_chunked_prefill_size is absent, on a GPU. Measured on an H100
# (bench-8b, ShareGPT, 2026-11-27, 71975dc and 358f307; docs/benchmarks-history.md) against the chunk budget alone: 1000 at
# once, P99 TTFT 9.45 -> 6.96 s and 39.6 -> 41.0 req/s; 2000 at once, median TTFT 8.61 -> 7.79 s
# at the same req/s; the price, the bursts' P99 TPOT 79-89 -> 226-234 ms (a step of 8192 prompt
# tokens beside the running decodes). None on a CPU, where such a step takes seconds.
GPU_BURST_CHUNK_BUDGET = 8192


def burst_budget(setting: int | None, chunk_budget: int, device_type: str) -> int:
    """The burst budget a --burst_chunked_prefill_size setting means on a device of this type:
    absent, GPU_BURST_CHUNK_BUDGET on a GPU and chunk_budget (off) elsewhere; 0, chunk_budget;
    never below chunk_budget."""
    if setting is None:
        setting = GPU_BURST_CHUNK_BUDGET if device_type == "cuda" else 0
    return max(chunk_budget, setting)

# A finished request's slots are freed by the plan after the step whose result shows it
# finished: up to two steps after its last scheduled decode when a step is in flight.
FREE_LAG_STEPS = 1

# A request whose first chunk would start with the same SHARE_PROBE tokens, at the same position,
# as a chunk already planned in this step waits a step and takes them from the cache: requests
# that arrive together with one system prompt compute it once.
SHARE_PROBE = 16


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def peak_token_usage(tokens_held: np.ndarray, tokens_left: np.ndarray) -> int:
    """Most KV tokens a batch can ever hold if every request grows by one token a step for
    `tokens_left` more steps and then frees what it holds.

    Sort by tokens left, descending. Request i (1-based) stops after left_i more steps; at that
    moment requests 1..i still run and have each grown by left_i (at most), while i+1..n have
    freed their tokens, so usage <= cumsum(held)_i + i * left_i. Usage only ever drops when a
    request ends, so the peak is the largest of these n values.
    """
    if len(tokens_held) == 0:
        return 0
    order = np.argsort(-tokens_left, kind="stable")
    left = tokens_left[order]
    held_cumsum = np.cumsum(tokens_held[order])
    position = np.arange(1, len(left) + 1)
    return int(np.max(held_cumsum + left * position))


class Attribution:
    """Cached tokens that running requests reference, each node charged to the one of its
    referrers that runs longest (the most steps left): the node is locked exactly as long as
    that request runs, so `peak_token_usage` over (own + charged, left) bounds the batch."""

    def __init__(self, held: np.ndarray, left: np.ndarray):
        self.held, self.left = held, left
        self.owner: dict = {}  # node -> (request index, tokens of it charged)

    def charge(self, i: int, path: list) -> None:
        for node, length in path:
            owner = self.owner.get(node)
            if owner is None:
                self.owner[node] = (i, length)
                self.held[i] += length
                continue
            j, charged = owner
            if self.left[i] > self.left[j]:
                self.held[j] -= charged
                self.owner[node] = (i, max(charged, length))
                self.held[i] += max(charged, length)
            elif length > charged:  # a longer part of a node that will be split
                self.owner[node] = (j, length)
                self.held[j] += length - charged

    def copy(self) -> Attribution:
        out = Attribution(self.held.copy(), self.left)
        out.owner = dict(self.owner)
        return out


def cache_path(node, above=None) -> list:
    """(node, its length) from `node` up to the root, or to `above` (either excluded)."""
    out = []
    while node is not None and node.parent is not None and node is not above:
        out.append((node, len(node.key)))
        node = node.parent
    return out


def peak_with_drafts(tokens_held: np.ndarray, tokens_left: np.ndarray, drafts: np.ndarray) -> int:
    """`peak_token_usage` from the step in which request i verifies drafts[i] drafts on, for any
    number of them accepted (the step itself holds every draft's slot at once).

    A request that accepts a drafts holds a more tokens from then on and stops a steps sooner:
    t steps on it holds held + min(left, t + a) <= held + min(left, t + drafts) while it runs.
    In `peak_token_usage`'s order, at t = left_j the requests i before j add min(left_i - left_j,
    drafts_i) <= drafts_i each and j adds nothing: each term grows by the drafts of the requests
    counted before it. Between two ends usage only grows, so these terms bound every t from the
    step on. With no drafts it is `peak_token_usage`."""
    if len(tokens_held) == 0:
        return 0
    order = np.argsort(-tokens_left, kind="stable")
    left, k = tokens_left[order], drafts[order]
    position = np.arange(1, len(left) + 1)
    return int(np.max(np.cumsum(tokens_held[order]) + left * position + np.cumsum(k) - k))


def _urgency(req: Req) -> tuple:
    """The priority policy's order: lower priority values first, then preempted requests (their
    KV may still be cached), then arrival order."""
    return req.priority, req.preemptions == 0, req.arrival_seq


def _preemptible(req: Req) -> bool:
    """A running request that can start again from its outputs: not one whose grammar's state or
    prompt logprobs a new start would lose or repeat."""
    return not req.sampling.grammar_kind and req.uses_cache


class Scheduler:
    def __init__(self, max_total_token_num: int, chunk_budget: int, max_running: int, policy: str = "lpt",
                 prefix_cache: bool = True, admission_wait_steps: int = 0, burst_chunk_budget: int | None = None,
                 speculator=None, host_cache_tokens: int = 0, disk_cache_tokens: int = 0, max_loras: int = 0,
                 lora_ids: tuple[int, ...] = (), snapshot_interval: int = 0, snapshot_slots: int = 0):
        """admission_wait_steps: while requests decode and fewer slots are free than
        max_running / ADMISSION_ROOM_DIVISOR (and than requests waiting), admit at most once in
        that many steps, so that slots freed one by one are filled by one prefill step, not one each.
        burst_chunk_budget: the prompt tokens a step may prefill while a burst waits (`step_budget`);
        None or chunk_budget: always chunk_budget. speculator: a spec.controller.Speculator, which
        gives decoding requests drafts where they pay (None: no speculative decoding).
        host_cache_tokens: room of the prefix cache's host tier (0: evicted tokens are dropped);
        disk_cache_tokens: of its disk tier, below the host tier. snapshot_interval > 0: the model
        has recurrent state, snapshots of it every that many prompt tokens, in `snapshot_slots` slots."""
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.max_total_token_num = max_total_token_num
        self.chunk_budget = chunk_budget
        self.burst_chunk_budget = max(chunk_budget, burst_chunk_budget or chunk_budget)
        self._waiting_prompt_tokens = 0  # over self.waiting
        self.max_running = max_running
        self.policy = policy
        self.admission_wait_steps = admission_wait_steps
        self._last_admission_step = 0
        self.waiting: dict[int, Req] = {}  # insertion-ordered: arrival order
        self.running: list[Req] = []  # admission order: prefill chunks follow it
        self._by_id: dict[int, Req] = {}
        self._ops: list = []  # ops for the runner, in order; they ride on the next plan
        if prefix_cache and snapshot_interval and not snapshot_slots:
            raise ValueError("a prefix cache for a model with recurrent state needs snapshot slots")
        self.snapshot_interval = snapshot_interval
        self.cache_tiers = (host_cache_tokens, disk_cache_tokens, snapshot_slots if snapshot_interval else 0)
        self.cache = RadixCache(self._ops, *self.cache_tiers) if prefix_cache else None
        self._growing: list[Req] = []  # requests whose chunk in the last plan joins the cache next
        # A hybrid model's requests whose prompts others admitted with them share up to a cut, by
        # the probe those others wait on: they start once the leader's chunks reach its cut.
        self._leaders: dict[tuple, Req] = {}
        self._in_steps: set[int] = set()  # ids of steps planned whose result is not yet in
        self._next_step = 0
        self.prompt_computed_tokens = 0  # prompt tokens put in a step's chunks (counter)
        self.num_preemptions = 0  # running requests preempted for more urgent ones (counter)
        self._arrivals = 0
        self.prefix_queried_tokens = 0  # prompt tokens looked up in the cache (counter)
        self.prefix_hit_tokens = 0  # of which found cached (counter)
        self.prefix_host_hit_tokens = 0  # of those, loaded back from the host or disk tier (counter)
        self.prefix_disk_hit_tokens = 0  # of those, from the disk tier (counter)
        self.speculator = speculator
        self.max_loras = max_loras  # LoRA adapters the running batch may use at once (the runner's slots)
        self.lora_ids = set(lora_ids)  # the adapters the runner holds (those of --lora_modules: 1, 2, ...)
        self._drafts: dict[int, dict[int, list[int]]] = {}  # step id -> its plan's drafts, until its result

    # ---- requests in and out ----

    def add(self, req: Req) -> None:
        req.arrival_step, req.arrival_seq = self._next_step, self._arrivals
        self._arrivals += 1
        if req.sampling.grammar_kind:  # its grammar loads off the step first (LoadGrammar), then it is admitted
            p = req.sampling
            self._ops.append(LoadGrammar(req.req_id, p.grammar_kind, p.grammar, p.compiled_grammar))
            req.sampling = dataclasses.replace(p, compiled_grammar=b"")  # sent once: megabytes, at times
            req.grammar_ready = False
        self.waiting[req.req_id] = req
        self._waiting_prompt_tokens += req.prompt_len
        self._by_id[req.req_id] = req

    def abort(self, req_id: int) -> bool:
        """Drop a request wherever it is; True if it was known and not yet finished."""
        req = self._by_id.pop(req_id, None)
        if req is None:
            return False
        if self.waiting.pop(req_id, None) is None:
            self._end(req)
        else:
            self._waiting_prompt_tokens -= req.prompt_len
            if req.sampling.grammar_kind:
                self._ops.append(DropGrammar(req_id))
        req.status = ReqStatus.FINISHED
        return True

    def _end(self, req: Req) -> None:
        """A running request ends: its slots go back (or into the cache) with the next plan."""
        self.running.remove(req)
        self._by_id.pop(req.req_id, None)
        req.status = ReqStatus.FINISHED
        if self.speculator is not None:
            self.speculator.finish(req.req_id)
        node, req.node = req.node, None
        start = 0 if node is None else node.depth
        if req.started:  # the runner holds it
            end = -1
            if self.cache is not None and req.kv_tokens > start:
                # Every position's token is known: a decode feeds a token whose result is in
                # (or a draft accepted after the token it ended on).
                fed = req.fed_outputs
                if req.decode_steps > len(fed):
                    raise RuntimeError(f"{req} ends with a decode in flight: its tokens are not all known")
                tokens = req.cache_ids[start: req.prefilled] + fed[: req.decode_steps]
                duplicated, new = self.cache.insert(node or self.cache.root, tokens, req.req_id, start)
                end = start + duplicated
                if self.snapshot_interval and self.cache.free_snapshots and (new is not None or duplicated == len(tokens)):
                    # its state is that after every token it cached: a chat's next turn resumes there
                    # (a free slot only: ended requests do not push out the snapshots of shared prefixes)
                    self.cache.snapshot(new or self.cache.take(self.cache.match(tokens, node or self.cache.root)),
                                        req.req_id, evict=False)
            self._ops.append(Release(req.req_id, start, end))
        if node is not None:
            self.cache.unlock(node)

    @property
    def awaiting_grammars(self) -> bool:
        """Some waiting request's grammar is still loading: the engine asks the runner (a step
        with nothing to run) until it reports them."""
        return any(not r.grammar_ready for r in self.waiting.values())

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._ops)

    @property
    def tokens_used(self) -> int:
        """KV slots requests need once the steps scheduled so far have run (prompts count when
        done): their own and the cached ones they reference. Unreferenced cached tokens are
        free for this count (they are evicted when the room is needed)."""
        locked = 0 if self.cache is None else self.cache.locked_tokens
        return locked + sum(req.kv_tokens - req.shared for req in self.running)

    @property
    def slots_used(self) -> int:
        """KV slots taken in the token table once the ops so far have run: tokens_used plus
        the unreferenced cached tokens."""
        return self.tokens_used + (0 if self.cache is None else self.cache.evictable_tokens)

    @property
    def cached_tokens(self) -> int:
        return 0 if self.cache is None else self.cache.total_tokens

    def flush_cache(self) -> int:
        """Evict every cached token no running request references; returns how many."""
        return 0 if self.cache is None else self.cache.flush()

    # ---- planning ----

    def schedule(self) -> StepPlan:
        self._grow_cache()
        self._admit()
        if self._leaders:
            self._leaders = {probe: r for probe, r in self._leaders.items() if r.status is ReqStatus.PREFILLING}
        plan = StepPlan(self._next_step)
        prefilling = 0  # prompt tokens of admitted requests still to prefill
        for req in self.running:
            if req.needs_decode:
                req.decode_steps += 1
                plan.decodes.append(req.req_id)
            elif req.status is ReqStatus.PREFILLING:
                prefilling += req.prompt_left
        budget = self.step_budget(prefilling)
        first_chunks = []
        computing = set()  # what the chunks planned so far start with: (position, SHARE_PROBE tokens)
        for req in self._chunk_order(budget, prefilling):
            if budget == 0:
                break
            if req.status is ReqStatus.PREFILLING:
                if not req.started:
                    self._take_cached(req)
                probe = self._probe(req) if self.cache is not None else None
                if not req.started:
                    if probe is not None and (probe in computing or self._led(probe)):
                        continue  # a chunk of this step computes its next tokens: take them cached next step
                    if probe is not None:
                        self._plan_cuts(req, probe)
                    self._start(req)
                    first_chunks.append(req)
                if probe is not None:
                    computing.add(probe)
                plan.chunks.append(self._chunk(req, min(budget, self._chunk_room(req, budget))))
                budget -= len(plan.chunks[-1].token_ids)
                if self.cache is not None:
                    self._growing.append(req)
        if self.speculator is not None:
            plan.drafts = self._plan_drafts(plan)
        self._make_room(plan.num_drafts)
        for req, chunk in zip(first_chunks, (c for c in plan.chunks if c.first)):
            chunk.prefix = tuple(node.node_id for node, _ in reversed(cache_path(req.node)))
            if self.snapshot_interval and req.node is not None:
                assert req.node.snapshot >= 0, req.node  # resumable() cut the match back to one
                chunk.snapshot = req.node.snapshot
        plan.ops = list(self._ops)
        self._ops.clear()
        if not plan.empty:
            self._in_steps.add(plan.step_id)
            self._next_step += 1
        if plan.drafts:
            self._drafts[plan.step_id] = plan.drafts
        return plan

    # ---- speculative decoding ----

    def _draftable(self, req: Req) -> int:
        """Most drafts the request may verify in the step being planned: its tokens are all back
        (a decode of it is planned in this step, none in flight), and it uses neither penalties
        nor a grammar (they depend on each token before); 0 otherwise."""
        if req.depends_on_tokens or len(req.output_ids) - req.resumed != req.decode_steps:
            return 0
        return max(0, req.max_new_tokens - req.output_count - 1)  # each step emits up to drafts + 1

    def wants_drafts(self) -> bool:
        """Whether the next step would speculate if every decoding request's tokens were back:
        the engine then collects the step in flight first (drafts continue the latest tokens).
        A request counts if the source had drafts for it after its last token (its shadow)."""
        reqs = [r for r in self.running if r.status is ReqStatus.DECODING and r.needs_decode]
        spec = self.speculator
        candidates = [r for r in reqs if spec.limit(r.spec) and r.spec.measured and self._draftable_later(r)]
        alphas = [r.spec.alpha(spec.global_alpha) for r in candidates]
        limits = [min(spec.limit(r.spec), self._draftable_later(r)) for r in candidates]
        tokens = len(reqs) + self._next_prompt_tokens()
        return self.speculator.allocate(alphas, limits, tokens, len(reqs)) is not None

    def _next_prompt_tokens(self) -> int:
        """The prompt tokens the next step is expected to prefill: those of the admitted requests
        and, while a slot is free, of the waiting ones, up to the step's budget. The decision to
        collect the step in flight for drafts is taken on the step the plan will make: chunks make
        it larger, and the choice on its size may be a plain step (a collection for nothing)."""
        prefilling = sum(r.prompt_left for r in self.running if r.status is ReqStatus.PREFILLING)
        waiting = self._waiting_prompt_tokens if len(self.running) < self.max_running else 0
        return min(self.step_budget(prefilling), prefilling + waiting)

    def _draftable_later(self, req: Req) -> int:
        """`_draftable` once its step in flight is back (one token more, maybe)."""
        return 0 if req.depends_on_tokens else max(0, req.run_new_tokens - req.decode_steps - 3)

    def _plan_drafts(self, plan: StepPlan) -> dict[int, list[int]]:
        """Drafts for this step's decodes where the controller expects them to pay, within the KV
        budget whatever is accepted (`peak_with_drafts`)."""
        spec = self.speculator
        candidates, limits = [], []
        for req in map(self._by_id.__getitem__, plan.decodes):
            k = req.spec.measured and self._draftable(req)
            if k:
                candidates.append(req)
                limits.append(k)
        prior = spec.global_alpha
        alphas = [r.spec.alpha(prior) for r in candidates]
        outputs = len(plan.sampled)
        counts = spec.allocate(alphas, limits, plan.num_tokens, outputs)
        if counts is None:
            spec.planned(False, len(plan.decodes), plan.num_tokens)
            return {}
        drafts = spec.propose({req.req_id: k for req, k in zip(candidates, counts) if k})
        while drafts and not self._drafts_fit(drafts):
            drafts = {i: d[: len(d) // 2] for i, d in drafts.items() if len(d) > 1}
        spec.planned(bool(drafts), len(plan.decodes), plan.num_tokens)
        return drafts

    def _drafts_fit(self, drafts: dict[int, list[int]]) -> bool:
        charged = self._charged(self.running, None)
        k = np.array([len(drafts.get(r.req_id, ())) for r in self.running], dtype=np.int64)
        return peak_with_drafts(charged.held, charged.left, k) <= self.max_total_token_num

    def step_budget(self, prefilling: int) -> int:
        """Prompt tokens this step may prefill: burst_chunk_budget while the prompts waiting to be
        prefilled (`prefilling` tokens admitted, and every waiting request's) exceed
        BURST_BACKLOG_STEPS steps of chunk_budget, else chunk_budget. Admission's delay term counts
        steps of chunk_budget, so a larger step only ever brings a request's growth sooner than it
        assumed, which its bound allows."""
        if prefilling + self._waiting_prompt_tokens > BURST_BACKLOG_STEPS * self.chunk_budget:
            return self.burst_chunk_budget
        return self.chunk_budget

    def _chunk_order(self, budget: int, prefilling: int) -> list[Req]:
        """The order in which the step's budget goes to the admitted requests' prompts: admission
        order, except that when it cannot take them all, the requests about to start with at least
        half of their prompt cached (a shared prefix's followers once their leader has cached it,
        a chat's next turn) go before those about to start from (mostly) nothing: a few tokens each
        bring their first tokens a step or more sooner. A request passed over this way has its
        turn back once it has waited AGING_STEPS steps."""
        if self.cache is None or budget >= prefilling:
            return self.running
        if self._leaders:  # followers take their leader's prefix now, not in the loop: it decides their turn
            for req in self.running:
                if req.status is ReqStatus.PREFILLING and not req.started and self._probe(req) in self._leaders:
                    self._take_cached(req)
        aged = self._next_step - AGING_STEPS
        return sorted(self.running, key=lambda r: r.status is ReqStatus.PREFILLING and not r.started
                      and 2 * r.prefilled < r.prompt_len and r.arrival_step > aged)

    def _take_cached(self, req: Req) -> None:
        """Before its first chunk: take whatever more of its prompt is cached by now (requests
        admitted with it may have computed it)."""
        if self.cache is None or not req.uses_cache:
            return
        above = req.node or self.cache.root
        found = self._match(req.cache_ids[req.prefilled: req.prompt_len - 1], above)
        if found.length:
            node = self.cache.take(found)
            self.cache.lock(node, above=above)
            req.node, req.prefilled = node, node.depth
            self._load_host([req])

    def _match(self, tokens: list[int], above=None) -> Match:
        """The longest cached prefix of `tokens` below `above` (the root) that a request can resume."""
        above = above or self.cache.root
        return self.cache.resumable(self.cache.match(tokens, above), above)

    def _chunk_room(self, req: Req, budget: int) -> int:
        """Most tokens its next chunk may take: the rest of its prompt, up to its next cut, and for
        a model with recurrent state up to the next multiple of the snapshot interval, unless that
        is the prompt's last one and the step's `budget` takes the whole rest: a request's chunks
        run one a step, so such a cut would cost it a step for a snapshot that only a prompt
        sharing its tokens past the boundary could use (a shared prefix's followers, resuming just
        before one, each paid a step and a snapshot slot there)."""
        if self.cache is None or not req.uses_cache:
            return req.prompt_left
        ends = [c for c in req.cuts if c > req.prefilled]
        if self.snapshot_interval:
            boundary = (req.prefilled // self.snapshot_interval + 1) * self.snapshot_interval
            if req.prompt_left > budget or req.prompt_len - boundary >= self.snapshot_interval:
                ends.append(boundary)
        return min([req.prompt_left, *(end - req.prefilled for end in ends)])

    def _plan_cuts(self, req: Req, probe: tuple) -> None:
        """Before a request's first chunk: the points where its prompt parts from those of the
        requests admitted with it that wait to start from the same tokens (SHARE_PROBE), where its
        chunks end, so that the prefix they share joins the cache whole and they start from all of
        it, the next step (it leads them: `_led`); not one token of it is computed twice (ends closer
        than SHARE_PROBE, as prompts whose tokens merge across the prefix's end have, make one). A hybrid
        model's chunks leave snapshots at the cuts (`_grow_cache`), each at least snapshot_interval
        / 8 past the last boundary, and cut also where its cached KV runs past the snapshot it
        resumes from (a prefix that ended inside an interval, cached whole by an earlier request:
        the request computes it again and leaves the snapshot the next one resumes from)."""
        above = req.node or self.cache.root
        tail = req.cache_ids[req.prefilled: req.prompt_len - 1]
        ends = [req.prefilled + self.cache.match(tail, above).length] if self.snapshot_interval else []
        shared = False
        for other in self.running:
            if other is not req and not other.started and other.status is ReqStatus.PREFILLING \
                    and self._probe(other) == probe:
                ends.append(req.prefilled + common_prefix(tail, other.cache_ids[req.prefilled: other.prompt_len - 1]))
                shared = True
        gap = max(1, self.snapshot_interval // 8) if self.snapshot_interval else SHARE_PROBE
        req.cuts = []
        for end in sorted(set(ends)):  # of ends closer than `gap`, the first (its followers compute the rest)
            if end - req.prefilled >= gap and (not self.snapshot_interval or end % self.snapshot_interval >= gap) \
                    and (not req.cuts or end - req.cuts[-1] >= gap):
                req.cuts.append(end)
        if shared and req.cuts:
            self._leaders[probe] = req

    def _led(self, probe: tuple) -> bool:
        """A request leads those that start with `probe`: its chunks up to its last cut are not all
        in the cache yet (the one that reaches it joins at the next plan)."""
        leader = self._leaders.get(probe)
        if leader is not None and leader.status is ReqStatus.PREFILLING and (
                leader.prefilled < leader.cuts[-1] or leader in self._growing):
            return True
        self._leaders.pop(probe, None)
        return False

    def _load_host(self, reqs: list[Req]) -> None:
        """Their locked paths' host-resident nodes come back to the device, root side first, after
        room is evicted for all of them (admission charged their tokens): the plan then holds the
        evictions, then the loads, which the runner moves as one batch each. A node two paths
        share counts as a host hit of the first."""
        nodes: dict = {}  # node -> the request it is loaded for, in load order
        for req in reqs:
            for node in self.cache.host_path(req.node):
                nodes.setdefault(node, req)
        if not nodes:
            return
        self._make_room(sum(len(node.key) for node in nodes))
        for node, req in nodes.items():
            req.disk_hits += len(node.key) if node.disk else 0
            self.cache.load(node)
            req.host_hits += len(node.key)

    def _probe(self, req: Req) -> tuple | None:
        """Where its next chunk starts and its first SHARE_PROBE tokens (None: too short to matter)."""
        if req.prompt_left <= SHARE_PROBE or not req.uses_cache:
            return None
        return req.prefilled, tuple(req.cache_ids[req.prefilled: req.prefilled + SHARE_PROBE])

    def _start(self, req: Req) -> None:
        """Its first chunk is planned: count the lookup."""
        if self.cache is not None:
            self.prefix_queried_tokens += req.prompt_len
            self.prefix_hit_tokens += req.prefilled
            self.prefix_host_hit_tokens += req.host_hits
            self.prefix_disk_hit_tokens += req.disk_hits
        req.cached = req.prefilled
        req.started = True
        if req.arrival_time > 0:
            req.queue_time = max(0.0, time.time() - req.arrival_time)

    def _chunk(self, req: Req, n: int) -> Chunk:
        start = req.prefilled
        req.prefilled += n
        self.prompt_computed_tokens += n
        last = req.prefilled == req.prompt_len
        chunk = Chunk(req.req_id, req.prompt_ids[start: start + n], start, last,
                      req.sampling if start == req.cached else None)
        if chunk.first:
            chunk.lora = req.lora_id
            if req.resumed:
                chunk.resumed = tuple(req.output_ids[: req.resumed])
        if not last and not req.uses_cache:
            chunk.next_id = req.prompt_ids[req.prefilled]
        if last:
            req.status = ReqStatus.DECODING
        return chunk

    def _grow_cache(self) -> None:
        """The chunks of the last plan go into the cache (their KV is computed before any later
        step reads it), so that later requests with the same prefix skip them. A chunk that begins
        with tokens the cache holds by now (computed at once with another request, or again by a
        hybrid request that resumed from an earlier snapshot: a prefix cut there to leave one, a
        prompt whose first tokens match another's) gives its copy of them up for the cache's
        (`Adopt`) and the rest joins below them."""
        growing, self._growing = self._growing, []
        for req in growing:
            if req.status is ReqStatus.FINISHED:
                continue  # an ended request was cached whole
            start, above = req.shared, req.node or self.cache.root
            tokens = req.cache_ids[start: req.prefilled]
            duplicated, node = self.cache.insert(above, tokens, req.req_id, start)
            if duplicated:  # the path down to what matched, which the new node (if any) hangs from
                held = node.parent if node is not None else self.cache.take(self.cache.match(tokens, above))
                ids = tuple(n.node_id for n, _ in reversed(cache_path(held, above)))
                self._ops.append(Adopt(req.req_id, start, start + duplicated, ids))
                node = node if node is not None else held
            if node is not None:
                self.cache.lock(node, above=above)
                req.node = node
            if self.snapshot_interval and self._snapshot_point(req):
                self.cache.snapshot(req.node, req.req_id)

    def _snapshot_point(self, req: Req) -> bool:
        return req.prefilled % self.snapshot_interval == 0 or req.prefilled in req.cuts

    def _make_room(self, extra: int = 0) -> None:
        """Evict unreferenced cached tokens until what the plan allocates fits (and `extra` more:
        the step's drafts, or a node about to be loaded from the host tier)."""
        if self.cache is None or self.cache.evictable_tokens == 0:
            return
        need = self.slots_used + extra - self.max_total_token_num
        if need > 0:
            freed = self.cache.evict(need)
            if freed < need:  # admission counts evictable tokens as free: this cannot happen
                raise RuntimeError(f"KV budget: {need} tokens over, {freed} evictable")

    def _admit(self) -> None:
        """Admit the longest prefix of the waiting queue whose peak KV use fits (binary search:
        adding a request never lowers the peak), so a large request is never overtaken."""
        preempted = self._preempt_for_priority()
        room = self.max_running - len(self.running)
        if room <= 0 or not self.waiting:  # the common case of a full batch: no sort, no check
            return
        if not preempted and self._gathering_room(room):
            return
        candidates = self._within_lora_slots([r for r in self._admission_order() if r.grammar_ready][:room])
        if not candidates:
            return
        matches = None
        if self.cache is not None and (self.cache.total_tokens or self.cache.host_tokens or self.cache.disk_tokens):
            matches = [self._match(req.cache_ids[: req.prompt_len - 1] if req.uses_cache else [])
                       for req in candidates]
        fits = self._fits(candidates, matches)
        lo, hi = 0, len(candidates)  # lo fits; find the largest count that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        if lo == 0 and not self.running and candidates[0].kv_cap <= self.max_total_token_num:
            lo = 1  # alone, a request never holds more than its cap: the delay term is moot
        if lo:
            self._last_admission_step = self._next_step
        matched = []  # admitted with a cached prefix: their host-resident nodes load once all are locked
        for req in candidates[:lo]:
            del self.waiting[req.req_id]
            self._waiting_prompt_tokens -= req.prompt_len
            req.status = ReqStatus.PREFILLING
            self.running.append(req)
            if self.speculator is not None:
                req.spec = self.speculator.start(req.req_id, req.prompt_ids)
            if matches is not None and req.uses_cache:  # matched again: an earlier admission may have split a node
                found = self._match(req.cache_ids[: req.prompt_len - 1])
                if found.length:
                    req.node = self.cache.take(found)
                    self.cache.lock(req.node)
                    req.prefilled = found.length
                    matched.append(req)
        if self.cache is not None:
            self._load_host(matched)

    # ---- preemption (the priority policy) ----

    def _preempt_for_priority(self) -> bool:
        """Under the priority policy, while the most urgent waiting request cannot be admitted (no
        free row, no adapter slot, or the KV budget's proof fails with it), preempt the running
        request of the lowest priority (the largest value; the last to arrive among equals) that
        is strictly less urgent than it, if preempting every such request would let it in at all.
        A preempted request goes back to waiting with its outputs so far at the end of its prompt
        (`Req.requeue`); its KV goes into the prefix cache, so that resuming computes again only
        what was evicted meanwhile. Returns whether any was preempted."""
        if self.policy != "priority" or not self.running or not self.waiting:
            return False
        ready = [r for r in self.waiting.values() if r.grammar_ready]
        if not ready:
            return False
        first = min(ready, key=_urgency)
        victims = [r for r in self.running if r.priority > first.priority and _preemptible(r)]
        if not victims or self._admissible(first) or not self._admissible(first, without=victims):
            return False  # (the first test alone, each step of a full batch of equals)
        victims.sort(key=lambda r: (r.priority, r.arrival_seq))
        while victims and not self._admissible(first):
            self._preempt(victims.pop())
        return True

    def _admissible(self, req: Req, without: list[Req] = ()) -> bool:
        """Whether `req` alone would be admitted next, with the running requests `without` gone."""
        running = self.running
        if without:
            gone = {r.req_id for r in without}  # a set: the batch and the victims may each be ~1,000
            self.running = [r for r in running if r.req_id not in gone]
        try:
            if len(self.running) >= self.max_running or not self._within_lora_slots([req]):
                return False
            if not self.running:  # alone, a request never holds more than its cap (as _admit)
                return req.kv_cap <= self.max_total_token_num
            matches = None
            if self.cache is not None and (self.cache.total_tokens or self.cache.host_tokens or self.cache.disk_tokens):
                matches = [self._match(req.cache_ids[: req.prompt_len - 1] if req.uses_cache else [])]
            return self._fits([req], matches)(1)
        finally:
            self.running = running

    def _preempt(self, req: Req) -> None:
        self._end(req)
        req.requeue(self._next_step)
        self.waiting[req.req_id] = req
        self._by_id[req.req_id] = req
        self._waiting_prompt_tokens += req.prompt_len
        self._growing = [r for r in self._growing if r is not req]
        self.num_preemptions += 1
        logger.debug("preempted request %d (priority %d, %d tokens out) for a more urgent one",
                     req.req_id, req.priority, req.output_count)

    def _within_lora_slots(self, candidates: list[Req]) -> list[Req]:
        """The candidates up to the first whose LoRA adapter would be one more than the runner's
        slots hold beside the running batch's."""
        adapters = {r.lora_id for r in self.running if r.lora_id}
        for i, req in enumerate(candidates):
            if req.lora_id and req.lora_id not in adapters:
                if len(adapters) == self.max_loras:
                    return candidates[:i]
                adapters.add(req.lora_id)
        return candidates

    # ---- LoRA adapters ----

    def load_lora(self, lora_id: int, path: str) -> None:
        if not self.max_loras or lora_id in self.lora_ids or lora_id <= 0:
            raise ValueError(f"cannot load LoRA adapter {lora_id}: no slots, or the id is taken")
        self.lora_ids.add(lora_id)
        self._ops.append(LoadLora(lora_id, path))

    def drop_lora(self, lora_id: int) -> list[TokenOut]:
        """Forget adapter `lora_id`: its requests that have not started end with an error (the
        running ones finish on the slot that holds it)."""
        self.lora_ids.discard(lora_id)
        unstarted = [r for r in [*self.waiting.values(), *self.running] if r.lora_id == lora_id and not r.started]
        for req in unstarted:
            self.abort(req.req_id)
        self._ops.append(DropLora(lora_id))
        return [TokenOut(r.req_id, -1, 0.0, FinishReason.ERROR, error="LoRA adapter unloaded") for r in unstarted]

    def _gathering_room(self, room: int) -> bool:
        """Whether to leave the free slots empty this step: every admission into a decoding batch
        costs a step with a prefill chunk, which runs eagerly (no CUDA graph), so new requests
        come in groups while the batch is nearly full."""
        if not self.admission_wait_steps or not self.running:
            return False
        wanted = min(max(1, self.max_running // ADMISSION_ROOM_DIVISOR), len(self.waiting))
        return room < wanted and self._next_step - self._last_admission_step < self.admission_wait_steps

    def _fits(self, candidates: list[Req], matches: list[Match] | None):
        """fits(k): whether the running batch plus the first k candidates stays in budget."""
        base = len(self.running)
        running = self._charged(self.running + candidates, matches)
        left = running.left

        def fits(k: int) -> bool:
            charged = running.copy() if matches is not None else running
            for i in range(k) if matches is not None else ():
                charged.charge(base + i, matches[i].partial_nodes())
            return peak_token_usage(charged.held[: base + k], left[: base + k]) <= self.max_total_token_num

        return fits

    def _charged(self, reqs: list[Req], matches: list[Match] | None) -> Attribution:
        """`_reservations` of `reqs` (the running batch first), with the cached tokens the running
        requests reference charged to them."""
        charged = Attribution(*self._reservations(reqs, matches))
        for i, req in enumerate(self.running):
            charged.charge(i, cache_path(req.node))
        return charged

    def _admission_order(self) -> list[Req]:
        """fcfs: arrival order. priority: lowest `priority` first, preempted requests first among
        equals (their KV may still be cached), then arrival order (vLLM's; strict: a stream of
        urgent requests keeps the others waiting, and preempts them: `_preempt_for_priority`).
        lpt: longest output budget first, so that long generations start early and a burst does
        not end on a few long requests at batch 1; a request that has waited AGING_STEPS steps
        goes before every younger one, in arrival order (no starvation)."""
        waiting = list(self.waiting.values())
        if self.policy == "fcfs":
            return waiting
        if self.policy == "priority":
            return sorted(waiting, key=_urgency)
        aged = self._next_step - AGING_STEPS
        return sorted(waiting, key=lambda r: (r.arrival_step > aged, -r.max_new_tokens if r.arrival_step > aged else 0))

    def _reservations(self, reqs: list[Req], matches: list[Match] | None) -> tuple[np.ndarray, np.ndarray]:
        """(own tokens, steps left) per request for `peak_token_usage`, in the order given
        (admission order); cached tokens they reference are charged on top (`Attribution`).

        A prefilling request holds its whole prompt from admission; it starts to grow once its
        last chunk has run, within ceil(prompt tokens still to prefill up to it / chunk_budget)
        steps, so its growth is counted from now with that delay added to its steps left.
        Every request holds its tokens FREE_LAG_STEPS longer than it grows."""
        held = np.empty(len(reqs), dtype=np.int64)
        left = np.empty(len(reqs), dtype=np.int64)
        queued = 0
        base = len(self.running)
        for i, req in enumerate(reqs):
            shared = req.shared if i < base or matches is None else matches[i - base].length
            if req.status is ReqStatus.DECODING:
                positions, delay = req.kv_tokens, 0
            else:
                queued += req.prompt_len - max(req.prefilled, shared)
                positions, delay = req.prompt_len, -(-queued // self.chunk_budget)
            held[i] = positions - shared
            left[i] = req.kv_cap - positions + delay + FREE_LAG_STEPS
        return held, left

    # ---- results ----

    def process(self, result: StepResult) -> list[TokenOut]:
        """Turn a step's tokens into outputs; end the requests that finished."""
        outs = self._grammars_loaded(result.grammars)
        if result.step_id not in self._in_steps:
            return outs  # a step launched before the engine was reset, or only grammars
        self._in_steps.remove(result.step_id)
        if result.error is not None:
            logger.error("model step %d failed: %s", result.step_id, result.error)
            return self.fail_all(result.error)
        runs = itertools.groupby(result.tokens, key=lambda token: token.req_id)  # a request's are adjacent
        drafts = self._drafts.pop(result.step_id, {})
        if drafts:  # runs of several tokens: read twice (a plain step's runs of one are read once)
            runs = [(req_id, list(run)) for req_id, run in runs]
            self._settle_drafts(runs, drafts)
        spec = self.speculator
        observed = []  # requests whose tokens came, for their next shadow drafts
        for req_id, run in runs:
            req = self._by_id.get(req_id)
            if req is None or result.step_id < req.first_step:  # ended (or preempted) while this step ran:
                continue  # its extra token is never emitted
            emitted, reason = self._emit(req, run, outs)
            if spec is not None:  # the source sees the whole run at once
                spec.observe(req_id, req.spec, emitted)
                if req_id not in drafts:
                    observed.append(req)
            if reason is not None:
                fed = drafts.get(req_id)
                if fed is not None:  # its KV holds the accepted drafts after the token it ended on
                    req.unemitted = fed[req.output_count - req.run_start: req.run_accepted]
                self._end(req)
        if spec is not None:
            spec.shadow_drafts([(r.req_id, r.spec) for r in observed if r.status is ReqStatus.DECODING])
        return outs

    @staticmethod
    def _emit(req: Req, run, outs: list[TokenOut]) -> tuple[list[int], FinishReason | None]:
        """A request's tokens of one step into outputs, up to the one that ends it; (their ids, why it ends)."""
        emitted, reason, req_id, append = [], None, req.req_id, req.append
        for token in run:
            token_id = token.token_id
            reason = append(token_id)
            out = TokenOut(req_id, token_id, token.logprob, reason, top_logprobs=token.top, rank=token.rank)
            if len(req.output_ids) == 1:
                out.cached_tokens, out.queue_time, out.prompt_logprobs = req.cached, req.queue_time, token.prompt
            outs.append(out)
            emitted.append(token_id)
            if reason is not None:
                break
        return emitted, reason

    def _grammars_loaded(self, loaded: list) -> list[TokenOut]:
        """Waiting requests whose grammar loaded may be admitted; one that cannot be used ends."""
        outs = []
        for req_id, error in loaded:
            req = self.waiting.get(req_id)
            if req is None:
                continue  # aborted meanwhile (its DropGrammar is on its way)
            if error is None:
                req.grammar_ready = True
                continue
            self.waiting.pop(req_id)
            self._by_id.pop(req_id, None)
            self._waiting_prompt_tokens -= req.prompt_len
            req.status = ReqStatus.FINISHED
            self._ops.append(DropGrammar(req_id))
            outs.append(TokenOut(req_id, -1, 0.0, FinishReason.ERROR, error=f"grammar: {error}"))
        return outs

    def _settle_drafts(self, runs: list[tuple[int, list]], drafts: dict[int, list[int]]) -> None:
        """A verifying request's run is its accepted drafts and one more token: it holds the KV of
        those drafts now, and the controller learns how many were accepted."""
        for req_id, run in runs:
            fed = drafts.get(req_id)
            req = self._by_id.get(req_id)
            if fed is None or req is None or req.status is ReqStatus.WAITING:
                continue
            accepted = len(run) - 1
            req.decode_steps += accepted
            req.run_start, req.run_accepted = req.output_count, accepted
            self.speculator.verified(req.spec, len(fed), accepted)

    def fail_all(self, error: str) -> list[TokenOut]:
        """The engine failed: every request ends with an error, and the runner starts again
        from nothing (a failed step may have left its slots and the cache half-written)."""
        reqs = self.running + list(self.waiting.values())
        for req in reqs:
            req.status = ReqStatus.FINISHED
        if self.speculator is not None:
            for req in self.running:
                self.speculator.finish(req.req_id)
        self._drafts.clear()
        self.running, self.waiting, self._by_id, self._growing = [], {}, {}, []
        self._leaders.clear()
        self._waiting_prompt_tokens = 0
        self._in_steps.clear()
        self._ops.clear()
        self._ops.append(Reset())
        if self.cache is not None:
            self.cache = RadixCache(self._ops, *self.cache_tiers)
        return [TokenOut(req.req_id, -1, 0.0, FinishReason.ERROR, error=error) for req in reqs]
