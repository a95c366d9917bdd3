"""The body of /generate and /generate_stream as a pydantic model, with TGI's parameter ranges,
and the checks that need the server's limits (prompt length in characters and in tokens).

A field left out or null takes SamplingParams' default (io_struct.py), written there once."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from lightllm.server.httpserver.json_body import RequestError
from lightllm.server.io_struct import SamplingParams

MAX_STOP_SEQUENCES = 16
INT32_MAX = 2**31 - 1  # TGI's top_k is an i32; the sampler holds it in an int64 tensor either way

# Strict: no "1" for 1 or 1 for true; finite: 1e999 reads as inf in JSON.
STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
NonEmptyStr = Annotated[str, Field(min_length=1)]
StopSequences = NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_SEQUENCES)]


@dataclass(frozen=True)
class Limits:
    max_req_input_len: int
    max_req_total_len: int
    max_total_token_num: int
    max_prompt_chars: int  # see prompt_char_bound


class GenerateParameters(BaseModel):
    model_config = STRICT

    do_sample: bool | None = Field(None, description="sample (with temperature, top_p, top_k) instead of greedy")
    temperature: float | None = Field(None, gt=0, description="default 1.0")
    top_p: float | None = Field(None, gt=0, le=1, description="default 1.0")
    top_k: int | None = Field(None, gt=0, le=INT32_MAX, description="default: the whole vocabulary")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="default 0")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="default 0")
    repetition_penalty: float | None = Field(None, gt=0, description="default 1.0 (none)")
    max_new_tokens: int | None = Field(None, ge=1, description="default 16")
    stop_sequences: StopSequences | None = Field(None, description="the text ends right before the first one")
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    seed: int | None = Field(None, ge=0, lt=2**63, description="default: drawn at random")

    def sampling(self) -> SamplingParams:
        return to_sampling(self.model_dump(exclude_none=True))


def to_sampling(given: dict, **fixed) -> SamplingParams:
    """SamplingParams from the parameters a client gave; a seed is drawn when none is given."""
    if isinstance(given.get("stop_sequences"), str):
        given["stop_sequences"] = [given["stop_sequences"]]
    given.setdefault("seed", secrets.randbelow(2**31))
    return SamplingParams(**given, **fixed)


class GenerateRequest(BaseModel):
    """TGI's request body: a prompt and its parameters."""

    model_config = STRICT

    inputs: NonEmptyStr
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)


def prompt_char_bound(tokenizer, max_req_input_len: int) -> int:
    """Characters in the longest prompt that can fit in `max_req_input_len` tokens: no token's text
    is longer than the longest vocabulary entry (byte-level BPE writes each byte as one character,
    SentencePiece's '▁' stands for one space, byte-fallback tokens are spelt longer than their
    byte). A longer prompt is refused before it is tokenized."""
    return max_req_input_len * max(map(len, tokenizer.get_vocab()))


def check_prompt_chars(chars: int, limits: Limits) -> None:
    if chars > limits.max_prompt_chars:
        raise RequestError(
            f"the prompt has {chars} characters: more than max_req_input_len={limits.max_req_input_len} tokens "
            f"can hold with this tokenizer ({limits.max_prompt_chars} characters); it was not tokenized"
        )


def check_lengths(prompt_len: int, sampling: SamplingParams, limits: Limits) -> None:
    """A request that could never run is refused here, before it reaches the router."""
    total = prompt_len + sampling.max_new_tokens
    if prompt_len == 0:  # control characters alone, for one, may tokenize to nothing
        raise RequestError("the prompt is empty once tokenized: there is nothing to continue")
    if prompt_len > limits.max_req_input_len:
        raise RequestError(
            f"the prompt has {prompt_len} tokens, more than max_req_input_len={limits.max_req_input_len}"
        )
    if total > limits.max_req_total_len:
        raise RequestError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({sampling.max_new_tokens}) = {total} is more "
            f"than max_req_total_len={limits.max_req_total_len}"
        )
    if total > limits.max_total_token_num:
        raise RequestError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({sampling.max_new_tokens}) = {total} can never "
            f"fit the KV cache of max_total_token_num={limits.max_total_token_num} tokens"
        )
