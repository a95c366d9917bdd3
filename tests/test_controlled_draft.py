"""test/benchmark/lib/controlled_draft.py: its drafts are right with probability alpha, position by
position and independently (so accepted runs are geometric), the same when proposed again, and
absent for an unknown prompt, a diverged request or past the oracle's end."""

from __future__ import annotations

import math

import pytest

from benchmark.lib.controlled_draft import ControlledDraft, read_oracle, write_oracle
from lightllm.engine.spec.config import SpeculativeConfig
from lightllm.engine.spec.drafts import make_draft_source
from seeds import fresh_rng, fresh_seed

VOCAB = 1000
Z = 4.5  # standard deviations: a correct draft fails a bound about once in 150,000 runs


def random_oracle(rng, prompts: int, output_len: int) -> list[tuple[list[int], list[int]]]:
    return [([rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))] + [i],  # the last id keeps prompts distinct
             [rng.randrange(VOCAB) for _ in range(output_len)]) for i in range(prompts)]


@pytest.fixture
def oracle_file(tmp_path):
    def make(pairs) -> str:
        path = tmp_path / "oracle.jsonl"
        assert write_oracle(path, pairs) == len(pairs)
        return str(path)
    return make


def one_token_drafts(draft: ControlledDraft, pairs) -> list[tuple[int, int]]:
    """(draft, truth) at every position, proposing one token at a time as the target decodes."""
    seen = []
    for req_id, (prompt, truth) in enumerate(pairs):
        draft.start(req_id, prompt)
        for token in truth:
            (proposed,) = draft.propose(req_id, 1)
            seen.append((proposed, token))
            draft.extend(req_id, [token])
        draft.finish(req_id)
    return seen


def accepted_runs(draft: ControlledDraft, pairs, k: int) -> list[int]:
    """Greedy verification's accepted drafts per step: the leading drafts equal to the target's
    tokens; the step then emits those and one more (the target's own). Steps with fewer than k
    drafts (at the oracle's end) are left out."""
    runs = []
    for req_id, (prompt, truth) in enumerate(pairs):
        draft.start(req_id, prompt)
        position = 0
        while position < len(truth):
            proposed = draft.propose(req_id, k)
            accepted = next((j for j, (d, t) in enumerate(zip(proposed, truth[position:])) if d != t), len(proposed))
            if len(proposed) == k:
                runs.append(accepted)
            emitted = truth[position: position + accepted + 1]
            draft.extend(req_id, emitted)
            position += len(emitted)
        draft.finish(req_id)
    return runs


@pytest.mark.parametrize("alpha", [0.3, 0.8])
def test_each_draft_is_right_with_probability_alpha(oracle_file, alpha):
    pairs = random_oracle(fresh_rng(), prompts=100, output_len=200)
    seen = one_token_drafts(ControlledDraft(VOCAB, oracle_file(pairs), alpha, seed=fresh_seed()), pairs)
    n = len(seen)
    right = sum(d == t for d, t in seen) / n
    assert abs(right - alpha) <= Z * math.sqrt(alpha * (1 - alpha) / n), (right, alpha, n)
    assert all(0 <= d < VOCAB for d, _ in seen)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_alpha_zero_is_always_wrong_and_one_always_right(oracle_file, alpha):
    pairs = random_oracle(fresh_rng(), prompts=20, output_len=50)
    seen = one_token_drafts(ControlledDraft(VOCAB, oracle_file(pairs), alpha, seed=fresh_seed()), pairs)
    assert all((d == t) == (alpha == 1.0) for d, t in seen)


@pytest.mark.parametrize("alpha,k", [(0.6, 4), (0.8, 4), (0.9, 8)])
def test_accepted_run_lengths_are_geometric(oracle_file, alpha, k):
    pairs = random_oracle(fresh_rng(), prompts=200, output_len=200)
    runs = accepted_runs(ControlledDraft(VOCAB, oracle_file(pairs), alpha, seed=fresh_seed()), pairs, k)
    n = len(runs)
    # P(run >= j) = alpha^j for j <= k: the mean is their sum, and each tail is its own check
    mean = alpha * (1 - alpha ** k) / (1 - alpha)
    second = sum((2 * j - 1) * alpha ** j for j in range(1, k + 1))  # E[run^2] = sum_j (2j - 1) P(run >= j)
    assert abs(sum(runs) / n - mean) <= Z * math.sqrt((second - mean ** 2) / n), (sum(runs) / n, mean)
    for j in (1, 2, k):
        tail = alpha ** j
        share = sum(run >= j for run in runs) / n
        assert abs(share - tail) <= Z * math.sqrt(tail * (1 - tail) / n), (j, share, tail)


def test_the_same_position_gets_the_same_drafts(oracle_file):
    pairs = random_oracle(fresh_rng(), prompts=10, output_len=40)
    path, seed = oracle_file(pairs), fresh_seed()
    first, second, other = (ControlledDraft(VOCAB, path, 0.5, seed=s) for s in (seed, seed, seed + 1))
    for req_id, (prompt, truth) in enumerate(pairs):
        for draft in (first, second, other):
            draft.start(req_id, prompt)
        again = first.propose(req_id, 8)
        assert again == first.propose(req_id, 8) == second.propose(req_id, 8)  # proposed again; another instance
        assert first.propose(req_id, 3) == again[:3]
        first.extend(req_id, truth[:5])
        assert first.propose(req_id, 3) == again[5:8]  # a position's draft does not depend on when it is asked
    # another seed draws other wrong positions (all 400 positions equal at alpha 0.5: chance 2^-400)
    assert [other.propose(i, 40) for i in range(10)] != [second.propose(i, 40) for i in range(10)]


def test_a_lower_alpha_is_wrong_wherever_a_higher_one_is(oracle_file):
    pairs = random_oracle(fresh_rng(), prompts=10, output_len=100)
    path, seed = oracle_file(pairs), fresh_seed()
    low, high = ControlledDraft(VOCAB, path, 0.4, seed), ControlledDraft(VOCAB, path, 0.8, seed)
    for req_id, (prompt, truth) in enumerate(pairs):
        low.start(req_id, prompt)
        high.start(req_id, prompt)
        for lo, hi, t in zip(low.propose(req_id, 100), high.propose(req_id, 100), truth):
            assert hi == t or lo == hi  # wrong at 0.8 -> the same wrong token at 0.4


def test_no_drafts_for_an_unknown_prompt_a_diverged_request_or_past_the_end(oracle_file):
    rng = fresh_rng()
    pairs = random_oracle(rng, prompts=3, output_len=10)
    draft = ControlledDraft(VOCAB, oracle_file(pairs), 1.0)
    (prompt, truth), (other, _) = pairs[0], pairs[1]
    draft.start(1, prompt + [5])  # a longer prompt is another prompt
    assert draft.propose(1, 4) == []
    draft.start(2, prompt)
    draft.extend(2, truth[:3])
    assert draft.propose(2, 4) == truth[3:7]
    draft.extend(2, [(truth[3] + 1) % VOCAB])  # the target decoded something else
    assert draft.propose(2, 4) == []
    draft.extend(2, truth[4:6])  # and stays off the oracle's path even if it rejoins
    assert draft.propose(2, 4) == []
    draft.start(3, prompt)
    draft.extend(3, truth[:8])
    assert draft.propose(3, 4) == truth[8:]  # the oracle's last two tokens
    draft.extend(3, truth[8:] + [7])  # past the oracle's end
    assert draft.propose(3, 4) == []
    draft.start(4, other)
    draft.finish(4)
    assert draft.propose(4, 4) == []  # a finished request is forgotten
    assert draft.propose(99, 4) == []  # and one never started is unknown


def test_the_engine_builds_it_from_the_speculative_config(oracle_file):
    pairs = random_oracle(fresh_rng(), prompts=2, output_len=10)
    path = oracle_file(pairs)
    assert read_oracle(path) == pairs
    config = SpeculativeConfig.parse(
        f'{{"method": "benchmark.lib.controlled_draft:ControlledDraft", "oracle": "{path}", "alpha": 1.0, '
        f'"seed": 3, "num_speculative_tokens": 4}}')
    draft = make_draft_source(config, VOCAB)
    assert isinstance(draft, ControlledDraft)
    draft.start(0, pairs[1][0])
    assert draft.propose(0, config.num_speculative_tokens) == pairs[1][1][:4]


@pytest.mark.parametrize("alpha", [-0.1, 1.5])
def test_alpha_outside_zero_to_one_is_refused(oracle_file, alpha):
    with pytest.raises(ValueError, match="alpha"):
        ControlledDraft(VOCAB, oracle_file([([1], [2])]), alpha)
