"""Structured output: the validator, the compile cache, the masks, and decoding under a grammar."""

import json
import os
import random
import re
import threading

import pytest
import torch

from lightllm.engine.grammar import (CACHE_SIZE, GrammarError, Grammars, Matcher, allocate_bitmask, apply_bitmask_,
                                     apply_bitmask_reference_, check_spec, json_arguments,
                                     json_schema_ebnf, parse_grammar)
from lightllm.engine.model_runner import GRAMMAR_NICENESS
from lightllm.engine.plan import LoadGrammar

VOCAB = 49152  # the default model's config.json
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "color": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "age", "color"]}
REGEX = r"[A-Z][a-z]{2,6}-\d{3}"

LOCAL_REF = {"type": "object", "$defs": {"city": {"type": "string"}}, "properties": {"x": {"$ref": "#/$defs/city"}}}
GOOD = [("json_object", ""), ("json_schema", json.dumps(SCHEMA)), ("json_schema", "{}"),
        ("json_schema", json.dumps(LOCAL_REF)),
        ("regex", REGEX), ("ebnf", 'root ::= "yes" | "no" | item\nitem ::= [0-9]+')]
BAD = [("yaml", "a: 1", "unknown grammar kind"),
       ("json_object", "{}", "takes no spec"),
       ("json_schema", '{"type": "object"', "not valid JSON"),
       ("json_schema", "[1, 2]", "should be an object"),
       ("json_schema", '{"type": "foo"}', "not a JSON type"),
       # xgrammar reads a remote $ref as no constraint at all
       ("json_schema", '{"properties": {"a": {"$ref": "https://example.com/s.json"}}}', "/properties/a"),
       ("json_schema", '{"$ref": "#/$defs/none"}', "names nothing"),
       ("json_schema", '{"anyOf": {"type": "string"}}', "anyOf"),
       ("regex", "(ab", "not closed"),
       ("regex", "[a-", "Unclosed"),
       ("ebnf", 'item ::= "a"', "root"),
       ("ebnf", "root ::= missing", "not defined")]


@pytest.mark.parametrize("kind,spec", GOOD)
def test_parse_grammar_accepts(kind, spec):
    check_spec(kind, spec)
    parse_grammar(kind, spec)


@pytest.mark.parametrize("kind,spec,hint", BAD)
def test_parse_grammar_rejects_with_a_one_line_message(kind, spec, hint):
    with pytest.raises(GrammarError, match=re.escape(hint)) as err:
        parse_grammar(kind, spec)
    message = str(err.value)
    assert "\n" not in message and not message.startswith("[")  # xgrammar's "[time] file.cc:line:" is cut


@pytest.mark.parametrize("kind,spec,hint", BAD[:8])
def test_the_cheap_check_refuses_what_it_can_without_xgrammar(kind, spec, hint):
    """A server checks every request with `check_spec` (the xgrammar parse runs with the compile):
    the kind, the JSON and a schema's structure are refused there already."""
    with pytest.raises(GrammarError, match=re.escape(hint)):
        check_spec(kind, spec)


def test_a_forced_calls_arguments_are_parsed_with_its_tag():
    """A forced call's structural tag carries each function's schema (`json_arguments`), not its
    EBNF: the cheap check leaves it be, and the parse writes in the grammar json_schema_ebnf gives
    (the same grammar as a tag made with it), naming the function whose schema xgrammar refuses."""
    def tag(content: dict) -> str:
        return json.dumps({"type": "structural_tag",
                           "format": {"type": "tag", "begin": "<call>", "content": content, "end": "</call>"}})

    separators = (",", ":")
    ours = tag(json_arguments("f", SCHEMA, separators))
    check_spec("structural_tag", ours)
    made = tag({"type": "grammar", "grammar": json_schema_ebnf(SCHEMA, separators)})
    assert str(parse_grammar("structural_tag", ours)) == str(parse_grammar("structural_tag", made))
    refused = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(ab"}}}
    check_spec("structural_tag", tag(json_arguments("g", refused, separators)))
    with pytest.raises(GrammarError, match="function 'g': its parameters cannot be used"):
        parse_grammar("structural_tag", tag(json_arguments("g", refused, separators)))
    with pytest.raises(GrammarError, match="'separators'"):
        parse_grammar("structural_tag", tag({"type": "json_arguments", "function": "h", "json_schema": SCHEMA}))
    # xgrammar reads a remote $ref as no constraint: refused in a tag's schemas too, by the cheap check
    remote = {"properties": {"a": {"$ref": "https://example.com/s.json"}}}
    with pytest.raises(GrammarError, match="function 'r': .*/properties/a"):
        check_spec("structural_tag", tag(json_arguments("r", remote, separators)))
    with pytest.raises(GrammarError, match="json_schema content of the structural tag: .*/properties/a"):
        check_spec("structural_tag", tag({"type": "json_schema", "json_schema": remote}))


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tensors here are one row each: a second thread only adds contention on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def grammars(default_model_dir):
    return Grammars(default_model_dir, VOCAB)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def closing_bias(tokenizer):
    """Random logits plus this end quickly: EOS and tokens that close a string or an object are
    favoured, whitespace (which JSON allows without limit between elements) is not."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    bias = torch.zeros(VOCAB)
    bias[[i for i, t in enumerate(texts) if '"' in t or "}" in t]] = 6.0
    bias[[i for i, t in enumerate(texts) if t.isspace()]] = -6.0
    bias[tokenizer.eos_token_id] = 20.0
    return bias


MAX_STEPS = 200  # tokens a biased random walk may take to end the grammar


def decode(grammars, tokenizer, bias, kind, spec, seed, max_steps=MAX_STEPS):
    """Sample random biased logits under the grammar's mask until it terminates; the text."""
    matcher = grammars.matcher(kind, spec)
    bitmask = allocate_bitmask(1, VOCAB)
    gen = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(max_steps):
        matcher.fill(bitmask, 0)
        logits = torch.randn(1, VOCAB, generator=gen) + bias
        apply_bitmask_(logits, bitmask, None)
        refused = (logits[0] == float("-inf")).nonzero()[:, 0]
        assert 0 < len(refused) < VOCAB
        outside = refused[torch.randint(len(refused), (1,), generator=gen)].item()
        assert not matcher.accept(outside), f"token {outside} is outside the mask but was accepted"
        token = torch.multinomial(logits.softmax(-1), 1, generator=gen).item()
        assert matcher.accept(token)
        if matcher.terminated:
            assert token == tokenizer.eos_token_id
            return tokenizer.decode(tokens)
        tokens.append(token)
    raise AssertionError(f"no end after {max_steps} tokens: {tokenizer.decode(tokens)!r}")


@pytest.mark.parametrize("seed", range(3))
def test_json_schema_output_validates(grammars, tokenizer, closing_bias, seed):
    value = json.loads(decode(grammars, tokenizer, closing_bias, "json_schema", json.dumps(SCHEMA), seed))
    assert isinstance(value, dict) and set(value) == {"name", "age", "color"}  # strict: no other keys
    assert isinstance(value["name"], str)
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool)
    assert value["color"] in SCHEMA["properties"]["color"]["enum"]


LAYOUTS = [('{"name": "Jo", "age": 25, "color": "red"}', True),
           ('{"name":"Jo","age":25,"color":"red"}', False),
           ('{ "name": "Jo", "age": 25, "color": "red" }', False),
           ('{"name": "Jo",\n"age": 25, "color": "red"}', False)]


@pytest.mark.parametrize("text,accepted", LAYOUTS)
def test_json_whitespace_is_one_space_after_colons_and_commas(grammars, tokenizer, text, accepted):
    """docs/api.md's layout: json.dumps' one line, no free whitespace."""
    matcher = grammars.matcher("json_schema", json.dumps(SCHEMA))
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert (all(matcher.accept(token) for token in ids) and matcher.terminated) == accepted


BOUNDED = {"type": "string", "minLength": 2, "maxLength": 3}
BOUNDED_TEXTS = ['"ab"', '"abcd"', '"a"', '"a\tb"', '"a\x01"', '"a\\tb"', '"\\u00e9\\n"', '"a\\"b"', '"é你🤖"', '"a\\x"']


def json_string_in_bounds(text: str) -> bool:
    try:
        value = json.loads(text)  # strict: no raw control character inside a string
    except ValueError:
        return False
    return BOUNDED["minLength"] <= len(value) <= BOUNDED["maxLength"]


@pytest.mark.parametrize("text", BOUNDED_TEXTS)
def test_a_string_with_a_length_bound_takes_what_json_loads_takes(grammars, tokenizer, text):
    """Each escape counts once, as in the decoded string. xgrammar's own rule for such a string takes
    raw control characters and no escape (mlc-ai/xgrammar#800; grammar._json_schema rewrites it)."""
    matcher = grammars.matcher("json_schema", json.dumps(BOUNDED))
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert (all(matcher.accept(token) for token in ids) and matcher.terminated) == json_string_in_bounds(text)


SURROGATE = b"\xed\xa0\x80"  # U+D800 written as UTF-8 would write it: bytes no UTF-8 decoder takes


@pytest.mark.parametrize("schema", [BOUNDED, {"type": "string"}, {"type": "object"}])
def test_a_json_string_takes_no_surrogate(grammars, schema):
    """xgrammar's strings, bounded or not, took a surrogate's three bytes as one character: a forced
    call's 12-character city decoded to 14, three U+FFFD (grammar._json_schema excludes them)."""
    start = '{"a' if schema["type"] == "object" else '"a'
    matcher = grammars.matcher("json_schema", json.dumps(schema))._matcher
    assert matcher.accept_string(start) and not matcher.accept_string(SURROGATE)
    assert matcher.accept_string("🤖".encode()) and matcher.accept_string('"')


@pytest.mark.parametrize("seed", range(3))
def test_json_object_output_is_an_object(grammars, tokenizer, closing_bias, seed):
    assert isinstance(json.loads(decode(grammars, tokenizer, closing_bias, "json_object", "", seed)), dict)


@pytest.mark.parametrize("seed", range(3))
def test_regex_output_matches(grammars, tokenizer, closing_bias, seed):
    text = decode(grammars, tokenizer, closing_bias, "regex", REGEX, seed)
    assert re.fullmatch(REGEX, text), text


def test_compile_cache(grammars, monkeypatch):
    schema = json.dumps(SCHEMA)
    assert grammars.compile("json_schema", schema) is grammars.compile("json_schema", schema)
    assert grammars.compile("regex", "a+") is not grammars.compile("regex", "b+")
    monkeypatch.setattr("lightllm.engine.grammar.CACHE_SIZE", 2)
    first = grammars.compile("regex", "x1")
    second = grammars.compile("regex", "x2")
    assert grammars.compile("regex", "x1") is first  # used again: now the most recent
    grammars.compile("regex", "x3")  # evicts x2, the least recently used
    assert len(grammars._compiled) == 2
    assert grammars.compile("regex", "x1") is first
    assert grammars.compile("regex", "x2") is not second
    assert CACHE_SIZE >= 2


def test_a_serialized_grammar_reads_back_to_the_same_masks(default_model_dir, grammars, tokenizer, closing_bias):
    """What the HTTP process compiles (`serialize`) and a runner's Grammars reads back (`compile`
    with it, no compile of its own): every step's mask equals that of the grammar compiled here."""
    spec = json.dumps(SCHEMA)
    runner_side = Grammars(default_model_dir, VOCAB)
    runner_side.compile = lambda kind, spec, serialized="": Grammars.compile(runner_side, kind, spec, serialized) \
        if serialized else pytest.fail("the runner compiled")
    read_back = runner_side.matcher("json_schema", spec, grammars.serialize("json_schema", spec))
    direct = grammars.matcher("json_schema", spec)
    masks = allocate_bitmask(2, VOCAB)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    for _ in range(MAX_STEPS):  # 60 ended 8 walks of 150 (seeds 0-149) too soon; the longest took 117
        read_back.fill(masks, 0)
        direct.fill(masks, 1)
        assert torch.equal(masks[0], masks[1])
        logits = torch.randn(1, VOCAB, generator=gen) + closing_bias
        apply_bitmask_(logits, masks[1:], None)
        token = torch.multinomial(logits.softmax(-1), 1, generator=gen).item()
        assert read_back.accept(token) and direct.accept(token)
        if direct.terminated:
            assert read_back.terminated
            return
    pytest.fail(f"no end after {MAX_STEPS} tokens")


def test_a_prepared_runner_only_reads_a_grammar_on_a_thread_of_lower_priority(tmp_path, monkeypatch):
    """A server's runner builds its structured output as it starts (`prepare_grammars`: xgrammar's
    import and its view of the tokenizer, Python holding the GIL for a second or more, which done at
    the first grammar stalled every running request's steps); a grammar that comes later is only
    read (xgrammar's C++, without the GIL), on a thread that yields its core to the steps'."""
    from helpers.models import make_runner
    from lightllm.tools.bench_model import write_bench_model

    runner = make_runner(write_bench_model(tmp_path, "tiny"))
    runner.prepare_grammars()
    grammar_thread = runner._grammar_executor()
    grammar_thread.submit(lambda: None).result(timeout=300)  # the preparation is done
    assert runner._grammars is not None, "prepare_grammars built nothing"
    spec = json.dumps(SCHEMA)
    serialized = runner._grammars.serialize("json_schema", spec)  # as the HTTP process sends it
    monkeypatch.setattr(Grammars, "_make_compiler", lambda self: pytest.fail("the load built the tokenizer view"))
    matcher = runner._load_grammar(LoadGrammar(7, "json_schema", spec, serialized)).result(timeout=60)
    assert isinstance(matcher, Matcher)
    thread = grammar_thread.submit(threading.get_native_id).result()
    steps = os.getpriority(os.PRIO_PROCESS, 0)  # this thread's niceness, as the steps' thread's
    assert os.getpriority(os.PRIO_PROCESS, thread) == max(steps, GRAMMAR_NICENESS)


def test_matcher_rejects_a_bad_spec(grammars):
    with pytest.raises(GrammarError, match="not closed"):
        grammars.matcher("regex", "(ab")


def test_allocate_bitmask_is_xgrammars_layout():
    import xgrammar

    for vocab in (100, VOCAB):
        assert torch.equal(allocate_bitmask(3, vocab), xgrammar.allocate_token_bitmask(3, vocab))


def _expected(logits, bitmask, rows):
    """Bit by bit in Python: the oracle for both implementations."""
    out = logits.clone()
    for r in rows:
        for j in range(logits.shape[1]):
            if (int(bitmask[r, j // 32]) & 0xFFFFFFFF) >> (j % 32) & 1 == 0:
                out[r, j] = float("-inf")
    return out


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [100, 32 * 7])
@pytest.mark.parametrize("rows", [None, [0, 3]])
def test_apply_bitmask_matches_reference(device, vocab, rows):
    gen = torch.Generator().manual_seed(vocab + len(rows or ()))
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31, (5, (vocab + 31) // 32), generator=gen, dtype=torch.int64).int()
    expected = _expected(logits, bitmask, range(5) if rows is None else rows)
    assert (expected == float("-inf")).any() and (expected != float("-inf")).any()
    row_tensor = None if rows is None else torch.tensor(rows)
    for apply in (apply_bitmask_, apply_bitmask_reference_):
        out = logits.to(device)
        apply(out, bitmask, row_tensor)
        assert torch.equal(out.cpu(), expected), apply.__name__
