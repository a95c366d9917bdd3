"""FrontendConfig: the engine's settings and those of request preparation (lengths, chat
templates, parsers, sampling defaults, grammars), shared by the HTTP server and the offline LLM."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightllm.engine.config import EngineConfig, flag


@dataclass(frozen=True)
class FrontendConfig(EngineConfig):
    max_req_input_len: int = field(default=2048, metadata=flag("longest prompt accepted, in tokens"))
    grammar_compile_timeout: float = field(
        default=10.0,
        metadata=flag("seconds a request's grammar (JSON schema, regex, forced tool call) may take to compile; longer gets 400 and the compile is killed. It compiles in a child process of the HTTP server, off the engine step, once per grammar (cached)"),
    )
    sampling_defaults: str = field(
        default="model",
        metadata=flag("model: the OpenAI-style routes (/v1/*) take the sampling fields a request leaves out (temperature, top_p, top_k, min_p, repetition_penalty) from the model's generation_config.json, as vLLM does by default (--generation-config auto; Qwen2.5: temperature 0.7, top_p 0.8, top_k 20); openai: OpenAI's defaults (temperature 1, the whole vocabulary). /generate keeps TGI's (greedy unless do_sample)", choices=("model", "openai")),
    )
    chat_template: str | None = field(
        default=None,
        metadata=flag("the Jinja chat template of every chat route (/v1/chat/completions, /v1/responses, /v1/messages, /tokenize's messages) and of LLM.chat, in place of the model's own: a file's path, or the template's text; for a model without one, or to change it (vLLM's --chat-template). Absent: the model directory's"),
    )
    tool_call_parser: str | None = field(
        default=None,
        metadata=flag("how the model writes tool calls, parsed into 'tool_calls' by the chat APIs: hermes = <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> (Qwen2.5, Qwen3), llama3_json = {\"name\": ..., \"parameters\": ...} (Llama 3.1), qwen3_xml = <tool_call><function=NAME><parameter=ARG>VALUE</parameter></function></tool_call>, values typed by the tool's schema (Qwen3.5, Qwen3-Coder); absent: the one the chat template writes, else llama3_json for Llama models, qwen3_xml for Qwen3.5 and hermes for the others", choices=("hermes", "llama3_json", "qwen3_xml")),
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata=flag("qwen3: the model's <think>...</think> is returned apart from the answer ('reasoning_content'; a reasoning item in /v1/responses, a thinking block in /v1/messages); harmony: gpt-oss's channels, analysis as reasoning and messages to functions.NAME as tool calls (the default for gpt-oss; qwen3 is Qwen3.5's, whose template opens <think> in the prompt); absent: it stays in the text", choices=("qwen3", "harmony")),
    )

    def check(self) -> None:
        super().check()
        if self.max_req_input_len < 1 or self.max_req_total_len <= self.max_req_input_len:
            raise ValueError("--max_req_total_len must be larger than --max_req_input_len (both positive)")
        if self.grammar_compile_timeout <= 0:
            raise ValueError("--grammar_compile_timeout must be positive")
        if self.chat_template is not None:
            from lightllm.frontend.chat.template import chat_template_text  # jinja2: only when asked

            chat_template_text(self.chat_template)  # a missing file or a syntax error at start, not per request
