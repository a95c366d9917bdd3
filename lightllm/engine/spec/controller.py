"""The speculation controller: per step, how many drafts each decoding request gets (zero allowed).

It speculates only where the expected tokens per second of the step beat plain decoding's:

- Acceptance. Each request keeps a decayed count of drafts accepted and chains rejected; under
  the usual geometric model (each draft accepted with probability alpha, given the ones before)
  alpha's estimate is accepted / (accepted + rejections). The counts come from real verification
  and, while a request does not speculate, from *shadow* drafts: the draft source's proposal
  after each token is compared with the tokens that then come, which costs no device time. So an
  alpha is known before a request ever speculates, and a request whose drafts stop matching is
  seen to stop without paying for it. New requests start from the acceptance over all requests.
- Cost. `StepCosts` keeps the measured period of steps (one step start to the next, which is
  what a step costs the batch, host and device both) by their token count, for plain steps and
  for steps with drafts, which are synchronous (their tokens decide the next plan) and so pay
  the host's planning time too. No step has drafts before a plain step of about its size is
  measured: plain's cost must be known where it is compared, not drawn from other steps.
- Choice. With alpha_i, drafting k tokens brings sum_{j=1..k} alpha_i^j expected tokens beyond
  the one a decode gets, and the j-th draft adds alpha_i^j. Those marginal gains fall with j, so
  the best K drafts over the batch are the K largest gains; for each K the step's rate is
  (plain tokens + gains) / spec(tokens + K), and the best K is taken only when its rate beats
  plain(tokens)'s. The comparison is redone every step from current measurements, for the batch
  as it is: there is no batch-size threshold at which speculation switches off, only a rate that
  stops paying, and a wrong estimate costs the steps it takes the measurements to correct it.
  While it speculates, a plain step of the batch's size is measured every PROBE_EVERY steps
  (PROBE_STEPS of them), so that plain's cost is current too; and while it does not, a step
  with drafts every SPEC_PROBE_EVERY steps where acceptance is high enough to matter.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from lightllm.engine.spec.config import SpeculativeConfig
from lightllm.engine.spec.drafts import make_draft_source

DECAY = 0.97  # a request's acceptance counts fade by this per outcome: about the last 30 chains count
PRIOR_WEIGHT = 2.0  # a new request's acceptance is the global one, worth this many outcomes
GLOBAL_RATE = 0.02  # the global acceptance moves this far towards each outcome
GLOBAL_PRIOR = 0.3
# ... and with a draft model, whose acceptance no shadow proposal measures before it is tried: a
# draft model's chains are accepted about this much a token where it suits its target at all.
MODEL_DRAFT_PRIOR = 0.6
ENTER_MARGIN = 0.05  # from plain steps, speculate only when 5% ahead: entering costs a step's overlap
COST_RATE = 0.1  # a step period's estimate moves this far towards each measurement
# While it speculates, plain steps of the batch's size are not measured: after this many steps
# with drafts, PROBE_STEPS plain ones (two: an overlapped step's period is measured by the next).
PROBE_EVERY = 64
PROBE_STEPS = 2
# And while it does not, a step with drafts every SPEC_PROBE_EVERY steps when some request's drafts
# would be accepted at least SPEC_PROBE_ALPHA: a cost measured long ago, or at another batch, must
# not keep speculation off for good.
SPEC_PROBE_EVERY = 64
SPEC_PROBE_ALPHA = 0.5
EXACT_BINS = 32  # step periods are kept per token count up to here, then in bins 1/8 apart
# Shadow proposals a step makes at most (the rest wait for a later step): a proposal costs the
# host 5-10 us, which at 256 requests a step came to 15% of an H200's throughput with every one.
SHADOW_PROPOSALS_A_STEP = 32
# Before any step with drafts is measured, one is assumed to cost this much more than a plain step
# of as many tokens (its host time is not hidden): drafts must promise that much to be tried.
UNMEASURED_SPEC_EXTRA = 0.25


@dataclass
class RequestSpec:
    """A request's acceptance counts and its shadow proposal (drafts compared, not run)."""

    accepted: float = 0.0
    rejected: float = 0.0
    shadow: list[int] = field(default_factory=list)
    unshadowed: bool = False  # its source makes no shadow proposals: it may speculate from the start

    def outcome(self, accepted: int, rejected: bool) -> None:
        self.accepted = self.accepted * DECAY + accepted
        self.rejected = self.rejected * DECAY + rejected

    @property
    def measured(self) -> bool:
        """Some draft of its own was scored (shadow or verified): it may speculate."""
        return self.unshadowed or self.accepted + self.rejected > 0

    def alpha(self, prior: float) -> float:
        return (self.accepted + PRIOR_WEIGHT * prior) / (self.accepted + self.rejected + PRIOR_WEIGHT)


def _bin(tokens: int) -> int:
    return tokens if tokens <= EXACT_BINS else EXACT_BINS + int(8 * math.log2(tokens / EXACT_BINS))


class Curve:
    """Step periods (seconds) by token count: a moving average per bin of counts."""

    def __init__(self):
        self._bins: dict[int, list[float]] = {}  # bin -> [tokens, seconds], moving averages
        self._points: tuple[np.ndarray, np.ndarray] | None = None

    def add(self, tokens: int, seconds: float) -> None:
        point = self._bins.get(_bin(tokens))
        if point is None:
            self._bins[_bin(tokens)] = [float(tokens), seconds]
        else:
            point[0] += COST_RATE * (tokens - point[0])
            point[1] += COST_RATE * (min(seconds, 5 * point[1]) - point[1])  # one stall is not the cost
        self._points = None

    def __bool__(self) -> bool:
        return bool(self._bins)

    def has_point_within(self, low: float, high: float) -> bool:
        return any(low <= point[0] <= high for point in self._bins.values())

    @property
    def points(self) -> tuple[np.ndarray, np.ndarray, float]:
        """(token counts, seconds, the slope past the last count: the last two points', flat with one)."""
        if self._points is None:
            pts = sorted(self._bins.values())
            slope = 0.0
            if len(pts) > 1:
                (x0, y0), (x1, y1) = pts[-2], pts[-1]
                slope = max(0.0, (y1 - y0) / max(x1 - x0, 1e-9))
            self._points = np.array([p[0] for p in pts]), np.array([p[1] for p in pts]), slope
        return self._points


class StepCosts:
    """Measured step periods by token count, of plain steps and of steps with drafts.

    plain(n) interpolates between measured counts and goes on past the largest along the last
    two's slope (flat with one). spec(n) is plain(n) plus the residual (spec less plain) of the
    steps with drafts measured nearest n, interpolated between them: a step with drafts pays the
    host's planning time that overlap hides for plain steps, and its rows may cost more or less
    than plain tokens. Below the fewest tokens measured with drafts the smallest residual counts,
    and with none measured yet UNMEASURED_SPEC_EXTRA of plain's: a step is tried rather than
    assumed dear, and once tried it is measured. (Few numpy calls: the controller evaluates
    them every step, and a step with drafts waits for it.)"""

    def __init__(self):
        self._plain, self._spec = Curve(), Curve()

    def measured(self, drafted: bool, tokens: int, seconds: float) -> None:
        (self._spec if drafted else self._plain).add(tokens, seconds)

    def known_near(self, tokens: int) -> bool:
        """A plain step of between half and twice `tokens` tokens was measured: plain's cost at
        this size is not a guess drawn from steps of another kind (a prefill of thousands)."""
        return self._plain.has_point_within(tokens / 2, tokens * 2)

    def plain(self, tokens: np.ndarray) -> np.ndarray:
        xs, ys, slope = self._plain.points
        out = np.interp(tokens, xs, ys)
        return out + slope * np.maximum(tokens - xs[-1], 0.0) if slope else out

    def spec(self, tokens: np.ndarray) -> np.ndarray:
        if not self._spec:
            return self.plain(tokens) * (1 + UNMEASURED_SPEC_EXTRA)
        xs, ys, _ = self._spec.points
        residual = ys - self.plain(xs)
        return self.plain(tokens) + np.interp(tokens, xs, residual, left=residual.min())


class DraftCost:
    """Seconds a draft model's proposal call takes, as a + b * chain (chain: the most drafts any
    request of the call gets, the draft's steps in a row), fitted by exponentially weighted least
    squares over calls in steady state (a catch-up of a few tokens a request; a request's first
    call, which catches up on its whole prompt, says nothing of the next ones). With one chain
    length seen so far the cost is taken as proportional to it."""

    def __init__(self):
        self._sums = np.zeros(5)  # weight, chain, seconds, chain^2, chain * seconds

    def add(self, chain: int, seconds: float) -> None:
        self._sums *= 1 - COST_RATE
        self._sums += (1.0, chain, seconds, chain * chain, chain * seconds)

    def __call__(self, chain: np.ndarray) -> np.ndarray | float:
        n, k, t, kk, kt = self._sums
        if n == 0:
            return 0.0
        var = kk / n - (k / n) ** 2
        if var < 1e-6 * max(kk / n, 1.0):
            return chain * (t / k)
        slope = max(0.0, (kt / n - k * t / n / n) / var)
        return max(0.0, t / n - slope * k / n) + slope * chain


class Speculator:
    """The draft source and the controller, for the scheduler: it sees each request's tokens
    and says which drafts the next step verifies. Counters in vLLM's names feed /metrics."""

    def __init__(self, config: SpeculativeConfig, vocab_size: int, max_rows: int, drafter=None):
        """`drafter`: the workers' `draft` call, for a draft model."""
        self.config = config
        self.source = make_draft_source(config, vocab_size, drafter)
        # Shadow proposals where proposing is free (the host's sources); a draft model's cost device time
        self.shadows = getattr(self.source, "free_proposals", True)
        self.k_max = config.num_speculative_tokens
        self.max_rows = max_rows  # decode rows a step may have (the largest CUDA-graph decode bucket)
        self.costs = StepCosts()
        self.global_alpha = GLOBAL_PRIOR if self.shadows else MODEL_DRAFT_PRIOR
        self.speculating = False  # the last plan had drafts
        self._drafted_steps = 0  # steps with drafts since the last probe
        self._probe_left = 0  # plain steps still to run for the probe
        self._plain_steps = 0  # steps without drafts since the last step with drafts
        self._shadow_turn = 0  # where the next step's shadow proposals start among those due
        # A draft model's proposal calls (device time, not part of the step's cost curve): their
        # model, and the seconds of the call the last plan made and of the one just made
        self.draft_cost = DraftCost()
        self._last_call_seconds = self._call_seconds = 0.0
        self.num_drafts = 0  # verified chains
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k_max

    # ---- requests' tokens ----

    def start(self, req_id: int, prompt_ids: list[int]) -> RequestSpec:
        self.source.start(req_id, prompt_ids)
        return RequestSpec(unshadowed=not self.shadows)

    def finish(self, req_id: int) -> None:
        self.source.finish(req_id)

    def observe(self, req_id: int, spec: RequestSpec, token_ids: list[int]) -> None:
        """Tokens the request generated: score its shadow drafts against them, pass them on to
        the source."""
        for token in token_ids:
            if not spec.shadow:
                break
            if spec.shadow[0] != token:
                self._outcome(spec, 0, True)
                spec.shadow = []
                break
            spec.shadow.pop(0)
            self._outcome(spec, 1, False)
        self.source.extend(req_id, token_ids)

    def shadow_drafts(self, reqs: list[tuple[int, RequestSpec]]) -> None:
        """New shadow drafts for requests whose last ones are used up, at most
        SHADOW_PROPOSALS_A_STEP a step, taken in turns across steps."""
        if not self.shadows:
            return
        empty = [(req_id, spec) for req_id, spec in reqs if not spec.shadow]
        if len(empty) > SHADOW_PROPOSALS_A_STEP:
            start = self._shadow_turn % len(empty)
            self._shadow_turn += SHADOW_PROPOSALS_A_STEP
            empty = (empty[start:] + empty[:start])[:SHADOW_PROPOSALS_A_STEP]
        for req_id, spec in empty:
            spec.shadow = self.source.propose(req_id, self.k_max)

    def propose(self, wants: dict[int, int]) -> dict[int, list[int]]:
        """Drafts for each request (req id -> most drafts), in one call where the source batches them.
        A call counts as the probe it may be, drafts or none: a draft model's can come back empty
        (its catch-up on long prompts), and a probe tried every step would cost each step's overlap."""
        self._plain_steps = 0
        many = getattr(self.source, "propose_many", None)
        if many is not None and not self.shadows:  # a draft model: time the call
            started = time.perf_counter()
            drafts = many(wants)
            self._call_seconds = time.perf_counter() - started
            if self.source.last_catch_up <= 2 * sum(k + 1 for k in wants.values()):  # steady state
                self.draft_cost.add(max(wants.values()), self._call_seconds)
            return drafts
        if many is not None:
            return many(wants)
        proposals = ((req_id, self.source.propose(req_id, k)) for req_id, k in wants.items())
        return {req_id: drafts[: wants[req_id]] for req_id, drafts in proposals if drafts}

    def limit(self, spec: RequestSpec) -> int:
        """Most drafts the request's source may propose next: its shadow's length, or k_max without shadows."""
        return len(spec.shadow) if self.shadows else self.k_max

    def verified(self, spec: RequestSpec, drafts: int, accepted: int) -> None:
        """A step verified `drafts` drafts of the request and accepted the first `accepted`."""
        spec.shadow = []
        self._outcome(spec, accepted, accepted < drafts)
        self.num_drafts += 1
        self.num_draft_tokens += drafts
        self.num_accepted_tokens += accepted
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1

    def _outcome(self, spec: RequestSpec, accepted: int, rejected: bool) -> None:
        spec.outcome(accepted, rejected)
        self._global(accepted, rejected)

    def _global(self, accepted: int, rejected: bool) -> None:
        for _ in range(accepted):
            self.global_alpha += GLOBAL_RATE * (1.0 - self.global_alpha)
        if rejected:
            self.global_alpha += GLOBAL_RATE * (0.0 - self.global_alpha)

    # ---- the choice ----

    def measured(self, drafted: bool, tokens: int, seconds: float) -> None:
        """The period of the last planned step (its proposal call's time left out: DraftCost has it)."""
        self.costs.measured(drafted, tokens, max(seconds - self._last_call_seconds, 1e-6) if drafted else seconds)

    def planned(self, drafted: bool) -> None:
        """The step just planned had drafts or not: count towards the next probes."""
        self.speculating = drafted
        self._last_call_seconds, self._call_seconds = (self._call_seconds if drafted else 0.0), 0.0
        self._plain_steps = 0 if drafted else self._plain_steps + 1
        if self._probe_left:
            self._probe_left -= 1
        elif drafted:
            self._drafted_steps += 1
            if self._drafted_steps >= PROBE_EVERY:
                self._drafted_steps, self._probe_left = 0, PROBE_STEPS

    @property
    def probing(self) -> bool:
        return self._probe_left > 0

    def allocate(self, alphas: list[float], limits: list[int], tokens: int, outputs: int) -> list[int] | None:
        """Drafts per candidate (alphas, most drafts each may take) for a step of `tokens`
        tokens that emits `outputs` without drafts; None when a plain step is expected to do
        at least as well (margin ENTER_MARGIN when the last step had no drafts)."""
        if not alphas or self.probing or not self.costs.known_near(tokens):
            return None
        room = self.max_rows - outputs  # at least one row per plain output: keep to the largest graph
        limits = np.minimum(np.array(limits, dtype=np.int64), self.k_max)
        if room <= 0 or limits.sum() == 0:
            return None
        owner = np.repeat(np.arange(len(alphas)), limits)
        depth = np.arange(len(owner)) - np.repeat(np.cumsum(limits) - limits, limits) + 1
        gains = np.array(alphas)[owner] ** depth
        order = np.argsort(-gains, kind="stable")[:room]
        extra = np.arange(1, len(order) + 1)
        cost = self.costs.spec(tokens + extra)
        if not self.shadows:  # a draft model runs as many steps as the longest chain
            cost = cost + self.draft_cost(np.maximum.accumulate(depth[order]))
        rate = (outputs + np.cumsum(gains[order])) / cost
        best = int(np.argmax(rate))
        plain = outputs / float(self.costs.plain(tokens))
        margin = 0.0 if self.speculating else ENTER_MARGIN
        probe = self._plain_steps >= SPEC_PROBE_EVERY and (max(alphas) >= SPEC_PROBE_ALPHA or not self.shadows)
        if rate[best] <= plain * (1 + margin) and not probe:
            return None
        return np.bincount(owner[order[: best + 1]], minlength=len(alphas)).tolist()

    def stats(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_pos": list(self.accepted_per_pos)}
