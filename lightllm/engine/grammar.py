"""Structured output: a request's grammar as a mask over the next token.

xgrammar compiles a JSON schema, a regex or an EBNF grammar against the tokenizer's vocabulary
once, and then answers "which tokens may come next" for a request's current state in well under
a millisecond per token (its precomputed per-state token sets and its persistent stack make that
cheap), as a packed bitmask of int32 words, bit j of word i allowing token 32 * i + j.

Where the mask is applied: in the sampler, after logit_bias and before penalties and
temperature, so that a masked token is impossible whatever the sampling parameters are.

How a request's matcher advances: the runner accepts each sampled token into the request's
`Matcher` before it fills that request's next mask. With one step in flight, a constrained
request therefore waits on the host for its previous token before its next step is planned,
as requests with penalties already do. A refused token (`accept` returns False) ends the request.

Where a grammar compiles: in the HTTP process's compiler child, off the engine step and within time
and memory bounds (lightllm/server/httpserver/grammar_cache.py), which sends xgrammar's serialized
form down with the request, packed (`pack`). The runner reads it back (`Grammars.matcher` with it), once per grammar,
on its grammar thread, off the step; the scheduler admits the request once it is read. The read is
xgrammar's C++ and does not hold the GIL (2026-12-02, 2-core CPU: about 60 ms per MiB of serialized
form, a Python loop in another thread never held up more than 16 ms; a $ref chain grows as its
square, 800 $refs 13.5 MiB), but it takes a core, so the thread runs at a lower CPU priority
(model_runner.GRAMMAR_NICENESS), and the HTTP side refuses a form over 16 MiB
(grammar_worker.MAX_COMPILED_BYTES). What does hold the GIL is the first use: importing xgrammar and
building its view of the tokenizer (TokenizerInfo), a second or more of Python, which slowed every
running step 2-3x at a server's first grammar; a server does it as it starts, in the background
(`ModelRunner.prepare_grammars`). The offline LLM sends no compiled form: its runner compiles.
`parse_grammar` needs no tokenizer. xgrammar and torch are imported inside functions: the offline LLM
and the GPU tests never import xgrammar unless a request needs it, and the compiler child, which runs
`parse_grammar` and the compile under its bounds, imports no torch.
"""

from __future__ import annotations

import json
import logging
import re
import zlib
from collections import OrderedDict
from typing import TYPE_CHECKING

from lightllm.engine.json_schema import SchemaError, check_json_schema

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

KINDS = ("json_object", "json_schema", "regex", "ebnf", "structural_tag")
JSON_ARGUMENTS = "json_arguments"  # our structural-tag content of a function's arguments (`json_arguments`)
CACHE_SIZE = 64  # compiled grammars kept per model runner (least recently used dropped first)
CACHE_BYTES = 32 << 20  # and their size at most, as xgrammar's JSON of them measures it: about what one takes in
# memory read back (a 700-$ref chain: 10.9 MB of JSON, 0.95 MB packed, 10-12 MB of RSS each). A grammar
# the cache dropped is read again from the packed form its next request brings (grammar_cache.py's cache).
PACK_LEVEL = 1  # zlib's fastest
_MESSAGE_CHARS = 300  # a user's error message quotes at most this much of xgrammar's
_ANY_OBJECT = '{"type": "object"}'
ONE_LINE = (", ", ": ")  # json.dumps' separators without indent: the layout of our JSON grammars
# xgrammar's C++ errors start "[hh:mm:ss] /path/file.cc:123: " and at times "Check failed: (...) is false: "
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: .*? is false:\s*)?")
# xgrammar (0.2.8; mlc-ai/xgrammar#800) writes one character of a string with minLength or maxLength
# as this rule, which admits raw control characters (a tab, \x01), invalid in JSON, and no escape.
# `_json_schema` rewrites it to one JSON character, as in xgrammar's unbounded strings: an escape
# counts once, as maxLength counts the decoded string. Once xgrammar writes it right, nothing matches.
# Both its rule and its unbounded strings' class of characters (_UNBOUNDED_STRING_CLASS) also admit
# a surrogate (U+D800-U+DFFF) written as three bytes, which is not UTF-8: a random model's byte tokens
# gave a 12-character city that decoded to 14 (three U+FFFD for one surrogate). Both exclude them here.
_BOUNDED_STRING_CHARACTER = re.compile(r"^(\S+ ::= )" + re.escape(r'(([^\"\\\r\n]))') + "$", re.MULTILINE)
_JSON_STRING_CHARACTER = (r'(([^\0-\x1f\"\\\uD800-\uDFFF]) | ("\\" [\"\\/bfnrt]) '
                          r'| ("\\u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))')
_UNBOUNDED_STRING_CLASS = r'[^\0-\x1f\"\\\r\n]'
_UNBOUNDED_STRING_CLASS_UTF8 = r'[^\0-\x1f\"\\\uD800-\uDFFF]'


class GrammarError(ValueError):
    """A grammar a user sent that cannot be used; the message is one line, for a 4xx."""


def _one_line(error: Exception) -> str:
    text = " ".join(str(error).split())
    text = _XGRAMMAR_PREFIX.sub("", text)
    return text if len(text) <= _MESSAGE_CHARS else text[:_MESSAGE_CHARS] + "..."


def check_spec(kind: str, spec: str):
    """What can be checked of (kind, spec) without xgrammar, cheaply enough for every request: the
    kind, a JSON spec's syntax, a schema's structure (json_schema.py). Returns the parsed JSON of a
    json_schema or structural_tag (None for the others); raises GrammarError."""
    if kind not in KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}; expected one of {', '.join(KINDS)}")
    if kind == "json_object" and spec:
        raise GrammarError("a json_object grammar takes no spec (any JSON object is allowed)")
    if kind not in ("json_schema", "structural_tag"):
        return None
    try:
        parsed = json.loads(spec)
    except (ValueError, RecursionError) as e:
        raise GrammarError(f"{kind} is not valid JSON: {e}") from None
    schemas = [("", parsed)] if kind == "json_schema" else [  # a structural tag's schema contents
        (_schema_owner(node), node["json_schema"]) for node in _objects(parsed)
        if node.get("type") in ("json_schema", JSON_ARGUMENTS) and "json_schema" in node]
    for owner, schema in schemas:  # xgrammar reads a remote $ref as no constraint at all
        try:
            check_json_schema(schema)
        except SchemaError as e:
            raise GrammarError(f"{owner}{e}") from None
    return parsed


def _objects(tree):
    """Every object (dict) in parsed JSON, each before what it holds (not recursion: a client's JSON
    may nest deeper than Python's stack). What a caller changes in one is what is walked below it."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _schema_owner(content: dict) -> str:
    """How an error names a structural tag's schema content: its function's, for ours."""
    if content.get("type") == JSON_ARGUMENTS:
        return f"function {str(content.get('function'))[:64]!r}: its parameters cannot be used for a forced call: "
    return "a json_schema content of the structural tag: "


def parse_grammar(kind: str, spec: str, separators: tuple[str, str] = ONE_LINE):
    """The xgrammar.Grammar of (kind, spec); raises GrammarError when the user's spec is wrong.
    `separators`: a json_schema's, between items and after keys (json.dumps'). Its cost grows
    faster than the spec (a chain of 1,700 $refs, 59 KB: 5.4 s on a 2-core CPU), so a server runs
    it in the compiler child, within the compile's bounds (grammar_worker.py)."""
    parsed = check_spec(kind, spec)
    if kind == "structural_tag":
        spec = _with_arguments_grammars(parsed, spec)
    import xgrammar

    parse = {"json_object": lambda _: _json_schema(_ANY_OBJECT),
             "json_schema": lambda schema: _json_schema(schema, separators),
             "regex": xgrammar.Grammar.from_regex,
             "ebnf": xgrammar.Grammar.from_ebnf,
             "structural_tag": xgrammar.Grammar.from_structural_tag}[kind]
    try:
        return parse(spec)
    except (RuntimeError, ValueError) as e:  # xgrammar's parse errors (InvalidJSONError is one too)
        raise GrammarError(f"invalid {kind}: {_one_line(e)}") from None


def json_arguments(function: str, schema: dict, separators: tuple[str, str]) -> dict:
    """A structural tag's content for a function's arguments: JSON of `schema` with `separators`,
    as `json_schema_ebnf` writes it; `parse_grammar` writes the EBNF in, so that a forced call's
    schemas are parsed where the compile runs (and within its bounds), not where the tag is made."""
    return {"type": JSON_ARGUMENTS, "function": function, "json_schema": schema, "separators": list(separators)}


def _with_arguments_grammars(tag, spec: str) -> str:
    """`spec` (a structural tag, parsed: `tag`) with each `json_arguments` content replaced by
    xgrammar's grammar content of its EBNF."""
    found = False
    for node in _objects(tag):
        if node.get("type") != JSON_ARGUMENTS:
            continue
        schema, separators = node.get("json_schema"), node.get("separators")
        if not (isinstance(schema, dict) and isinstance(separators, list) and len(separators) == 2
                and all(isinstance(s, str) for s in separators)):
            raise GrammarError(f"a {JSON_ARGUMENTS} content needs a 'json_schema' object and two 'separators'")
        try:
            ebnf = json_schema_ebnf(schema, tuple(separators))
        except GrammarError as e:
            raise GrammarError(f"{_schema_owner(node)}{e}") from None
        node.clear()
        node.update(type="grammar", grammar=ebnf)
        found = True
    return json.dumps(tag) if found else spec


def _json_schema(spec: str, separators: tuple[str, str] = ONE_LINE):
    """xgrammar's grammar of a JSON schema, its strings held to JSON's characters in UTF-8 (those with
    a length bound: to JSON's characters at all)."""
    import xgrammar

    # No free whitespace, which a small model can emit until max_new_tokens: one line, the
    # separators' spaces only.
    grammar = xgrammar.Grammar.from_json_schema(spec, any_whitespace=False, separators=separators)
    ebnf, bounded = _BOUNDED_STRING_CHARACTER.subn(lambda m: m[1] + _JSON_STRING_CHARACTER, str(grammar))
    unbounded = _UNBOUNDED_STRING_CLASS in ebnf
    ebnf = ebnf.replace(_UNBOUNDED_STRING_CLASS, _UNBOUNDED_STRING_CLASS_UTF8)
    return xgrammar.Grammar.from_ebnf(ebnf) if bounded or unbounded else grammar


def json_schema_ebnf(schema: dict, separators: tuple[str, str] = ONE_LINE) -> str:
    """A JSON schema as xgrammar's EBNF, one line with no free whitespace (`separators`: json.dumps'
    meaning; (",", ":") is compact JSON), for use inside a structural tag; GrammarError when
    xgrammar cannot use it."""
    return str(parse_grammar("json_schema", json.dumps(schema), separators))


class Matcher:
    """The grammar state of one running request."""

    def __init__(self, compiled, kind: str):
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled)
        self._kind = kind

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False (and a warning) if the grammar does not allow it."""
        if self._matcher.accept_token(token_id):
            return True
        logger.warning("token %d is not allowed by the request's %s grammar", token_id, self._kind)
        return False

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (a bitmask from `allocate_bitmask`)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing more may follow."""
        return self._matcher.is_terminated()


class Grammars:
    """Compiles grammars for one model's tokenizer (one per model runner) and makes matchers.

    The tokenizer's xgrammar view (TokenizerInfo, about 0.2 s on top of loading the tokenizer)
    is built on first use (a server's runner uses it as it starts: ModelRunner.prepare_grammars).
    `vocab_size` is the model's (the logits' width), which may exceed the tokenizer's length;
    `stop_token_ids` default to the tokenizer's EOS; the tokenizer is loaded as the server's
    (`tokenizer_mode`, `trust_remote_code`).
    """

    def __init__(self, model_dir: str, vocab_size: int, *, stop_token_ids: list[int] | None = None,
                 tokenizer_mode: str = "auto", trust_remote_code: bool = False, max_threads: int = 8):
        self.model_dir, self.vocab_size, self.stop_token_ids = str(model_dir), vocab_size, stop_token_ids
        self._tokenizer_options = (tokenizer_mode, trust_remote_code)
        self.max_threads = max_threads  # xgrammar's threads for one compile
        self._compiler = None
        self._info = None  # xgrammar.TokenizerInfo, made with the compiler
        # (compiled grammar, its size: spec and packed form, in bytes)
        self._compiled: OrderedDict[tuple[str, str], tuple[object, int]] = OrderedDict()
        self._compiled_bytes = 0

    @property
    def compiler(self):
        if self._compiler is None:
            self._compiler = self._make_compiler()
        return self._compiler

    def _make_compiler(self):
        import xgrammar

        from lightllm.engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(self.model_dir, *self._tokenizer_options)
        self._info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                             stop_token_ids=self.stop_token_ids)
        # our LRU below is the cache (xgrammar's own would keep a second copy of each grammar)
        return xgrammar.GrammarCompiler(self._info, max_threads=self.max_threads, cache_enabled=False)

    def compile(self, kind: str, spec: str, serialized: bytes = b""):
        """The compiled grammar of (kind, spec), from the cache when it is there; else read from
        `serialized` (its packed form, from `serialize`) when given, else compiled."""
        key = (kind, spec)
        entry = self._compiled.get(key)
        if entry is None:
            if serialized:
                compiled, size = self._deserialize(serialized)
            else:
                compiled = self.compiler.compile_grammar(parse_grammar(kind, spec))
                size = len(compiled.serialize_json())
            entry = self._compiled[key] = (compiled, len(spec) + size)
            self._compiled_bytes += entry[1]
        self._compiled.move_to_end(key)
        while len(self._compiled) > CACHE_SIZE or self._compiled_bytes > CACHE_BYTES:
            self._compiled_bytes -= self._compiled.popitem(last=False)[1][1]
        return entry[0]

    @property
    def cached_bytes(self) -> int:
        return self._compiled_bytes

    def serialize(self, kind: str, spec: str) -> bytes:
        """Compile (kind, spec) (uncached: the caller keeps the result) into its packed form, which
        a Grammars of the same model reads back with `compile(kind, spec, serialized)`."""
        return pack(self.compiler.compile_grammar(parse_grammar(kind, spec)).serialize_json())

    def _deserialize(self, serialized: bytes) -> tuple[object, int]:
        """The compiled grammar of a packed form, and the length of its JSON (what the cache counts)."""
        import xgrammar

        self.compiler  # builds self._info
        text = zlib.decompress(serialized).decode()
        return xgrammar.CompiledGrammar.deserialize_json(text, self._info), len(text)

    def matcher(self, kind: str, spec: str, serialized: bytes = b"") -> Matcher:
        return Matcher(self.compile(kind, spec, serialized), kind)


def pack(serialized: str) -> bytes:
    """xgrammar's JSON of a compiled grammar as it crosses processes: zlib's, about 7x smaller (its
    per-rule automata repeat; 800 $refs: 13.5 -> 1.9 MiB in 0.12 s), so that the router, which
    forwards it to each runner in a step's ops, and the runner, which reads the step, handle a
    seventh; the runner inflates it on its grammar thread. The compiler child writes the same."""
    return zlib.compress(serialized.encode(), PACK_LEVEL)


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """int32 [batch, ceil(vocab_size / 32)] on the CPU, every token allowed (xgrammar's layout)."""
    import torch

    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Set to -inf each logit whose bit is 0, in rows `rows` of logits (all rows if None).

    logits: fp32 [B, V], CPU or CUDA; bitmask: int32 [B', ceil(V / 32)] from `allocate_bitmask`,
    moved to logits' device here; `rows` (integer, either device) index both.
    """
    assert bitmask.shape[-1] * 32 >= logits.shape[-1], "the bitmask must cover every logit"
    if logits.device.type not in ("cpu", "cuda"):
        apply_bitmask_reference_(logits, bitmask, rows)
        return
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[-1],
                                         indices=rows)


def apply_bitmask_reference_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Plain-torch `apply_bitmask_`: unpack each int32 word into its 32 bits, lowest bit first."""
    import torch

    vocab = logits.shape[-1]
    rows = torch.arange(logits.shape[0]) if rows is None else rows
    rows = rows.to(logits.device)
    words = bitmask.to(logits.device)[rows]  # [R, W]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()  # [R, W * 32] -> [R, V]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
