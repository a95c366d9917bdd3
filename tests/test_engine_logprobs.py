"""Log probabilities, stop token ids and min_tokens through the engine core (scheduler + runner in
process) against transformers on the same weights, in fp32: generated tokens' logprobs and their
top k, and prompt logprobs over several chunks, with and without the prefix cache holding the prompt.
Relies on transformers' Llama modeling code (rotary with llama3 scaling) as the oracle of the logits."""

import pytest
import torch
from helpers.models import assert_idle, assert_rank, engine, make_model, make_runner, random_prompts

from lightllm.engine.request import FinishReason, GenerateReq, SamplingParams

TOL = 1e-3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("logprobs")
    hf_model = make_model("llama_gqa_llama3_rope", path)
    hf_model.generation_config.eos_token_id = None
    return hf_model, make_runner(path, tokens=512)


def run(core, requests) -> dict[int, list]:
    outs: dict[int, list] = {}
    for req_id, prompt, params in requests:
        core.add(GenerateReq(req_id, prompt, params))
    for out in core.drain():
        outs.setdefault(out.req_id, []).append(out)
    return outs


def hf_log_softmax(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)


def test_generated_logprobs_and_top_k_equal_transformers(model):
    hf_model, runner = model
    core = engine(runner, chunk=7)
    prompts = random_prompts(3, lengths=(20, 9), vocab=hf_model.config.vocab_size)
    params = [SamplingParams(max_new_tokens=6, top_logprobs=5),
              SamplingParams(max_new_tokens=6, top_logprobs=2, do_sample=True, temperature=0.8, seed=5,
                             repetition_penalty=1.3)]
    outs = run(core, [(i, p, params[i]) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        tokens = [o.token_id for o in outs[i]]
        expected = hf_log_softmax(hf_model, prompt + tokens)[len(prompt) - 1: -1]
        for step, out in enumerate(outs[i]):
            # the raw model's logprob, before temperature and penalties
            assert abs(out.logprob - expected[step, out.token_id].item()) < TOL
            top = out.top_logprobs
            assert len(top) == params[i].top_logprobs
            assert [t for t, _ in top] == expected[step].topk(len(top)).indices.tolist()
            assert all(abs(lp - expected[step, t].item()) < TOL for t, lp in top)
            assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))
            if params[i].greedy:
                assert top[0][0] == out.token_id
    assert_idle(core)


@pytest.mark.parametrize("cached_first", [False, True])
def test_prompt_logprobs_over_chunks_equal_transformers(model, cached_first):
    hf_model, runner = model
    core = engine(runner, chunk=7)
    (prompt,) = random_prompts(4, lengths=(30,), vocab=hf_model.config.vocab_size)
    if cached_first:  # the prefix cache holds the prompt: a request for prompt logprobs still computes it all
        run(core, [(0, prompt, SamplingParams(max_new_tokens=2))])
        assert core.scheduler.cached_tokens >= len(prompt) - 1
    params = SamplingParams(max_new_tokens=2, prompt_logprobs=3)
    (first, _) = run(core, [(1, prompt, params)])[1]
    assert first.cached_tokens == 0
    expected = hf_log_softmax(hf_model, prompt)
    got = first.prompt_logprobs
    assert len(got) == len(prompt) - 1
    for pos, (logprob, rank, top) in enumerate(got):
        assert abs(logprob - expected[pos, prompt[pos + 1]].item()) < TOL
        assert_rank(rank, expected[pos], prompt[pos + 1], TOL)
        assert [t for t, _ in top] == expected[pos].topk(3).indices.tolist()
    assert max(rank for _, rank, _ in got) > 3  # ranks are counted outside the top k too
    assert_idle(core)


def test_prompt_logprobs_reach_the_head_a_slice_at_a_time(model, monkeypatch):
    """A step's prompt-logprob rows are scored PROMPT_LOGITS_BYTES of logits at a time (3 rows here,
    and a chunk's 11 rows end inside a slice, the next request's chunk in the same step), never
    whole, and give the logprobs transformers gives."""
    from lightllm.engine import sampling

    hf_model, runner = model
    vocab = hf_model.config.vocab_size
    monkeypatch.setattr(sampling, "PROMPT_LOGITS_BYTES", 3 * 4 * vocab)
    head, scored = runner.model.lm_head, []
    score = head.logits
    monkeypatch.setattr(head, "logits", lambda h: scored.append(h.shape[0]) or score(h))
    core = engine(runner, chunk=16)
    prompts = random_prompts(6, lengths=(12, 11), vocab=vocab)
    outs = run(core, [(i, p, SamplingParams(max_new_tokens=2, prompt_logprobs=2)) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        expected = hf_log_softmax(hf_model, prompt)
        got = outs[i][0].prompt_logprobs
        assert len(got) == len(prompt) - 1
        for pos, (logprob, rank, top) in enumerate(got):
            assert abs(logprob - expected[pos, prompt[pos + 1]].item()) < TOL
            assert_rank(rank, expected[pos], prompt[pos + 1], TOL)
            assert [t for t, _ in top] == expected[pos].topk(2).indices.tolist()
    assert max(scored) == 3 and sum(scored) >= sum(len(p) - 1 for p in prompts)
    assert head.deferred is None and head.defer_rows == 0
    assert_idle(core)


def test_stop_token_ids_and_min_tokens(model):
    hf_model, runner = model
    core = engine(runner, chunk=64)
    (prompt,) = random_prompts(6, lengths=(12,), vocab=hf_model.config.vocab_size)
    greedy = [o.token_id for o in run(core, [(0, prompt, SamplingParams(max_new_tokens=8))])[0]]
    stop = greedy[3]
    first_at = greedy.index(stop)
    outs = run(core, [(1, prompt, SamplingParams(max_new_tokens=8, stop_token_ids=[stop]))])[1]
    assert [o.token_id for o in outs] == greedy[: first_at + 1]
    assert outs[-1].finish_reason is FinishReason.STOP
    # min_tokens past the stop token: it cannot be sampled before, so the text differs there
    outs = run(core, [(2, prompt, SamplingParams(max_new_tokens=8, stop_token_ids=[stop], min_tokens=first_at + 1))])[2]
    assert len(outs) > first_at + 1 or outs[-1].finish_reason is not FinishReason.STOP
    assert outs[first_at].token_id != stop
    assert_idle(core)


def test_prompt_logprobs_of_a_one_token_prompt_and_a_one_token_last_chunk(model):
    hf_model, runner = model
    core = engine(runner, chunk=4)
    prompts = random_prompts(7, lengths=(1, 5), vocab=hf_model.config.vocab_size)
    outs = run(core, [(i, p, SamplingParams(max_new_tokens=2, prompt_logprobs=1)) for i, p in enumerate(prompts)])
    assert outs[0][0].prompt_logprobs == ()
    expected = hf_log_softmax(hf_model, prompts[1])
    got = outs[1][0].prompt_logprobs
    assert len(got) == 4
    assert all(abs(lp - expected[p, prompts[1][p + 1]].item()) < TOL for p, (lp, _, _) in enumerate(got))
    assert_idle(core)
