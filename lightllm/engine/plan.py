"""What crosses the seam between the engine core (router process) and the model workers, per step.

The scheduler writes a `StepPlan`; every rank's model runner first applies its `ops` in order
(requests that ended, prefix-cache changes), then turns it into tensors and runs one forward
over all of it (decodes first, then prefill chunks). A worker's `step(plan)` launches the
plan and answers with the `StepResult` of the step before it (one step always in flight), or of
this step when `plan.sync` is set. rpyc carries them as plain tuples (`to_wire`/`*_from_wire`),
whose runs of numbers (req ids, prompt tokens, drafts, sampled tokens and their logprobs) are
packed into bytes: rpyc's serializer takes bytes whole but a tuple item by item.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from array import array
from dataclasses import dataclass, field

from lightllm.common.radix_cache import (Evict, Insert, Load, Offload, Snapshot, Spill,  # the prefix cache's ops,
                                         Split)  # carried in a plan
from lightllm.engine.request import SamplingParams


@dataclass
class Chunk:
    """A run of one request's prompt tokens whose KV is computed in this step."""

    req_id: int
    token_ids: list[int]
    start: int  # position of the first token = prompt tokens already in the cache
    last: bool  # ends the prompt: the step samples the request's first output token
    sampling: SamplingParams | None = None  # on the request's first chunk only
    # First chunk: the prefix-cache nodes, root first, whose slots hold positions [0, start).
    prefix: tuple[int, ...] = ()
    next_id: int = -1  # the prompt token after this chunk (not the last), for prompt logprobs
    lora: int = 0  # first chunk: the request's LoRA adapter (LoadLora's id; 0: the base model)
    # First chunk with a prefix, for a model with recurrent state: the snapshot slot holding the
    # state after positions [0, start), copied into the request's state slot before the chunk.
    snapshot: int = -1
    # First chunk of a preempted request's new start: its outputs before it (its prompt ends with
    # them), from which its sampling state is restored (seeds' step, min_tokens, penalty counts).
    resumed: tuple[int, ...] = ()

    @property
    def first(self) -> bool:
        return self.sampling is not None


# ---- ops: what the runner does before the step, in order (slots move between requests and
# the prefix cache's nodes; Insert, Split, Evict, Offload, Spill, Load and Snapshot are the radix
# tree's, in lightllm/common/radix_cache.py) ----


@dataclass
class Release:
    """A request ends: its slots at positions [start, end) (end -1: all it holds from start)
    go back to the token table, and its row is returned. Positions outside the range belong
    to prefix-cache nodes."""

    req_id: int
    start: int = 0
    end: int = -1


@dataclass
class Adopt:
    """A running request computed positions [start, end) again that prefix-cache nodes already
    hold (with another request at once, or to leave a snapshot there): its row takes the nodes'
    slots for them (`node_ids`, top down, their slots end to end) and its own go back, so that the
    rest of its prompt can join the cache below those nodes."""

    req_id: int
    start: int
    end: int
    node_ids: tuple[int, ...]


@dataclass
class Reset:
    """Drop every request and node (after a failed step: start again from an empty cache)."""


@dataclass
class LoadGrammar:
    """A request with structured output arrived: read its grammar (xgrammar's serialized form from
    the HTTP process, else compile it) on the runner's grammar thread, off the step; the request is
    admitted once a result reports it loaded (StepResult.grammars)."""

    req_id: int
    kind: str
    grammar: str
    compiled: bytes = b""


@dataclass
class DropGrammar:
    """A request whose grammar was loading or loaded ended before its first chunk."""

    req_id: int


@dataclass
class LoadLora:
    """Read the LoRA adapter at `path` into host memory under `lora_id` (ids are never reused: a
    request names its adapter by id, and the prefix cache keys on it)."""

    lora_id: int
    path: str


@dataclass
class DropLora:
    """Forget adapter `lora_id` (no waiting or running request names it any more)."""

    lora_id: int


OPS = (Release, Insert, Split, Evict, Reset, LoadGrammar, DropGrammar, Offload, Load, Spill, LoadLora, DropLora, Snapshot,
       Adopt)


@dataclass
class StepPlan:
    step_id: int
    decodes: list[int] = field(default_factory=list)  # req ids; each feeds its last sampled token (on the device)
    chunks: list[Chunk] = field(default_factory=list)
    ops: list = field(default_factory=list)  # applied in order before the step (OPS)
    sync: bool = False  # answer with this step's result instead of the previous one's
    # Speculative decoding: req id (among `decodes`) -> draft tokens to follow its last sampled
    # token. The step feeds 1 + len(drafts) tokens for it and answers with the accepted ones plus
    # one more (1 to 1 + len(drafts) tokens, in order); its result is needed before the next plan,
    # so a plan with drafts is always `sync`.
    drafts: dict[int, list[int]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.chunks

    @property
    def sampled(self) -> list[int]:
        """Req ids that get a token from this step, in result order."""
        return self.decodes + [c.req_id for c in self.chunks if c.last]

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + self.num_drafts + sum(len(c.token_ids) for c in self.chunks)

    @property
    def num_drafts(self) -> int:
        return sum(map(len, self.drafts.values()))


@dataclass
class SampledToken:
    req_id: int
    token_id: int
    logprob: float
    top: tuple | None = None  # ((token, logprob), ...) when the request asks for top logprobs
    prompt: tuple | None = None  # with its first token, when asked: ((logprob, rank, top), ...) per prompt token from the 2nd
    rank: int | None = None  # with top: the token's rank (1 + the tokens more likely, ties counted)


@dataclass
class StepResult:
    step_id: int
    tokens: list[SampledToken] = field(default_factory=list)  # in `StepPlan.sampled` order (a run for a drafting request)
    error: str | None = None  # the step failed: none of its requests got a token
    # Grammars loaded since the last result, (req id, None) or (req id, why it cannot be used);
    # step_id -1: a result with only these (no step finished).
    grammars: list[tuple[int, str | None]] = field(default_factory=list)


# ---- rpyc passes lists by reference (a round trip per element): plans cross as nested tuples ----

_SAMPLING_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]
_CONTAINER_FIELDS = {f.name: type(f.default_factory()) for f in dataclasses.fields(SamplingParams)
                     if f.default_factory is not dataclasses.MISSING}  # list or dict: cross as tuples


def sampling_to_wire(params: SamplingParams | None) -> tuple | None:
    if params is None:
        return None
    return tuple(tuple(v.items()) if isinstance(v, dict) else tuple(v) if isinstance(v, list) else v
                 for v in (getattr(params, n) for n in _SAMPLING_FIELDS))


def sampling_from_wire(values: tuple | None) -> SamplingParams | None:
    if values is None:
        return None
    params = dict(zip(_SAMPLING_FIELDS, values))
    for name, kind in _CONTAINER_FIELDS.items():
        params[name] = kind(params[name])
    return SamplingParams(**params)


# A tuple of numbers crosses rpyc item by item, bytes whole: a step's runs of numbers go packed,
# little-endian (a remote worker's machine may differ from node 0's). Measured (2026-12-05, 2-core
# CPU, test/benchmark/engine/wire_cost.py) as tuples, then packed: a round trip of 64 decodes with 4
# drafts each (192 tokens back) 3.0-3.3 ms, 0.7; of 256 decodes 3.2-3.5, 0.5-0.65; of 64 decodes
# beside a 2,048-token chunk 7.2-7.6, 0.9-1.0.
_SWAP = sys.byteorder != "little"


def _packed(values: array) -> bytes:
    if _SWAP:
        values.byteswap()
    return values.tobytes()


def _unpacked(values: array, data: bytes) -> list:
    values.frombytes(data)
    if _SWAP:
        values.byteswap()
    return values.tolist()


def pack_ints(values) -> bytes:
    return _packed(array("q", values))


def unpack_ints(data: bytes) -> list[int]:
    return _unpacked(array("q"), data)


def pack_floats(values) -> bytes:
    return _packed(array("d", values))


def unpack_floats(data: bytes) -> list[float]:
    return _unpacked(array("d"), data)


def plan_to_wire(plan: StepPlan) -> tuple:
    chunks = tuple((c.req_id, pack_ints(c.token_ids), c.start, c.last, sampling_to_wire(c.sampling), c.prefix,
                    c.next_id, c.lora, c.snapshot, pack_ints(c.resumed)) for c in plan.chunks)
    ops = tuple((OPS.index(type(op)), *vars(op).values()) for op in plan.ops)
    drafts = (pack_ints(plan.drafts), pack_ints(map(len, plan.drafts.values())),
              pack_ints(itertools.chain.from_iterable(plan.drafts.values())))
    return plan.step_id, pack_ints(plan.decodes), chunks, ops, plan.sync, drafts


def plan_from_wire(wire: tuple) -> StepPlan:
    step_id, decodes, chunks, ops, sync, (draft_ids, draft_lengths, draft_tokens) = wire
    tokens, drafts, end = unpack_ints(draft_tokens), {}, 0
    for req_id, length in zip(unpack_ints(draft_ids), unpack_ints(draft_lengths)):
        drafts[req_id], end = tokens[end: end + length], end + length
    return StepPlan(step_id, unpack_ints(decodes),
                    [Chunk(r, unpack_ints(t), s, last, sampling_from_wire(p), tuple(prefix), next_id, lora, snapshot,
                           tuple(unpack_ints(resumed)))
                     for r, t, s, last, p, prefix, next_id, lora, snapshot, resumed in chunks],
                    [OPS[op[0]](*op[1:]) for op in ops], sync, drafts)


def result_to_wire(result: StepResult | None) -> tuple | None:
    if result is None:
        return None
    tokens = result.tokens
    # top and prompt logprobs, for the few tokens whose requests asked: (index, top, prompt, rank)
    extras = tuple((i, t.top, t.prompt, t.rank) for i, t in enumerate(tokens) if t.top is not None or t.prompt is not None)
    columns = (pack_ints([t.req_id for t in tokens]), pack_ints([t.token_id for t in tokens]),
               pack_floats([t.logprob for t in tokens]), extras)
    return result.step_id, columns, result.error, tuple(result.grammars)


def result_from_wire(wire: tuple | None) -> StepResult | None:
    if wire is None:
        return None
    step_id, (req_ids, token_ids, logprobs, extras), error, grammars = wire
    tokens = list(map(SampledToken, unpack_ints(req_ids), unpack_ints(token_ids), unpack_floats(logprobs)))
    for i, top, prompt, rank in extras:
        tokens[i].top, tokens[i].prompt, tokens[i].rank = top, prompt, rank
    return StepResult(step_id, tokens, error, list(grammars))


@dataclass(frozen=True)
class DraftRequest:
    """A draft model's proposal for one request (spec/draft_runner.py): its tokens from position
    `start` on, and how many drafts to continue them with (0: catch up only, the tokens end
    before the request's last sampled one)."""

    req_id: int
    start: int
    tokens: tuple[int, ...]
    k: int


def drafts_to_wire(asks: list[DraftRequest]) -> tuple:
    return tuple((a.req_id, a.start, pack_ints(a.tokens), a.k) for a in asks)


def drafts_from_wire(wire: tuple) -> list[DraftRequest]:
    return [DraftRequest(req_id, start, tuple(unpack_ints(tokens)), k) for req_id, start, tokens, k in wire]
