"""The range of every sampling parameter, written once.

`SamplingRanges` holds the fields every front end shares under the same name (TGI's /generate,
the OpenAI-style /v1 routes, the offline `SamplingParams` of lightllm/llm.py): each body
inherits them, and the offline API validates through it. A temperature below the engine's
GREEDY_TEMPERATURE (lightllm/engine/request.py) samples greedily on every route. Where an API documents a narrower
range of its own (TGI: temperature and top_k above 0; OpenAI: temperature at most 2), its body
narrows that field; none widens one.
"""

from __future__ import annotations

import logging
import secrets
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lightllm.engine.request import SamplingParams

logger = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1  # TGI's top_k is an i32; the sampler holds it in an int64 tensor either way
SEED_BOUND = 2**63  # seeds are in [0, 2**63): TGI's u64 seed, as the engine's int64 holds it
LOGIT_BIAS_BOUND = 100  # OpenAI's: a bias of +-100 bans or forces a token
# Entries of one logit_bias. OpenAI's API reference (platform.openai.com/docs/api-reference/chat/create,
# logit_bias) gives each bias's range, -100 to 100, and no count; this one is ours: more entries than any
# hand-made list of tokens to ban or favour, while a body of 700k entries no longer costs 1.6 s of
# validation (to constrain the whole vocabulary, use structured output).
MAX_LOGIT_BIAS = 1024
# Entries of one allowed_token_ids (vLLM's field, which it leaves unbounded): a class label's or a
# choice's tokens, not a vocabulary (for that, structured output), so a body's work stays small.
MAX_ALLOWED_TOKEN_IDS = 4096
# vLLM's bad_words, which it leaves unbounded: a list a person writes, each word tokenized twice
# and matched against the output's tail at every step
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 256, 256
BadWord = Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]

# Strict: no "1" for 1 or 1 for true; finite: 1e999 reads as inf in JSON.
STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
TokenId = Annotated[int, Field(ge=0)]
Bias = Annotated[float, Field(ge=-LOGIT_BIAS_BOUND, le=LOGIT_BIAS_BOUND)]


class SamplingRanges(BaseModel):
    """Absent (None): the engine's default (lightllm/engine/request.py's SamplingParams)."""

    model_config = STRICT

    temperature: float | None = Field(None, ge=0, description="default 1.0; 0 is greedy")
    top_p: float | None = Field(None, gt=0, le=1, description="default 1.0")
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="-1 or 0: the whole vocabulary (the default)")
    min_p: float | None = Field(None, ge=0, le=1, description="drop tokens less likely than min_p x the most likely")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="default 0")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="default 0")
    repetition_penalty: float | None = Field(None, gt=0, description="default 1.0 (none)")
    seed: int | None = Field(None, ge=0, lt=SEED_BOUND, description="default: drawn at random")
    min_tokens: int | None = Field(None, ge=0, description="EOS and stop_token_ids are not sampled before this many tokens")
    stop_token_ids: list[TokenId] | None = Field(None, description="token ids that end the text")
    logit_bias: dict[str, Bias] | None = Field(None, max_length=MAX_LOGIT_BIAS,
                                               description=f"token id (as a string) -> bias added to its logit; "
                                                           f"at most {MAX_LOGIT_BIAS} entries")
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS,
                                                    description="vLLM's: only these token ids may be sampled "
                                                                f"(at most {MAX_ALLOWED_TOKEN_IDS})")
    bad_words: list[BadWord] | None = Field(None, max_length=MAX_BAD_WORDS,
                                            description="vLLM's: words never generated (each banned where its "
                                                        f"last token would complete it; at most {MAX_BAD_WORDS})")
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = Field(None, description="vLLM's: the text ends with the stop "
                                                                       "sequence that ended it (default: before it)")


SHARED_FIELDS = tuple(SamplingRanges.model_fields)


def check_ranges(values: dict, owner: str) -> None:
    """ValueError naming the first field of `values` (SHARED_FIELDS only) out of its range."""
    try:
        SamplingRanges.model_validate(values)
    except ValidationError as exc:
        error = exc.errors()[0]
        name = ".".join(str(part) for part in error["loc"])
        raise ValueError(f"{owner}.{name}: {error['msg']}, not {error['input']!r}") from None


class OpenAIRanges(SamplingRanges):
    """OpenAI's narrower temperature (at most 2), for the /v1 routes and the model's defaults."""

    temperature: float | None = Field(None, ge=0, le=2, description="default 1.0; 0 is greedy")


def model_sampling_defaults(model_defaults: dict) -> dict:
    """The OpenAI routes' and the offline LLM's defaults from the model's generation_config.json
    (ModelConfig's sampling_defaults), each within OpenAI's ranges: one outside (such as top_p 0)
    is left out with a warning, since no request could then succeed."""
    defaults = {}
    for name, value in model_defaults.items():
        try:
            OpenAIRanges.model_validate({name: value})
        except ValidationError as exc:
            logger.warning("generation_config.json's %s=%r is not used as a default: %s", name, value,
                           exc.errors()[0]["msg"])
            continue
        defaults[name] = value
    return defaults


def to_sampling(given: dict, **fixed) -> SamplingParams:
    """The engine's SamplingParams from the fields a client gave (engine names); a seed is drawn
    when none is given."""
    if isinstance(given.get("stop_sequences"), str):
        given["stop_sequences"] = [given["stop_sequences"]]
    given.setdefault("seed", secrets.randbelow(2**31))
    return SamplingParams(**given, **fixed)
