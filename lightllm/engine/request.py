"""A request as the engine sees it: what it asks (GenerateReq, SamplingParams), what comes out
(TokenOut, FinishReason), and `Req`, its counters, status and stop criteria in the scheduler.

The server wraps these in its process messages (lightllm/server/io_struct.py); they belong here.

`Req`'s counts are of what has been *scheduled*, not what has come back: with one step in flight the
scheduler learns a step's tokens one step later, and the KV budget must cover what runs.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import operator
from dataclasses import dataclass, field


def pickled_as_columns(item_cls, leading: int):
    """Pickle a dataclass of one field, `items: list[item_cls]`, as columns of the items' first
    `leading` fields, plus (index, the other fields) for each item whose other fields are not all
    at their defaults: the messages sent for every token (TokenOut, TextOut) cross two sockets,
    and an object a token (even pickled as its constructor's arguments) took twice the time to
    dump (2026-12-05, 2-core CPU: 215 tokens 0.42 ms, as columns 0.19; loading 0.19, 0.15)."""
    fields = dataclasses.fields(item_cls)
    head = operator.attrgetter(*(f.name for f in fields[:leading]))
    tail = operator.attrgetter(*(f.name for f in fields[leading:]))
    defaults = tuple(f.default for f in fields[leading:])

    def decorate(cls):
        def __reduce__(self):
            items = self.items
            columns = tuple(zip(*map(head, items))) if items else ((),) * leading
            extras = [(i, rest) for i, rest in enumerate(map(tail, items)) if rest != defaults]
            return _from_columns, (cls, item_cls, columns, extras)

        cls.__reduce__ = __reduce__
        return cls

    return decorate


def _from_columns(cls, item_cls, columns: tuple, extras: list):
    items = list(map(item_cls, *columns))
    for i, rest in extras:
        items[i] = item_cls(*(column[i] for column in columns), *rest)
    return cls(items)


# Below this temperature every path samples greedily (the HTTP routes and the offline LLM alike):
# the sampler divides the logits by the temperature, which overflows float32 to inf below about
# 1e-37 (NaN probabilities, then garbage tokens), and long before that the distribution is
# one-hot anyway: at 1e-5 a logit gap of 0.001 is a factor of e^100. vLLM's threshold is the same.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 16
    stop_sequences: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # the text ends with the stop sequence found, not before it
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int = 0  # the HTTP process draws one when the client gives none
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    # TGI's and transformers' typical decoding (Meister et al.): keep the tokens whose surprisal is
    # nearest the distribution's entropy, up to this much probability (1.0: off); after the others
    typical_p: float = 1.0
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
    stop_token_ids: list[int] = field(default_factory=list)  # end the request (finish reason STOP)
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the raw logits before sampling
    # TGI's watermark (Kirchenbauer et al.): each token's logits get the server's delta on a "green"
    # share gamma of the vocabulary that the token before it picks (engine/watermark.py)
    watermark: bool = False
    allowed_token_ids: list[int] = field(default_factory=list)  # vLLM's: none: every token; else only these
    # vLLM's bad_words: the front end's texts, and their token sequences (frontend/tokenizer.py's
    # bad_words_ids): a sequence's last token is banned where the output ends with the rest of it
    bad_words: list[str] = field(default_factory=list)
    bad_words_ids: list[tuple[int, ...]] = field(default_factory=list)
    # Log probabilities, always of the model's raw logits (before logit_bias, penalties, temperature):
    top_logprobs: int = 0  # per generated token, the k most likely tokens too (the sampled one always)
    prompt_logprobs: int | None = None  # per prompt token (from the 2nd) its logprob and the top k; the
    # prefix cache is not used for such a request (every position's logits are computed)
    # Structured output: "" (none), "json_object", "json_schema" (grammar: the schema as JSON text),
    # "regex" or "ebnf" (grammar: the pattern or the EBNF grammar); compiled by xgrammar.
    grammar_kind: str = ""
    grammar: str = ""
    compiled_grammar: bytes = b""  # xgrammar's compiled grammar, packed (engine/grammar.py), from the HTTP process

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def depends_on_tokens(self) -> bool:
        """Each token's choice depends on the ones before it on the host (penalty counts, a grammar,
        a bad word of several tokens)."""
        return bool(self.grammar_kind) or self.uses_penalties or self.bad_word_context > 0

    @property
    def bad_word_context(self) -> int:
        """How many of the last output tokens the bad words' bans read (0: single tokens, banned always)."""
        return max((len(ids) - 1 for ids in self.bad_words_ids), default=0)

    def nothing_allowed(self, eos_token_ids) -> str | None:
        """Why no token could ever be sampled first, where allowed_token_ids holds only tokens that
        min_tokens bans (EOS, stop_token_ids): the sampler would be left a row of -inf."""
        if not self.allowed_token_ids or self.min_tokens == 0:
            return None
        banned = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))
        if set(self.allowed_token_ids) <= banned:
            return (f"allowed_token_ids holds only tokens that end the text (EOS or stop_token_ids), which "
                    f"min_tokens={self.min_tokens} bans: no token could be sampled")
        return None

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class GenerateReq:
    req_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0
    lora_id: int = 0  # the LoRA adapter it runs under (the engine's id of it; 0: the base model)
    cache_salt: str = ""  # vLLM's: the prefix cache shares KV only between requests of the same salt
    priority: int = 0  # vLLM's: under the "priority" policy, lower values are admitted first


@dataclass
class TokenOut:
    req_id: int
    token_id: int
    logprob: float
    finish_reason: FinishReason | None = None  # set on the request's last token
    error: str | None = None  # set with FinishReason.ERROR
    cached_tokens: int = 0  # on the request's first token: prompt tokens the prefix cache supplied
    queue_time: float = 0.0  # on the first token: seconds from arrival until its first chunk was scheduled
    top_logprobs: list[tuple[int, float]] | None = None  # with SamplingParams.top_logprobs: (token, logprob)
    rank: int | None = None  # with top_logprobs: the token's rank (1: the most likely; ties counted)
    # On the first token, with SamplingParams.prompt_logprobs: per prompt position from the 2nd,
    # (its token's logprob, its rank, [(token, logprob)] top k).
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"  # admitted: its whole prompt is reserved, chunks still to run
    DECODING = "decoding"  # its last chunk is scheduled; one decode a step from now on
    FINISHED = "finished"


def salt_key(salt: str) -> int:
    """A cache salt as a number of 128 bits (0: none): two salts share a key once in 2^128."""
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=16).digest()) if salt else 0


class Req:
    def __init__(self, msg: GenerateReq, eos_token_ids: frozenset[int]):
        self.req_id = msg.req_id
        self.prompt_ids = msg.prompt_ids
        self.sampling: SamplingParams = msg.sampling
        self.arrival_time = msg.arrival_time
        self.prompt_len = len(msg.prompt_ids)
        self.lora_id = msg.lora_id
        self.priority = msg.priority
        # Its key in the prefix cache: the first token tagged with the adapter and the salt, so that
        # KV computed under one adapter (or none), or one salt, is never found by a request under another.
        tag = (msg.lora_id << 32) | (salt_key(msg.cache_salt) << 64)
        self.cache_ids = msg.prompt_ids if not tag else [msg.prompt_ids[0] + tag, *msg.prompt_ids[1:]]
        self.max_new_tokens = msg.sampling.max_new_tokens
        self.prefilled = 0  # prompt tokens scheduled (or taken from the prefix cache)
        self.cached = 0  # prompt tokens taken from the prefix cache (final at its first chunk)
        self.host_hits = 0  # of those, loaded back from its host (or disk) tier
        self.disk_hits = 0  # ... from its disk tier
        self.started = False  # its first chunk is scheduled: the runner holds a row for it
        # The deepest prefix-cache node it holds a reference on: positions [0, node.depth) of its
        # KV are the cache's slots, the rest its own. None without the cache (or nothing cached).
        self.node = None
        self.cuts: list[int] = []  # where a prefix it shares with others ends in its prompt (a chunk ends there)
        self.output_ids: list[int] = []  # tokens received back
        # Speculative decoding: the controller's state of it (spec.controller.RequestSpec), where
        # its last verified run started in output_ids and how many drafts it accepted, and the
        # accepted drafts after the token it ended on (their KV is written, never emitted).
        self.grammar_ready = True  # False while its grammar loads (structured output): not admitted yet
        self.spec = None
        self.run_start = self.run_accepted = 0
        self.unemitted: list[int] = []
        self.decode_steps = 0  # decode steps scheduled; each writes one KV token
        self.arrival_step = 0  # the scheduler's step count when it arrived
        self.arrival_seq = 0  # its place in the order of arrivals (the scheduler's count)
        # Preemption (the priority policy): how many times, how many of its outputs its prompt now
        # ends with (they are computed again as prompt tokens when it resumes), and the first step
        # whose tokens are its current run's (a step in flight when it was preempted is not).
        self.preemptions = 0
        self.resumed = 0
        self.first_step = 0
        self.status = ReqStatus.WAITING
        self.queue_time = 0.0  # seconds from arrival until its first chunk was scheduled
        # Prompt logprobs need every position's logits: such a request computes its whole prompt.
        self.uses_cache = msg.sampling.prompt_logprobs is None
        # Its tokens' choice depends on the ones before it on the host: it never verifies drafts
        # (read for each decode of each step that may draft, so taken once here).
        self.depends_on_tokens = msg.sampling.depends_on_tokens
        self._eos_token_ids = frozenset() if msg.sampling.ignore_eos else eos_token_ids
        self._stop_token_ids = frozenset(msg.sampling.stop_token_ids)

    @property
    def kv_tokens(self) -> int:
        """KV slots this request holds once every step scheduled so far has run."""
        return self.prefilled + self.decode_steps

    @property
    def output_count(self) -> int:
        return len(self.output_ids)

    @property
    def shared(self) -> int:
        """Positions of its KV held by prefix-cache nodes (not its own)."""
        return 0 if self.node is None else self.node.depth

    @property
    def kv_cap(self) -> int:
        """Most KV slots it can ever hold: its last token is sampled, never fed back."""
        return self.prompt_len + self.run_new_tokens - 1

    @property
    def run_new_tokens(self) -> int:
        """The most tokens it samples from its current start (its prompt holds the outputs before)."""
        return self.max_new_tokens - self.resumed

    @property
    def prompt_left(self) -> int:
        return self.prompt_len - self.prefilled

    @property
    def needs_decode(self) -> bool:
        """Decoding, and the steps scheduled so far do not yet sample max_new_tokens tokens.
        A request that hit EOS in the step in flight still gets one more (never emitted)."""
        return self.status is ReqStatus.DECODING and 1 + self.decode_steps < self.run_new_tokens

    @property
    def fed_outputs(self) -> list[int]:
        """The outputs its decodes feed (after those its prompt holds), and the accepted drafts
        after the token it ended on."""
        return self.output_ids[self.resumed:] + self.unemitted

    def requeue(self, step: int) -> None:
        """Preempted: back to waiting, to start again from a prompt that ends with its outputs so
        far (their KV went to the prefix cache, where it may still be when it resumes); tokens of
        steps before `step` are no longer its own."""
        new = self.output_ids[self.resumed:]
        self.prompt_ids = self.prompt_ids + new
        self.cache_ids = self.cache_ids + new
        self.prompt_len = len(self.prompt_ids)
        self.resumed = len(self.output_ids)
        self.preemptions += 1
        self.first_step = step
        self.prefilled = self.cached = self.host_hits = self.disk_hits = self.decode_steps = 0
        self.started, self.node, self.cuts, self.spec = False, None, [], None
        self.run_start = self.run_accepted = 0
        self.unemitted = []
        self.status = ReqStatus.WAITING

    def append(self, token_id: int) -> FinishReason | None:
        """Count one generated token; return why the request ends, if it does."""
        if self.status is not ReqStatus.DECODING and self.status is not ReqStatus.PREFILLING:
            raise RuntimeError(f"{self!r} got a token while {self.status.value}")
        output_ids = self.output_ids
        output_ids.append(token_id)
        if token_id in self._eos_token_ids:
            return FinishReason.EOS
        if token_id in self._stop_token_ids:
            return FinishReason.STOP
        if len(output_ids) >= self.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Req({self.req_id}, prompt={self.prefilled}/{self.prompt_len}, "
                f"out={self.output_count}/{self.max_new_tokens}, {self.status.value})")
