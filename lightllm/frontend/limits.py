"""The length checks every request passes before it reaches an engine: the prompt in characters
(before tokenizing) and in tokens, and prompt + max_new_tokens against the engine's limits; their
messages name fields as the caller's API does."""

from __future__ import annotations

from dataclasses import dataclass

from lightllm.engine.request import SamplingParams
from lightllm.frontend.errors import RequestError


@dataclass(frozen=True)
class Limits:
    max_req_input_len: int
    max_req_total_len: int
    max_total_token_num: int
    max_prompt_chars: int  # see prompt_char_bound


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


def truncated(prompt_ids: list[int], keep: int | None, limits: Limits) -> list[int]:
    """vLLM's truncate_prompt_tokens (TGI's truncate): the prompt's last `keep` tokens (-1: the
    last max_req_input_len); None: the prompt as it is. A prompt refused for its characters
    (check_prompt_chars) is not tokenized, truncation or not: the bound assumes the vocabulary's
    longest token, several times a typical one's, so an over-long prose prompt passes it."""
    if keep is None:
        return prompt_ids
    keep = limits.max_req_input_len if keep == -1 else keep
    return prompt_ids[max(0, len(prompt_ids) - keep):]


def check_lengths(prompt_len: int, sampling: SamplingParams, limits: Limits, max_tokens_field: str) -> None:
    """A request that could never run is refused here, before it reaches the router. The message
    calls max_new_tokens by the name the caller's API gives it (`max_tokens_field`)."""
    total = prompt_len + sampling.max_new_tokens
    if prompt_len == 0:  # control characters alone, for one, may tokenize to nothing
        raise RequestError("the prompt is empty once tokenized: there is nothing to continue")
    if prompt_len > limits.max_req_input_len:
        raise RequestError(
            f"the prompt has {prompt_len} tokens, more than max_req_input_len={limits.max_req_input_len}"
        )
    if total > limits.max_req_total_len:
        raise RequestError(
            f"prompt ({prompt_len} tokens) + {max_tokens_field} ({sampling.max_new_tokens}) = {total} is more "
            f"than max_req_total_len={limits.max_req_total_len}"
        )
    if total > limits.max_total_token_num:
        raise RequestError(
            f"prompt ({prompt_len} tokens) + {max_tokens_field} ({sampling.max_new_tokens}) = {total} can never "
            f"fit the KV cache of max_total_token_num={limits.max_total_token_num} tokens"
        )
