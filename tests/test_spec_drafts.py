"""Draft sources for speculative decoding, checked against brute-force references.

The references scan every earlier position (O(n^2)); the sources must agree with them while
keeping their own per-token and per-proposal costs independent of the request's length.
"""

import random
import time
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightllm.engine.spec.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from lightllm.engine.spec.drafts import NgramDraft, SuffixDraft, make_draft_source

tokens_strategy = st.lists(st.integers(0, 3), max_size=60)  # a small alphabet: many matches


def reference_ngram(tokens, min_n, max_n, k):
    """Latest earlier occurrence of the longest suffix n-gram, continued token by token (a copy
    that runs into the end reads on into what it has copied)."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n:end] == tokens[length - n:]:
                sequence = list(tokens)
                for j in range(k):
                    sequence.append(sequence[end + j])
                return sequence[length:]
    return []


def common_suffix(a, b, limit):
    length = 0
    while length < min(limit, len(a), len(b)) and a[-1 - length] == b[-1 - length]:
        length += 1
    return length


def reference_suffix(pool, own, k, max_depth, min_match_len, min_token_prob):
    """Every occurrence in the finished sequences (oldest first) and the request's own tokens:
    keep those of the longest suffix, then follow the most frequent continuation (ties: the most
    recent occurrence) while its share of them is at least min_token_prob."""
    sources = [list(s) for s in pool] + [list(own)]
    found = [(common_suffix(seq[:end], own, max_depth), index, end)
             for index, seq in enumerate(sources) for end in range(1, len(seq))]
    found = [f for f in found if f[0] >= min_match_len]
    if not found:
        return []
    longest = max(f[0] for f in found)
    alive = sorted(((index, end) for length, index, end in found if length == longest), reverse=True)
    total, drafts = len(alive), []
    while len(drafts) < k:
        followers = []
        for index, end in alive:
            seq = sources[index] + (drafts if index == len(sources) - 1 else [])
            followers.append(((index, end), seq[end + len(drafts)] if end + len(drafts) < len(seq) else None))
        counts = {}
        for _, token in followers:
            if token is not None:
                counts[token] = counts.get(token, 0) + 1
        if not counts or max(counts.values()) < min_token_prob * total:
            break
        token = max(counts, key=counts.get)
        drafts.append(token)
        alive = [occurrence for occurrence, follower in followers if follower == token]
    return drafts


def feed(draft, req_id: int, parts: list[list[int]]):
    """Start the request with parts[0] and extend it by each next part; yield its tokens so far after each."""
    draft.start(req_id, parts[0])
    seen = list(parts[0])
    yield list(seen)
    for part in parts[1:]:
        draft.extend(req_id, part)
        seen += part
        yield list(seen)


def chunks(tokens, cuts):
    """tokens split at the given (sorted, deduplicated) cut points."""
    bounds = [0] + sorted({c % (len(tokens) + 1) for c in cuts}) + [len(tokens)]
    return [tokens[a:b] for a, b in zip(bounds, bounds[1:])]


# ---- ngram -------------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(tokens=tokens_strategy, min_n=st.integers(1, 3), extra=st.integers(0, 3), k=st.integers(0, 8))
def test_ngram_matches_brute_force(tokens, min_n, extra, k):
    draft = NgramDraft(min_n, min_n + extra)
    draft.start(0, tokens)
    assert draft.propose(0, k) == reference_ngram(tokens, min_n, min_n + extra, k)


@settings(max_examples=150, deadline=None)
@given(tokens=tokens_strategy, cuts=st.lists(st.integers(0, 60), max_size=8), k=st.integers(1, 8))
def test_ngram_incremental_extend_equals_start(tokens, cuts, k):
    incremental, whole = NgramDraft(1, 4), NgramDraft(1, 4)
    for seen in feed(incremental, 0, chunks(tokens, cuts)):
        whole.start(1, seen)
        assert incremental.propose(0, k) == whole.propose(1, k) == reference_ngram(seen, 1, 4, k)
        whole.finish(1)


def test_ngram_proposes_the_prompt_when_the_output_repeats_it():
    rng = random.Random(1)
    prompt = rng.sample(range(1000), 50)  # distinct tokens: one match only
    draft = NgramDraft(2, 5)
    draft.start(7, prompt)
    draft.extend(7, prompt[10:13])
    assert draft.propose(7, 6) == prompt[13:19]
    draft.extend(7, prompt[13:15])
    assert draft.propose(7, 4) == prompt[15:19]


def test_ngram_continues_a_loop_past_the_end():
    draft = NgramDraft(2, 3)
    draft.start(0, [9, 1, 2, 1, 2, 1, 2])
    assert draft.propose(0, 7) == [1, 2, 1, 2, 1, 2, 1]


def test_ngram_no_match_and_k_bound():
    draft = NgramDraft(2, 4)
    draft.start(0, [1, 2, 3, 4, 5])
    assert draft.propose(0, 5) == []
    draft.extend(0, [1, 2])
    assert draft.propose(0, 0) == []
    assert draft.propose(0, 2) == [3, 4]
    assert len(draft.propose(0, MAX_SPECULATIVE_TOKENS)) == MAX_SPECULATIVE_TOKENS  # the loop copies on
    draft.finish(0)
    draft.finish(0)  # twice is harmless
    with pytest.raises(KeyError):
        draft.propose(0, 2)


# ---- suffix ------------------------------------------------------------------------------------

@st.composite
def pool_and_request(draw):
    """Finished sequences and a request that repeats pieces of them (and random tokens between),
    so that matches of every length, up to a sequence's very start, are common."""
    pool = draw(st.lists(st.lists(st.integers(0, 2), max_size=25), max_size=4))
    request = []
    for _ in range(draw(st.integers(0, 4))):
        source = draw(st.sampled_from(pool)) if pool and draw(st.booleans()) else draw(st.lists(st.integers(0, 2), max_size=6))
        start = draw(st.integers(0, len(source)))
        request += source[start:draw(st.integers(start, len(source)))]
    return pool, request


@settings(max_examples=300, deadline=None)
@given(pool_request=pool_and_request(), cuts=st.lists(st.integers(0, 25), max_size=4),
       min_match_len=st.integers(1, 3), max_depth=st.integers(3, 9), k=st.integers(1, 6),
       min_token_prob=st.sampled_from([0.0, 0.1, 0.3, 0.6]))
def test_suffix_matches_brute_force(pool_request, cuts, min_match_len, max_depth, k, min_token_prob):
    pool, own = pool_request
    # bounds large enough that nothing is forgotten: the reference sees everything
    draft = SuffixDraft(max_depth=max_depth, min_match_len=min_match_len, max_occurrences=10_000,
                        min_token_prob=min_token_prob, max_cached_tokens=10_000)
    for req_id, tokens in enumerate(pool):
        draft.start(req_id, tokens)
        draft.finish(req_id)
    *_, seen = feed(draft, 99, chunks(own, cuts))
    expected = reference_suffix(pool, seen, k, max_depth, min_match_len, min_token_prob)
    assert draft.propose(99, k) == expected


def test_suffix_match_reaching_a_sequence_start_counts_whole():
    draft = SuffixDraft(min_match_len=2)
    for req_id, tokens in enumerate([[0, 1, 2, 5], [9, 1, 2, 6]]):
        draft.start(req_id, tokens)
        draft.finish(req_id)
    draft.start(2, [7, 0, 1, 2])
    assert draft.propose(2, 1) == [5]  # "0 1 2" (3 tokens) beats the more recent "1 2"


def test_suffix_proposes_what_a_finished_request_said():
    rng = random.Random(2)
    answer = rng.sample(range(1000), 40)
    draft = SuffixDraft()
    draft.start(1, [5000, 5001] + answer)
    draft.finish(1)
    draft.start(2, [6000, 6001, 6002])
    assert draft.propose(2, 4) == []
    draft.extend(2, answer[:3])
    assert draft.propose(2, 8) == answer[3:11]


def test_suffix_frequency_beats_recency():
    draft = SuffixDraft()
    common, rare = [40, 41, 42], [50, 51, 52]
    for req_id, (lead, tail) in enumerate([(1, common), (2, common), (3, rare)]):  # the rare one last
        draft.start(req_id, [lead, 7, 8, 9] + tail)
        draft.finish(req_id)
    draft.start(10, [4, 7, 8, 9])
    assert draft.propose(10, 3) == common


def test_suffix_stops_below_min_token_prob():
    followers = list(range(100, 111))  # 11 continuations, each 1/11 < 0.1
    draft = SuffixDraft(min_token_prob=0.1)
    for req_id, token in enumerate(followers):
        draft.start(req_id, [7, 8, token])
        draft.finish(req_id)
    draft.start(50, [3, 7, 8])
    assert draft.propose(50, 4) == []
    draft.start(51, [7, 8, 100])  # a 12th occurrence makes 100 2/12
    draft.finish(51)
    assert draft.propose(50, 4) == [100]


def test_suffix_min_token_prob_is_the_share_of_the_whole_path():
    draft = SuffixDraft(min_token_prob=0.5)
    continuations = [[1, 2]] * 3 + [[1, 3]] * 3 + [[4, 5]] * 4  # "1": 6/10, then "1 2" or "1 3": 3/10
    for req_id, tail in enumerate(continuations):
        draft.start(req_id, [20 + req_id, 7, 8] + tail)
        draft.finish(req_id)
    draft.start(50, [3, 7, 8])
    assert draft.propose(50, 4) == [1]  # 3/6 of the paths through "1", but only 3/10 of all


def test_suffix_sees_its_own_tokens_but_not_other_running_requests():
    draft = SuffixDraft()
    draft.start(1, [1, 2, 3, 4, 5, 6])
    draft.start(2, [9, 1, 2, 3])
    assert draft.propose(2, 3) == []  # request 1 is still running
    draft.extend(2, [7, 8, 9, 1, 2, 3])
    assert draft.propose(2, 3) == [7, 8, 9]  # its own earlier "9 1 2 3 7 8 9"
    draft.finish(1)
    assert draft.propose(2, 3) == [7, 8, 9]  # "9 1 2 3" beats request 1's "1 2 3 4"
    draft.start(3, [0, 1, 2, 3])
    assert draft.propose(3, 3) == [4, 5, 6]  # request 1 is in the pool now


def test_suffix_pool_bound_and_eviction():
    rng = random.Random(3)
    draft = SuffixDraft(max_cached_tokens=5_000)
    first = [rng.randrange(10_000, 20_000) for _ in range(300)]  # tokens nobody else uses
    draft.start(0, first)
    draft.finish(0)
    draft.start(1, first[:3])
    assert draft.propose(1, 4) == first[3:7]
    draft.finish(1)
    for req_id in range(2, 200):
        draft.start(req_id, [rng.randrange(1000) for _ in range(rng.randrange(1, 400))])
        draft.finish(req_id)
        assert draft.cached_tokens <= 5_000
        assert draft.cached_tokens == sum(len(seq.tokens) for seq in draft._pool)
    draft.start(500, first[:3])
    assert draft.propose(500, 4) == []  # forgotten
    pooled = {id(seq) for seq in draft._pool}
    assert all(id(seq) in pooled or seq is draft._live[500]
               for key in draft._index for seq, _ in draft._occurrences(key))


def test_suffix_index_memory_a_cached_token():
    """The pool's index at its bound holds well under 1 KB a cached token where most n-grams are new
    (random tokens, the ladder's five keys a token): with an n-gram tuple and a deque a key it held 3.5 KB."""
    rng = random.Random(4)
    draft = SuffixDraft(max_cached_tokens=30_000)
    tracemalloc.start()
    try:
        for req_id in range(150):
            draft.start(req_id, [rng.randrange(32_000) for _ in range(300)])
            draft.finish(req_id)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert draft.cached_tokens == 30_000
    assert held / draft.cached_tokens < 800, f"{held / draft.cached_tokens:.0f} bytes a cached token"


def index_content(draft, names):
    """The index as {key: sorted (sequence's name, position)}: what it holds, whatever the order."""
    return {key: sorted((names[id(seq)], end) for seq, end in draft._occurrences(key)) for key in draft._index}


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["start", "extend", "finish", "catch_up"]), st.integers(0, 5),
                              st.lists(st.integers(0, 3), max_size=30)), max_size=40),
       index_a_step=st.integers(1, 40), max_cached_tokens=st.sampled_from([20, 200, 10_000]))
def test_prompt_backlog_indexes_what_an_eager_index_holds(ops, index_a_step, max_cached_tokens):
    """Prompts indexed and evicted sequences' entries removed a share a step (catch_up) hold, once
    the backlogs are done, what doing both at once holds: prompt lookup's positions exactly, and
    the suffix index the same occurrences under every key, sequences evicted on the way (in the
    backlog or not) leaving none; no call does more than its share."""
    suffix = [SuffixDraft(max_occurrences=10_000, max_cached_tokens=max_cached_tokens, **extra)
              for extra in ({}, {"index_a_step": index_a_step})]
    ngram = [NgramDraft(2, 4), NgramDraft(2, 4, index_a_step)]
    names, live, next_id = [{}, {}], set(), 0
    for op, pick, tokens in ops:
        target = sorted(live)[pick % len(live)] if live else None
        if op == "start":
            for draft, named in zip(suffix, names):
                draft.start(next_id, tokens)
                named[id(draft._live[next_id])] = next_id
            for draft in ngram:
                draft.start(next_id, tokens)
            live.add(next_id)
            next_id += 1
        elif op == "extend" and target is not None:
            for draft in suffix + ngram:
                draft.extend(target, tokens)
        elif op == "finish" and target is not None:
            state = ngram[1]._requests[target]
            for draft in suffix + ngram:
                draft.finish(target)
            assert state not in ngram[1]._backlog._sequences  # its tokens are no one's now
            live.discard(target)
        elif op == "catch_up":
            assert suffix[1].catch_up() <= index_a_step and ngram[1].catch_up() <= index_a_step
    for draft in (suffix[1], ngram[1]):
        while done := draft.catch_up():
            assert done <= index_a_step
        assert not draft._backlog
    assert not suffix[1]._evicted
    assert suffix[1].cached_tokens == suffix[0].cached_tokens
    assert index_content(suffix[1], names[1]) == index_content(suffix[0], names[0])
    for req_id in live:
        assert ngram[1]._requests[req_id].next_position == ngram[0]._requests[req_id].next_position
        assert ngram[1].propose(req_id, 4) == ngram[0].propose(req_id, 4)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_the_served_sources_index_prompts_a_share_a_step(method):
    """A wave of prompts costs the step they start in nothing: their tokens enter the index
    PROMPT_INDEX_TOKENS_A_STEP a step, and a request proposes from its prompt once it is in."""
    from lightllm.engine.spec.drafts import PROMPT_INDEX_TOKENS_A_STEP

    draft = make_draft_source(SpeculativeConfig(method, num_speculative_tokens=4), vocab_size=50_000)
    rng = random.Random(5)
    block = rng.sample(range(40_000, 41_000), 20)
    prompts = [[rng.randrange(30_000) for _ in range(700)] + block + [rng.randrange(30_000) for _ in range(5)] + block[:5]
               for _ in range(3)]
    for req_id, prompt in enumerate(prompts):
        draft.start(req_id, prompt)
    assert draft.propose(2, 4) == []
    total, steps = sum(map(len, prompts)), 0
    while draft._backlog:
        assert draft.catch_up() == min(PROMPT_INDEX_TOKENS_A_STEP, total - steps * PROMPT_INDEX_TOKENS_A_STEP)
        steps += 1
    assert steps == -(-total // PROMPT_INDEX_TOKENS_A_STEP)
    assert draft.propose(2, 4) == block[5:9]  # its own prompt's earlier block


def test_suffix_evicted_entries_leave_a_share_a_step():
    """An evicted sequence is invisible at once; its entries leave the index a share a step, or all at
    once when those waiting reach half the bound."""
    rng = random.Random(6)
    draft = SuffixDraft(max_cached_tokens=3_000, index_a_step=500)
    sequences = [rng.sample(range(10_000 * i, 10_000 * (i + 1)), 1_000) for i in range(5)]  # no token shared

    def entries_of(sequence):
        return sum(seq.tokens == sequence for key in draft._index for seq, _ in draft._occurrences(key))

    for req_id, tokens in enumerate(sequences[:4]):
        draft.start(req_id, tokens)
        while draft.catch_up():
            pass
        draft.finish(req_id)  # the fourth puts the pool over its bound: the first is evicted
    assert draft.cached_tokens == 3_000 and entries_of(sequences[0]) > 0
    draft.start(10, sequences[0][:5])
    assert draft.propose(10, 4) == []  # invisible while its entries wait
    assert draft.catch_up() == 500 and entries_of(sequences[0]) > 0
    assert draft.catch_up() == 500 and entries_of(sequences[0]) == 0
    assert draft.catch_up() == 5  # then request 10's prompt
    draft.start(11, rng.sample(range(100_000, 110_000), 2_000))
    draft.start(4, sequences[4])
    while draft.catch_up():
        pass
    draft.finish(4)  # evicts the second, its entries to leave a share a step
    assert entries_of(sequences[1]) > 0
    draft.finish(11)  # evicts the third and fourth: those waiting pass half the bound with the third
    assert entries_of(sequences[1]) == entries_of(sequences[2]) == 0 and entries_of(sequences[3]) > 0
    assert [seq.tokens for seq in draft._evicted] == [sequences[3]]


def test_suffix_bad_options():
    with pytest.raises(ValueError, match="min_match_len"):
        SuffixDraft(min_match_len=30, max_depth=24)
    with pytest.raises(ValueError, match="min_token_prob"):
        SuffixDraft(min_token_prob=1.5)


# ---- cost --------------------------------------------------------------------------------------

def best_time(call, repeats=5, calls=300):
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(calls):
            call()
        times.append(time.perf_counter() - began)
    return min(times)


def long_request(length, rng):
    """Random tokens, then the same 30-token block 70 times: every source has as many
    occurrences to weigh at the end whatever the length."""
    block = rng.sample(range(5000, 6000), 30)
    return [rng.randrange(5000) for _ in range(length - 30 * 70)] + block * 70


@pytest.mark.parametrize("make", [lambda: NgramDraft(2, 5), lambda: SuffixDraft()], ids=["ngram", "suffix"])
def test_proposal_cost_does_not_grow_with_the_request(make):
    rng = random.Random(4)
    timings = {}
    for length in (3_000, 100_000):
        draft = make()
        tokens = long_request(length, rng)
        draft.start(0, tokens[:-60])
        began = time.perf_counter()
        draft.extend(0, tokens[-60:])
        extend = time.perf_counter() - began
        assert draft.propose(0, 8) == tokens[-30:-22]
        timings[length] = best_time(lambda: draft.propose(0, 8)), extend
    assert timings[100_000][0] < 4 * timings[3_000][0], timings  # a scan would be ~30x
    assert timings[100_000][1] < 0.05, timings  # 60 appended tokens: no rescan of 100k tokens


# ---- config and factory ------------------------------------------------------------------------

class TinyDraft:
    """A draft source of a test's own, for the "module:Class" method."""

    def __init__(self, vocab_size, token=0):
        self.vocab_size, self.token = vocab_size, token

    def start(self, req_id, prompt_ids):
        pass

    def extend(self, req_id, token_ids):
        pass

    def propose(self, req_id, k):
        return [self.token] * k

    def finish(self, req_id):
        pass


def test_make_draft_source():
    ngram = make_draft_source(SpeculativeConfig.parse('{"method": "ngram", "prompt_lookup_min": 1, '
                                                      '"prompt_lookup_max": 3}'), vocab_size=100)
    assert isinstance(ngram, NgramDraft) and (ngram.min_n, ngram.max_n) == (1, 3)
    suffix = make_draft_source(SpeculativeConfig.parse('{"method": "suffix", "max_depth": 12, '
                                                       '"min_token_prob": 0.25}'), vocab_size=100)
    assert isinstance(suffix, SuffixDraft) and (suffix.max_depth, suffix.min_token_prob) == (12, 0.25)
    custom = make_draft_source(SpeculativeConfig.parse({"method": f"{__name__}:TinyDraft", "token": 5}),
                               vocab_size=100)
    assert isinstance(custom, TinyDraft) and custom.vocab_size == 100 and custom.propose(0, 2) == [5, 5]


@pytest.mark.parametrize("text, message", [
    ("{method: ngram}", "not JSON"),
    ('{"num_speculative_tokens": 3}', '"method"'),
    ("[1, 2]", '"method"'),
    ('{"method": "eagle9"}', "choose one of ngram, suffix"),
    ('{"method": 5}', "must be a string"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be 1..16"),
    ('{"method": "ngram", "num_speculative_tokens": 17}', "num_speculative_tokens must be 1..16"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "must be an integer"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
])
def test_config_errors(text, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(text)


def test_config_absent_and_valid():
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    config = SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 16, "max_depth": 8}')
    assert config.num_speculative_tokens == MAX_SPECULATIVE_TOKENS and config.options == {"max_depth": 8}
