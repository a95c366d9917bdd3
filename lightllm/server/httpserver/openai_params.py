"""OpenAI-style bodies (/v1/completions, /v1/chat/completions) as pydantic models, with OpenAI's
ranges.

Sampling follows OpenAI's defaults (temperature 1.0, so sampling unless temperature is 0). vLLM's
extensions top_k, min_p, min_tokens, stop_token_ids, repetition_penalty, ignore_eos and
skip_special_tokens are accepted too, and chat_template_kwargs. Fields that would change the
answer in ways this server cannot honour (best_of, suffix, the legacy functions, ...) are
described with OpenAI's types and refused with a 400 rather than silently ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from lightllm.engine.json_schema import SchemaError, check_json_schema
from lightllm.engine.request import SamplingParams
from lightllm.frontend.errors import RequestError
from lightllm.frontend.sampling_ranges import STRICT, OpenAIRanges, to_sampling
from lightllm.server.httpserver.params import NonEmptyStr, StopSequences, check_token_ids, checked_grammar, json_grammar

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
    "min_p": "min_p",
    "min_tokens": "min_tokens",
    "stop_token_ids": "stop_token_ids",
    "allowed_token_ids": "allowed_token_ids",
    "bad_words": "bad_words",
    "include_stop_str_in_output": "include_stop_str_in_output",
}
MAX_LOGPROBS = 20  # the most top logprobs per token (OpenAI's limit for chat, vLLM's default)
# The most prompts in one /v1/completions body (a bound on one body's work); the choices of a batch
# (prompts x n) must also fit --max_queued_requests.
MAX_PROMPTS = 2048
# The longest chat template a request may bring (vLLM's field; Qwen3's own is about 4 KiB).
MAX_CHAT_TEMPLATE_CHARS = 64 << 10
# Fields of a message, content part or tool beyond those read here change nothing.
LENIENT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = Field(None, description="vLLM's: with include_usage, every chunk carries "
                                                                  "its choice's usage so far")


class JsonSchemaFormat(BaseModel):
    model_config = LENIENT
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema", description="a JSON schema; absent: any JSON value")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format, and TGI's ({"type": "json", "value": a schema} or {"type": "regex",
    "value": a pattern}, as huggingface_hub's chat_completion sends it)."""

    model_config = STRICT
    type: Literal["text", "json_object", "json_schema", "json", "regex"]
    json_schema: JsonSchemaFormat | None = None
    value: dict | NonEmptyStr | None = Field(None, description="TGI's: the schema of type json, the pattern of regex")

    def grammar(self) -> tuple[str, str]:
        """(SamplingParams.grammar_kind, grammar), checked by xgrammar (a bad schema is a 400)."""
        if self.type == "text":
            return "", ""
        if self.type in ("json", "regex"):
            if self.value is None:
                raise RequestError(f"'response_format': TGI's type '{self.type}' needs a 'value'")
            if self.type == "json":
                kind, spec = json_grammar(self.value, "response_format.value")
            elif isinstance(self.value, str):
                kind, spec = "regex", self.value
            else:
                raise RequestError("'response_format.value' of type 'regex' is a pattern: a string")
        elif self.type == "json_object":
            kind, spec = "json_object", ""
        elif self.json_schema is None:
            raise RequestError("'response_format': type 'json_schema' needs a 'json_schema' object")
        elif self.json_schema.schema_ is None:
            kind, spec = "json_object", ""
        else:
            kind, spec = "json_schema", json.dumps(self.json_schema.schema_)
        return kind, checked_grammar(kind, spec)


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: the output follows exactly one of these (xgrammar)."""

    model_config = STRICT
    json_: dict | NonEmptyStr | None = Field(None, alias="json", description="a JSON schema (an object, or its text)")
    regex: NonEmptyStr | None = Field(None, description="a regular expression the whole output matches")
    choice: Annotated[list[str], Field(min_length=1)] | None = Field(None, description="the output is one of these")
    grammar: NonEmptyStr | None = Field(None, description="an EBNF grammar (xgrammar's, GBNF-style), from `root`")
    json_object: bool | None = Field(None, description="true: any JSON object")

    def grammar_of(self, where: str) -> tuple[str, str]:
        """(grammar_kind, spec), checked by xgrammar (a bad one is a 400)."""
        given = [name for name, value in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                          ("grammar", self.grammar), ("json_object", self.json_object or None))
                 if value is not None]
        if len(given) != 1:
            raise RequestError(f"{where} takes exactly one of json, regex, choice, grammar, json_object; "
                               f"got {', '.join(given) or 'none'}")
        if self.json_ is not None:
            kind, spec = json_grammar(self.json_, f"{where}.json")
        elif self.regex is not None:
            kind, spec = "regex", self.regex
        elif self.choice is not None:  # JSON's string escapes are EBNF's
            kind, spec = "ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
        elif self.grammar is not None:
            kind, spec = "ebnf", self.grammar
        else:
            kind, spec = "json_object", ""
        return kind, checked_grammar(kind, spec)


# vLLM's names for structured_outputs' fields until its v0.12, which clients still send.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class OpenAIBody(OpenAIRanges):
    """The fields both endpoints share: the shared sampling ranges (SamplingRanges, which hold
    vLLM's extensions top_k, min_p, ... too), OpenAI's narrower temperature, and OpenAI's own."""

    # name -> (accepts the value?, why not)
    UNSUPPORTED: ClassVar[dict] = {}

    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    stop: StopSequences | None = None
    n: int | None = Field(None, ge=1, le=128, description="choices to generate; the prompt is computed once")
    response_format: ResponseFormat | None = Field(
        None, description="{'type': 'json_object'} or {'type': 'json_schema', 'json_schema': {'schema': ...}}: "
                          "the output follows it (xgrammar)")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's extension: one of json, regex, choice, grammar (EBNF), json_object")
    guided_json: dict | NonEmptyStr | None = Field(None, description="structured_outputs.json (vLLM's old name)")
    guided_regex: NonEmptyStr | None = Field(None, description="structured_outputs.regex (vLLM's old name)")
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = Field(
        None, description="structured_outputs.choice (vLLM's old name)")
    guided_grammar: NonEmptyStr | None = Field(None, description="structured_outputs.grammar (vLLM's old name)")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                        description="vLLM's extension: each prompt token's logprob and the k most "
                                                    "likely tokens' at its position (not with stream)")
    priority: int | None = Field(None, ge=-2**31, lt=2**31,
                                 description="vLLM's extension: with --schedule_policy priority, waiting requests "
                                             "are admitted lowest value first (ties in arrival order); other "
                                             "policies take only 0, the default")
    request_id: str | None = Field(None, min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$",
                                   description="vLLM's extension: the answer's id is the route's prefix and this "
                                               "(printable ASCII, no spaces), not a random one")
    cache_salt: NonEmptyStr | None = Field(
        None, max_length=1024, description="vLLM's extension: the prefix cache shares a prompt's KV only with "
                                           "requests of the same salt (one tenant's)")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="vLLM's extension: keep only the prompt's last k tokens (-1: the last "
                                 "max_req_input_len), the rest dropped before the length checks")
    return_tokens_as_token_ids: bool | None = Field(
        None, description="vLLM's extension: logprobs name each token 'token_id:<id>' instead of by its text")
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def check_supported(self, vocab_size: int) -> None:
        for name, (accepts, why) in self.UNSUPPORTED.items():
            value = getattr(self, name)
            if not accepts(value):
                raise RequestError(f"'{name}' = {value!r} is not supported: {why}")
        if self.truncate_prompt_tokens == 0:
            raise RequestError("'truncate_prompt_tokens' must be -1 (the longest prompt accepted) or at least 1")
        if self.stream and self.prompt_logprobs is not None:  # as vLLM: the answer is whole, not streamed
            raise RequestError("'prompt_logprobs' is not available with 'stream': true")
        check_token_ids(vocab_size, self.logit_bias, self.stop_token_ids, self.allowed_token_ids)

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def reads_grammar(self) -> bool:
        return bool(self._constraints())

    def _constraints(self) -> list[tuple[str, object]]:
        """(field, value) of each field that constrains the output; one at most may."""
        given = [(name, getattr(self, name)) for name in ("response_format", "structured_outputs", *GUIDED_FIELDS)]
        return [(name, value) for name, value in given if value is not None
                and not (name == "response_format" and value.type == "text")]

    def grammar(self) -> tuple[str, str] | None:
        """(grammar_kind, spec) of the constraint on the output, None without one."""
        constraints = self._constraints()
        if len(constraints) > 1:
            raise RequestError(f"give one of {', '.join(repr(name) for name, _ in constraints)}: each constrains "
                               "the whole output")
        if not constraints:
            return None
        (name, value), = constraints
        if name == "response_format":
            return value.grammar()
        if name in GUIDED_FIELDS:
            value = StructuredOutputs.model_validate({GUIDED_FIELDS[name]: value})
        return value.grammar_of(f"'{name}'")

    def sampling(self, defaults: dict | None = None) -> SamplingParams:
        """The request's SamplingParams; `defaults` (model_sampling_defaults') for what it leaves out."""
        given = {ours: value for name, ours in SAMPLING_NAMES.items() if (value := getattr(self, name, None)) is not None}
        for name, value in (defaults or {}).items():
            given.setdefault(name, value)
        if self.logit_bias:
            given["logit_bias"] = {int(token): float(bias) for token, bias in self.logit_bias.items()}
        grammar = self.grammar()
        if grammar is not None:
            given["grammar_kind"], given["grammar"] = grammar
        given.update(self.logprob_fields())
        if self.prompt_logprobs is not None:  # with echo's (CompletionRequest), the larger k serves both
            given["prompt_logprobs"] = max(self.prompt_logprobs, given.get("prompt_logprobs", 0))
        return to_sampling(given, do_sample=True)  # OpenAI samples unless temperature is 0

    def logprob_fields(self) -> dict:
        return {}

    @property
    def wants_logprobs(self) -> bool:
        return False

    @property
    def max_tokens_field(self) -> str:
        """The name of max_new_tokens in this body, for its errors."""
        return "max_tokens"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


def _prompt_form(value) -> str:
    """Which of the prompt's forms a value is meant as, by its first element: a wrong value is told
    what that form expects, not every form's complaint about every element."""
    if not isinstance(value, list):
        return "str"
    first = value[0] if value else None
    return "list[str]" if isinstance(first, str) else "list[list[int]]" if isinstance(first, list) else "list[int]"


# The tags are type names, which error paths leave out (json_body.UNION_MEMBER_NAMES and brackets).
Prompt = Annotated[
    Annotated[NonEmptyStr, Tag("str")] | Annotated[TokenIds, Tag("list[int]")]
    | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_PROMPTS), Tag("list[str]")]
    | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS), Tag("list[list[int]]")],
    Discriminator(_prompt_form)]


class CompletionRequest(OpenAIBody):
    UNSUPPORTED: ClassVar[dict] = {
        **OpenAIBody.UNSUPPORTED,
        "best_of": (lambda v: v in (None, 1), "use n: every choice is returned"),
        "suffix": (lambda v: v is None, "there is no insertion mode"),
    }

    prompt: Prompt = Field(description="a string or token ids, or a batch: a list of strings or of token-id lists "
                                       "(choice i of the answer is choice i % n of prompt i // n)")
    best_of: int | None = Field(None, ge=0, le=20, description="only 1 is supported")
    echo: bool | None = Field(None, description="the prompt comes first in each choice's text (and logprobs)")
    suffix: str | None = Field(None, description="not supported")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="the sampled token's logprob and the k most likely tokens', per token")

    def logprob_fields(self) -> dict:
        if self.logprobs is None:
            return {}
        return {"top_logprobs": self.logprobs, **({"prompt_logprobs": self.logprobs} if self.echo else {})}

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def prompt_values(self, vocab_size: int) -> list[str] | list[list[int]]:
        """The prompts, texts or token ids: one, or a batch's."""
        batch = isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list))
        prompts = self.prompt if batch else [self.prompt]
        if isinstance(prompts[0], list) and max(max(ids) for ids in prompts) >= vocab_size:
            raise RequestError(f"'prompt' token ids must be in [0, {vocab_size})")
        return prompts


class TextPart(BaseModel):
    model_config = LENIENT
    type: Literal["text"] = Field(description="only text parts are supported")
    text: str


# OpenAI's rule for function names; it also keeps a name safe inside the forced-call grammar
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionCall(BaseModel):
    model_config = LENIENT
    name: FunctionName
    arguments: str = Field(description="the arguments as JSON text (an object)")


class ToolCall(BaseModel):
    model_config = LENIENT
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


def call_for_template(name: str, arguments: str, call_id: str | None, where: str) -> dict:
    """A call as chat templates read it: arguments as a dict (Llama 3.1's template writes them with tojson)."""
    try:
        args = json.loads(arguments)
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise RequestError(f"{where}: the arguments must be a JSON object (as text), got {arguments[:60]!r}")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


class Message(BaseModel):
    model_config = LENIENT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(None, description="null only for role 'assistant'")
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="role 'assistant': the calls it made")
    tool_call_id: str | None = Field(None, description="role 'tool': the call this is the result of")

    def for_template(self, i: int) -> dict:
        """The message as chat templates read it: text parts joined; OpenAI's newer "developer"
        role is the "system" that templates know; calls' arguments as dicts."""
        if self.content is None and not (self.role == "assistant"):
            raise RequestError(f"messages[{i}].content may be null only for role 'assistant'")
        if self.tool_calls and self.role != "assistant":
            raise RequestError(f"messages[{i}].tool_calls: only an assistant makes calls")
        if self.role == "tool" and self.tool_call_id is None:  # OpenAI's 400: the result of which call?
            raise RequestError(f"missing required parameter 'messages[{i}].tool_call_id': a 'tool' message is "
                               "the result of the call with that id")
        content = self.content or ""
        text = content if isinstance(content, str) else "".join(part.text for part in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [call_for_template(c.function.name, c.function.arguments, c.id,
                                                       f"messages[{i}].tool_calls[{j}]")
                                     for j, c in enumerate(self.tool_calls)]
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
            if self.name is not None:
                message["name"] = self.name
        return message


class FunctionDef(BaseModel):
    model_config = LENIENT
    name: FunctionName
    description: str | None = None
    parameters: dict | None = Field(None, description="a JSON schema of the arguments (an object)")
    strict: bool | None = None


def template_tool(function: FunctionDef) -> dict:
    """A function as chat templates read tools (OpenAI's chat shape), whatever API it came from."""
    fields = function.model_dump(exclude_none=True, include=set(FunctionDef.model_fields))
    return {"type": "function", "function": fields}


class Tool(BaseModel):
    model_config = LENIENT
    type: Literal["function"] = Field(description="only functions")
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = LENIENT
    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = LENIENT
    type: Literal["function"]
    function: NamedFunction


# The most functions one request may give (OpenAI's bound): each is in the prompt, and a forced call
# compiles a grammar of all of them (1000 took the compiler 11 GB).
MAX_TOOLS = 128
ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def check_tools(tools: list[FunctionDef] | None, choice: str | None) -> None:
    """`choice`: none, auto, required or a function's name."""
    names = [f.name for f in tools or ()]
    if len(names) > MAX_TOOLS:
        raise RequestError(f"'tools' holds {len(names)} functions, more than {MAX_TOOLS} (the most a request may "
                           "give, as OpenAI's API)")
    if len(set(names)) < len(names):
        raise RequestError("'tools': two functions have the same name")
    if choice not in (None, "none") and not names:
        raise RequestError(f"'tool_choice' {choice!r} needs 'tools'")
    if choice not in (None, "none", "auto", "required") and choice not in names:
        raise RequestError(f"'tool_choice' names the function {choice!r}, which is not in 'tools'")
    for function in tools or ():
        check_parameters(function)


def check_parameters(function: FunctionDef) -> None:
    """A tool's parameters are a schema whatever tool_choice is (a forced call compiles them, an
    "auto" one does not): the structural check, no grammar."""
    try:
        check_json_schema(function.parameters or EMPTY_PARAMETERS)
    except SchemaError as exc:
        raise RequestError(f"'tools': function {function.name!r}: its parameters are not a usable JSON schema: "
                           f"{exc}") from None


def arguments_format(call_format, function: FunctionDef) -> dict:
    """A function's arguments as a structural tag's content: our JSON grammar of its schema (written
    in where the tag is parsed: engine.grammar.json_arguments), or the schema in xgrammar's style of
    the format (its XML forms). Its schema's structure is checked already (`check_parameters`)."""
    from lightllm.engine.grammar import json_arguments

    parameters = function.parameters or EMPTY_PARAMETERS
    if call_format.arguments_style == "json":
        return json_arguments(function.name, parameters, call_format.arguments_separators)
    return {"type": "json_schema", "json_schema": parameters, "style": call_format.arguments_style}


def forced_call_grammar(call_format, tools: list[FunctionDef], choice: str, parallel: bool,
                        max_new_tokens: int | None = None) -> tuple[str, str]:
    """(grammar_kind, grammar) that makes the model call `choice` ('required': any of `tools`) within
    the answer's `max_new_tokens` (a format that lets the model reason first bounds its reasoning by it)."""
    functions = [(f.name, arguments_format(call_format, f)) for f in tools if choice == "required" or f.name == choice]
    spec = call_format.forced_grammar(functions, parallel and choice == "required", max_new_tokens)
    return "structural_tag", checked_grammar("structural_tag", spec)


def prompt_ending(add_generation_prompt: bool | None, continue_final_message: bool | None) -> dict:
    """render_chat's add_generation_prompt and continue_final_message from a request's (None: not
    given): the assistant header unless the last message is continued."""
    continues = bool(continue_final_message)
    if continues and add_generation_prompt:
        raise RequestError("'continue_final_message' and 'add_generation_prompt' cannot both be true: one "
                           "continues the last message, the other starts a new one")
    adds = not continues if add_generation_prompt is None else add_generation_prompt
    return {"add_generation_prompt": adds, "continue_final_message": continues}


class ChatRequest(OpenAIBody):
    UNSUPPORTED: ClassVar[dict] = {
        **OpenAIBody.UNSUPPORTED,
        "functions": (lambda v: not v, "the legacy 'functions' are not supported: send 'tools'"),
        "function_call": (lambda v: v is None, "the legacy 'function_call' is not supported: send 'tool_choice'"),
    }

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(None, description="each generated token's logprob")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                     description="with logprobs: the k most likely tokens at each position too")
    tools: list[Tool] | None = Field(None, description="functions the model may call; they reach the chat template")
    tool_choice: ToolChoice | None = Field(
        None, description="none, auto (the default with tools), required, or {'type': 'function', 'function': "
                          "{'name': ...}}; required and a named function are enforced with a grammar")
    parallel_tool_calls: bool | None = Field(None, description="with required: more than one call (default true)")
    functions: list[dict] | None = Field(None, description="not supported")
    function_call: str | dict | None = Field(None, description="not supported")
    chat_template_kwargs: dict | None = Field(None, description="variables for the chat template, such as "
                                                                 "{'enable_thinking': false}")
    chat_template: NonEmptyStr | None = Field(
        None, max_length=MAX_CHAT_TEMPLATE_CHARS,
        description="vLLM's extension: a Jinja chat template for this request in place of the model's (only on a "
                    "server started with --trust_request_chat_template)")
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        None, description="passed to the chat template as reasoning_effort (gpt-oss's)")
    add_generation_prompt: bool | None = Field(
        None, description="vLLM's extension: end the prompt with the template's assistant header (default true, "
                          "false with continue_final_message)")
    continue_final_message: bool | None = Field(
        None, description="vLLM's extension: the model continues the last message (an assistant's prefill) rather "
                          "than starting a new one; the answer holds what it adds")

    @property
    def prompt_ending(self) -> dict:
        return prompt_ending(self.add_generation_prompt, self.continue_final_message)

    @property
    def template_kwargs(self) -> dict | None:
        """chat_template_kwargs, with reasoning_effort where given (the kwargs' own wins)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    def logprob_fields(self) -> dict:
        if self.top_logprobs and not self.logprobs:
            raise RequestError("'top_logprobs' needs 'logprobs': true")
        return {"top_logprobs": self.top_logprobs or 0} if self.logprobs else {}

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    @property
    def max_tokens_given(self) -> bool:
        return self.max_tokens is not None or self.max_completion_tokens is not None

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def template_messages(self) -> list[dict]:
        return [message.for_template(i) for i, message in enumerate(self.messages)]

    @property
    def functions_given(self) -> list[FunctionDef]:
        return [tool.function for tool in self.tools or ()]

    @property
    def choice(self) -> str:
        """none, auto, required or a function's name."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or ("auto" if self.tools else "none")

    def check_tools(self) -> None:
        check_tools(self.functions_given, self.choice if self.tool_choice is not None else None)
        constraints = self._constraints()
        if self.choice not in ("none", "auto") and constraints:
            raise RequestError(f"'{constraints[0][0]}' cannot be combined with a forced tool call ('tool_choice')")
