"""Validation of OpenAI-style bodies (/v1/completions, /v1/chat/completions).

Sampling follows OpenAI's defaults (temperature 1.0, so sampling unless temperature is 0) and
checks values with the same rules as /generate (params.py). vLLM's extensions top_k,
repetition_penalty, ignore_eos and skip_special_tokens are accepted too. Fields that would
change the answer in ways this server cannot honour (n > 1, logprobs, tools, ...) are refused
with a 400 rather than silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightllm.server.httpserver.params import RequestError, build_sampling, check_bool
from lightllm.server.io_struct import SamplingParams

# the client's name -> ours
SAMPLING_NAMES = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "stop": "stop_sequences",
    "temperature": "temperature",
    "top_p": "top_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
}
# Accepted, and they change nothing here.
IGNORED = {"model", "stream", "stream_options", "user", "metadata", "store", "service_tier", "parallel_tool_calls"}
# name -> (accepts the value?, why not)
UNSUPPORTED = {
    "n": (lambda v: v in (None, 1), "this server returns one choice per request"),
    "best_of": (lambda v: v in (None, 1), "this server returns one choice per request"),
    "echo": (lambda v: v in (None, False), "the prompt is not echoed"),
    "suffix": (lambda v: v is None, "there is no insertion mode"),
    "logprobs": (lambda v: v in (None, False, 0), "log probabilities are only in /generate_stream's events"),
    "top_logprobs": (lambda v: v in (None, 0), "log probabilities are only in /generate_stream's events"),
    "logit_bias": (lambda v: not v, "logit biases are not supported"),
    "tools": (lambda v: not v, "tool calling is not supported"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), "tool calling is not supported"),
    "functions": (lambda v: not v, "function calling is not supported"),
    "response_format": (lambda v: v in (None, {"type": "text"}), "only plain text responses are supported"),
}
COMPLETION_FIELDS = {"prompt"}
CHAT_FIELDS = {"messages"}
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class OpenAIRequest:
    model: str | None
    stream: bool
    include_usage: bool
    sampling: SamplingParams
    max_tokens_given: bool
    prompt: str | list[int] | None = None  # /v1/completions
    messages: list[dict] = field(default_factory=list)  # /v1/chat/completions


def parse_completion(body: dict, vocab_size: int) -> OpenAIRequest:
    check_fields(body, COMPLETION_FIELDS)
    request = parse_common(body)
    request.prompt = parse_prompt(body.get("prompt"), vocab_size)
    return request


def parse_chat(body: dict) -> OpenAIRequest:
    check_fields(body, CHAT_FIELDS)
    request = parse_common(body)
    request.messages = parse_messages(body.get("messages"))
    return request


def check_fields(body: dict, own: set[str]) -> None:
    known = own | set(SAMPLING_NAMES) | IGNORED | set(UNSUPPORTED)
    unknown = set(body) - known
    if unknown:
        raise RequestError(f"unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    for name, (accepts, why) in UNSUPPORTED.items():
        if name in body and not accepts(body[name]):
            raise RequestError(f"'{name}' = {body[name]!r} is not supported: {why}")


OPENAI_MAX_TEMPERATURE = 2.0  # /generate (TGI) has no upper bound; OpenAI's API stops at 2


def parse_common(body: dict) -> OpenAIRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string")
    stream = check_bool(body.get("stream") or False, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("'stream_options' must be a JSON object")
    include_usage = check_bool(options.get("include_usage") or False, "stream_options.include_usage")
    values = {ours: (name, body[name]) for name, ours in SAMPLING_NAMES.items() if name in body}
    sampling = build_sampling(values, do_sample=True)  # OpenAI samples unless temperature is 0
    if sampling.temperature > OPENAI_MAX_TEMPERATURE:
        raise RequestError(f"'temperature' must be a number in [0, {OPENAI_MAX_TEMPERATURE:g}] (OpenAI's range), "
                           f"got {body['temperature']!r}")
    max_tokens_given = body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None
    return OpenAIRequest(model, stream, include_usage, sampling, max_tokens_given)


def parse_prompt(prompt, vocab_size: int) -> str | list[int]:
    """A string, or token ids; also either of them alone in a list (one prompt per request)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise RequestError(f"'prompt' token ids must be in [0, {vocab_size})")
        return prompt
    raise RequestError("'prompt' must be a non-empty string or list of token ids (one prompt per request)")


def parse_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    return [parse_message(i, message) for i, message in enumerate(messages)]


def parse_message(i: int, message) -> dict:
    if not isinstance(message, dict):
        raise RequestError(f"messages[{i}] must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}")
    # Chat templates know "system"; OpenAI's newer "developer" role means the same.
    return {"role": "system" if role == "developer" else role, "content": message_text(i, message.get("content"), role)}


def message_text(i: int, content, role: str) -> str:
    """A string, or a list of text parts joined; null only where OpenAI allows it (assistant)."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise RequestError(f"messages[{i}].content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}")
        texts.append(part["text"])
    return "".join(texts)
