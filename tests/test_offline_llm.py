"""The offline API (lightllm/llm.py) on the default model, one LLM for the module: greedy
generate equals transformers' greedy decoding on the same weights; n choices follow their seeds;
a batch of mixed parameters gives what each prompt gives alone; a near-zero temperature is greedy;
stop strings, chat, errors;
and afterwards the engine holds nothing.
Relies on transformers' Llama modeling code, greedy `generate` and tokenizer (encode, decode, chat template) as the oracle."""

import dataclasses
import json
import re
import subprocess
import sys

import pytest
import torch
from helpers.models import assert_rank
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightllm import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
LOGPROB_ATOL = 2e-3  # fp32 both; our attention sums in another order than transformers'


@pytest.fixture(scope="module")
def llm(default_model_dir):
    # a chunk budget of the longest prompt accepted: the start's profile step is 256 prompt tokens, not 2048
    with LLM(default_model_dir, max_total_token_num=4096, max_req_input_len=256, max_req_total_len=512,
             running_max_req_size=8, chunked_prefill_size=256) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf(default_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32, local_files_only=True)
    return tokenizer, model.eval()


def hf_greedy(hf, prompt_ids: list[int], new_tokens: int) -> list[int]:
    _, model = hf
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' raw logits: row i is the distribution of token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf[1](torch.tensor([ids])).logits[0].float(), -1)


def assert_idle(llm: LLM) -> None:
    """No request waits, runs or holds a KV slot; flushing the prefix cache frees every slot."""
    engine, runner = llm.engine, llm.engine._workers
    assert not engine.has_work and engine.scheduler.tokens_used == 0
    assert runner.stats()["running_requests"] == 0
    engine.scheduler.flush_cache()
    engine.drain()
    assert runner.stats()["tokens_used"] == 0


def texts(output) -> list[str]:
    return [c.text for c in output.outputs]


def test_greedy_equals_transformers(llm, hf):
    tokenizer, _ = hf
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    for prompt, output in zip(PROMPTS, outputs):
        assert output.prompt_token_ids == tokenizer.encode(prompt)
        expected = hf_greedy(hf, output.prompt_token_ids, NEW_TOKENS)
        (choice,) = output.outputs
        assert choice.token_ids == expected
        assert choice.text == tokenizer.decode(expected, skip_special_tokens=True)
        ended_by_eos = expected[-1] == tokenizer.eos_token_id
        assert choice.finish_reason == ("stop" if ended_by_eos else "length") and choice.stop_reason is None
        assert output.finished and choice.logprobs is None and output.prompt_logprobs is None
        rows = hf_logprobs(hf, output.prompt_token_ids + expected)[len(output.prompt_token_ids) - 1:]
        want = rows[torch.arange(len(expected)), expected].sum().item()
        assert choice.cumulative_logprob == pytest.approx(want, abs=LOGPROB_ATOL * len(expected))
    assert_idle(llm)


def test_token_id_prompts_and_dicts_equal_text_prompts(llm):
    ids = llm.tokenizer.encode(PROMPTS[0])
    by_text, by_ids, by_dict = llm.generate([PROMPTS[0], ids, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert by_ids.prompt is None and by_ids.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == by_dict.outputs[0].token_ids


def test_n_greedy_choices_are_identical(llm):
    (output,) = llm.generate(PROMPTS[1], SamplingParams(n=3, temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in output.outputs}) == 1
    alone = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0]
    assert output.outputs[0].token_ids == alone.token_ids


def test_n_seeded_choices_differ_and_follow_the_seed(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=NEW_TOKENS, ignore_eos=True)
    (first,) = llm.generate(PROMPTS[2], params, use_tqdm=False)
    (again,) = llm.generate(PROMPTS[2], params, use_tqdm=False)
    assert len(set(texts(first))) == 3
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]
    assert all(len(c.token_ids) == NEW_TOKENS and c.finish_reason == "length" for c in first.outputs)
    # choice i is the request with seed + i
    single = dataclasses.replace(params, n=1, seed=1235)
    assert llm.generate(PROMPTS[2], single, use_tqdm=False)[0].outputs[0].token_ids == first.outputs[1].token_ids
    other = llm.generate(PROMPTS[2], dataclasses.replace(params, seed=99), use_tqdm=False)[0]
    assert texts(other) != texts(first)


def test_tiny_temperature_is_greedy(llm):
    """test_greedy_rule's check of the offline path, on this module's LLM (one default-model load
    fewer): a temperature under GREEDY_TEMPERATURE, 1e-38 too, gives temperature 0's text."""
    from test_greedy_rule import MAX_TOKENS, PROMPT, TINY

    texts = [llm.generate(PROMPT, SamplingParams(temperature=t, max_tokens=MAX_TOKENS, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].text for t in (0.0, *TINY)]
    assert texts[0].strip() and texts[1:] == [texts[0]] * len(TINY)


def test_mixed_batch_equals_each_prompt_alone(llm):
    params = [SamplingParams(temperature=0, max_tokens=5),
              SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=7, repetition_penalty=1.3, presence_penalty=0.5)]
    batch = llm.generate(PROMPTS, params, use_tqdm=False)
    alone = [llm.generate(p, sp, use_tqdm=False)[0] for p, sp in zip(PROMPTS, params)]
    assert [o.prompt for o in batch] == PROMPTS
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in alone]
    assert len(batch[1].outputs[0].token_ids) == 9
    assert all(len(o.outputs[0].token_ids) <= sp.max_tokens for o, sp in zip(batch, params))
    assert_idle(llm)


@pytest.fixture(scope="module")
def full(llm):
    """PROMPTS[1] continued greedily for 16 tokens."""
    output = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    return output[0].outputs[0]


def test_stop_string_ends_the_text_before_it(llm, full):
    stop = full.text[len(full.text) // 2:][:3]  # three characters from the middle
    assert stop.strip()
    (output,) = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                        stop=["@@never@@", stop]), use_tqdm=False)
    choice = output.outputs[0]
    assert choice.text == full.text[: full.text.index(stop)]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", stop)
    assert choice.token_ids == full.token_ids[: len(choice.token_ids)] and len(choice.token_ids) < 16
    assert_idle(llm)  # the engine request was aborted when its text hit the stop string
    (kept,) = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop],
                                                      include_stop_str_in_output=True), use_tqdm=False)
    assert kept.outputs[0].text == full.text[: full.text.index(stop) + len(stop)]
    assert (kept.outputs[0].stop_reason, kept.outputs[0].token_ids) == (stop, choice.token_ids)


def test_stop_token_ids_end_with_that_token(llm, full):
    at = next(i for i, t in enumerate(full.token_ids) if i >= 3 and t not in full.token_ids[:i])
    stop_id = full.token_ids[at]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_id])
    choice = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    assert choice.token_ids == full.token_ids[: at + 1]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", stop_id)
    assert choice.text == llm.tokenizer.decode(choice.token_ids, skip_special_tokens=True)


def test_chat_equals_generate_on_the_templated_prompt(llm, hf):
    tokenizer, _ = hf
    conversation = [{"role": "user", "content": "What is 2 + 2?"}]
    (chat,) = llm.chat(conversation, GREEDY, use_tqdm=False)
    templated = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True, return_dict=True)
    assert chat.prompt_token_ids == list(templated["input_ids"])
    (plain,) = llm.generate({"prompt_token_ids": chat.prompt_token_ids}, GREEDY, use_tqdm=False)
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    both = llm.chat([conversation, [{"role": "user", "content": "Hi"}]], GREEDY, use_tqdm=False)
    assert both[0].outputs[0].token_ids == chat.outputs[0].token_ids and len(both) == 2


def test_chat_continues_a_final_message(llm, hf):
    tokenizer, _ = hf
    prefill = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    (chat,) = llm.chat(prefill, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert chat.prompt == tokenizer.apply_chat_template(prefill, tokenize=False, continue_final_message=True)
    assert chat.prompt.endswith("My favourite is")
    with pytest.raises(ValueError, match="needs add_generation_prompt=False"):
        llm.chat(prefill, GREEDY, use_tqdm=False, continue_final_message=True)


def test_structured_output_and_logit_bias_reach_the_engine(llm):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    pattern = r"[0-9]{3}-[0-9]{4}"
    params = [SamplingParams(temperature=0, max_tokens=40, json_schema=schema),
              SamplingParams(temperature=0.7, seed=3, max_tokens=20, regex=pattern),
              SamplingParams(temperature=0, max_tokens=4, logit_bias={42: 100.0})]
    as_json, as_regex, biased = llm.generate(["A person as JSON:", "My phone number is", "Hello"], params,
                                            use_tqdm=False)
    value = json.loads(as_json.outputs[0].text)
    assert isinstance(value["name"], str) and isinstance(value["age"], int)
    assert re.fullmatch(pattern, as_regex.outputs[0].text)
    assert as_json.outputs[0].finish_reason == as_regex.outputs[0].finish_reason == "stop"
    assert biased.outputs[0].token_ids == [42] * 4


def test_allowed_token_ids_greedy_is_transformers_argmax_over_them(llm, hf):
    """Each greedy token is the likeliest of the allowed ones under transformers' logits of the
    text so far (a sentiment label's tokens, none the model's own first choice), its logprob the
    raw one; a sampled choice draws only among them."""
    tokenizer, model = hf
    allowed = sorted({tokenizer.encode(word)[0] for word in (" positive", " negative", " neutral", ".")})
    prompt_ids = tokenizer.encode(PROMPTS[0])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0, allowed_token_ids=allowed)
    (output,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    ids, expected = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(6):
            logits = model(torch.tensor([ids])).logits[0, -1]
            expected.append(allowed[int(logits[allowed].argmax())])
            ids.append(expected[-1])
    choice = output.outputs[0]
    assert choice.token_ids == expected and hf_greedy(hf, prompt_ids, 1)[0] not in allowed
    rows = hf_logprobs(hf, ids)[len(prompt_ids) - 1:]
    for row, token, entry in zip(rows, expected, choice.logprobs):
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=LOGPROB_ATOL)
    sampled = SamplingParams(temperature=1.5, seed=4, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)
    (output,) = llm.generate(PROMPTS[1], sampled, use_tqdm=False)
    assert set(output.outputs[0].token_ids) <= set(allowed) and len(set(output.outputs[0].token_ids)) > 1
    eos = SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=[tokenizer.eos_token_id])
    with pytest.raises(RuntimeError, match="no token could be sampled"):  # min_tokens bans the one allowed
        llm.generate(PROMPTS[1], eos, use_tqdm=False)
    assert_idle(llm)


def test_bad_words_greedy_is_transformers_argmax_without_them(llm, hf):
    """Greedy tokens with bad_words equal transformers' argmax step by step with each word's last
    token banned where the output so far ends with the rest of it; the words' tokens, as the text's
    start or after a space, never appear in the output, though the plain greedy output has them."""
    from lightllm.frontend.tokenizer import bad_words_of

    tokenizer, model = hf
    words = ["Paris", "the capital"]
    plain = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    banned = bad_words_of(tokenizer, words)
    assert [tokenizer.decode(list(ids)) for ids in banned] == ["Paris", " Paris", "the capital", " the capital"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=words)
    (output,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    prompt_ids, out = tokenizer.encode(PROMPTS[0]), []
    with torch.no_grad():
        for _ in range(12):
            logits = model(torch.tensor([prompt_ids + out])).logits[0, -1]
            for ids in banned:
                if tuple(out[len(out) - len(ids) + 1:]) == ids[:-1] and len(ids) - 1 <= len(out):
                    logits[ids[-1]] = float("-inf")
            out.append(int(logits.argmax()))
    assert output.outputs[0].token_ids == out
    has = lambda seq, ids: any(tuple(seq[i: i + len(ids)]) == ids for i in range(len(seq)))
    assert any(has(plain[0].outputs[0].token_ids, ids) for ids in banned)
    assert not any(has(out, ids) for ids in banned)


def test_truncated_prompt_is_its_last_tokens(llm):
    full = llm.tokenizer.encode(PROMPTS[2])
    (cut,) = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=4),
                          use_tqdm=False)
    (alone,) = llm.generate({"prompt_token_ids": full[-4:]}, SamplingParams(temperature=0, max_tokens=6),
                            use_tqdm=False)
    assert cut.prompt_token_ids == full[-4:] and cut.outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_k=-2), dict(n=0),
                                 dict(max_tokens=0), dict(min_p=1.5), dict(stop=[""]), dict(logprobs=-1),
                                 dict(logit_bias={"a": 1.0}), dict(json_schema="{not json"),
                                 dict(json_schema={}, regex="a+"), dict(min_tokens=9, max_tokens=4),
                                 dict(stop_token_ids=[-1]), dict(seed=1.5), dict(allowed_token_ids=[]),
                                 dict(allowed_token_ids=[-3]), dict(truncate_prompt_tokens=0)])
def test_bad_sampling_params_raise_value_error(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**bad)


def test_chat_history_with_tools_reaches_the_prompt(llm, hf):
    """The routes' template application: SmolLM2's template knows no tools, so the definitions and
    the assistant's call are written as text (in Llama 3.1's JSON, the Llama family's default)."""
    tokenizer, _ = hf
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    conversation = [{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                    {"role": "tool", "content": "sunny"}]
    (chat,) = llm.chat(conversation, GREEDY, use_tqdm=False, tools=[tool])
    prompt = tokenizer.decode(chat.prompt_token_ids)
    assert json.dumps(tool) in prompt
    assert '<|im_start|>assistant\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|im_end|>' in prompt
    assert "<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n" in prompt
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        llm.chat(conversation, GREEDY, use_tqdm=False, chat_template_kwargs={"tokenize": True})


def test_bad_requests_raise_before_anything_runs(llm):
    with pytest.raises(ValueError, match="max_req_input_len"):
        llm.generate([PROMPTS[0], [5] * 300], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"\+ max_tokens \(600\) = \d+ is more than max_req_total_len"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=600), use_tqdm=False)  # its own field's name
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 2, llm.model_info["vocab_size"]]], use_tqdm=False)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(PROMPTS, [GREEDY, GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    assert_idle(llm)


def test_priority_orders_admission_under_its_policy(llm, monkeypatch):
    """vLLM's LLM.generate(priority=...): with schedule_policy "priority" (vLLM's name,
    scheduling_policy, is taken too) and one running slot, the prompts start lowest value first,
    each answer as it is alone; under another policy a priority other than 0 is refused."""
    with pytest.raises(ValueError, match="schedule_policy='priority'"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[1, 0, 0])
    with pytest.raises(ValueError, match="2 priorities for 3 prompts"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[0, 0])
    alone = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    monkeypatch.setattr(llm, "config", dataclasses.replace(llm.config, schedule_policy="priority"))
    monkeypatch.setattr(llm.engine.scheduler, "policy", "priority")
    monkeypatch.setattr(llm.engine.scheduler, "max_running", 1)
    started, take = [], llm._take
    monkeypatch.setattr(llm, "_take", lambda out, progress: (out.req_id in started or started.append(out.req_id),
                                                             take(out, progress)))
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[2, -1, 0])
    first = min(started)  # the prompts' request ids are given in prompt order
    assert [i - first for i in started] == [1, 2, 0]
    assert [o.outputs[0].token_ids for o in outputs] == alone
    assert_idle(llm)


def test_vllm_scheduling_policy_name_is_taken(default_model_dir):
    from lightllm.llm import engine_config

    assert engine_config(default_model_dir, scheduling_policy="priority").schedule_policy == "priority"
    with pytest.raises(ValueError, match="schedule_policy"):
        engine_config(default_model_dir, scheduling_policy="urgent")


def test_unknown_settings_and_bad_model_dirs_are_refused(tmp_path):
    with pytest.raises(TypeError, match="chunk_size"):
        LLM(tmp_path, chunk_size=8)
    with pytest.raises(ValueError, match="not a directory"):
        LLM(tmp_path / "missing")


def test_an_engine_failure_raises_and_leaves_the_engine_usable(llm, monkeypatch):
    runner = llm.engine._workers
    real_step, calls = runner.step, []

    def fail_once(plan):
        calls.append(plan.step_id)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return real_step(plan)

    monkeypatch.setattr(runner, "step", fail_once)
    with pytest.raises(RuntimeError, match=r"request \d+ \(choice 0\) failed in the engine: RuntimeError: injected"):
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    monkeypatch.undo()
    assert_idle(llm)
    again = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0]
    assert again.token_ids == llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_import_lightllm_stays_light():
    code = ("import sys, lightllm; assert 'torch' not in sys.modules; "
            "from lightllm import LLM, SamplingParams; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_logprobs_and_prompt_logprobs_equal_transformers(llm, hf):
    k = 3
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=k, prompt_logprobs=k)
    (output,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    choice, prompt_ids = output.outputs[0], output.prompt_token_ids
    rows = hf_logprobs(hf, prompt_ids + choice.token_ids)
    assert len(choice.logprobs) == len(choice.token_ids)
    for j, (token, entry) in enumerate(zip(choice.token_ids, choice.logprobs)):
        check_position(entry, token, rows[len(prompt_ids) - 1 + j], k)
        assert entry[token].rank == 1  # greedy on raw logits: the sampled token is the most likely
        assert entry[token].decoded_token == llm.tokenizer.decode([token])
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt_ids)
    for i in range(1, len(prompt_ids)):
        check_position(output.prompt_logprobs[i], prompt_ids[i], rows[i - 1], k)
    assert max(output.prompt_logprobs[i][prompt_ids[i]].rank for i in range(1, len(prompt_ids))) > k


@pytest.mark.parametrize("k", [1, 0])
def test_sampled_logprobs_are_of_the_raw_logits(llm, hf, k):
    """Hot sampling picks tokens outside the top k: each logprob is transformers' log_softmax of
    the unscaled logits, each sampled token's rank its rank in those (vLLM's Logprob.rank, with
    logprobs=0 too, where the entry holds the sampled token alone), and cumulative_logprob is
    their sum."""
    params = SamplingParams(temperature=1.8, seed=5, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=k)
    (output,) = llm.generate(PROMPTS[2], params, use_tqdm=False)
    choice, prompt_ids = output.outputs[0], output.prompt_token_ids
    rows = hf_logprobs(hf, prompt_ids + choice.token_ids)[len(prompt_ids) - 1:]
    for j, (token, entry) in enumerate(zip(choice.token_ids, choice.logprobs)):
        check_position(entry, token, rows[j], k)
    assert max(entry[token].rank for token, entry in zip(choice.token_ids, choice.logprobs)) > max(k, 1)
    assert choice.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(choice.token_ids, choice.logprobs)))


def check_position(entry: dict, token: int, row: torch.Tensor, k: int) -> None:
    """`entry` holds `token` first, then transformers' top k in order, with their logprobs; `token`
    has its rank over the whole vocabulary."""
    top = row.topk(k)
    assert list(entry)[0] == token
    ranked = {t: lp for t, lp in entry.items() if lp.rank is not None and lp.rank <= k}
    assert [t for t, lp in sorted(ranked.items(), key=lambda item: item[1].rank)] == top.indices.tolist()
    assert set(entry) - {token} <= set(top.indices.tolist())
    for t, lp in entry.items():
        assert lp.logprob == pytest.approx(row[t].item(), abs=LOGPROB_ATOL)
    assert_rank(entry[token].rank, row, token, LOGPROB_ATOL)
