"""A conversation as the model's prompt: the chat template from the model directory (or the one
--chat_template gives, chat_template_text), applied once here for every route
(/v1/chat/completions, /v1/responses, /v1/messages, /tokenize) and for the offline `LLM.chat`.

Messages arrive in the template's own vocabulary (Hugging Face's): {"role", "content"}, an
assistant's "tool_calls" ([{"type": "function", "function": {"name", "arguments": a dict}}]) and
"tool" messages with their "tool_call_id". Tool definitions go to the template as `tools`.

Not every template knows tools. One that never mentions `tools` gets them as a system message
that we write, and one that never mentions `tool_calls` gets an assistant's calls written into
its content in the server's tool-call format, so that a history is never silently dropped.
"""

from __future__ import annotations

import json
from pathlib import Path

# apply_chat_template's own parameters: chat_template_kwargs may not set them
RESERVED_OPTIONS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered; the message is for the client (a 400)."""


def render_chat(tokenizer, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False, options: dict | None = None, call_format=None,
                template: str | None = None) -> str:
    """The prompt text of `messages`. `continue_final_message`: the text ends inside the last
    message, without its end of turn, so that the model continues it (an assistant's prefill;
    not with add_generation_prompt). `options`: variables for the template (chat_template_kwargs,
    such as {"enable_thinking": False}); `call_format`: how to write an assistant's calls for a
    template that does not render them (a ToolCallFormat, tool_calls.py); `template`: a template
    in place of the tokenizer's (a request's own, checked by `parsed_template`)."""
    given = template
    template = template or getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        raise ChatTemplateError("this model has no chat template; send a plain prompt (/v1/completions)")
    clash = RESERVED_OPTIONS.intersection(options or {})
    if clash:
        raise ChatTemplateError(f"'chat_template_kwargs' may not set {', '.join(sorted(clash))}")
    messages = fit_to_template(template, messages, tools, call_format)
    if "tools" not in template:
        tools = None
    try:
        return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             **({"chat_template": given} if given else {}), **(options or {}))
    except Exception as exc:  # the template's own checks (role order, ...) raise jinja errors
        raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from None


def chat_template_text(value: str, name: str = "--chat_template") -> str:
    """--chat_template's template (or LLM.chat's, `name`): the file `value` names, or `value`
    itself where it is a template's text (it has a Jinja tag or expression). ValueError, naming
    the flag, where it is neither or does not parse (with transformers' settings: sandboxed, loop
    controls on)."""
    try:
        path = Path(value).expanduser()
        text = path.read_text() if path.is_file() else None
    except OSError:  # a template's text is no usable path (too long a name, ...)
        text = None
    if text is None:
        if "{{" not in value and "{%" not in value:
            raise ValueError(f"{name} {value!r} is neither a file nor a template's text")
        text = value
    error = parse_error(text)
    if error is not None:
        raise ValueError(f"{name} does not parse: {error}")
    return text


def parsed_template(text: str) -> str:
    """A request's own chat template (vLLM's `chat_template` field), its text checked as
    --chat_template's is; ChatTemplateError (a 400) where it does not parse."""
    error = parse_error(text)
    if error is not None:
        raise ChatTemplateError(f"'chat_template' does not parse: {error}")
    return text


def parse_error(text: str) -> str | None:
    """Why a template's text does not parse, with transformers' settings (sandboxed, loop controls
    on), or None."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateSyntaxError as exc:
        return f"{exc.message} (line {exc.lineno})"
    return None


CHAT_SPECIAL_TOKENS = False  # the template writes any special tokens (BOS, role markers) itself


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=CHAT_SPECIAL_TOKENS)


def fit_to_template(template: str, messages: list[dict], tools: list[dict] | None, call_format) -> list[dict]:
    """`messages`, with what the template cannot render written as text it can."""
    if call_format is not None and "tool_calls" not in template:
        messages = [_calls_as_text(m, call_format) if m.get("tool_calls") else m for m in messages]
    if tools and "tools" not in template:
        messages = _with_tool_system_prompt(messages, tools, call_format)
    return messages


def _calls_as_text(message: dict, call_format) -> dict:
    calls = [call_format.write(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    text = "\n".join(filter(None, [message.get("content") or "", *calls]))
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}


def _with_tool_system_prompt(messages: list[dict], tools: list[dict], call_format) -> list[dict]:
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    how = f" To call one, write {call_format.example}" if call_format is not None else ""
    text = f"You may call these functions (JSON schemas of their arguments):\n{listing}\n{how.strip()}".rstrip()
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
