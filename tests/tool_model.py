"""A tiny random model whose chat template knows tools, tool calls, tool results and Qwen3's
enable_thinking, in the Hermes style Qwen2.5 and Qwen3 use (written for these tests)."""

from __future__ import annotations

import json
from pathlib import Path

from lightllm.tools.bench_model import write_bench_model

TOOL_TEMPLATE = """\
{%- set rest = messages[1:] if messages[0].role == 'system' else messages -%}
{%- if messages[0].role == 'system' or tools -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif -%}
{%- if tools %}Functions you may call:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one as <tool_call>{"name": NAME, "arguments": ARGUMENTS}</tool_call>.
{% endif %}<|im_end|>
{% endif -%}
{%- for message in rest -%}
{%- if message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif -%}
{%- endif -%}
"""


def write_tool_model(out: Path) -> Path:
    model_dir = write_bench_model(out, "tiny")
    (model_dir / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    return model_dir


def matches(value, schema: dict) -> bool:
    """Whether `value` satisfies the few JSON-schema keywords the tool tests use."""
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind == "object":
        properties = schema.get("properties", {})
        return isinstance(value, dict) and all(key in value for key in schema.get("required", ())) \
            and (schema.get("additionalProperties", True) or set(value) <= set(properties)) \
            and all(matches(value[key], sub) for key, sub in properties.items() if key in value)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) \
            and schema.get("minimum", value) <= value <= schema.get("maximum", value)
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "boolean":
        return isinstance(value, bool)
    return kind is None


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "hourly": {"type": "boolean"},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
