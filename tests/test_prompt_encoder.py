"""The HTTP process's prompt encoder (lightllm/server/httpserver/prompt_encoder.py): prompts
encoded together, in batches, on one thread, give exactly what the tokenizer gives each alone.
The oracle: the default model's tokenizer's own encode, one prompt at a time."""

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from lightllm.server.httpserver.prompt_encoder import PromptEncoder


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)


TEXTS = st.lists(st.tuples(st.text(max_size=60), st.booleans()), min_size=1, max_size=40)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=TEXTS, max_batch=st.integers(1, 8))
def test_concurrent_prompts_encode_as_each_alone(tokenizer, items, max_batch):
    encoder = PromptEncoder(tokenizer, max_batch=max_batch)

    async def all_at_once():
        return await asyncio.gather(*(encoder.encode(text, add_special_tokens=flag) for text, flag in items))

    got = asyncio.run(all_at_once())
    assert got == [tokenizer.encode(text, add_special_tokens=flag) for text, flag in items]


class Fussy:
    """A fast tokenizer's shape, whose batch call fails if any prompt says "boom"; encode then fails for that one."""

    is_fast = True

    def __init__(self):
        self.batch_calls = 0

    def encode(self, text, add_special_tokens=True):
        if "boom" in text:
            raise ValueError("cannot encode boom")
        return [7] * add_special_tokens + [len(text)]

    def __call__(self, texts, add_special_tokens=True):
        self.batch_calls += 1
        return {"input_ids": [self.encode(t, add_special_tokens) for t in texts]}


def test_one_bad_prompt_fails_alone_and_a_cancelled_wait_harms_nobody():
    fussy = Fussy()
    encoder = PromptEncoder(fussy)

    async def scenario():
        gone = asyncio.ensure_future(encoder.encode("client went away"))
        gone.cancel()
        results = await asyncio.gather(encoder.encode("ab"), encoder.encode("boom"), encoder.encode("abc", False),
                                       return_exceptions=True)
        return results, gone

    (ab, boom, abc), gone = asyncio.run(scenario())
    assert ab == [7, 2] and abc == [3]
    assert isinstance(boom, ValueError) and "boom" in str(boom)
    assert gone.cancelled()
    assert asyncio.run(encoder.encode("later")) == [7, 5]  # the thread still serves, from another event loop
