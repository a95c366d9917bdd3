"""ModelRunner's step contract without a model: the scheduler's and the engine core's tests drive it."""

import random

from lightllm.engine.plan import Adopt, Evict, Insert, Release, Reset, SampledToken, Split, StepPlan, StepResult

EOS = 2


class FakeRunner:
    """ModelRunner's step contract (ops, launch, answer with the previous step unless sync) with
    its KV slots mirrored position by position: each request's own positions and each cache
    node's size. It checks what the real runner relies on: a prefix covers exactly the cached
    positions, an insert or release touches only the request's own positions, a released
    request leaves none behind, and the slots in use never exceed the budget. EOS drawn at random.
    A request with drafts takes a slot for each, accepts a random number of them (the slots of
    the rest are free again after the step) and answers with its accepted run."""

    def __init__(self, budget: int, eos_rate: float, rng: random.Random):
        self.budget, self.eos_rate, self.rng = budget, eos_rate, rng
        self.seq: dict[int, int] = {}  # req id -> positions written
        self.own: dict[int, set[int]] = {}  # req id -> positions whose slots it owns
        self.nodes: dict[int, int] = {}  # cache node id -> slots
        self.peak = 0
        self._pending: StepResult | None = None

    @property
    def kv(self) -> dict[int, int]:
        return dict(self.seq)

    @property
    def used(self) -> int:
        return sum(self.nodes.values()) + sum(len(p) for p in self.own.values())

    def apply(self, ops) -> None:
        for op in ops:
            if isinstance(op, Release):
                seq, own = self.seq.pop(op.req_id), self.own.pop(op.req_id)
                freed = set(range(op.start, seq if op.end < 0 else op.end))
                assert freed <= own and own - freed == set(), (op, sorted(own - freed)[:5])
            elif isinstance(op, Adopt):  # its own slots go back, the nodes' take their place
                given = set(range(op.start, op.end))
                assert given <= self.own[op.req_id] and sum(self.nodes[n] for n in op.node_ids) == len(given), op
                self.own[op.req_id] -= given
            elif isinstance(op, Insert):
                taken = set(range(op.start, op.end))
                assert taken <= self.own[op.req_id] and op.node_id not in self.nodes, op
                self.own[op.req_id] -= taken
                self.nodes[op.node_id] = len(taken)
            elif isinstance(op, Split):
                assert 0 < op.at < self.nodes[op.node_id] and op.upper_id not in self.nodes, op
                self.nodes[op.upper_id] = op.at
                self.nodes[op.node_id] -= op.at
            elif isinstance(op, Evict):
                del self.nodes[op.node_id]
            elif isinstance(op, Reset):
                self.seq, self.own, self.nodes = {}, {}, {}

    def step(self, plan: StepPlan) -> list[StepResult]:
        self.apply(plan.ops)
        launched = None
        if not plan.empty:
            for req_id in plan.decodes:
                fed = 1 + len(plan.drafts.get(req_id, ()))
                self.own[req_id] |= set(range(self.seq[req_id], self.seq[req_id] + fed))
                self.seq[req_id] += fed
            for chunk in plan.chunks:
                assert chunk.first == (chunk.req_id not in self.seq)
                if chunk.first:
                    assert sum(self.nodes[n] for n in chunk.prefix) == chunk.start, chunk
                    self.seq[chunk.req_id], self.own[chunk.req_id] = chunk.start, set()
                assert self.seq[chunk.req_id] == chunk.start
                end = chunk.start + len(chunk.token_ids)
                self.own[chunk.req_id] |= set(range(chunk.start, end))
                self.seq[chunk.req_id] = end
            self.peak = max(self.peak, self.used)
            assert self.peak <= self.budget, (self.peak, self.budget)
            tokens = [t for i in plan.sampled for t in self._run(i, plan.drafts.get(i, []))]
            launched = StepResult(plan.step_id, [SampledToken(i, t, -1.0) for i, t in tokens])
        done = [self._pending] if self._pending is not None else []
        self._pending = None
        if launched is not None and (plan.sync or plan.empty):
            done.append(launched)
        else:
            self._pending = launched
        return done

    def _run(self, req_id: int, drafts: list[int]) -> list[tuple[int, int]]:
        """(req id, token) of its accepted drafts and one more; the rejected drafts' slots go back."""
        accepted = self.rng.randint(0, len(drafts)) if drafts else 0
        rejected = len(drafts) - accepted
        if rejected:
            self.seq[req_id] -= rejected
            self.own[req_id] -= set(range(self.seq[req_id], self.seq[req_id] + rejected))
        return [(req_id, t) for t in drafts[:accepted] + [self._token()]]

    def _token(self) -> int:
        return EOS if self.rng.random() < self.eos_rate else 100
