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
  While it does not speculate, a step with drafts every SPEC_PROBE_EVERY steps where acceptance
  is high enough to matter, the first at once (before a step with drafts is measured their cost
  is a guess; a draft model's acceptance only verification measures); plain steps are measured
  in the guard's held-off epochs, steady.
- The run-level guard (`RunGuard`). The per-step rates rest on a cost model, and a model can be
  wrong where the run is not (a step with drafts is synchronous: the host's turnaround that overlap
  hides for plain steps, prefill steps with drafts, a plain period measured after a synchronous
  step). So the choice above runs only in epochs where speculation is allowed; other epochs hold
  it off, and the two are compared by what the run realized: tokens emitted per second per
  decoding request. The side that wins (allowed must win by MARGIN) runs in long epochs, the other
  is tried once after each, and the winner's epochs lengthen while it keeps winning. The windows
  before the first verdict (the run's start: its first prompts prefilled at once) set neither the
  spread of later windows nor the plain step's period that epochs are measured in.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np

from lightllm.engine.spec.config import SpeculativeConfig
from lightllm.engine.spec.drafts import make_draft_source

logger = logging.getLogger(__name__)

DECAY = 0.97  # a request's acceptance counts fade by this per outcome: about the last 30 chains count
PRIOR_WEIGHT = 2.0  # a new request's acceptance is the global one, worth this many outcomes
GLOBAL_RATE = 0.02  # the global acceptance moves this far towards each outcome
GLOBAL_PRIOR = 0.3
# ... and with a draft model, whose acceptance no shadow proposal measures before it is tried: a
# draft model's chains are accepted about this much a token where it suits its target at all.
MODEL_DRAFT_PRIOR = 0.6
ENTER_MARGIN = 0.05  # from plain steps, speculate only when 5% ahead: entering costs a step's overlap
COST_RATE = 0.1  # a step period's estimate moves this far towards each measurement
# While it does not speculate, a step with drafts every SPEC_PROBE_EVERY steps when some request's
# drafts would be accepted at least SPEC_PROBE_ALPHA: a cost measured long ago, or at another
# batch, must not keep speculation off for good.
SPEC_PROBE_EVERY = 64
SPEC_PROBE_ALPHA = 0.5
# Each probe the rates did not call for doubles the gap to the next (up to this many steps), and a
# step they call for drafts in sets it back: a draft model's probe (tried whatever the acceptance,
# which only verification measures) catches up on its prompts and verifies in a synchronous step,
# 5% of an H200's time at 64 in flight when it came every 64 steps with no draft accepted.
SPEC_PROBE_MAX_GAP = 4096
EXACT_BINS = 32  # step periods are kept per token count up to here, then in bins 1/8 apart
# Shadow proposals a step makes at most (the rest wait for a later step): a proposal costs the
# host 5-20 us, which at 256 requests a step came to 15% of an H200's throughput with every one,
# and 32 a step (0.5 ms) part of the 3% suffix drafts lost at 64 in flight on an H100.
SHADOW_PROPOSALS_A_STEP = 16
# Before any step with drafts is measured, one is assumed to cost this much more than a plain step
# of as many tokens (its host time is not hidden): drafts must promise that much to be tried.
UNMEASURED_SPEC_EXTRA = 0.25
# A choice over at most this many candidate drafts runs in plain Python (Speculator._choose_small)
SMALL_CHOICE_ROWS = 32

# The run-level guard. Epochs are measured in time, in units of a plain step's period (of the
# last held-off window): a step with drafts, longer, counts for more, so a share of epochs is a
# share of the run's time. An epoch's window leaves out its first SETTLE_STEPS steps (the tokens
# that come in them are the other side's), then measures until MIN_STEPS steps were and the
# rate's relative standard error is at most PRECISION, or MAX_STEPS plain steps' time passed:
# plain steps at batch 1 are regular and done in four, steps that prefill beside 64 decodes are
# not. The error is the larger of the window's own and the one the spread of that side's steps
# seen before gives (SPREAD_DECAY a window): four steps that happen to miss every prefill say
# nothing of the spread. The winner's epoch is measured over its last WINNER_WINDOW x MAX_STEPS.
SETTLE_STEPS = 1
MIN_STEPS = 4
MAX_STEPS = 24
WINNER_WINDOW = 4
PRECISION = 0.03
SPREAD_DECAY = 0.9
# Speculation is allowed where it realized more than MARGIN above held off, by more than
# SIGNIFICANCE standard errors of the comparison: at a tie, or in doubt, it is held off.
MARGIN = 0.02
SIGNIFICANCE = 1.0
# The winner's epochs last RUN_STEPS << backoff plain steps; each win by the same side adds
# BACKOFF doublings (a short run explores a few times, not ten), one by more than DECISIVE
# (either way) DECISIVE_BACKOFF, up to MAX_BACKOFF (2,048 plain steps).
RUN_STEPS = 16
BACKOFF = 2
DECISIVE = 0.2
DECISIVE_BACKOFF = 4
MAX_BACKOFF = 7
# The load (decoding requests, a moving average, LOAD_FLOOR added: 1 to 2 in flight is no new
# regime) at half or twice its value at the last verdict makes that verdict stale: both sides are
# measured again, the backoff from zero. 64 to 1 in flight is seen in 7 steps; a low Poisson
# load's swings from step to step are not.
LOAD_CHANGE = 2.0
LOAD_RATE = 0.1
LOAD_FLOOR = 2.0
MAX_INTERVAL_SECONDS = 1.0  # a longer time between two steps counts as this (a stall is not a rate)
MIN_DECODE_SHARE = 0.25  # of a step's time, at least this much is its decodes' (the prompts' is an estimate)


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
        self._lists: tuple[list[float], list[float], float] | None = None

    def add(self, tokens: int, seconds: float) -> None:
        point = self._bins.get(_bin(tokens))
        if point is None:
            self._bins[_bin(tokens)] = [float(tokens), seconds]
        else:
            point[0] += COST_RATE * (tokens - point[0])
            point[1] += COST_RATE * (min(seconds, 5 * point[1]) - point[1])  # one stall is not the cost
        self._points = self._lists = None

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

    @property
    def lists(self) -> tuple[list[float], list[float], float]:
        """`points` as Python lists (StepCosts.plain_at, spec_at)."""
        if self._lists is None:
            xs, ys, slope = self.points
            self._lists = xs.tolist(), ys.tolist(), slope
        return self._lists


def interp(x: float, xs: list[float], ys: list[float], left: float | None = None) -> float:
    """np.interp(x, xs, ys, left) of one value, with numpy's arithmetic (the same float, not
    just a close one: the small choice must choose as the vectorised one)."""
    if x < xs[0]:
        return ys[0] if left is None else left
    if x >= xs[-1]:
        return ys[-1]
    j = bisect.bisect_right(xs, x) - 1
    if x == xs[j]:
        return ys[j]
    slope = (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j])
    out = slope * (x - xs[j]) + ys[j]
    return out if out == out else slope * (x - xs[j + 1]) + ys[j + 1]  # numpy's second try on a nan


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

    @property
    def spec_measured(self) -> bool:
        """Some step with drafts was measured: spec(n) is no longer UNMEASURED_SPEC_EXTRA's guess."""
        return bool(self._spec)

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

    def plain_at(self, tokens: float) -> float:
        """plain() of one count, in Python (the same float)."""
        xs, ys, slope = self._plain.lists
        out = interp(tokens, xs, ys)
        return out + slope * max(tokens - xs[-1], 0.0) if slope else out

    def spec_at(self):
        """spec() of one count at a time, in Python (the same floats): the function, its
        residuals computed once."""
        plain_at = self.plain_at
        if not self._spec:
            return lambda tokens: plain_at(tokens) * (1 + UNMEASURED_SPEC_EXTRA)
        xs, ys, _ = self._spec.lists
        residual = [y - plain_at(x) for x, y in zip(xs, ys)]
        low = min(residual)
        return lambda tokens: plain_at(tokens) + interp(tokens, xs, residual, left=low)


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


class Window:
    """Tokens emitted against request-seconds (decoding requests x seconds) over an epoch's
    measured steps: the realized rate, and its relative standard error (a ratio estimator's)."""

    __slots__ = ("steps", "drafted", "seconds", "shortest", "x", "y", "xx", "xy", "yy")

    def __init__(self):
        self.steps = self.drafted = 0
        self.seconds = self.x = self.y = self.xx = self.xy = self.yy = 0.0
        self.shortest = math.inf  # the shortest step's seconds

    def add(self, tokens: int, requests: int, seconds: float, drafted: bool) -> None:
        request_seconds = requests * seconds
        self.steps += 1
        self.seconds += seconds
        self.shortest = min(self.shortest, seconds)
        self.drafted += drafted
        self.x += tokens
        self.y += request_seconds
        self.xx += tokens * tokens
        self.xy += tokens * request_seconds
        self.yy += request_seconds * request_seconds

    @property
    def rate(self) -> float:
        return self.x / self.y if self.y > 0 else 0.0

    def describe(self) -> str:
        return (f"{self.steps} steps, {self.drafted} with drafts, {self.seconds * 1e3:.1f} ms, {self.x} tokens, "
                f"{self.rate:.1f}/s a request")

    @property
    def variance(self) -> float:
        """The rate's relative variance (its relative standard error, squared)."""
        if self.x <= 0:
            return math.inf
        r = self.rate
        return max(0.0, self.xx - 2 * r * self.xy + r * r * self.yy) / (self.x * self.x)


class RunGuard:
    """Whether the per-step choice may speculate now, from what the run realized with it and
    without: epochs that allow speculation and epochs that hold it off, compared by tokens emitted
    per second per decoding request (a request's progress: the inverse of its time per token, which
    compares across batch sizes where throughput does not).

    The side that won the last comparison (allowed must beat held off by MARGIN and by the
    comparison's doubt) runs an epoch of RUN_STEPS << backoff plain steps' time, then the other side
    one short epoch, then they are compared; each win by the same side lengthens the winner's epoch
    (up to MAX_BACKOFF), a change of winner starts over, and so does a change of load. So while one
    side keeps winning, the loser runs about MAX_STEPS of every RUN_STEPS << MAX_BACKOFF plain
    steps' time (at least SETTLE_STEPS + MIN_STEPS of its steps): speculation that loses costs the
    run that share of its loss, and holding off speculation that pays that share of its gain. The
    first epochs hold off, then allow: speculation is tried, not assumed. `step` is called once a
    step (one clock read and a few sums); `tokens` is added to as tokens are emitted."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.allowed = False  # this epoch lets the per-step choice speculate
        self.winner: bool | None = None  # whether allowed won the last comparison (None: none yet)
        self.backoff = 0
        self._displaced = 0  # the backoff of the winner the last verdict displaced (0: none)
        self.tokens = 0  # emitted since the last step
        self.load = 0.0
        self._verdict_load = 0.0
        self._rates: dict[bool, Window] = {}  # each side's last window
        # A step's relative variance by side, the largest seen, decaying by window: at batch 1 a
        # step with drafts emits 1-9 tokens and a plain one always 1.
        self._spread = {True: 0.0, False: 0.0}
        self._window = Window()
        self._steps = 0  # steps with decodes in this epoch
        self._seconds = 0.0  # the time of this epoch's steps with decodes
        self._length = 0  # the time this epoch runs at least, in plain steps
        self._unmeasured = 0  # the time before its window, in plain steps
        self._plain_period = 0.0  # the mean time of a step in the last held-off window
        self._last = (0.0, 0, False, 0.0)  # the last step: (its time, decoding requests, had drafts, prompt time)
        self._prompt_before = 0.0  # the prompt time of the step before it

    def step(self, drafted: bool, decoding: int, prompt_seconds: float = 0.0) -> None:
        """A step was planned with `decoding` decodes (and drafts or not; `prompt_seconds`: what its
        prompt tokens cost a plain step, by the measured costs): the one before it ran from its
        start to now, and the tokens that came meanwhile are its epoch's."""
        now = self.clock()
        then, requests, had_drafts, prompt = self._last
        self._last, before = (now, decoding, drafted, prompt_seconds), self._prompt_before
        self._prompt_before = prompt
        tokens, self.tokens = self.tokens, 0
        if requests:
            seconds = min(now - then, MAX_INTERVAL_SECONDS)
            self._seconds += seconds
            if self._steps > SETTLE_STEPS and self._in_plain_steps(self._seconds) > self._unmeasured:
                # The rate is of decoding: the time a plain step would spend on prompt tokens is left
                # out, or the side whose window fell on a wave of prompts looks several times slower.
                # A plain step's period is that of the step before it (in flight meanwhile), a
                # synchronous one's its own.
                prompt = prompt if had_drafts else before
                self._window.add(tokens, requests, max(seconds - prompt, MIN_DECODE_SHARE * seconds), had_drafts)
        if not decoding:
            return
        self.load = decoding if not self.load else self.load + LOAD_RATE * (decoding - self.load)
        self._steps += 1
        if self._verdict_load and not 1 / LOAD_CHANGE < self._load_ratio() < LOAD_CHANGE:
            self._load_changed(decoding)
        elif self._window_done():
            self._next_epoch()

    def _load_ratio(self) -> float:
        return (self.load + LOAD_FLOOR) / (self._verdict_load + LOAD_FLOOR)

    def _window_done(self) -> bool:
        w = self._window
        if self._in_plain_steps(self._seconds) < self._length or w.steps < MIN_STEPS:
            return False
        return self._in_plain_steps(w.seconds) >= MAX_STEPS or self._variance(w, self.allowed) <= PRECISION**2

    def _in_plain_steps(self, seconds: float) -> float:
        """Time in plain steps (of the last held-off window, or of this epoch's before there is one):
        epochs are measured in time, so that a step with drafts, longer, counts for more."""
        period = self._plain_period or self._seconds / max(self._steps, 1)
        return seconds / period if period > 0 else math.inf

    def _variance(self, w: Window, allowed: bool) -> float:
        return max(w.variance, self._spread[allowed] / max(w.steps, 1))

    def _next_epoch(self) -> None:
        w = self._window
        # Before the first verdict the windows are the run's start (its first prompts prefilled at
        # once): no norm for the steps' spread, nor for a plain step's period (its shortest stands in).
        started = self.winner is not None
        if started:
            seen = w.variance * w.steps if w.steps >= MIN_STEPS and w.x > 0 else 0.0
            self._spread[self.allowed] = max(self._spread[self.allowed] * SPREAD_DECAY, seen)
        self._rates[self.allowed] = w
        if not self.allowed and w.steps:
            self._plain_period = w.seconds / w.steps if started else w.shortest
        if self.allowed != self.winner and len(self._rates) == 2:  # an exploration ended
            self._verdict()
            self._start(self.winner, RUN_STEPS << self.backoff)
        else:
            self._start(not self.allowed, 0)

    def _verdict(self) -> None:
        """Compare the two sides' last windows: the winner, and how long until the next comparison."""
        allowed, held = self._rates[True], self._rates[False]
        ratio = allowed.rate / held.rate if held.rate > 0 else math.inf
        doubt = 1 + SIGNIFICANCE * math.sqrt(self._variance(allowed, True) + self._variance(held, False))
        wins = ratio > (1 + MARGIN) * doubt
        decisive = ratio > (1 + MARGIN) * (1 + DECISIVE) * doubt or ratio * (1 + DECISIVE) * doubt < 1
        # No drafts: no news. The first verdict compares the run's start (its first prompts prefilled
        # in the held-off epoch) with what came after: it is checked again at once.
        # Only evidence lengthens the winner's epoch: a win, or a loss beyond the doubt. A verdict in
        # doubt (held off, though drafts may be ahead by the margin) compares again as soon: on an H100
        # at 64 in flight, noisy windows had speculation held off after comparisons of 1.16-1.30x,
        # for ever longer epochs, and most of its gain lost.
        lost = ratio * doubt < 1 + MARGIN
        news = allowed.drafted and self.winner is not None and (wins or lost)
        doublings = (DECISIVE_BACKOFF if decisive else BACKOFF) if news else 0
        changed = wins != self.winner
        if not changed:
            self.backoff, self._displaced = min(MAX_BACKOFF, self.backoff + doublings), 0
        else:  # a new winner; one displaced by the verdict before gets its backoff back
            self.winner, self.backoff, self._displaced = wins, max(self._displaced, doublings - 1), self.backoff
        self._verdict_load = self.load
        # at info when the verdict changes (an operator's news), else at debug: with no drafts in the
        # allowed epochs a verdict comes every RUN_STEPS plain steps
        logger.log(logging.INFO if changed else logging.DEBUG,
                   "speculation %s: %.3fx the rate held off (allowed: %s; held off: %s; %.1f decoding), next "
                   "exploration in %d plain steps' time", "allowed" if wins else "held off", ratio,
                   allowed.describe(), held.describe(), self.load, RUN_STEPS << self.backoff)

    def _load_changed(self, decoding: int) -> None:
        """The last verdict was at another load: measure both sides again, the winner's first."""
        logger.debug("load changed: %d decoding, %.1f at the verdict", decoding, self._verdict_load)
        self._rates.clear()
        self.load = self._verdict_load = decoding  # the new load, not the average's way to it
        self.backoff = self._displaced = 0
        self._start(bool(self.winner), 0)

    def _start(self, allowed: bool, length: int) -> None:
        """An epoch of at least `length` plain steps' time, its window its last WINNER_WINDOW x
        MAX_STEPS (the rate where the comparison is made, not long before), past the settle."""
        self.allowed, self._length, self._unmeasured = allowed, length, length - WINNER_WINDOW * MAX_STEPS
        self._window, self._steps, self._seconds = Window(), 0, 0.0


class Speculator:
    """The draft source and the controller, for the scheduler: it sees each request's tokens
    and says which drafts the next step verifies. Counters in vLLM's names feed /metrics."""

    def __init__(self, config: SpeculativeConfig, vocab_size: int, max_rows: int, drafter=None,
                 catch_up_tokens: int = 0):
        """`drafter`: the workers' `draft` call, for a draft model, and `catch_up_tokens` the most
        tokens a call catches it up on (0: the source's default)."""
        self.config = config
        self.source = make_draft_source(config, vocab_size, drafter, catch_up_tokens)
        # Shadow proposals where proposing is free (the host's sources); a draft model's cost device time
        self.shadows = getattr(self.source, "free_proposals", True)
        self.k_max = config.num_speculative_tokens
        self.max_rows = max_rows  # decode rows a step may have (the largest CUDA-graph decode bucket)
        self.costs = StepCosts()
        self.global_alpha = GLOBAL_PRIOR if self.shadows else MODEL_DRAFT_PRIOR
        self.speculating = False  # the last plan had drafts
        self.guard: RunGuard | None = RunGuard()  # None: the per-step choice alone decides
        self._plain_steps = 0  # steps without drafts since the last step with drafts
        # Plain steps before the next probe. A draft model's first is due at once: only verification
        # measures its acceptance, and the step costs interpolated between a batch's decodes and a
        # prefill can leave its prior short of paying for good on a machine where prefill is dear.
        self._probe_gap = SPEC_PROBE_EVERY if self.shadows else 0
        self._probe = False  # the last allocation is a probe (the rates did not call for it)
        self._shadow_turn = 0  # where the next step's shadow proposals start among those due
        self._catch_up = getattr(self.source, "catch_up", None)  # a host source's backlog, a share a step
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
        if self.guard is not None:
            self.guard.tokens += len(token_ids)

    def shadow_drafts(self, reqs: list[tuple[int, RequestSpec]]) -> None:
        """Once a step: new shadow drafts for requests whose last ones are used up, at most
        SHADOW_PROPOSALS_A_STEP a step, taken in turns across steps; before them the source does its
        share of the work waiting (prompts to index, evicted entries to remove: index_a_step)."""
        if self._catch_up is not None:
            self._catch_up()
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
        (its catch-up on long prompts), and a probe tried every step would cost each step's overlap.
        Only until a draft model's first drafts are verified, a call that brought none because it
        caught up on prompts is no probe: else a first probe that only caught up left the next one
        64 steps away, past a short request's end, and the draft was never tried."""
        self._plain_steps = 0
        probe, self._probe = self._probe, False
        if probe and self.shadows:
            self._back_off_probes()
        many = getattr(self.source, "propose_many", None)
        if many is not None and not self.shadows:  # a draft model: time the call
            started = time.perf_counter()
            drafts = many(wants)
            self._call_seconds = time.perf_counter() - started
            steady = self.source.last_catch_up <= 2 * sum(k + 1 for k in wants.values())
            if steady:
                self.draft_cost.add(max(wants.values()), self._call_seconds)
            if probe and (drafts or self.num_drafts or steady):
                self._back_off_probes()
            return drafts
        if many is not None:
            return many(wants)
        proposals = ((req_id, self.source.propose(req_id, k)) for req_id, k in wants.items())
        return {req_id: drafts[: wants[req_id]] for req_id, drafts in proposals if drafts}

    def _back_off_probes(self) -> None:
        self._probe_gap = min(max(2 * self._probe_gap, SPEC_PROBE_EVERY), SPEC_PROBE_MAX_GAP)

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

    def planned(self, drafted: bool, decoding: int = 0, tokens: int = 0) -> None:
        """The step just planned, with `decoding` decodes and `tokens` tokens before drafts, had
        drafts or not."""
        self.speculating = drafted
        self._last_call_seconds, self._call_seconds = (self._call_seconds if drafted else 0.0), 0.0
        self._plain_steps = 0 if drafted else self._plain_steps + 1
        if self.guard is not None:
            self.guard.step(drafted, decoding, self._prompt_seconds(decoding, tokens))

    def _prompt_seconds(self, decoding: int, tokens: int) -> float:
        """What a step's prompt tokens add to a plain step of its decodes alone, where plain steps
        near both sizes were measured (else 0): two interpolations, only for steps with prompts."""
        costs = self.costs
        if tokens <= decoding or not decoding or not (costs.known_near(tokens) and costs.known_near(decoding)):
            return 0.0
        with_prompts, alone = costs.plain(np.array([tokens, decoding], dtype=np.float64))
        return max(0.0, float(with_prompts - alone))

    def allocate(self, alphas: list[float], limits: list[int], tokens: int, outputs: int) -> list[int] | None:
        """Drafts per candidate (alphas, most drafts each may take) for a step of `tokens`
        tokens that emits `outputs` without drafts; None when a plain step is expected to do
        at least as well (margin ENTER_MARGIN when the last step had no drafts), or while the
        guard holds speculation off."""
        held_off = self.guard is not None and not self.guard.allowed
        if held_off or not alphas or not self.costs.known_near(tokens):
            return None
        room = self.max_rows - outputs  # at least one row per plain output: keep to the largest graph
        k_max = self.k_max
        if room <= 0 or not any(limits):
            return None
        if sum(min(k, k_max) for k in limits) <= SMALL_CHOICE_ROWS and self.shadows:
            counts, best_rate, plain = self._choose_small(alphas, limits, room, tokens, outputs)
        else:
            counts, best_rate, plain = self._choose(alphas, limits, room, tokens, outputs)
        margin = 0.0 if self.speculating else ENTER_MARGIN
        self._probe = best_rate <= plain * (1 + margin)
        if not self._probe:
            self._probe_gap = SPEC_PROBE_EVERY
        elif (self._plain_steps < self._probe_gap and self.costs.spec_measured) or (
                max(alphas) < SPEC_PROBE_ALPHA and self.shadows):
            return None
        return counts

    def _choose(self, alphas: list[float], limits: list[int], room: int, tokens: int, outputs: int
                ) -> tuple[list[int], float, float]:
        """The choice over every candidate draft: (drafts per candidate of the best step, that
        step's expected rate of tokens, a plain step's)."""
        limits = np.minimum(np.array(limits, dtype=np.int64), self.k_max)
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
        counts = np.bincount(owner[order[: best + 1]], minlength=len(alphas)).tolist()
        return counts, float(rate[best]), outputs / float(self.costs.plain(tokens))

    def _choose_small(self, alphas: list[float], limits: list[int], room: int, tokens: int, outputs: int
                      ) -> tuple[list[int], float, float]:
        """`_choose` for a few candidate drafts (a host source's), in plain Python with the same
        arithmetic: at batch 1 every step with drafts waits for this choice, and numpy's calls
        on arrays of a few values cost more than the values (0.11 ms a step on an H100's host)."""
        rows = []  # (gain, request), in the order _choose enumerates them (its sort is stable)
        for i, (alpha, k) in enumerate(zip(alphas, limits)):
            rows += [(alpha ** depth, i) for depth in range(1, min(k, self.k_max) + 1)]
        rows.sort(key=lambda row: -row[0])
        del rows[room:]
        spec_at = self.costs.spec_at()
        best, best_rate, gained = 0, -math.inf, 0.0
        for j, (gain, _) in enumerate(rows):
            gained += gain
            rate = (outputs + gained) / spec_at(tokens + j + 1)
            if rate > best_rate:
                best, best_rate = j, rate
        counts = [0] * len(alphas)
        for _, i in rows[: best + 1]:
            counts[i] += 1
        return counts, best_rate, outputs / self.costs.plain_at(tokens)

    def stats(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_pos": list(self.accepted_per_pos)}
