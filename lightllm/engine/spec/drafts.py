"""Draft sources: what proposes the tokens a request's next step verifies.

A source sees each request's tokens as they become known (`start` with the prompt, `extend` with
generated tokens, `finish` when it ends) and `propose(req_id, k)` returns up to k tokens that
would continue them. Every source here proposes point masses (one token per position, no
probabilities): verification then accepts a draft exactly when the target samples it, which is
rejection sampling against a point mass (lightllm/engine/spec/controller.py uses them; the model
runner verifies). They run in the scheduler's process, on the host, and must be cheap: O(k) a
proposal and O(1) amortized a token, whatever the request's length.

NgramDraft (prompt lookup)
    Per request: its tokens and a dict from every n-gram (min_n <= n <= max_n) to the position just
    after its latest occurrence. The n-grams that end the tokens enter the dict only when the next
    token arrives, so the dict never holds the current suffix itself and one lookup finds the latest
    *earlier* occurrence. Appending a token enters max_n - min_n + 1 keys; a proposal looks up at most
    that many keys and copies k tokens. Memory is that many keys a token, freed on `finish`; the keys
    are the n-grams' hashes (about 0.35 KB a token at 2..5-grams, 0.48 KB with the n-grams as
    tuples), and two n-grams of one hash, about one lookup in 10^13 at a million keys, cost a draft
    that verification rejects.

SuffixDraft (suffix decoding: Oliaro et al., 2024)
    One index shared by all requests maps an n-gram to its most recent occurrences, a bounded deque
    of (sequence, position after the n-gram). Only n in a doubling ladder (min_match_len, 2x, 4x ..
    up to max_depth) is indexed, so an appended token costs one deque append per ladder step; the
    real match length of an occurrence is then found by comparing backwards, at most max_depth
    tokens. A proposal takes the longest ladder n-gram ending the request that has visible
    occurrences, keeps those whose match is longest, and walks their continuations greedily: the
    token most of them continue with, then the most common continuation of that path, while the
    path's share of the occurrences stays at least min_token_prob. That is a walk down the
    frequency-weighted suffix tree of the paper, restricted to max_occurrences paths, so a
    proposal costs O(max_occurrences * (max_depth + k)) whatever the lengths involved.
    Visible are the request's own tokens and the pool: finished requests' sequences (prompt and
    output), kept whole in least-recently-finished order up to max_cached_tokens. Evicting a
    sequence removes its entries from the index, O(ladder steps * max_occurrences) a token, which
    is amortized over the token's insertion; so the index never outgrows the tokens it describes.
    Its keys are the n-grams' hashes, and an n-gram seen once (most of the longer ones) holds its one
    occurrence without a deque: about 0.6 KB a cached token where most n-grams are new (3.5 KB with a
    deque a key, 1.1 KB with the n-grams as tuples). Two n-grams of one hash share a key: a match
    found through it continues another n-gram, a draft that verification rejects, never a wrong
    token; with 64-bit hashes that is about one lookup in 10^13 at the default bound.

Served, both index a prompt not as it starts but from a backlog, PROMPT_INDEX_TOKENS_A_STEP tokens
a step (`catch_up`), so that a wave of prompts does not hold the router for many steps' time at
once; a request's tokens that come while it waits there join it, and it proposes from what is in.
An evicted suffix sequence is invisible at once, and its entries leave the index from the same
budget.

ModelDraft (a draft model, an EAGLE-3 head, or the target's MTP layer)
    The workers run the draft model (spec/draft_runner.py) or the head (spec/eagle3_runner.py, mtp_runner.py);
    this side keeps each request's tokens and how far the workers' draft KV has caught up, and asks
    for a step's proposals in one call.
"""

from __future__ import annotations

import importlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from lightllm.engine.plan import DraftRequest
from lightllm.engine.spec.config import SpeculativeConfig


class DraftSource(Protocol):
    def start(self, req_id: int, prompt_ids: Sequence[int]) -> None: ...

    def extend(self, req_id: int, token_ids: Sequence[int]) -> None: ...

    def propose(self, req_id: int, k: int) -> list[int]: ...

    def finish(self, req_id: int) -> None: ...


def make_draft_source(config: SpeculativeConfig, vocab_size: int, drafter=None,
                      catch_up_tokens: int = 0) -> DraftSource:
    """`drafter`: the workers' `draft` call, for the draft_model method, and `catch_up_tokens` the
    most tokens one call catches its KV up on (the largest prompt step the KV budget was sized
    beside; 0: CATCH_UP_TOKENS)."""
    if config.method == "ngram":
        return NgramDraft(config.prompt_lookup_min, config.prompt_lookup_max, PROMPT_INDEX_TOKENS_A_STEP)
    if config.method == "suffix":
        return SuffixDraft(**{"index_a_step": PROMPT_INDEX_TOKENS_A_STEP, **config.options})
    if config.method in ("draft_model", "eagle3", "mtp"):  # the workers run the draft model or the head alike
        if drafter is None:
            raise ValueError(f"the {config.method} method needs workers that run the draft model")
        return ModelDraft(drafter, catch_up_tokens or CATCH_UP_TOKENS, **config.options)
    module, _, name = config.method.partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(vocab_size=vocab_size, **config.options)


def copy_forward(tokens: list[int], start: int, k: int) -> list[int]:
    """k tokens continuing `tokens` as a copy of tokens[start:]. Where the copy reaches the end it
    goes on copying its own output, i.e. repeats tokens[start:] with period len(tokens) - start:
    a match at `start` says the sequence repeats itself with that period, so a loop keeps going."""
    period = len(tokens) - start
    return [tokens[start + j % period] for j in range(k)]


# Tokens a served host source (NgramDraft, SuffixDraft) indexes (or, suffix, removes) a step, its
# `index_a_step`: at about 2-3 us a token, a wave of 64 prompts of 400 tokens indexed at their
# admission held the router for 50-80 ms, a stall of several steps. Spread over the steps after it,
# 256 a step cost about 0.6 ms of the host's time, which the step on the device hides (1024, 2-3 ms,
# did not always: the host's work for a step of 64 decodes is most of a 7 ms step already).
PROMPT_INDEX_TOKENS_A_STEP = 256


class _Backlog:
    """A source's sequences (each with `tokens` and `indexed`, the positions in its index) not yet
    indexed to their end, oldest first: `catch_up`, once a step, indexes up to `share` of their
    tokens. share 0: there is no backlog, a sequence is indexed as its tokens come."""

    def __init__(self, share: int, index_to):
        if share < 0:
            raise ValueError(f"index_a_step must be >= 0, got {share}")
        self.share, self._index_to, self._sequences = share, index_to, deque()

    def start(self, sequence) -> None:
        """A new sequence with its prompt: into the backlog (or indexed now, without one)."""
        if not self.share:
            self._index_to(sequence, len(sequence.tokens))
        elif sequence.tokens:
            self._sequences.append(sequence)

    def extend(self, sequence, token_ids: Sequence[int]) -> None:
        """Tokens that came: indexed now, unless the sequence waits in the backlog (it takes them too)."""
        behind = sequence.indexed < len(sequence.tokens)
        sequence.tokens.extend(token_ids)
        if not behind:
            self._index_to(sequence, len(sequence.tokens))

    def drop(self, sequence) -> None:
        if sequence.indexed < len(sequence.tokens):
            self._sequences.remove(sequence)

    def __bool__(self) -> bool:
        return bool(self._sequences)

    def catch_up(self, budget: int | None = None) -> int:
        """Index up to `budget` (default `share`) tokens of the backlog; the tokens indexed."""
        budget = start = self.share if budget is None else budget
        while budget > 0 and self._sequences:
            sequence = self._sequences[0]
            stop = min(len(sequence.tokens), sequence.indexed + budget)
            budget -= stop - sequence.indexed
            self._index_to(sequence, stop)
            if stop == len(sequence.tokens):
                self._sequences.popleft()
        return start - budget


@dataclass(eq=False)
class _NgramState:
    tokens: list[int] = field(default_factory=list)
    # hash of an n-gram -> index after its latest earlier occurrence
    next_position: dict[int, int] = field(default_factory=dict)
    indexed: int = 0  # the positions whose n-grams before them are in next_position: 0 .. indexed - 1


class NgramDraft:
    """Prompt lookup: continue the longest n-gram ending the request from where it last occurred."""

    def __init__(self, min_n: int = 2, max_n: int = 5, index_a_step: int = 0):
        """index_a_step: 0, a prompt is indexed as it starts; n > 0, prompts wait in a backlog that
        each `catch_up` (once a step) indexes n tokens of, oldest first."""
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram draft: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._requests: dict[int, _NgramState] = {}
        self._backlog = _Backlog(index_a_step, self._index_to)
        self.catch_up = self._backlog.catch_up

    def start(self, req_id: int, prompt_ids: Sequence[int]) -> None:
        assert req_id not in self._requests, f"request {req_id} started twice"
        self._requests[req_id] = state = _NgramState(list(prompt_ids))
        self._backlog.start(state)

    def extend(self, req_id: int, token_ids: Sequence[int]) -> None:
        self._backlog.extend(self._requests[req_id], token_ids)

    def _index_to(self, state: _NgramState, stop: int) -> None:
        """Enter the n-grams before each position up to `stop`: the n-grams ending the tokens enter
        only with the token after them, as earlier occurrences followed by it."""
        tokens, positions = state.tokens, state.next_position
        for end in range(state.indexed, stop):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                positions[hash(tuple(tokens[end - n:end]))] = end
        state.indexed = stop

    def propose(self, req_id: int, k: int) -> list[int]:
        state = self._requests[req_id]
        tokens = state.tokens
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = state.next_position.get(hash(tuple(tokens[-n:])))
            if start is not None:
                return copy_forward(tokens, start, k)
        return []

    def finish(self, req_id: int) -> None:
        state = self._requests.pop(req_id, None)  # a request may be finished twice (abort after its end)
        if state is not None:
            self._backlog.drop(state)


@dataclass(eq=False)  # identity: the index tells sequences apart by object
class _Sequence:
    tokens: list[int]
    pooled: bool = False  # finished and in the pool: visible to every request
    indexed: int = 0  # the positions whose n-grams before them are in the index: 0 .. indexed - 1
    removed: int = 0  # evicted: the positions whose entries are out of the index again: 0 .. removed - 1


_Occurrence = tuple[_Sequence, int]  # (sequence, index of the token after the n-gram)


class SuffixDraft:
    """Suffix decoding: continue the request the way its longest matching suffix most often went on,
    in its own tokens and in recently finished requests (see the module docstring)."""

    def __init__(self, *, max_depth: int = 24, min_match_len: int = 2, max_occurrences: int = 64,
                 min_token_prob: float = 0.1, max_cached_tokens: int = 200_000, index_a_step: int = 0):
        """index_a_step: 0, a prompt is indexed as it starts and an evicted sequence's entries leave
        the index at once; n > 0, prompts wait in a backlog, oldest first, and so do evicted
        sequences' entries (the sequences are invisible meanwhile), each `catch_up` (once a step)
        doing n tokens' worth of both: a request proposes from its prompt once it is indexed."""
        if not 1 <= min_match_len <= max_depth:
            raise ValueError(f"suffix draft: need 1 <= min_match_len <= max_depth, got {min_match_len}, {max_depth}")
        if max_occurrences < 1 or max_cached_tokens < 0 or not 0 <= min_token_prob <= 1:
            raise ValueError("suffix draft: max_occurrences >= 1, max_cached_tokens >= 0, min_token_prob in [0, 1]")
        self.max_depth, self.max_occurrences = max_depth, max_occurrences
        self.min_token_prob, self.max_cached_tokens = min_token_prob, max_cached_tokens
        self.key_lengths = _doubling(min_match_len, max_depth)
        # hash of an n-gram -> its one occurrence, or a deque of them (oldest first) once there are two
        self._index: dict[int, _Occurrence | deque[_Occurrence]] = {}
        self._live: dict[int, _Sequence] = {}
        self._pool: deque[_Sequence] = deque()  # oldest finished first
        self._backlog = _Backlog(index_a_step, self._index_to)
        self._evicted: deque[_Sequence] = deque()  # whose entries are still to remove, oldest first
        self._evicted_tokens = 0  # their entries' positions still in the index
        self.cached_tokens = 0  # tokens of the pooled sequences

    def start(self, req_id: int, prompt_ids: Sequence[int]) -> None:
        assert req_id not in self._live, f"request {req_id} started twice"
        self._live[req_id] = sequence = _Sequence(list(prompt_ids))
        self._backlog.start(sequence)

    def extend(self, req_id: int, token_ids: Sequence[int]) -> None:
        self._backlog.extend(self._live[req_id], token_ids)

    def catch_up(self) -> int:
        """Up to index_a_step tokens' worth of removing evicted sequences' entries, then of indexing
        prompts; the tokens done."""
        budget = share = self._backlog.share
        while budget > 0 and self._evicted:
            budget -= self._remove_some(budget)
        return share - budget + self._backlog.catch_up(budget)

    def _index_to(self, sequence: _Sequence, stop: int) -> None:
        """Enter the n-grams before each position up to `stop` (as in NgramDraft, those before the end
        enter with the next token: the current suffix is never its own match)."""
        tokens, index, lengths = sequence.tokens, self._index, self.key_lengths
        for end in range(sequence.indexed, stop):
            occurrence = (sequence, end)  # one tuple for every ladder step
            for n in lengths:
                if n > end:
                    break
                key = hash(tuple(tokens[end - n:end]))
                entries = index.get(key)
                if entries is None:
                    index[key] = occurrence
                elif type(entries) is tuple:
                    index[key] = deque((entries, occurrence), maxlen=self.max_occurrences)
                else:
                    entries.append(occurrence)
        sequence.indexed = stop

    def _occurrences(self, key: int) -> Sequence[_Occurrence]:
        """The occurrences under `key`, oldest first."""
        entries = self._index.get(key, ())
        return (entries,) if type(entries) is tuple and entries else entries

    def propose(self, req_id: int, k: int) -> list[int]:
        own = self._live[req_id]
        matches = self._longest_matches(own)
        return self._walk(own, matches, k) if matches else []

    def _longest_matches(self, own: _Sequence) -> list[_Occurrence]:
        """The visible occurrences of the longest suffix that has any, most recent first."""
        tokens, size = own.tokens, len(own.tokens)
        depth = min(self.max_depth, size)  # the longest match there can be
        for n in reversed(self.key_lengths):
            if n > size:
                continue
            entries = [(seq, end) for seq, end in reversed(self._occurrences(hash(tuple(tokens[-n:]))))
                       if seq is own or seq.pooled]
            rest = tokens[size - depth: size - n]
            deepest = [(seq, end) for seq, end in entries if end >= depth and seq.tokens[end - depth: end - n] == rest]
            if deepest:  # a request that repeats itself or others: no need to measure the others
                return deepest
            scored = [(self._match_length(tokens, seq, end, n), seq, end) for seq, end in entries]
            if scored:
                longest = max(length for length, _, _ in scored)
                return [(seq, end) for length, seq, end in scored if length == longest]
        return []

    def _match_length(self, tokens: list[int], seq: _Sequence, end: int, known: int) -> int:
        """How many tokens before `end` in seq equal the end of `tokens` (the first `known` do), up to max_depth."""
        length, limit = known, min(self.max_depth, len(tokens), end)
        while length < limit and tokens[-1 - length] == seq.tokens[end - 1 - length]:
            length += 1
        return length

    def _walk(self, own: _Sequence, matches: list[_Occurrence], k: int) -> list[int]:
        """Greedy path down the continuations of `matches`; ties go to the most recent occurrence.

        Each occurrence's continuation is known before the walk: a finished sequence's next tokens
        (fewer at its end), and for the request's own occurrences the tokens after it read on into
        the drafts, which while it is on the path are its own continuation again: the tokens from
        it to the end, repeated. Equal continuations are counted together, in order of first sight."""
        weights: dict[tuple[int, ...], int] = {}
        for seq, end in matches:
            cont = seq.tokens[end: end + k]
            if seq is own and len(cont) < k:  # the whole rest of its tokens: repeated
                cont = (cont * (k // len(cont) + 1))[:k]
            cont = tuple(cont)
            weights[cont] = weights.get(cont, 0) + 1
        alive = list(weights.items())
        drafts: list[int] = []
        needed = self.min_token_prob * len(matches)
        while len(drafts) < k:
            depth = len(drafts)
            counts: dict[int, int] = {}  # in order of first sight, i.e. most recent first
            for cont, weight in alive:
                if len(cont) > depth:
                    counts[cont[depth]] = counts.get(cont[depth], 0) + weight
            if not counts:
                break
            token, count = max(counts.items(), key=lambda item: item[1])
            if count < needed:
                break
            drafts.append(token)
            alive = [(cont, weight) for cont, weight in alive if len(cont) > depth and cont[depth] == token]
        return drafts

    def finish(self, req_id: int) -> None:
        sequence = self._live.pop(req_id, None)
        if sequence is None:  # finished twice (abort after its end)
            return
        sequence.pooled = True  # its index entries were made as it grew: joining the pool is free
        self._pool.append(sequence)
        self.cached_tokens += len(sequence.tokens)
        while self.cached_tokens > self.max_cached_tokens:
            self._evict(self._pool.popleft())

    def _evict(self, sequence: _Sequence) -> None:
        """Out of the pool and invisible at once; its entries leave the index now without a backlog,
        else a share a step, unless those waiting to leave reach half the bound's worth."""
        sequence.pooled = False
        self._backlog.drop(sequence)
        self.cached_tokens -= len(sequence.tokens)
        self._evicted.append(sequence)
        self._evicted_tokens += sequence.indexed
        if not self._backlog.share or self._evicted_tokens > self.max_cached_tokens // 2:
            while self._evicted:
                self._remove_some(self._evicted_tokens)

    def _remove_some(self, budget: int) -> int:
        """Remove up to `budget` positions' entries of the oldest evicted sequence; the positions done."""
        sequence = self._evicted[0]
        tokens, index, start = sequence.tokens, self._index, sequence.removed
        stop = min(sequence.indexed, start + budget)
        keys = {hash(tuple(tokens[end - n:end])) for end in range(max(start, 1), stop) for n in self.key_lengths
                if n <= end}
        for key in keys:  # every key _index_to entered for these positions
            entries = index.get(key)
            if entries is None:
                continue
            if type(entries) is tuple:  # one occurrence (most longer n-grams)
                if entries[0] is sequence:
                    del index[key]
                continue
            kept = [entry for entry in entries if entry[0] is not sequence]
            if not kept:
                del index[key]
            elif len(kept) == 1:
                index[key] = kept[0]
            elif len(kept) < len(entries):
                index[key] = deque(kept, maxlen=self.max_occurrences)
        sequence.removed = stop
        self._evicted_tokens -= stop - start
        if stop == sequence.indexed:
            self._evicted.popleft()
        return stop - start


# Tokens a proposal call catches the draft model up on at most, over all its requests (unless the
# engine says: its largest prompt step), so that the draft's step stays within the activations of
# a target step the KV budget is sized beside. A request's first call takes its whole prompt with
# its drafts where it fits (its acceptance is then known after one call, whatever the prompt); one
# that does not fit waits for a call with room, and a prompt longer than a whole call goes on over
# several calls, without drafts until it is done.
CATCH_UP_TOKENS = 2048


@dataclass
class _ModelDraftState:
    tokens: list[int]
    drafted: int = 0  # positions the workers' draft KV holds, as they last said


class ModelDraft:
    """draft_model: proposals from a draft model that the workers run (spec/draft_runner.py).
    This side keeps each request's tokens and how far the draft's KV has caught up, and sends a
    proposal call the tokens since. Proposals cost device time, so the controller makes no shadow
    proposals with this source (`free_proposals`); its acceptance is learnt from verification."""

    free_proposals = False

    def __init__(self, drafter, catch_up_tokens: int = CATCH_UP_TOKENS):
        self._drafter, self.catch_up_tokens = drafter, catch_up_tokens
        self._requests: dict[int, _ModelDraftState] = {}
        self.last_catch_up = 0  # tokens the last call caught the draft up on, the last of each request's included

    def start(self, req_id: int, prompt_ids: Sequence[int]) -> None:
        assert req_id not in self._requests, f"request {req_id} started twice"
        self._requests[req_id] = _ModelDraftState(list(prompt_ids))

    def extend(self, req_id: int, token_ids: Sequence[int]) -> None:
        self._requests[req_id].tokens.extend(token_ids)

    def finish(self, req_id: int) -> None:
        self._requests.pop(req_id, None)

    def propose(self, req_id: int, k: int) -> list[int]:
        return self.propose_many({req_id: k}).get(req_id, [])

    def propose_many(self, wants: dict[int, int]) -> dict[int, list[int]]:
        """Drafts for each request (req id -> most drafts) in one call to the workers; requests
        past this call's catch-up budget only catch up."""
        asks, budget = [], self.catch_up_tokens
        for req_id, k in wants.items():
            state = self._requests[req_id]
            pending = len(state.tokens) - state.drafted
            if pending <= budget:
                asks.append(DraftRequest(req_id, state.drafted, tuple(state.tokens[state.drafted:]), k))
                budget -= pending
            elif not asks and pending > self.catch_up_tokens:  # longer than any call: part of it now
                take = self.catch_up_tokens
                asks.append(DraftRequest(req_id, state.drafted, tuple(state.tokens[state.drafted: state.drafted + take]), 0))
                budget = 0
        self.last_catch_up = sum(len(a.tokens) for a in asks)
        if not asks:
            return {}
        out = {}
        for ask, (drafts, drafted) in zip(asks, self._drafter(asks)):
            self._requests[ask.req_id].drafted = drafted
            if drafts:
                out[ask.req_id] = list(drafts)
        return out


def _doubling(first: int, last: int) -> tuple[int, ...]:
    lengths = []
    while first <= last:
        lengths.append(first)
        first *= 2
    return tuple(lengths)
