"""The tool-call and reasoning parsers against model texts as Qwen2.5/Qwen3 (hermes) and Llama 3.1
(llama3_json) write them: whole, and streamed in pieces split anywhere, which must join into the
same answer. The chat template's handling of tools and histories, and the forced-call grammar."""

import json
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightllm.frontend.chat.output import FORMATS, Answer, AnswerParser, chat_parsers
from lightllm.frontend.chat.reasoning import Qwen3Reasoning
from lightllm.frontend.chat.template import ChatTemplateError, render_chat
from lightllm.frontend.chat.tool_calls import CallStart, HermesParser, Llama3JsonParser

# (text, content, reasoning, [(name, arguments)])
HERMES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
     "", "", [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    ('Let me look.\n\n<tool_call>\n{"name": "a", "arguments": {"q": "}{\\"</tool_call>", "n": [1, {"x": []}]}}\n'
     '</tool_call>\n<tool_call>\n{"name": "b_2", "arguments": {}}\n</tool_call>\n',
     "Let me look.", "", [("a", '{"q": "}{\\"</tool_call>", "n": [1, {"x": []}]}'), ("b_2", "{}")]),
    ('<tool_call>{"arguments": {"k": 1}, "name": "late_name"}</tool_call>', "", "", [("late_name", '{"k": 1}')]),
    ('<tool_call>{"name": "s", "arguments": "{\\"k\\": 2}"}</tool_call>', "", "", [("s", '{"k": 2}')]),
    ("No call here, only < and <tool and {json}.", "No call here, only < and <tool and {json}.", "", []),
    ("Broken: <tool_call>not json</tool_call> end", "Broken: <tool_call>not json</tool_call> end", "", []),
    ('<tool_call>\n{"name": "cut", "arguments": {"city": "Par', "", "", [("cut", '{"city": "Par')]),
    ("  spaces kept  \n", "  spaces kept  \n", "", []),
    ('Ünïcödé 你好 <tool_call>{"name": "u", "arguments": {"t": "🤖"}}</tool_call>', "Ünïcödé 你好", "",
     [("u", '{"t": "🤖"}')]),
]
LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", "", [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": "}"}}\n', "", "",
     [("a", '{"x": 1}'), ("b", '{"y": "}"}')]),
    ("The answer is 42.", "The answer is 42.", "", []),
    ("  {not a call", "  {not a call", "", []),
]
QWEN3 = [  # with hermes calls after the reasoning
    ("<think>\nThe user wants weather.\n</think>\n\nSure.", "Sure.", "The user wants weather.", []),
    ('<think>\nCall it.\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "",
     "Call it.", [("f", '{"a": 1}')]),
    ("Plain answer, no thinking.", "Plain answer, no thinking.", "", []),
    ("<think>\nCut off while thinking", "", "Cut off while thinking", []),
    ("<think>\nCut off  \n", "", "Cut off  \n", []),
    ("<thinking is not the tag", "<thinking is not the tag", "", []),
]


def hermes():
    return AnswerParser(None, HermesParser())


def llama3():
    return AnswerParser(None, Llama3JsonParser())


def qwen3():
    return AnswerParser(Qwen3Reasoning(), HermesParser())


CASES = [(hermes, *case) for case in HERMES] + [(llama3, *case) for case in LLAMA3] + [(qwen3, *case) for case in QWEN3]


def summary(answer: Answer) -> tuple:
    return answer.content, answer.reasoning, [(c.name, c.arguments) for c in answer.calls]


def streamed(make, pieces: list[str]) -> Answer:
    parser, answer = make(), Answer()
    for piece in pieces:
        answer.add(parser.feed(piece))
    answer.add(parser.finish())
    return answer


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("make,text,content,reasoning,calls", CASES)
def test_whole_text(make, text, content, reasoning, calls):
    assert summary(make().parse(text)) == (content, reasoning, calls)


@pytest.mark.parametrize("make,text,content,reasoning,calls", CASES)
def test_one_character_at_a_time(make, text, content, reasoning, calls):
    assert summary(streamed(make, list(text))) == (content, reasoning, calls)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), data=st.data())
def test_any_split_joins_to_the_whole(case, data):
    make, text, *expected = case
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    assert summary(streamed(make, split(text, cuts))) == tuple(expected)


def test_a_call_starts_with_its_name_before_its_arguments_end():
    """OpenAI's streams: the first delta of a call carries its id and name, the rest its arguments."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parser = HermesParser()
    events = [(i, e) for i in range(len(text)) for e in parser.feed(text[i])]
    events += [(len(text), e) for e in parser.finish()]
    (start_at, start), *args = events
    assert isinstance(start, CallStart) and start.name == "get_weather" and start.id.startswith("call_")
    assert start_at < text.index("Paris") and len(args) > 5  # the arguments stream, character by character
    assert "".join(e.text for _, e in args) == '{"city": "Paris"}'


def test_reasoning_that_starts_in_the_prompt():
    """Templates that always think end the prompt with <think>: the answer begins inside it."""
    parser = AnswerParser(Qwen3Reasoning.for_prompt("<|im_start|>assistant\n<think>\n"), None)
    assert summary(parser.parse("weighing it\n</think>\n\nYes.")) == ("Yes.", "weighing it", [])


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_written_calls_parse_back(name):
    call_format = FORMATS[name]
    args = {"city": "Zürich", "days": [1, 2], "nested": {"q": "\"}"}}
    text = call_format.write("get_weather", args)
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "array"},
                                               "nested": {"type": "object"}}}  # the XML form's values need it
    (call,) = AnswerParser(None, call_format.new_parser({"get_weather": schema})).parse(text).calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", args)


def test_default_format_follows_the_template_then_the_model():
    assert chat_parsers(None, None, "LlamaForCausalLM", "... <tool_call> ...").call_format is FORMATS["hermes"]
    assert chat_parsers(None, None, "LlamaForCausalLM", "{{ messages }}").call_format is FORMATS["llama3_json"]
    assert chat_parsers(None, None, "Qwen3ForCausalLM", None).call_format is FORMATS["hermes"]
    assert chat_parsers("llama3_json", "qwen3", "Qwen3ForCausalLM", "<tool_call>").reasoning is Qwen3Reasoning


# ---- the chat template ----

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
]


@pytest.fixture(scope="module")
def tool_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    from tool_model import TOOL_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


def test_tools_calls_and_results_reach_the_template(tool_tokenizer):
    text = render_chat(tool_tokenizer, HISTORY, tools=[WEATHER_TOOL])
    assert json.dumps(WEATHER_TOOL) in text  # the definitions
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"celsius": 21}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_template_kwargs_reach_the_template(tool_tokenizer):
    thinking_off = render_chat(tool_tokenizer, HISTORY[:1], options={"enable_thinking": False})
    assert thinking_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render_chat(tool_tokenizer, HISTORY[:1]).endswith("<|im_start|>assistant\n")
    with pytest.raises(ChatTemplateError, match="add_generation_prompt"):
        render_chat(tool_tokenizer, HISTORY[:1], options={"add_generation_prompt": False})


def test_a_template_without_tools_gets_them_as_text(default_model_dir):
    """SmolLM2's template knows neither tools nor calls: both are written in the server's format."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    call_format = FORMATS["hermes"]
    text = render_chat(tokenizer, HISTORY, tools=[WEATHER_TOOL], call_format=call_format)
    assert json.dumps(WEATHER_TOOL) in text and call_format.example in text
    assert call_format.write("get_weather", {"city": "Paris"}) in text
    assert '<|im_start|>tool\n{"celsius": 21}<|im_end|>' in text


# ---- the forced-call grammar ----

@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
def test_forced_grammar_takes_exactly_the_calls_it_should(name, default_model_dir):
    from transformers import AutoTokenizer

    from lightllm.engine.grammar import Grammars, json_schema_ebnf

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    call_format = FORMATS[name]
    schema = WEATHER_TOOL["function"]["parameters"]
    arguments = {"type": "grammar", "grammar": json_schema_ebnf(schema)}
    spec = call_format.forced_grammar([("get_weather", arguments)], parallel=False)
    grammars = Grammars(default_model_dir, len(tokenizer))

    def accepts(text: str) -> bool:
        matcher = grammars.matcher("structural_tag", spec)
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        return all(matcher._matcher.accept_token(i) for i in ids) and matcher.terminated

    assert accepts(call_format.write("get_weather", {"city": "Paris"}))
    assert not accepts(call_format.write("get_weather", {"town": "Paris"}))  # the schema's required key
    assert not accepts(call_format.write("get_weather", {"city": 7}))  # its type
    spaced = call_format.write("get_weather", {"city": "Paris"}).replace('{"city": ', '{ "city": ')
    assert not accepts(spaced)  # json.dumps' layout, as structured output: no free whitespace
    assert not accepts(call_format.write("other", {"city": "Paris"}))  # another function
    assert not accepts("Paris is sunny.")  # no call at all
    two = call_format.separator.join([call_format.write("get_weather", {"city": c}) for c in ("A", "B")])
    assert not accepts(two)  # one call without parallel_tool_calls
    parallel = call_format.forced_grammar([("get_weather", arguments)], parallel=True)
    matcher = grammars.matcher("structural_tag", parallel)
    assert all(matcher._matcher.accept_token(i) for i in tokenizer.encode(two, add_special_tokens=False))


@pytest.mark.parametrize("written", ["", "Pa", "Pa\\u00e9"])
def test_a_forced_call_allows_no_raw_control_character_in_a_bounded_string(default_model_dir, written):
    """The tool server's forced call (tests/tool_model.py's WEATHER: city has maxLength 12) once took
    the byte-level tokens of \\x01 .. \\x1f and the tab inside the city, which json.loads refuses."""
    import torch
    from transformers import AutoTokenizer

    from lightllm.engine.grammar import Grammars, allocate_bitmask, json_schema_ebnf
    from tool_model import WEATHER

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    call_format = FORMATS["hermes"]
    arguments = {"type": "grammar", "grammar": json_schema_ebnf(WEATHER)}
    spec = call_format.forced_grammar([("get_weather", arguments)], parallel=False)
    matcher = Grammars(default_model_dir, len(tokenizer)).matcher("structural_tag", spec)
    inside_city = f'{call_format.begin}{{"name": "get_weather", "arguments": {{"city": "{written}'
    assert all(matcher.accept(i) for i in tokenizer.encode(inside_city, add_special_tokens=False))
    bitmask = allocate_bitmask(1, len(tokenizer))
    matcher.fill(bitmask, 0)
    bits = ((bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:len(tokenizer)]
    texts = tokenizer.batch_decode([[i] for i in bits.nonzero()[:, 0].tolist()])
    assert not [t for t in texts if any(ord(c) < 0x20 for c in t)]
    assert "\\" in texts and "é" in texts  # an escape may start; any other character is one
