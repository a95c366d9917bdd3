"""Validation of a /generate body: every mistake a client can make becomes a RequestError (4xx).

The parameter rules here are shared with the OpenAI-style endpoints (openai_params.py)."""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass

from lightllm.server.io_struct import SamplingParams

MAX_STOP_SEQUENCES = 16


class RequestError(Exception):
    """An error the client caused: answered with `status_code` and this message."""

    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.status_code = status_code


@dataclass(frozen=True)
class Limits:
    max_req_input_len: int
    max_req_total_len: int
    max_total_token_num: int


def _finite(value: float) -> bool:
    return math.isfinite(value)


# name -> (check, what the value must be)
FLOAT_RULES = {
    "temperature": (lambda v: _finite(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
    "repetition_penalty": (lambda v: 0 < v <= 10, "a number in (0, 10]"),
}
INT_RULES = {
    "top_k": (lambda v: v == -1 or v >= 1, "-1 (whole vocabulary) or an integer >= 1"),
    "max_new_tokens": (lambda v: v >= 1, "an integer >= 1"),
    "seed": (lambda v: 0 <= v < 2**63, "an integer in [0, 2**63)"),
}
BOOL_PARAMS = ("do_sample", "ignore_eos", "skip_special_tokens")
KNOWN_PARAMS = set(FLOAT_RULES) | set(INT_RULES) | set(BOOL_PARAMS) | {"stop_sequences"}


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(body: bytes) -> dict:
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    try:  # JSON may escape lone UTF-16 surrogates ("\ud800"), which no tokenizer can take
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError("request body holds text that is not valid Unicode (a lone surrogate such as "
                           "\\ud800)") from None
    return data


def parse_generate(data: dict) -> tuple[str, SamplingParams]:
    """`{"inputs": str, "parameters": {...}}` -> (prompt, SamplingParams); a seed is drawn if absent."""
    unknown = set(data) - {"inputs", "parameters"}
    if unknown:
        raise RequestError(f"unknown field(s) {sorted(unknown)}; expected 'inputs' and 'parameters'")
    prompt = data.get("inputs")
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("'inputs' must be a non-empty string")
    params = data.get("parameters", {})
    if not isinstance(params, dict):
        raise RequestError("'parameters' must be a JSON object")
    return prompt, parse_parameters(params)


def parse_parameters(params: dict) -> SamplingParams:
    unknown = set(params) - KNOWN_PARAMS
    if unknown:
        raise RequestError(f"unknown parameter(s) {sorted(unknown)}; known: {sorted(KNOWN_PARAMS)}")
    return build_sampling({name: (name, value) for name, value in params.items()})


def build_sampling(values: dict[str, tuple[str, object]], **fixed) -> SamplingParams:
    """SamplingParams from {our name: (the client's name, value)}, each value checked; the
    client's name is the one an error message shows. A null value means the default; a seed is
    drawn when none is given."""
    checked = {name: check_param(name, value, label) for name, (label, value) in values.items() if value is not None}
    checked.setdefault("seed", secrets.randbelow(2**31))
    return SamplingParams(**checked, **fixed)


def check_param(name: str, value, label: str | None = None):
    label = label or name
    if name in BOOL_PARAMS:
        return check_bool(value, label)
    if name == "stop_sequences":
        return _check_stop_sequences(value, label)
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if name in INT_RULES:
        check, expected = INT_RULES[name]
        if not is_int or not check(value):
            raise RequestError(f"parameter '{label}' must be {expected}, got {value!r}")
        return value
    check, expected = FLOAT_RULES[name]
    if not (is_int or isinstance(value, float)) or not check(value):
        raise RequestError(f"parameter '{label}' must be {expected}, got {value!r}")
    return float(value)


def check_bool(value, label: str) -> bool:
    if not isinstance(value, bool):
        raise RequestError(f"parameter '{label}' must be true or false, got {value!r}")
    return value


def _check_stop_sequences(value, label: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise RequestError(f"parameter '{label}' must be a list of non-empty strings")
    if len(value) > MAX_STOP_SEQUENCES:
        raise RequestError(f"parameter '{label}' may hold at most {MAX_STOP_SEQUENCES} strings")
    return value


def check_lengths(prompt_len: int, sampling: SamplingParams, limits: Limits) -> None:
    """A request that could never run is refused here, before it reaches the router."""
    total = prompt_len + sampling.max_new_tokens
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
