"""A conversation's prompt for the chat routes (/v1/chat/completions, /v1/responses, /v1/messages,
/tokenize): messages in the chat template's vocabulary -> the rendered text and its token ids."""

from __future__ import annotations

import json

from lightllm.frontend.chat.template import CHAT_SPECIAL_TOKENS, ChatTemplateError, parsed_template, render_chat
from lightllm.server.httpserver.generation import off_loop
from lightllm.frontend.errors import RequestError
from lightllm.server.httpserver.openai_params import FunctionDef, forced_call_grammar, template_tool
from lightllm.frontend.limits import check_lengths, check_prompt_chars, truncated
from lightllm.engine.request import SamplingParams


def message_chars(messages: list[dict]) -> int:
    """The text a conversation holds: contents and calls' arguments."""
    return sum(len(m["content"]) + sum(len(json.dumps(c["function"]["arguments"])) for c in m.get("tool_calls", ()))
               for m in messages)


async def chat_prompt(state, messages: list[dict], tools: list[dict] | None = None, options: dict | None = None,
                      add_generation_prompt: bool = True, continue_final_message: bool = False,
                      template: str | None = None) -> tuple[str, list[int]]:
    """(prompt text, token ids); a conversation the template cannot render is a 400. With
    continue_final_message the prompt ends inside the last message (render_chat). `template`: the
    request's own chat template (vLLM's field): a 400 unless --trust_request_chat_template."""
    check_prompt_chars(message_chars(messages) + (len(json.dumps(tools)) if tools else 0), state.limits)
    if template is not None and not state.config.trust_request_chat_template:
        raise RequestError("'chat_template' is not rendered: this server renders chats with its own template "
                           "unless started with --trust_request_chat_template (vLLM's --trust-request-chat-template)")

    def render() -> str:
        return render_chat(state.tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, options=options,
                           call_format=state.chat.call_format,
                           template=None if template is None else parsed_template(template))

    try:
        text = await off_loop(render)
    except ChatTemplateError as exc:
        raise RequestError(str(exc)) from None
    return text, await state.encoder.encode(text, add_special_tokens=CHAT_SPECIAL_TOKENS)


def default_max_tokens(state, prompt_ids: list[int]) -> int:
    """As many tokens as the context leaves (OpenAI's default when a client gives none)."""
    room = min(state.limits.max_req_total_len, state.limits.max_total_token_num) - len(prompt_ids)
    return max(1, room)


async def chat_inputs(state, messages: list[dict], functions: list[FunctionDef], choice: str, parallel: bool,
                      options: dict | None, sampling: SamplingParams, max_tokens_given: bool,
                      max_tokens_field: str, add_generation_prompt: bool = True,
                      continue_final_message: bool = False, truncate: int | None = None,
                      template: str | None = None) -> tuple[str, list[int]]:
    """The prompt (text, token ids) of a chat API's request, with `sampling` completed: a forced
    call's grammar (`choice` required or a function's name), the default max_new_tokens, and its
    grammar compiled (a 400 past --grammar_compile_timeout) once the lengths are known to fit
    (an error names max_new_tokens as the route does: `max_tokens_field`). The prompt ends as
    render_chat's add_generation_prompt and continue_final_message say; `truncate` keeps only its
    last tokens (frontend/limits.py's truncated: the text stays whole)."""
    tools = state.chat.prompt_tools([template_tool(f) for f in functions], choice)
    if state.chat.keeps_special_tokens:  # the reasoning parser reads them (harmony) and takes them out
        sampling.skip_special_tokens = False
    text, prompt_ids = await chat_prompt(state, messages, tools, options, add_generation_prompt,
                                         continue_final_message, template)
    prompt_ids = truncated(prompt_ids, truncate, state.limits)
    if not max_tokens_given:
        sampling.max_new_tokens = default_max_tokens(state, prompt_ids)
    check_lengths(len(prompt_ids), sampling, state.limits, max_tokens_field)  # a prompt refused compiles nothing
    if choice not in ("none", "auto"):
        sampling.grammar_kind, sampling.grammar = await off_loop(
            forced_call_grammar, state.chat.call_format, functions, choice, parallel, sampling.max_new_tokens)
    await state.grammars.attach(sampling)  # the forced call's or the response format's, compiled here
    return text, prompt_ids
