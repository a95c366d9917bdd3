"""OpenAI-style bodies (/v1/completions, /v1/chat/completions) as pydantic models, with OpenAI's
ranges.

Sampling follows OpenAI's defaults (temperature 1.0, so sampling unless temperature is 0). vLLM's
extensions top_k, repetition_penalty, ignore_eos and skip_special_tokens are accepted too. Fields
that would change the answer in ways this server cannot honour (n > 1, logprobs, tools, ...) are
described with OpenAI's types and refused with a 400 rather than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from lightllm.server.httpserver.json_body import RequestError
from lightllm.server.httpserver.params import INT32_MAX, STRICT, NonEmptyStr, StopSequences, to_sampling
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
ONE_CHOICE = "this server returns one choice per request"
NO_LOGPROBS = "log probabilities are only in /generate_stream's events"
# Fields of a message or content part beyond those read here (name, tool_calls, ...) change nothing.
LENIENT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = None


class OpenAIBody(BaseModel):
    """The fields both endpoints share."""

    model_config = STRICT
    # name -> (accepts the value?, why not)
    UNSUPPORTED: ClassVar[dict] = {
        "n": (lambda v: v in (None, 1), ONE_CHOICE),
        "logit_bias": (lambda v: not v, "logit biases are not supported"),
    }

    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, description="default 1.0; 0 is greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: StopSequences | None = None
    n: int | None = Field(None, ge=1, le=128, description="only 1 is supported")
    logit_bias: dict[str, Annotated[int, Field(ge=-100, le=100)]] | None = Field(None, description="not supported")
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="-1 or 0: the whole vocabulary")
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None

    def check_supported(self) -> None:
        for name, (accepts, why) in self.UNSUPPORTED.items():
            value = getattr(self, name)
            if not accepts(value):
                raise RequestError(f"'{name}' = {value!r} is not supported: {why}")

    def sampling(self) -> SamplingParams:
        given = {ours: value for name, ours in SAMPLING_NAMES.items() if (value := getattr(self, name, None)) is not None}
        return to_sampling(given, do_sample=True)  # OpenAI samples unless temperature is 0

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(OpenAIBody):
    UNSUPPORTED: ClassVar[dict] = {
        **OpenAIBody.UNSUPPORTED,
        "best_of": (lambda v: v in (None, 1), ONE_CHOICE),
        "echo": (lambda v: v in (None, False), "the prompt is not echoed"),
        "suffix": (lambda v: v is None, "there is no insertion mode"),
        "logprobs": (lambda v: v in (None, 0), NO_LOGPROBS),
    }

    prompt: NonEmptyStr | TokenIds | Annotated[list[NonEmptyStr | TokenIds], Field(min_length=1, max_length=1)] = (
        Field(description="a string or token ids; one prompt per request"))
    best_of: int | None = Field(None, ge=0, le=20, description="only 1 is supported")
    echo: bool | None = Field(None, description="only false is supported")
    suffix: str | None = Field(None, description="not supported")
    logprobs: int | None = Field(None, ge=0, le=5, description="only 0 is supported")

    def prompt_value(self, vocab_size: int) -> str | list[int]:
        """A string or token ids (a one-element list holds either)."""
        prompt = self.prompt[0] if isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list)) else self.prompt
        if isinstance(prompt, list) and max(prompt) >= vocab_size:
            raise RequestError(f"'prompt' token ids must be in [0, {vocab_size})")
        return prompt


class TextPart(BaseModel):
    model_config = LENIENT
    type: Literal["text"] = Field(description="only text parts are supported")
    text: str


class Message(BaseModel):
    model_config = LENIENT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(None, description="null only for role 'assistant'")

    def for_template(self, i: int) -> dict:
        """{"role", "content"} as chat templates read them: text parts joined; OpenAI's newer
        "developer" role is the "system" that templates know."""
        if self.content is None and self.role != "assistant":
            raise RequestError(f"messages[{i}].content may be null only for role 'assistant'")
        content = self.content or ""
        text = content if isinstance(content, str) else "".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(OpenAIBody):
    UNSUPPORTED: ClassVar[dict] = {
        **OpenAIBody.UNSUPPORTED,
        "logprobs": (lambda v: v in (None, False), NO_LOGPROBS),
        "top_logprobs": (lambda v: v in (None, 0), NO_LOGPROBS),
        "tools": (lambda v: not v, "tool calling is not supported"),
        "tool_choice": (lambda v: v in (None, "none", "auto"), "tool calling is not supported"),
        "functions": (lambda v: not v, "function calling is not supported"),
        "response_format": (lambda v: v in (None, {"type": "text"}), "only plain text responses are supported"),
    }

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(None, description="only false is supported")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="only 0 is supported")
    tools: list[dict] | None = Field(None, description="not supported")
    tool_choice: str | dict | None = Field(None, description="only 'none' and 'auto' are supported")
    functions: list[dict] | None = Field(None, description="not supported")
    parallel_tool_calls: bool | None = None
    response_format: dict | None = Field(None, description="only {'type': 'text'} is supported")

    @property
    def max_tokens_given(self) -> bool:
        return self.max_tokens is not None or self.max_completion_tokens is not None

    def template_messages(self) -> list[dict]:
        return [message.for_template(i) for i, message in enumerate(self.messages)]
