"""Token choice for one step: allowed tokens, logit biases, the watermark, grammar masks, min_tokens bans and
penalties, then greedy or seeded top-k/min-p/top-p/typical-p sampling. Log probabilities (of the sampled token
and the top k) are of the model's raw logits, before any of these (vLLM's default).

The random draw for request b at step s (tokens it has generated so far) uses
u = random_uniform(seed_b, s, vocab), a counter hash, and picks argmax(p / -log(u)) (the
exponential race, an exact sample from p). So a seed gives the same tokens whatever
batch the request runs in.

Host lists are built here (`host_lists`) and turned into tensors by the model runner's one
upload; `SamplingBatch` then views them on the device.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lightllm.engine.request import SamplingParams
from lightllm.engine.watermark import DELTA, GAMMA, apply_watermark_
from lightllm.kernels import apply_penalties_, greedy_sample, random_uniform

_INT64_SPAN = 1 << 64


@dataclass
class SamplingState:
    """Host-side sampling state of one running request."""

    params: SamplingParams
    generated: int = 0  # tokens sampled in launched steps (counted at launch, known without them)
    output_counts: dict[int, int] = field(default_factory=dict)  # kept only when penalties are used
    matcher: object = None  # grammar.Matcher of a request with structured output
    # The last output tokens its bad words of several tokens read (params.bad_word_context of them)
    recent: deque | None = field(init=False, repr=False, compare=False)
    # Its row of host_lists' fixed columns, made once: a step with drafts has a row per draft
    # (seed, top_k, greedy, temperature, top_p, uses penalties, uses a sparse input)
    row: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        p = self.params
        greedy = p.greedy
        sparse = (bool(p.logit_bias) or p.min_tokens > 0 or p.min_p > 0.0 or bool(p.allowed_token_ids)
                  or bool(p.bad_words_ids) or p.typical_p < 1.0 or p.watermark)
        self.recent = deque(maxlen=p.bad_word_context) if p.bad_word_context else None
        self.row = (_signed64(p.seed), p.top_k if p.top_k > 0 else -1, int(greedy),
                    1.0 if greedy else p.temperature, p.top_p, p.uses_penalties, sparse)

    @property
    def uses_penalties(self) -> bool:
        return self.params.uses_penalties

    @property
    def needs_tokens(self) -> bool:
        """Its next step depends on the token sampled before (penalty counts, grammar state, bad words)."""
        return self.matcher is not None or self.uses_penalties or self.recent is not None

    def record(self, token: int) -> None:
        """Take a sampled token on the host: count it for the penalties, advance the grammar."""
        if self.uses_penalties:
            self.output_counts[token] = self.output_counts.get(token, 0) + 1
        if self.matcher is not None and not self.matcher.terminated:
            self.matcher.accept(token)
        if self.recent is not None:
            self.recent.append(token)

    def bad_word_bans(self) -> set[int]:
        """The tokens its bad words ban next: each one-token word's, and the last token of each
        longer one whose other tokens end the output so far."""
        recent = tuple(self.recent or ())
        return {ids[-1] for ids in self.params.bad_words_ids
                if len(ids) == 1 or (len(ids) - 1 <= len(recent) and recent[len(recent) - len(ids) + 1:] == ids[:-1])}


def _signed64(seed: int) -> int:
    """Any integer seed as the int64 with the same low 64 bits."""
    seed %= _INT64_SPAN
    return seed - _INT64_SPAN if seed >= _INT64_SPAN // 2 else seed


def _penalty_lists(states: list[SamplingState], ints: dict, floats: dict) -> None:
    ids, counts, offsets = [], [], [0]
    for s in states:
        ids.extend(s.output_counts)
        counts.extend(s.output_counts.values())
        offsets.append(len(ids))
    ints.update(penalty_ids=ids, penalty_counts=counts, penalty_offsets=offsets)
    floats.update(presence=[s.params.presence_penalty for s in states],
                  frequency=[s.params.frequency_penalty for s in states],
                  repetition=[s.params.repetition_penalty for s in states])


def _optional_lists(states: list[SamplingState], offsets: list[int], eos_token_ids, ints: dict, floats: dict,
                    prev: Callable[[], list[int]] | None) -> None:
    """Sparse inputs, in one pass (most batches have none): logit biases as (row, token, value),
    min_p and typical_p per row, the tokens that would end a request before its min_tokens and those its bad
    words ban as (row, token) pairs set to -inf, allowed_token_ids as (row, token) pairs
    beside the rows they mask, and the watermarked rows with the token before each (`prev`'s)."""
    bias_rows, bias_ids, bias_values, ban_rows, ban_ids, min_p, typical = [], [], [], [], [], False, False
    allow_rows, allow_ids, masked_rows, marked = [], [], [], []
    for b, (s, offset) in enumerate(zip(states, offsets)):
        p = s.params
        if p.watermark:
            marked.append(b)
        if p.allowed_token_ids:
            allow_rows += [b] * len(p.allowed_token_ids)
            allow_ids += p.allowed_token_ids
            masked_rows.append(b)
        if p.logit_bias:
            bias_rows += [b] * len(p.logit_bias)
            bias_ids += p.logit_bias
            bias_values += p.logit_bias.values()
        banned = s.bad_word_bans() if p.bad_words_ids else set()
        if s.generated + offset < p.min_tokens:
            banned |= set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        if banned:
            banned = sorted(banned)
            ban_rows += [b] * len(banned)
            ban_ids += banned
        min_p = min_p or p.min_p > 0.0
        typical = typical or p.typical_p < 1.0
    if bias_rows:
        ints.update(bias_rows=bias_rows, bias_ids=bias_ids)
        floats.update(bias_values=bias_values)
    if ban_rows:
        ints.update(ban_rows=ban_rows, ban_ids=ban_ids)
    if allow_rows:
        ints.update(allow_rows=allow_rows, allow_ids=allow_ids, masked_rows=masked_rows)
    if marked:
        before = prev() if prev is not None else [-1] * len(states)
        ints.update(watermark_rows=marked, watermark_prev=[before[b] for b in marked])
    if min_p:
        floats["min_ps"] = [s.params.min_p for s in states]
    if typical:
        floats["typical_ps"] = [s.params.typical_p for s in states]


def host_lists(states: list[SamplingState], eos_token_ids=(), offsets: list[int] | None = None,
               prev: Callable[[], list[int]] | None = None) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    """The batch's sampling inputs as named int and float lists (one entry per sampled row; the
    optional sparse ones only when some request uses them). A row `offsets[b]` tokens past its
    request's generated count (a draft's) draws the random numbers of that later token, so a
    seeded request samples the same tokens with drafts as without. `prev`, called only when some
    request is watermarked: the token before each row's (-1: its request's last sampled token,
    which the device holds; without it, every row's)."""
    offsets = offsets or [0] * len(states)
    if not states:
        seeds = top_ks = greedy = temperatures = top_ps = penalties = sparse = ()
    else:  # one pass over the rows, then columns at C speed
        seeds, top_ks, greedy, temperatures, top_ps, penalties, sparse = zip(*[s.row for s in states])
    ints = {"seeds": list(seeds), "steps": [s.generated + o for s, o in zip(states, offsets)],
            "top_ks": list(top_ks), "greedy": list(greedy)}
    floats = {"temperatures": list(temperatures), "top_ps": list(top_ps)}
    if any(penalties):
        _penalty_lists(states, ints, floats)
    if any(sparse):
        _optional_lists(states, offsets, eos_token_ids, ints, floats, prev)
    return ints, floats


@dataclass
class SamplingBatch:
    """Device views of `host_lists`, plus the host flags that choose the code path."""

    seeds: torch.Tensor
    steps: torch.Tensor
    top_ks: torch.Tensor
    greedy: torch.Tensor  # bool
    temperatures: torch.Tensor
    top_ps: torch.Tensor
    all_greedy: bool
    penalties: tuple | None = None  # (presence, frequency, repetition, ids, counts, offsets)
    min_ps: torch.Tensor | None = None
    bias: tuple | None = None  # (rows, token ids, values)
    bans: tuple | None = None  # (rows, token ids)
    allowed: tuple | None = None  # (rows, token ids, rows masked): a masked row keeps only its (row, token) pairs
    grammar: tuple | None = None  # (bitmask int32 [R, ceil(V/32)], rows [R]): allowed tokens of constrained rows
    top_logprobs: int = 0  # the most top logprobs any request wants
    typical_ps: torch.Tensor | None = None
    watermark: tuple | None = None  # (rows, the token before each, gamma, delta): engine/watermark.py

    @property
    def changes_logits(self) -> bool:
        """Some request's logits are changed before the choice (allowed tokens, bias, watermark, grammar,
        bans, penalties)."""
        return any(x is not None for x in (self.allowed, self.bias, self.watermark, self.grammar, self.bans,
                                           self.penalties))

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], all_greedy: bool, top_logprobs: int = 0,
                     grammar: tuple | None = None, last_token: torch.Tensor | None = None,
                     watermark: tuple[float, float] = (GAMMA, DELTA)) -> "SamplingBatch":
        """`last_token`: each request row's last sampled token (the runner's), which a watermarked
        row of prev -1 follows; `watermark`: the server's (gamma, delta)."""
        penalties = bias = bans = allowed = marked = None
        if "penalty_ids" in t:
            penalties = (t["presence"], t["frequency"], t["repetition"], t["penalty_ids"].int(),
                         t["penalty_counts"].int(), t["penalty_offsets"].int())
        if "bias_rows" in t:
            bias = (t["bias_rows"], t["bias_ids"], t["bias_values"])
        if "ban_rows" in t:
            bans = (t["ban_rows"], t["ban_ids"])
        if "allow_rows" in t:
            allowed = (t["allow_rows"], t["allow_ids"], t["masked_rows"])
        if "watermark_rows" in t:
            rows, prev = t["watermark_rows"], t["watermark_prev"]
            if last_token is not None:
                prev = torch.where(prev < 0, last_token[t["sample_rows"][rows]], prev)
            marked = (rows, prev, *watermark)
        return cls(t["seeds"], t["steps"], t["top_ks"], t["greedy"].bool(), t["temperatures"], t["top_ps"],
                   all_greedy, penalties, t.get("min_ps"), bias, bans, allowed, grammar, top_logprobs,
                   t.get("typical_ps"), marked)


def sample(logits: torch.Tensor, batch: SamplingBatch):
    """(token ids int64 [B], their logprobs fp32 [B], top) from fp32 logits [B, V] (modified in
    place); top is None or (token ids [B, k], logprobs [B, k], the sampled tokens' ranks [B]) with
    k = batch.top_logprobs, a rank counting the tokens at least as likely (vLLM's). Log
    probabilities are those of the raw logits."""
    if batch.all_greedy and not batch.changes_logits and not batch.top_logprobs:
        tokens, logprobs = greedy_sample(logits)  # one pass over the logits (a kernel on the GPU)
        return tokens, logprobs, None
    # Raw log-probabilities first (one kernel, as before logprobs were raw); the logits are
    # modified in place below, so they are read from this.
    logp = torch.log_softmax(logits, -1)
    if batch.allowed is not None:
        rows, ids, masked = batch.allowed
        kept = logits[rows, ids]
        logits[masked] = float("-inf")
        logits[rows, ids] = kept
    if batch.bias is not None:
        rows, ids, values = batch.bias
        logits.index_put_((rows, ids), values, accumulate=True)
    if batch.watermark is not None:
        apply_watermark_(logits, *batch.watermark)
    if batch.grammar is not None:
        from lightllm.engine.grammar import apply_bitmask_

        apply_bitmask_(logits, *batch.grammar)
    if batch.bans is not None:
        logits.index_put_(batch.bans, logits.new_full((), float("-inf")))  # made on the device: no host copy
    if batch.penalties is not None:
        apply_penalties_(logits, *batch.penalties)
    tokens = logits.argmax(-1)
    if not batch.all_greedy:
        tokens = torch.where(batch.greedy, tokens, _draw(logits, batch))
    logprobs = logp.gather(1, tokens[:, None]).squeeze(1)
    top = None
    if batch.top_logprobs:
        values, ids = logp.topk(batch.top_logprobs, -1)
        top = (ids, values, (logp >= logprobs[:, None]).sum(-1))
    return tokens, logprobs, top


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int):
    """(logprobs, ranks, top k) of the prompt tokens `targets` [P] under raw logits [P, V]. A rank
    is vLLM's: how many tokens are at least as likely (1 for the most likely), whether or not the
    token is among the top k."""
    target = logits.gather(1, targets[:, None])
    lse = torch.logsumexp(logits, -1)
    chosen, ranks = target.squeeze(1) - lse, (logits >= target).sum(-1)
    if not k:
        return chosen, ranks, None
    values, ids = logits.topk(k, -1)
    return chosen, ranks, (ids, values - lse[:, None])


# The filtered draw takes its rows in blocks of at most this many bytes of fp32 logits: its sort,
# softmax, cumulative sums and uniforms hold many copies of a block at once (16 on the CPU), which
# for a full batch of 1,024 rows over a 128k vocabulary would be several GiB, held back from the
# KV cache by the start-up profile (engine/memory.py). Each row's draw depends on its own seed and
# step alone, so the blocks draw what the whole batch would.
DRAW_LOGITS_BYTES = 64 << 20


def _rows_within(nbytes: int, vocab: int) -> int:
    """The most rows whose fp32 logits over `vocab` tokens take at most `nbytes` (at least one)."""
    return max(1, nbytes // (4 * vocab))


def _draw(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """_sample_filtered over the temperature-scaled logits, a block of rows at a time."""
    rows, vocab = logits.shape
    step = _rows_within(DRAW_LOGITS_BYTES, vocab)
    if rows <= step:
        return _sample_filtered(logits / batch.temperatures[:, None], batch)
    return torch.cat([_sample_filtered(logits[i: i + step] / batch.temperatures[i: i + step, None],
                                       _rows(batch, i, i + step)) for i in range(0, rows, step)])


def _rows(batch: SamplingBatch, start: int, end: int) -> SamplingBatch:
    """The per-row inputs of rows [start, end) that the filtered draw reads."""
    return dataclasses.replace(batch, seeds=batch.seeds[start:end], steps=batch.steps[start:end],
                               top_ks=batch.top_ks[start:end], top_ps=batch.top_ps[start:end],
                               min_ps=None if batch.min_ps is None else batch.min_ps[start:end],
                               typical_ps=None if batch.typical_ps is None else batch.typical_ps[start:end])


def _sample_filtered(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Seeded draw from softmax(scaled) restricted to top_k, to min_p, to the top_p nucleus and
    then to the typical_p set."""
    probs, order = filtered_probs(scaled, batch)
    u = random_uniform(batch.seeds, batch.steps, scaled.shape[-1]).gather(1, order)
    choice = (probs / -torch.log(u)).argmax(-1, keepdim=True)
    return order.gather(1, choice).squeeze(1)


def filtered_probs(scaled: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(the probabilities that the draw samples from, unnormalised, each row sorted by its logits
    from the largest; that order): softmax(scaled), the tokens that the filters drop at 0."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(-1, descending=True)
    probs = sorted_logits.softmax(-1)
    rank = torch.arange(vocab, device=scaled.device)
    top_ks = torch.where(batch.top_ks > 0, batch.top_ks, vocab)
    probs = probs.masked_fill(rank[None, :] >= top_ks[:, None], 0.0)
    if batch.min_ps is not None:  # min_p of the most likely token's probability (sorted first)
        probs = probs.masked_fill(probs < batch.min_ps[:, None] * probs[:, :1], 0.0)
    # top_p over the top-k renormalised distribution; the best token always stays, and a row at
    # 1.0 keeps its tail (its cumulative sum may round to 1 before the last tokens)
    cum_before = (probs.cumsum(-1) - probs) / probs.sum(-1, keepdim=True)
    probs = probs.masked_fill((cum_before >= batch.top_ps[:, None]) & (rank[None, :] > 0)
                              & (batch.top_ps < 1.0)[:, None], 0.0)
    if batch.typical_ps is not None:
        del sorted_logits, cum_before
        probs = _typical(probs, batch.typical_ps)
    return probs, order


def _typical(probs: torch.Tensor, typical_ps: torch.Tensor) -> torch.Tensor:
    """Typical decoding over what the other filters left (transformers' TypicalLogitsWarper): by
    how far each token's surprisal -log q lies from the entropy of q (q: `probs` renormalised),
    nearest first, the fewest tokens whose probability reaches typical_p, with every token as
    near as the last of them; rows at 1.0 are left as they are. In place, and a few copies of
    the block at a time (the start-up profile's draw uses it: its peak is the KV cache's loss)."""
    total = probs.sum(-1, keepdim=True)
    q = probs / total
    entropy = torch.special.entr(q).sum(-1, keepdim=True)  # -q log q, 0 where q is 0
    distance = q.log_().neg_().sub_(entropy).abs_()  # in q's place; inf where q is 0: never kept
    del q
    nearest, by_distance = distance.sort(-1)
    mass = probs.gather(1, by_distance).cumsum_(-1)
    del by_distance
    last = (mass < typical_ps[:, None] * total).sum(-1, keepdim=True).clamp_(max=probs.shape[-1] - 1)
    del mass
    threshold = nearest.gather(1, last)
    del nearest
    return probs.masked_fill_((distance > threshold) & (typical_ps < 1.0)[:, None], 0.0)


def grammar_masks(states: list[SamplingState], vocab_size: int, device: torch.device) -> tuple | None:
    """(bitmask, rows) on the device for the constrained requests of the batch, or None."""
    rows = [b for b, s in enumerate(states) if s.matcher is not None and not s.matcher.terminated]
    if not rows:
        return None
    from lightllm.engine.grammar import allocate_bitmask  # xgrammar: only once a request needs it

    bitmask = allocate_bitmask(len(states), vocab_size)  # rows of the other requests stay unread
    for b in rows:
        states[b].matcher.fill(bitmask, b)
    return bitmask.to(device, non_blocking=True), torch.tensor(rows, device=device)


# The most bytes of fp32 logits that prompt logprobs hold at once (chunk_prompt_logprobs scores a
# chunk's rows in slices of this size): a whole 8,192-token chunk over a 128k vocabulary would
# take 4 GiB, twice with logsumexp's temporary, all of it held back from the KV cache by the
# start-up profile, which runs every prompt token with prompt logprobs (engine/memory.py).
PROMPT_LOGITS_BYTES = 256 << 20


def chunk_prompt_logprobs(hidden: torch.Tensor | None, targets: torch.Tensor | None, chunks,
                          score: Callable[[torch.Tensor], torch.Tensor], vocab: int) -> list:
    """(request, chosen, ranks, top) per chunk that wants prompt logprobs. `hidden`: those chunks' rows,
    in order (ParallelLMHead.deferred), which `score` turns into fp32 logits, PROMPT_LOGITS_BYTES
    of them at a time."""
    parts, offset = [], 0
    step = _rows_within(PROMPT_LOGITS_BYTES, vocab)
    for r, c in chunks:
        n = len(c.token_ids) - (1 if c.last else 0)
        if r.prompt_logprobs is None or n == 0:  # a one-token last chunk: its row is the sampled one
            continue
        k, end = r.sampling.params.prompt_logprobs, offset + n
        pieces = [prompt_logprobs(score(hidden[i: min(i + step, end)]), targets[i: min(i + step, end)], k)
                  for i in range(offset, end, step)]
        chosen, ranks, tops = zip(*pieces)
        top = tuple(torch.cat(part) for part in zip(*tops)) if k else None
        parts.append((r, torch.cat(chosen), torch.cat(ranks), top))
        offset += n
    return parts
