"""A conversation's prompt for the chat routes (/v1/chat/completions, /v1/responses, /v1/messages,
/tokenize): messages in the chat template's vocabulary -> the rendered text and its token ids."""

from __future__ import annotations

import json

from lightllm.server.chat.template import ChatTemplateError, chat_prompt_ids, render_chat
from lightllm.server.httpserver.generation import off_loop
from lightllm.server.httpserver.json_body import RequestError
from lightllm.server.httpserver.params import check_prompt_chars


def message_chars(messages: list[dict]) -> int:
    """The text a conversation holds: contents and calls' arguments."""
    return sum(len(m["content"]) + sum(len(json.dumps(c["function"]["arguments"])) for c in m.get("tool_calls", ()))
               for m in messages)


async def chat_prompt(state, messages: list[dict], tools: list[dict] | None = None, options: dict | None = None,
                      add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """(prompt text, token ids); a conversation the template cannot render is a 400."""
    check_prompt_chars(message_chars(messages) + len(json.dumps(tools or [])), state.limits)

    def render() -> str:
        return render_chat(state.tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                           options=options, call_format=state.chat.call_format)

    try:
        text = await off_loop(render)
    except ChatTemplateError as exc:
        raise RequestError(str(exc)) from None
    return text, await off_loop(chat_prompt_ids, state.tokenizer, text)
