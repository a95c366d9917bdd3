"""TGI's watermark: the green lists the sampler favours, the score that finds them again, and the
whole path through the server on the default model's real weights: a watermarked answer scores
far above chance, an unwatermarked one near it."""

import math

import pytest
import torch

from lightllm.engine import watermark
from lightllm.engine.request import SamplingParams
from lightllm.engine.sampling import SamplingBatch, SamplingState, host_lists, sample
from lightllm.engine.watermark import GAMMA, apply_watermark_, green_mask, score
from lightllm.kernels.random_uniform import random_uniform_ref

VOCAB = 300


def test_green_lists_are_the_hash_of_the_token_before_and_gamma_of_the_vocabulary():
    prev = torch.tensor([0, 7, 7, 123])
    green = green_mask(prev, VOCAB, 0.25)
    expected = random_uniform_ref(prev * watermark.HASH_KEY, torch.zeros_like(prev), VOCAB) < 0.25
    assert torch.equal(green, expected)
    assert torch.equal(green[1], green[2]) and not torch.equal(green[0], green[1])
    assert abs(green.float().mean().item() - 0.25) < 0.05
    # a column's hash is its own: a wider vocabulary keeps the same list in front
    assert torch.equal(green_mask(prev, 2 * VOCAB, 0.25)[:, :VOCAB], green)


@pytest.mark.parametrize("block_rows", [None, 2])  # one block, or blocks of two rows
def test_the_watermark_adds_delta_to_the_green_tokens_of_its_rows_alone(monkeypatch, block_rows):
    if block_rows:
        monkeypatch.setattr(watermark, "BLOCK_BYTES", block_rows * 4 * VOCAB)
    logits = torch.randn(6, VOCAB)
    before = logits.clone()
    rows, prev = torch.tensor([4, 0, 2, 5, 1]), torch.tensor([9, 3, 9, 0, 42])
    apply_watermark_(logits, rows, prev, 0.5, 2.0)
    for row, p in zip(rows.tolist(), prev.tolist()):
        green = green_mask(torch.tensor([p]), VOCAB, 0.5)[0]
        assert torch.allclose(logits[row], before[row] + 2.0 * green.float())
    assert torch.equal(logits[3], before[3])


def test_the_sampler_follows_each_rows_token_before_from_the_device():
    """A decode row's token before is its request's last sampled token (the runner's last_token,
    on the device: host_lists gives -1); a prompt's first row gives the prompt's last token. With
    flat logits, greedy picks the first green token after it."""
    states = [SamplingState(SamplingParams(watermark=True)), SamplingState(SamplingParams()),
              SamplingState(SamplingParams(watermark=True))]
    ints, floats = host_lists(states, prev=lambda: [-1, -1, 77])
    assert ints["watermark_rows"] == [0, 2] and ints["watermark_prev"] == [-1, 77]
    t = {k: torch.tensor(v) for k, v in {**ints, **floats}.items()}
    t["sample_rows"] = torch.tensor([3, 1, 0])  # request rows
    last_token = torch.tensor([5, 6, 7, 31])
    batch = SamplingBatch.from_tensors(t, all_greedy=True, last_token=last_token, watermark=(GAMMA, 2.0))
    tokens, logprobs, _ = sample(torch.zeros(3, VOCAB), batch)
    first_green = green_mask(torch.tensor([31, 77]), VOCAB, GAMMA).int().argmax(-1)
    assert tokens[0] == first_green[0] and tokens[2] == first_green[1] and tokens[1] == 0
    assert torch.allclose(logprobs, torch.full((3,), -math.log(VOCAB)))  # of the raw logits, as always


def test_a_text_of_green_tokens_scores_high_and_a_random_one_near_zero():
    text = [1]
    for _ in range(60):  # each token the first green one after the last
        text.append(int(green_mask(torch.tensor([text[-1]]), VOCAB, GAMMA)[0].int().argmax()))
    marked = score(text)
    assert (marked.scored, marked.green) == (60, 60)
    assert math.isclose(marked.z, (60 - 30) / math.sqrt(60 * 0.25))
    noise = score(torch.randint(VOCAB, (2000,), generator=torch.Generator().manual_seed(0)).tolist())
    assert noise.scored == 1999 and abs(noise.z) < 4
    assert score([5]).scored == 0


def test_watermarked_answers_score_as_watermarked(default_server, default_model_dir):
    """The default model's real weights, sampled: with "watermark": true every answer's z-score is
    past 4, without it below; the score of the text (through the tokenizer, as a client would)
    says the same."""
    import json
    import subprocess
    import sys

    def answer(mark: bool, seed: int) -> tuple[list[int], str]:
        response = default_server.post("/generate", {"inputs": "Write a short story about a lighthouse keeper.",
                                                     "parameters": {"max_new_tokens": 120, "do_sample": True,
                                                                    "seed": seed, "watermark": mark, "ignore_eos": True,
                                                                    "details": True}})
        assert response.status_code == 200, response.text
        body = response.json()
        return [t["id"] for t in body["details"]["tokens"]], body["generated_text"][0]

    for seed in (1, 2):
        ids, text = answer(True, seed)
        plain_ids, _ = answer(False, seed)
        assert score(ids).z > 4, score(ids)
        assert score(plain_ids).z < 4, score(plain_ids)
    tool = subprocess.run([sys.executable, "-m", "lightllm.tools.watermark", "--model_dir", str(default_model_dir),
                           text], capture_output=True, text=True, check=True)
    assert json.loads(tool.stdout)["z"] > 4, tool.stdout


def test_each_row_follows_its_own_token_before_through_the_runner(tmp_path, monkeypatch):
    """Through the model runner: a prompt's first token follows the prompt's last token; a decode's
    follows the token its request sampled last (the device's); a request without the watermark
    has no row. What the sampler is handed is recorded, then the tokens are checked against it."""
    from helpers.models import make_model, make_runner

    from lightllm.engine import model_runner
    from lightllm.engine.plan import Chunk, StepPlan

    make_model("llama_gqa_llama3_rope", tmp_path)
    runner = make_runner(tmp_path, tokens=256, max_req_total_len=64)
    seen = []

    def recording(logits, batch):
        seen.append(None if batch.watermark is None else (batch.watermark[0].tolist(), batch.watermark[1].tolist()))
        return sample(logits, batch)

    monkeypatch.setattr(model_runner, "sample", recording)
    marked, plain = SamplingParams(watermark=True), SamplingParams()
    (first,) = runner.step(StepPlan(1, [], [Chunk(0, [5, 6, 7], 0, True, marked), Chunk(1, [9, 8], 0, True, plain)],
                                    sync=True))
    (second,) = runner.step(StepPlan(2, [0, 1], sync=True))
    (third,) = runner.step(StepPlan(3, [1, 0], sync=True))
    tokens = [{t.req_id: t.token_id for t in result.tokens} for result in (first, second, third)]
    assert seen == [([0], [7]), ([0], [tokens[0][0]]), ([1], [tokens[1][0]])]
