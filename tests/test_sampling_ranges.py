"""The three front ends (TGI's /generate body, the OpenAI-style body, the offline SamplingParams)
share one set of sampling ranges: a value the shared ranges refuse, every front end refuses."""

from __future__ import annotations

import pytest

from lightllm.frontend.sampling_ranges import SHARED_FIELDS, SamplingRanges
from lightllm.llm import SamplingParams as OfflineParams
from lightllm.server.httpserver.openai_params import CompletionRequest
from lightllm.server.httpserver.params import GenerateParameters

# Values just outside (and just inside) each shared range, and wrong types.
PROBES = {
    "temperature": [-0.01, 0.5, "1", float("inf")],
    "top_p": [0.0, 1.0, 1.01],
    "top_k": [-2, -1, 5, 2**31],
    "min_p": [-0.1, 0.5, 1.1],
    "presence_penalty": [-2.01, 2.0, 2.01],
    "frequency_penalty": [-2.01, -2.0, 2.01],
    "repetition_penalty": [0.0, 1.3],
    "seed": [-1, 0, 2**63 - 1, 2**63, 1.5],
    "min_tokens": [-1, 3],
    "stop_token_ids": [[-1], [0, 7]],
    "allowed_token_ids": [[], [-1], [3, 9], list(range(4097))],
    "bad_words": [[], ["a", "b c"], [""], ["x" * 257], ["a"] * 257, [3]],
    "logit_bias": [{"5": 100.0}, {"5": -100.5}, {"5": 101.0}, {"5": float("nan")}],
    "ignore_eos": [True, 1],
    "skip_special_tokens": [False, "yes"],
    "include_stop_str_in_output": [True, 0],
}


def accepted(validate, *args) -> bool:
    try:
        validate(*args)
        return True
    except ValueError:  # pydantic's ValidationError is one
        return False


def shared_accepts(name, value) -> bool:
    return accepted(SamplingRanges.model_validate, {name: value})


def generate_accepts(name, value) -> bool:
    return accepted(GenerateParameters.model_validate, {name: value})


def openai_accepts(name, value) -> bool:
    return accepted(CompletionRequest.model_validate, {"prompt": "hi", name: value})


def offline_accepts(name, value) -> bool:
    if name == "logit_bias":
        value = {int(token): bias for token, bias in value.items()}
    return accepted(lambda: OfflineParams(**{name: value}))


def test_every_shared_field_is_probed():
    assert set(PROBES) == set(SHARED_FIELDS)


@pytest.mark.parametrize("name,value", [(n, v) for n, vs in PROBES.items() for v in vs], ids=repr)
def test_no_front_end_accepts_what_the_shared_ranges_refuse(name, value):
    accepts = {"generate": generate_accepts(name, value), "openai": openai_accepts(name, value),
               "offline": offline_accepts(name, value)}
    if not shared_accepts(name, value):
        assert not any(accepts.values()), accepts
    elif name not in ("temperature", "top_k"):  # the two fields an API narrows (TGI: > 0)
        assert all(accepts.values()), accepts


def test_the_probes_reach_both_sides_of_each_range():
    for name, values in PROBES.items():
        results = {shared_accepts(name, v) for v in values}
        assert results == {True, False}, name
