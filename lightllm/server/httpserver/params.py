"""The body of /generate and /generate_stream as a pydantic model, with TGI's parameter ranges.

A field left out or null takes SamplingParams' default (lightllm/engine/request.py), written there
once; the ranges TGI shares with the other front ends are lightllm/frontend/sampling_ranges.py's,
and the length checks lightllm/frontend/limits.py's."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from lightllm.engine.request import SamplingParams
from lightllm.frontend.sampling_ranges import INT32_MAX, STRICT, SamplingRanges, to_sampling
from lightllm.frontend.errors import RequestError
from lightllm.server.httpserver.json_text import load_json, shown

MAX_STOP_SEQUENCES = 16
# A token id as a logit_bias key: ASCII digits (str.isdigit() also takes "²", which int() refuses, and
# "٣", which int() reads as 3), few enough for any vocabulary and for int() (which refuses over 4300).
TOKEN_ID = re.compile(r"[0-9]{1,10}")

# The longest grammar a client may send (a JSON schema as json.dumps writes it, a regex, an EBNF):
# the compile's time and the compiled form's size grow with it.
MAX_GRAMMAR_BYTES = 64 << 10
NonEmptyStr = Annotated[str, Field(min_length=1)]
StopSequences = NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_SEQUENCES)]


class Grammar(BaseModel):
    """TGI's `grammar`: {"type": "json", "value": a JSON schema ({} for any JSON object)} or
    {"type": "regex", "value": a pattern}."""

    model_config = STRICT
    type: Literal["json", "regex"]
    value: dict | NonEmptyStr

    def sampling_fields(self) -> dict:
        if self.type == "regex":
            if not isinstance(self.value, str):
                raise RequestError("'grammar': a regex grammar's value is a string")
            kind, spec = "regex", self.value
        else:
            kind, spec = json_grammar(self.value, "'grammar': the json grammar's value")
        return {"grammar_kind": kind, "grammar": checked_grammar(kind, spec)}


def json_grammar(value: dict | str, where: str) -> tuple[str, str]:
    """(grammar_kind, spec) of a JSON schema given as an object or its text; {} is any JSON object."""
    schema = load_json(value, where) if isinstance(value, str) else value
    if not isinstance(schema, dict):
        raise RequestError(f"{where} is a JSON schema: an object, or its text")
    return ("json_schema", json.dumps(schema)) if schema else ("json_object", "")


def checked_grammar(kind: str, spec: str) -> str:
    """`spec`, checked as far as it cheaply can be (engine.grammar.check_spec); a bad one, or a client's
    longer than MAX_GRAMMAR_BYTES, is a 400. xgrammar's parse, whose cost grows faster than the spec,
    runs with the compile, within its bounds (grammar_worker.py); what it refuses is a 400 then."""
    from lightllm.engine.grammar import GrammarError, check_spec

    if kind != "structural_tag" and len(spec.encode()) > MAX_GRAMMAR_BYTES:  # a structural tag is ours
        raise RequestError(f"the {kind.replace('_', ' ')} takes {len(spec.encode())} bytes, more than the "
                           f"{MAX_GRAMMAR_BYTES} a grammar for structured output may")
    try:
        check_spec(kind, spec)
    except GrammarError as exc:
        raise RequestError(f"the {kind.replace('_', ' ')} cannot be used for structured output: {exc}") from None
    return spec


def check_token_ids(vocab_size: int, logit_bias: dict[str, float] | None, stop_token_ids: list[int] | None,
                    allowed_token_ids: list[int] | None) -> None:
    for token in logit_bias or {}:
        if not TOKEN_ID.fullmatch(token) or int(token) >= vocab_size:
            raise RequestError(f"'logit_bias' keys must be token ids in [0, {vocab_size}), got {shown(token)}")
    for name, tokens in (("stop_token_ids", stop_token_ids), ("allowed_token_ids", allowed_token_ids)):
        if any(token >= vocab_size for token in tokens or ()):
            raise RequestError(f"'{name}' must be in [0, {vocab_size})")


MAX_TOP_TOKENS = 20
# GenerateParameters fields that are not SamplingParams fields (read by sampling() or the route)
ROUTE_FIELDS = {"n", "details", "decoder_input_details", "top_n_tokens", "grammar", "logit_bias", "adapter_id",
                "truncate", "stop", "return_full_text", "best_of"}


class GenerateParameters(SamplingRanges):
    """TGI's parameters: the shared ranges (SamplingRanges), TGI's narrower temperature and
    top_k, and the fields only /generate has."""

    do_sample: bool | None = Field(None, description="sample (with temperature, top_p, top_k) instead of greedy")
    temperature: float | None = Field(None, gt=0, description="default 1.0")
    top_k: int | None = Field(None, gt=0, le=INT32_MAX, description="default: the whole vocabulary")
    max_new_tokens: int | None = Field(None, ge=1, description="default 16")
    stop_sequences: StopSequences | None = Field(None, description="the text ends right before the first one")
    n: int | None = Field(None, ge=1, le=128, description="sequences to generate (generated_text holds them all); "
                                                           "not with /generate_stream")
    details: bool | None = Field(None, description="per-token ids, texts and logprobs in 'details' (TGI)")
    decoder_input_details: bool | None = Field(None, description="with details: the prompt tokens' logprobs ('prefill')")
    top_n_tokens: int | None = Field(None, ge=0, le=MAX_TOP_TOKENS, description="the n most likely tokens per position")
    grammar: Grammar | None = Field(None, description="structured output: the text follows a JSON schema or a regex")
    adapter_id: str | None = Field(None, description="the LoRA adapter to generate with, by name (TGI's); default: none")
    truncate: int | None = Field(None, ge=1, description="keep only the prompt's last n tokens (TGI's)")
    # TGI's names and fields that its clients (huggingface_hub's InferenceClient) send
    stop: StopSequences | None = Field(None, description="TGI's name of stop_sequences")
    best_of: int | None = Field(None, ge=1, le=128, description="TGI's: sample this many sequences, answer the most "
                                                                "likely (the others in details.best_of_sequences)")
    return_full_text: bool | None = Field(None, description="TGI's: the prompt's text before each generated text")
    watermark: bool | None = Field(None, description="TGI's: green-list watermark the text (Kirchenbauer et al.); "
                                   "`python -m lightllm.tools.watermark` scores a text")
    typical_p: float | None = Field(None, gt=0, le=1, description="TGI's typical decoding: keep the tokens whose "
                                    "surprisal is nearest the entropy, up to this probability (sampling only)")

    @property
    def reads_grammar(self) -> bool:
        return self.grammar is not None

    def check_tgi(self) -> None:
        """TGI's fields that change nothing here, or that cannot be served, or that clash."""
        if self.stop is not None and self.stop_sequences is not None:
            raise RequestError("give 'stop' (TGI's name) or 'stop_sequences', not both")
        if (self.best_of or 1) > 1 and (self.n or 1) > 1:
            raise RequestError("give 'best_of' (TGI's: the most likely of them) or 'n' (all of them), not both")

    @property
    def sequences(self) -> int:
        """How many sequences run: n, or TGI's best_of."""
        return max(self.n or 1, self.best_of or 1)

    def sampling(self) -> SamplingParams:
        given = self.model_dump(exclude_none=True, exclude=ROUTE_FIELDS)
        if self.stop is not None:
            given["stop_sequences"] = self.stop
        if self.logit_bias:
            given["logit_bias"] = {int(token): bias for token, bias in self.logit_bias.items()}
        if self.top_n_tokens:
            given["top_logprobs"] = self.top_n_tokens
        if self.decoder_input_details:
            given["prompt_logprobs"] = self.top_n_tokens or 0
        if self.grammar is not None:
            given.update(self.grammar.sampling_fields())
        return to_sampling(given)


class GenerateRequest(BaseModel):
    """TGI's request body: a prompt and its parameters."""

    model_config = STRICT

    inputs: NonEmptyStr
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)


class CompatGenerateRequest(GenerateRequest):
    """TGI's POST / (its clients' default route): /generate's body and whether to stream it."""

    stream: bool = Field(False, description="true: /generate_stream's events; false: a list of one TGI answer")
