"""Sampling: greedy, seeded top-k/top-p draws, penalties, against direct computations."""

import math

import pytest
import torch

from lightllm.engine.request import SamplingParams
from lightllm.engine.sampling import SamplingBatch, SamplingState, host_lists, sample


def to_batch(states):
    ints, floats = host_lists(states)
    tensors = {k: torch.tensor(v, dtype=torch.int64) for k, v in ints.items()}
    tensors.update({k: torch.tensor(v, dtype=torch.float32) for k, v in floats.items()})
    return SamplingBatch.from_tensors(tensors, all_greedy=all(s.params.greedy for s in states))


def run(logits, params_list, steps=None):
    states = [SamplingState(p, generated=s) for p, s in zip(params_list, steps or [0] * len(params_list))]
    return sample(logits.clone(), to_batch(states))[:2]


def random_logits(batch, vocab, seed):
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_with_its_logprob():
    logits = random_logits(8, 500, 0)
    tokens, logprobs = run(logits, [SamplingParams()] * 8)
    assert torch.equal(tokens, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected)


def test_greedy_shortcut_equals_the_general_path():
    """An all-greedy batch with nothing changing its logits takes greedy_sample; asking for top
    logprobs takes the general path, which must choose the same tokens with the same logprobs."""
    logits = random_logits(8, 700, 5)
    logits[0, 3] = logits[0, 600] = logits[0].max() + 1  # a tie
    quick = sample(logits.clone(), to_batch([SamplingState(SamplingParams())] * 8))
    general = to_batch([SamplingState(SamplingParams())] * 8)
    general.top_logprobs = 1
    full = sample(logits.clone(), general)
    assert quick[2] is None and torch.equal(quick[0], full[0]) and quick[0][0] == 3
    torch.testing.assert_close(quick[1], full[1])
    torch.testing.assert_close(full[2][1][:, 0], quick[1])  # the chosen token is the top one


def test_same_seed_same_tokens_whatever_the_batch():
    vocab = 300
    mine = SamplingParams(do_sample=True, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    row = random_logits(1, vocab, 1)
    alone = [run(row, [mine], steps=[step])[0].item() for step in range(20)]
    others = [SamplingParams(do_sample=True, seed=s) for s in (1, 2)] + [SamplingParams()]
    batched = []
    for step in range(20):
        logits = torch.cat([random_logits(2, vocab, 100 + step), row, random_logits(1, vocab, 200 + step)])
        params = [others[0], others[1], mine, others[2]]
        batched.append(run(logits, params, steps=[3, 7, step, 0])[0][2].item())
    assert alone == batched
    assert len(set(alone)) > 1, "the step must change the draw"


def test_top_k_one_is_greedy():
    logits = random_logits(16, 400, 2)
    states = [SamplingState(SamplingParams(do_sample=True, temperature=1.3, top_k=1, seed=i)) for i in range(16)]
    batch = to_batch(states)
    batch.greedy.zero_()  # force the sampling path, which must reach the same answer
    batch.all_greedy = False
    tokens, _, _ = sample(logits.clone(), batch)
    assert torch.equal(tokens, logits.argmax(-1))


def test_tiny_top_p_is_greedy():
    logits = random_logits(16, 400, 3)
    params = [SamplingParams(do_sample=True, temperature=0.8, top_p=1e-6, seed=i) for i in range(16)]
    tokens, logprobs = run(logits, params)
    assert torch.equal(tokens, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)  # raw: before temperature
    torch.testing.assert_close(logprobs, expected)


def chi_square(tokens, expected_probs):
    n = tokens.numel()
    observed = torch.bincount(tokens, minlength=expected_probs.numel()).double()
    support = expected_probs > 0
    assert observed[~support].sum() == 0, "drew a token outside the allowed set"
    expected = expected_probs[support].double() * n
    return float(((observed[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def renormalised(probs, keep):
    probs = probs * keep
    return probs / probs.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, -1, 1.0), (0.5, 3, 1.0), (1.0, -1, 0.7)])
def test_draws_follow_the_filtered_softmax(temperature, top_k, top_p):
    logits = torch.tensor([2.0, 1.5, 0.3, -0.5, 1.0, -2.0])
    probs = torch.softmax(logits / temperature, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros(6, dtype=torch.bool)
    if top_k > 0:
        keep[order[:top_k]] = True
    else:
        sorted_probs = probs[order]
        keep[order[(sorted_probs.cumsum(0) - sorted_probs) < top_p]] = True
    expected = renormalised(probs, keep)
    draws = 20000
    params = [SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, seed=s)
              for s in range(draws)]
    tokens, _ = run(logits.expand(draws, 6), params)
    stat, dof = chi_square(tokens, expected)
    # chi-square with dof <= 5: P(stat > 30) < 2e-5
    assert stat < 30, (stat, dof, torch.bincount(tokens, minlength=6) / draws, expected)


def penalised_python(logits, counts, presence, frequency, repetition):
    out = logits.clone()
    for token, count in counts.items():
        value = out[token].item()
        value = value / repetition if value > 0 else value * repetition
        out[token] = value - frequency * count - presence * (1 if count > 0 else 0)
    return out


def test_penalties_match_direct_computation():
    vocab = 50
    logits = random_logits(3, vocab, 4)
    history = [[3, 3, 7, 10, 3], [], [0, 49, 49, 12]]
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3),
              SamplingParams(),
              SamplingParams(presence_penalty=-0.5, repetition_penalty=0.8)]
    states = [SamplingState(p) for p in params]
    for state, tokens in zip(states, history):
        for t in tokens:
            state.record(t)
    penalised = logits.clone()
    tokens, logprobs, _ = sample(penalised, to_batch(states))
    expected = torch.stack([penalised_python(logits[b], states[b].output_counts, p.presence_penalty,
                                             p.frequency_penalty, p.repetition_penalty)
                            for b, p in enumerate(params)])
    torch.testing.assert_close(penalised, expected)
    assert torch.equal(tokens, expected.argmax(-1))
    # logprobs are of the raw logits, before the penalties
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1))
    assert not torch.equal(expected[0], logits[0]) and torch.equal(expected[1], logits[1])


def test_no_penalty_inputs_when_unused():
    ints, floats = host_lists([SamplingState(SamplingParams(do_sample=True, seed=3))])
    assert "penalty_ids" not in ints and "presence" not in floats
    state = SamplingState(SamplingParams())
    state.record(5)
    assert state.output_counts == {}  # counts are kept only for requests with penalties


def test_huge_seeds_fit_int64():
    ints, _ = host_lists([SamplingState(SamplingParams(seed=2**64 - 1)), SamplingState(SamplingParams(seed=2**63))])
    assert ints["seeds"] == [-1, -(2**63)]
    assert math.isfinite(run(random_logits(1, 10, 5), [SamplingParams(do_sample=True, seed=2**64 - 1)])[1].item())


def sample_full(logits, params_list, steps=None, eos=()):
    states = [SamplingState(p, generated=s) for p, s in zip(params_list, steps or [0] * len(params_list))]
    ints, floats = host_lists(states, eos)
    tensors = {k: torch.tensor(v, dtype=torch.int64) for k, v in ints.items()}
    tensors.update({k: torch.tensor(v, dtype=torch.float32) for k, v in floats.items()})
    batch = SamplingBatch.from_tensors(tensors, all_greedy=all(p.greedy for p in params_list),
                                       top_logprobs=max(p.top_logprobs for p in params_list))
    return sample(logits.clone(), batch)


def test_a_filtered_draw_in_blocks_of_rows_draws_what_the_whole_batch_draws(monkeypatch):
    """The filtered draw takes its rows DRAW_LOGITS_BYTES of logits at a time (3 rows here, the
    last block short), and every row draws the token the whole batch draws: temperature, top-k,
    top-p, min-p, seed and step differ from row to row, one row greedy."""
    from lightllm.engine import sampling

    vocab = 400
    logits = random_logits(11, vocab, 21)
    params = [SamplingParams(do_sample=i != 4, temperature=0.5 + 0.2 * i, top_k=(0, 5, 50)[i % 3],
                             top_p=(1.0, 0.9, 0.6)[i % 3], min_p=0.05 if i % 4 == 1 else 0.0, seed=100 + i)
              for i in range(11)]
    steps = list(range(3, 14))
    whole = sample_full(logits, params, steps)[0]
    blocks = []
    draw = sampling._sample_filtered
    monkeypatch.setattr(sampling, "DRAW_LOGITS_BYTES", 3 * 4 * vocab)
    monkeypatch.setattr(sampling, "_sample_filtered", lambda scaled, batch: blocks.append(len(scaled)) or draw(scaled, batch))
    assert torch.equal(sample_full(logits, params, steps)[0], whole)
    assert blocks == [3, 3, 3, 2]


def test_top_logprobs_are_the_raw_top_k_sorted_and_hold_the_chosen_token():
    logits = random_logits(6, 300, 11)
    params = [SamplingParams(top_logprobs=k, do_sample=bool(k % 2), temperature=0.7, seed=k,
                             repetition_penalty=1.2 if k == 3 else 1.0) for k in (1, 2, 3, 5, 20, 0)]
    tokens, logprobs, (top_ids, top_lps, ranks) = sample_full(logits, params)
    raw = torch.log_softmax(logits, -1)
    # each sampled token's rank: the tokens at least as likely (vLLM's), itself included
    assert ranks.tolist() == [int((raw[b] >= raw[b, t]).sum()) for b, t in enumerate(tokens.tolist())]
    assert ranks.max() > 1  # the draws leave the top 1
    assert top_ids.shape == (6, 20)
    torch.testing.assert_close(top_lps, raw.gather(1, top_ids))
    assert torch.all(top_lps[:, :-1] >= top_lps[:, 1:])  # sorted, most likely first
    torch.testing.assert_close(top_lps[:, 0], raw.max(-1).values)
    torch.testing.assert_close(logprobs, raw.gather(1, tokens[:, None]).squeeze(1))
    for b, p in enumerate(params):
        if p.greedy and p.top_logprobs:
            assert top_ids[b, 0] == tokens[b]


def test_logit_bias_moves_the_choice_and_not_the_logprob():
    logits = random_logits(2, 100, 12)
    target = int(logits[0].argmin())
    params = [SamplingParams(logit_bias={target: 100.0}), SamplingParams(logit_bias={int(logits[1].argmax()): -100.0})]
    tokens, logprobs, _ = sample_full(logits, params)
    assert tokens[0] == target
    assert tokens[1] == logits[1].topk(2).indices[1]
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1))


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = random_logits(3, 50, 13)
    logits[:, 7] = 50.0  # the EOS id below: the most likely token by far
    logits[:, 9] = 40.0  # a stop token id
    params = [SamplingParams(min_tokens=2, stop_token_ids=[9])] * 2 + [SamplingParams(min_tokens=2, ignore_eos=True)]
    tokens, _, _ = sample_full(logits, params, steps=[1, 2, 0], eos=(7,))
    assert tokens[0] not in (7, 9)  # one token generated: both banned
    assert tokens[1] == 7  # two generated: free again
    assert tokens[2] == 7  # ignore_eos: EOS ends nothing, so it is not banned


def test_allowed_token_ids_keep_only_their_tokens_and_not_the_logprobs():
    """A greedy row takes the likeliest of its allowed tokens, a sampled row draws only among them
    in their renormalised proportions, rows without the field are untouched, and every logprob is
    still of the raw logits."""
    vocab, draws = 60, 600
    logits = random_logits(1, vocab, 14).repeat(3, 1)
    allowed = [int(t) for t in logits[0].topk(20).indices[[3, 9, 17]]]  # none the likeliest
    params = [SamplingParams(allowed_token_ids=allowed), SamplingParams(),
              SamplingParams(do_sample=True, seed=2, allowed_token_ids=allowed)]
    tokens, logprobs, _ = sample_full(logits, params)
    assert tokens[0] == allowed[0] and tokens[1] == logits[1].argmax()
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1))
    drawn = []
    for seed in range(draws):
        params = [SamplingParams(), SamplingParams(do_sample=True, seed=seed, allowed_token_ids=allowed)]
        drawn.append(int(sample_full(logits[:2], params)[0][1]))
    assert set(drawn) <= set(allowed)
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[allowed] = True
    expected = renormalised(torch.softmax(logits[0], -1), keep)
    statistic, dof = chi_square(torch.tensor(drawn), expected)
    assert dof == 2 and statistic < 13.8  # p = 0.001


def test_bad_words_ban_a_last_token_only_where_the_rest_ends_the_output():
    """A one-token word is banned at every step; a longer one's last token only where the output so
    far ends with its other tokens, read from the tokens recorded (a request with such a word waits
    for them, as with penalties)."""
    logits = random_logits(1, 30, 15)
    logits[0, 9], logits[0, 5] = 40.0, 30.0  # 9 the likeliest, then 5
    params = SamplingParams(bad_words_ids=[(5,), (7, 8, 9)])
    state = SamplingState(params)
    assert state.needs_tokens and params.depends_on_tokens and params.bad_word_context == 2

    def chosen() -> int:
        return int(sample(logits.clone(), to_batch([state]))[0][0])

    got = []
    for token in (7, 8, 3, 8, 7, 8):
        got.append(chosen())
        state.record(token)
    got.append(chosen())
    third = int(logits[0].topk(3).indices[2])  # the likeliest after 9 and 5
    assert got == [9, 9, third, 9, 9, 9, third]  # 9 banned right after 7 8 (steps 2 and 6), 5 always
    single = SamplingState(SamplingParams(bad_words_ids=[(5,)]))
    assert not single.needs_tokens and not single.params.depends_on_tokens  # speculation stays on


class SpaceTokenizer:
    """A SentencePiece-like tokenizer: a leading space is a token of its own ("▁", id 1); words are
    one token each, "lamp" 50 and "red" 51, and a word after a space is the same token."""

    words = {"lamp": 50, "red": 51}

    def encode(self, text, add_special_tokens=False):
        ids = [1] if text.startswith(" ") else []
        return ids + [self.words[w] for w in text.split()]

    def decode(self, ids):
        return " ".join("" if i == 1 else next(w for w, j in self.words.items() if j == i) for i in ids) or " "


def test_bad_words_never_ban_a_lone_space():
    """A word's mid-text form drops a leading token that is only a space: banning that would ban
    every space. Repeats, leading spaces and a word whose two forms are one sequence come once."""
    from lightllm.frontend.tokenizer import bad_words_of

    assert bad_words_of(SpaceTokenizer(), ["lamp", " lamp", "red lamp"]) == [(50,), (51, 50)]


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_keeps_only_tokens_that_likely(min_p):
    vocab, draws = 40, 400
    logits = random_logits(1, vocab, 14).expand(draws, vocab).contiguous()
    params = [SamplingParams(do_sample=True, min_p=min_p, seed=s) for s in range(draws)]
    tokens, _, _ = sample_full(logits, params)
    probs = torch.softmax(logits[0], -1)
    allowed = probs >= min_p * probs.max()
    assert allowed[tokens].all()
    assert len(set(tokens.tolist())) > 1 or allowed.sum() == 1


def test_prompt_logprobs_are_the_log_softmax_at_the_next_tokens():
    from lightllm.engine.sampling import prompt_logprobs

    logits = random_logits(5, 60, 15)
    targets = torch.tensor([3, 59, 0, 7, 7])
    logits[1, 5] = logits[1, 59]  # a tie: both count as at least as likely as either
    chosen, ranks, (ids, values) = prompt_logprobs(logits, targets, 4)
    raw = torch.log_softmax(logits, -1)
    torch.testing.assert_close(chosen, raw.gather(1, targets[:, None]).squeeze(1))
    torch.testing.assert_close(values, raw.topk(4).values)
    places = raw.argsort(-1, descending=True).argsort(-1) + 1  # each token's place, most likely first
    tied = max(places[1, 5], places[1, 59]).item()  # the later place of the two tied tokens
    expected = [tied if i == 1 else places[i, t].item() for i, t in enumerate(targets.tolist())]
    assert ranks.tolist() == expected
    assert prompt_logprobs(logits, targets, 0)[2] is None


def test_every_uploaded_view_starts_on_16_bytes_and_holds_its_list():
    """A step's metadata goes up in one buffer; Triton compiles a kernel per alignment of its
    pointer arguments, so every view starts on a 16-byte boundary whatever the lists' lengths
    (the random draw's `steps` followed an odd number of seeds at an 8-byte offset)."""
    from lightllm.engine.batch import upload

    rng = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    for _ in range(20):
        lengths = torch.randint(0, 7, (7,), generator=rng).tolist()
        ints = {f"i{k}": torch.randint(-(1 << 40), 1 << 40, (n,), generator=rng).tolist() for k, n in enumerate(lengths[:4])}
        floats = {f"f{k}": torch.randn(n, generator=rng).tolist() for k, n in enumerate(lengths[4:])}
        views = upload(ints, floats, torch.device("cpu"))
        assert all(view.data_ptr() % 16 == 0 for view in views.values()), lengths
        assert all(views[name].tolist() == values for name, values in ints.items())
        for name, values in floats.items():
            assert views[name].dtype == torch.float32
            torch.testing.assert_close(views[name], torch.tensor(values, dtype=torch.float32))


@pytest.mark.parametrize("typical_p", [0.2, 0.5, 0.9, 0.99])
def test_typical_p_keeps_transformers_typical_set(typical_p):
    """typical_p (TGI's) against transformers' TypicalLogitsWarper after the temperature: the same
    tokens kept with the same renormalised probabilities; a row at 1.0 in the same batch keeps
    every token, and the draws fall inside the set."""
    from transformers import TemperatureLogitsWarper, TypicalLogitsWarper

    from lightllm.engine.sampling import filtered_probs

    vocab, temperature = 300, 0.8
    logits = random_logits(6, vocab, 31)
    params = [SamplingParams(do_sample=True, temperature=temperature, typical_p=typical_p if i % 3 else 1.0,
                             seed=i) for i in range(6)]
    batch = to_batch([SamplingState(p) for p in params])
    probs, order = filtered_probs(logits / temperature, batch)
    ours = torch.zeros_like(probs).scatter_(1, order, probs)
    ours /= ours.sum(-1, keepdim=True)
    for i, p in enumerate(params):
        scores = TemperatureLogitsWarper(temperature)(None, logits[i: i + 1])
        if p.typical_p < 1.0:
            scores = TypicalLogitsWarper(p.typical_p)(None, scores)
        expected = torch.softmax(scores, -1)[0]
        assert torch.equal(ours[i] > 0, expected > 0), (i, int((ours[i] > 0).sum()), int((expected > 0).sum()))
        assert torch.allclose(ours[i], expected, atol=1e-6), i
    assert all(int((ours[i] > 0).sum()) == vocab for i in (0, 3))
    assert int((ours[1] > 0).sum()) < vocab
    draws = 300
    rows = [SamplingParams(do_sample=True, temperature=temperature, typical_p=typical_p, seed=s) for s in range(draws)]
    tokens, _, _ = sample_full(logits[1:2].expand(draws, vocab).contiguous(), rows)
    assert (ours[1][tokens] > 0).all()
    assert len(set(tokens.tolist())) > 1 or int((ours[1] > 0).sum()) == 1
