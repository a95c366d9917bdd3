"""The offline Python API in vLLM's shape: `LLM` and `SamplingParams`, running the engine core
in this process, with no HTTP server and no sockets.

    from lightllm import LLM, SamplingParams

    llm = LLM()  # the default model; or LLM("/path/to/hf/model", max_total_token_num=4096)
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(outputs[0].outputs[0].text)

`generate` submits every prompt (each of its n choices is one engine request) at once and
steps the engine until all have ended: the scheduler admits them as the KV budget allows. Each
choice is detokenized as its tokens arrive (IncrementalDecoder); a stop string ends it here and
aborts it in the engine. See docs/offline.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import random
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from lightllm.engine.build import start_engine
from lightllm.engine.request import FinishReason, GenerateReq, TokenOut
from lightllm.engine.request import SamplingParams as EngineSampling
from lightllm.frontend.chat.output import chat_parsers
from lightllm.frontend.chat.template import chat_prompt_ids, chat_template_text, render_chat
from lightllm.frontend.config import FrontendConfig
from lightllm.frontend.decoder import IncrementalDecoder
from lightllm.frontend.errors import RequestError
from lightllm.frontend.limits import Limits, check_lengths, prompt_char_bound, truncated
from lightllm.frontend.lora import LoraNames
from lightllm.frontend.sampling_ranges import SHARED_FIELDS, check_ranges, model_sampling_defaults
from lightllm.frontend.tokenizer import bad_words_of, load_tokenizer

logger = logging.getLogger(__name__)

FINISH_REASONS = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                  FinishReason.ABORT: "abort"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# The fields only the offline API has: name -> (accepts the value?, what it must be). The others'
# ranges are the HTTP routes' (SamplingRanges).
_CHECKS = {
    "n": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "max_tokens": (lambda v: v is None or (_is_int(v) and v >= 1), "None (as many as the context leaves) or an integer >= 1"),
    "logprobs": (lambda v: v is None or (_is_int(v) and v >= 0), "None or an integer >= 0"),
    "prompt_logprobs": (lambda v: v is None or (_is_int(v) and v >= 0), "None or an integer >= 0"),
    "truncate_prompt_tokens": (lambda v: v is None or (_is_int(v) and (v >= 1 or v == -1)), "None, -1 or an integer >= 1"),
}


@dataclass
class SamplingParams:
    """vLLM's sampling parameters, names and defaults; checked when made (ValueError)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled (None: every token)
    bad_words: list[str] | None = None  # words never generated (a word's last token is banned where it would end it)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # the text ends with the stop string found, not before it
    json_schema: dict | str | None = None  # structured output: a JSON schema (dict or JSON text)
    regex: str | None = None  # structured output: the text matches this regular expression
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: the last max_req_input_len)

    def __post_init__(self):
        for name, (accepts, what) in _CHECKS.items():
            if not accepts(getattr(self, name)):
                raise ValueError(f"SamplingParams.{name} must be {what}, not {getattr(self, name)!r}")
        check_ranges(self._shared_fields(), "SamplingParams")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        self._check_stops()
        self._grammar()

    def _shared_fields(self) -> dict:
        """The fields the HTTP routes share, in the form their ranges read (JSON's string keys)."""
        values = {name: getattr(self, name) for name in SHARED_FIELDS}
        for name in ("stop_token_ids", "allowed_token_ids", "bad_words"):
            if isinstance(values[name], tuple):
                values[name] = list(values[name])
        bias = self.logit_bias
        if isinstance(bias, dict):
            if not all(_is_int(t) and t >= 0 for t in bias):
                raise ValueError(f"SamplingParams.logit_bias keys must be token ids (integers >= 0), not {bias!r}")
            values["logit_bias"] = {str(t): b for t, b in bias.items()}
        return values

    def _check_stops(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None and (not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops)):
            raise ValueError(f"SamplingParams.stop must be a non-empty string or a list of them, not {self.stop!r}")

    def _grammar(self) -> tuple[str, str]:
        """(grammar_kind, grammar) for the engine."""
        if self.json_schema is not None and self.regex is not None:
            raise ValueError("SamplingParams: give json_schema or regex, not both")
        if self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise ValueError(f"SamplingParams.regex must be a non-empty string, not {self.regex!r}")
            return "regex", self.regex
        if self.json_schema is None:
            return "", ""
        schema = self.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"SamplingParams.json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"SamplingParams.json_schema must be a JSON schema (an object), not {schema!r}")
        return "json_schema", json.dumps(schema)

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())

    def to_engine(self, index: int = 0) -> EngineSampling:
        """The engine's parameters for choice `index`: its seed is seed + index (seed None: one
        drawn at random). Only choice 0 asks for prompt logprobs (they are the same for all,
        and they keep a request out of the prefix cache). max_tokens must be set by now."""
        assert self.max_tokens is not None, "LLM.generate fills in max_tokens=None from the prompt length"
        kind, grammar = self._grammar()
        seed = secrets.randbelow(2**31) if self.seed is None else self.seed
        return EngineSampling(
            do_sample=True, temperature=float(self.temperature), top_p=float(self.top_p),
            top_k=self.top_k if self.top_k > 0 else -1, min_p=float(self.min_p),
            presence_penalty=float(self.presence_penalty), frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty), max_new_tokens=self.max_tokens,
            stop_sequences=self.stop_list, include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
            seed=seed + index, min_tokens=self.min_tokens, stop_token_ids=list(self.stop_token_ids or ()),
            logit_bias={t: float(b) for t, b in (self.logit_bias or {}).items()},
            allowed_token_ids=list(self.allowed_token_ids or ()), bad_words=list(self.bad_words or ()),
            # logprobs=0 asks the engine for one: the sampled token's rank comes with the top k
            top_logprobs=0 if self.logprobs is None else max(self.logprobs, 1),
            prompt_logprobs=self.prompt_logprobs if index == 0 else None,
            grammar_kind=kind, grammar=grammar)


@dataclass
class LoRARequest:
    """vLLM's: a LoRA adapter (PEFT's directory) by name. The name identifies it: the first request
    naming it loads it (unless --lora_modules did); `lora_int_id` is taken for vLLM's signature."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


@dataclass
class Logprob:
    logprob: float  # of the model's raw logits (before logit_bias, penalties and temperature)
    # 1: the most likely token (counted as vLLM does: tokens at least as likely); every prompt and
    # sampled token has one, a top-k entry its place.
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float  # sum of the sampled tokens' logprobs
    logprobs: list[dict[int, Logprob]] | None  # per generated token: the sampled one first, then the top k
    finish_reason: str | None = None  # "stop" (EOS, a stop string or stop token), "length"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it; None for EOS

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None  # None for the first position
    outputs: list[CompletionOutput]
    finished: bool = True


def logprob_dict(token_id: int, logprob: float, top, text_of, rank: int | None = None) -> dict[int, Logprob]:
    """{token: Logprob} for one position: `token_id` first, then the top k as (token, logprob)
    pairs, most likely first. `token_id`'s rank is `rank` where the engine counted it, else its
    place in `top`."""
    ranked = {t: Logprob(lp, place, text_of(t)) for place, (t, lp) in enumerate(top or (), 1)}
    if rank is None and token_id in ranked:
        rank = ranked[token_id].rank
    return {token_id: Logprob(logprob, rank, text_of(token_id)), **ranked}


@dataclass
class _Choice:
    """One engine request: choice `index` of a prompt, detokenized as its tokens arrive."""

    index: int
    req_id: int
    decoder: IncrementalDecoder
    logprobs: list | None
    top_k: int = 0  # the top logprobs asked for (the engine sends at least one)
    pieces: list[str] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, out: TokenOut, text_of) -> None:
        last = out.finish_reason is not None
        self.pieces.append(self.decoder.add(out.token_id, last=last))
        self.cumulative_logprob += out.logprob
        if self.logprobs is not None:
            top = out.top_logprobs[: self.top_k] if out.top_logprobs else None
            self.logprobs.append(logprob_dict(out.token_id, out.logprob, top, text_of, out.rank))
        if self.decoder.stopped:
            self.finish_reason, self.stop_reason = "stop", self.decoder.stop_found
        elif last:
            self.finish_reason = FINISH_REASONS[out.finish_reason]
            self.stop_reason = out.token_id if out.finish_reason is FinishReason.STOP else None

    def output(self) -> CompletionOutput:
        return CompletionOutput(self.index, "".join(self.pieces), list(self.decoder.ids), self.cumulative_logprob,
                                self.logprobs, self.finish_reason, self.stop_reason)


@dataclass
class _Prompt:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    choices: list[_Choice]
    prompt_logprobs: list | None = None

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, self.prompt_logprobs,
                             [c.output() for c in self.choices], all(c.finish_reason for c in self.choices))


class _Progress:
    """Prompts finished out of the total, with token throughput since the start."""

    def __init__(self, total: int, enabled: bool):
        self._bar = tqdm(total=total, desc="Processed prompts", unit="prompt", disable=not enabled)
        self._start = time.perf_counter()
        self._in = self._out = 0

    def prompt_done(self, prompt: _Prompt) -> None:
        self._in += len(prompt.prompt_ids)
        self._out += sum(len(c.decoder.ids) for c in prompt.choices)
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        self._bar.set_postfix_str(f"in {self._in / elapsed:.0f} tok/s, out {self._out / elapsed:.0f} tok/s",
                                  refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def engine_config(model: str | Path | None, **settings) -> FrontendConfig:
    """The FrontendConfig of an offline engine; a setting that is no FrontendConfig field is a TypeError."""
    if "scheduling_policy" in settings:  # vLLM's name of schedule_policy
        settings.setdefault("schedule_policy", settings.pop("scheduling_policy"))
    names = {f.name for f in dataclasses.fields(FrontendConfig)}
    unknown = sorted(set(settings) - names)
    if unknown:
        raise TypeError(f"LLM() got unknown settings {', '.join(unknown)}: they must be FrontendConfig fields "
                        "(the server's engine and request flags without the dashes)")
    if isinstance(settings.get("speculative_config"), dict):  # vLLM's LLM takes it as a dict
        settings["speculative_config"] = json.dumps(settings["speculative_config"])
    for name in ("dp", "nnodes"):  # one engine, on this machine
        if settings.get(name, 1) != 1:
            raise ValueError(f"LLM() runs one engine in this process, so {name} must be 1, not {settings[name]!r}: "
                             f"for data parallelism run the server with --dp, or one LLM per process")
    if model is None:
        from lightllm.tools.default_model import ensure_default_model

        model = ensure_default_model()
    if not Path(model).is_dir():
        raise ValueError(f"model {str(model)!r} is not a directory: give a local Hugging Face model directory")
    config = FrontendConfig(model_dir=str(model), **settings)
    config.check()
    return config


class LLM:
    """An engine core with its model, in this process (tp=1) or in tp worker processes."""

    def __init__(self, model: str | Path | None = None, *, tp: int = 1, dtype: str = "auto",
                 max_total_token_num: int | None = None, tokenizer_mode: str = "auto",
                 trust_remote_code: bool = False, seed: int | None = 0, **engine_kwargs):
        self.config = engine_config(model, tp=tp, data_type=dtype, max_total_token_num=max_total_token_num,
                                    tokenizer_mode=tokenizer_mode, trust_remote_code=trust_remote_code,
                                    **engine_kwargs)
        self.tokenizer = load_tokenizer(self.config)
        self._workers, self.engine, self.model_info = start_engine(self.config)
        budget = self.engine.scheduler.max_total_token_num
        self.limits = Limits(self.config.max_req_input_len, self.config.max_req_total_len, budget,
                             prompt_char_bound(self.tokenizer, self.config.max_req_input_len))
        self._seeds = random.Random(seed) if seed is not None else None  # for requests without a seed
        self._req_ids = itertools.count()
        self._prompt_ids = itertools.count()
        self._open: dict[int, tuple[_Prompt, _Choice]] = {}
        self._token_text: dict[int, str] = {}
        self.loras = LoraNames(self.config, self.model_info)
        logger.info("LLM ready: %s, tp %d, max_total_token_num %d", self.config.model_dir, tp, budget)

    # ---- life cycle ----

    def shutdown(self) -> None:
        """Free the model and its workers; the LLM cannot generate afterwards."""
        if self._workers is not None:
            self._workers.shutdown()
            self._workers = self.engine = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat use without sampling_params (vLLM's name): SamplingParams' own
        defaults, with the model's generation_config.json sampling fields under sampling_defaults
        "model" (the server's --sampling_defaults, the default), each within its range."""
        if self.config.sampling_defaults != "model":
            return SamplingParams()
        return SamplingParams(**model_sampling_defaults(dict(self.model_info["sampling_defaults"])))

    # ---- generation ----

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """Complete each prompt (a string, token ids, or {"prompt_token_ids": ids} / {"prompt": text});
        `sampling_params`: one for all, or one per prompt (None: get_default_sampling_params());
        `lora_request`: the LoRA adapter of all prompts, or one per prompt (None: the base model);
        `priority`: one per prompt, lower admitted first (schedule_policy="priority" only, as vLLM's).
        Outputs come in prompt order."""
        inputs = [self._prompt_input(p) for p in _as_list(prompts)]
        return self._run(inputs, sampling_params, use_tqdm, lora_request, priority)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, continue_final_message: bool = False,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Answer one conversation (a list of {"role", "content"} dicts, with an assistant's
        "tool_calls" and "tool" results as Hugging Face's templates take them) or a list of them,
        through the tokenizer's chat template; `tools`: function definitions for the template;
        `chat_template_kwargs`: its variables (such as {"enable_thinking": False});
        `continue_final_message`: the model continues each conversation's last message (an
        assistant's prefill; with add_generation_prompt=False); `chat_template`: a Jinja template's
        text in place of the tokenizer's (vLLM's)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True needs add_generation_prompt=False: one continues the last "
                             "message, the other starts a new one")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = None if chat_template is None else chat_template_text(chat_template, "chat_template")
        inputs = [self._chat_input(c, add_generation_prompt, continue_final_message, tools, chat_template_kwargs,
                                   template) for c in conversations]
        return self._run(inputs, sampling_params, use_tqdm, lora_request)

    def _prompt_input(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._checked_ids(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, self._checked_ids(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict with 'prompt_token_ids' "
                         f"or 'prompt', not {prompt!r}")

    def _checked_ids(self, ids) -> list[int]:
        vocab = self.model_info["vocab_size"]
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be a list of integers in [0, {vocab})")
        return list(ids)

    def _chat_input(self, conversation, add_generation_prompt: bool, continue_final_message: bool,
                    tools: list[dict] | None, options: dict | None, template: str | None = None) -> tuple[str, list[int]]:
        own = getattr(self.tokenizer, "chat_template", None)
        call_format = chat_parsers(None, None, self.model_info.get("architecture"), template or own).call_format
        text = render_chat(self.tokenizer, conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, options=options, call_format=call_format,
                           template=template)
        return text, chat_prompt_ids(self.tokenizer, text)

    def _run(self, inputs: list[tuple[str | None, list[int]]], sampling_params, use_tqdm: bool,
             lora_request=None, priority: list[int] | None = None) -> list[RequestOutput]:
        if self.engine is None:
            raise RuntimeError("this LLM has been shut down")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _per_prompt(sampling_params, len(inputs))
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(inputs)
        if len(loras) != len(inputs):
            raise ValueError(f"{len(loras)} lora_request for {len(inputs)} prompts")
        priorities = [0] * len(inputs) if priority is None else list(priority)
        if len(priorities) != len(inputs):
            raise ValueError(f"{len(priorities)} priorities for {len(inputs)} prompts")
        if any(priorities) and self.config.schedule_policy != "priority":
            raise ValueError(f"priority needs schedule_policy='priority' (this LLM's is {self.config.schedule_policy!r})")
        # Every prompt is checked before any is submitted.
        prepared = [self._prepare(text, ids, p, i) for i, ((text, ids), p) in enumerate(zip(inputs, params))]
        lora_ids = [self._lora_id(request) for request in loras]
        progress = _Progress(len(prepared), use_tqdm)
        try:
            for (prompt, engine_params), lora_id, rank in zip(prepared, lora_ids, priorities):
                self._submit(prompt, engine_params, lora_id, rank)
            while self.engine.has_work:
                for out in self.engine.step():
                    self._take(out, progress)
            assert not self._open, f"the engine went idle with requests open: {list(self._open)}"
        except BaseException:
            self._abort_open()
            raise
        finally:
            progress.close()
        return [prompt.output() for prompt, _ in prepared]

    def _prepare(self, text: str | None, ids: list[int], params: SamplingParams,
                 i: int) -> tuple[_Prompt, list[EngineSampling]]:
        """The prompt's choices and the engine's parameters for each; ValueError if it cannot run."""
        ids = truncated(ids, params.truncate_prompt_tokens, self.limits)
        if params.max_tokens is None:  # as many as the context leaves
            room = min(self.limits.max_req_total_len, self.limits.max_total_token_num) - len(ids)
            params = dataclasses.replace(params, max_tokens=max(1, room))
        if params.seed is None and self._seeds is not None:
            params = dataclasses.replace(params, seed=self._seeds.randrange(2**31))
        engine_params = [params.to_engine(index) for index in range(params.n)]
        if params.bad_words:
            banned = bad_words_of(self.tokenizer, params.bad_words)
            for engine_param in engine_params:
                engine_param.bad_words_ids = banned
        try:
            check_lengths(len(ids), engine_params[0], self.limits, "max_tokens")
        except RequestError as exc:
            raise ValueError(f"prompt {i} ({(text or '')[:40]!r}): {exc}") from None
        choices = [_Choice(index, next(self._req_ids),
                           IncrementalDecoder(self.tokenizer, params.skip_special_tokens, params.stop_list,
                                              params.include_stop_str_in_output),
                           [] if params.logprobs is not None else None, params.logprobs or 0)
                   for index in range(params.n)]
        return _Prompt(str(next(self._prompt_ids)), text, ids, choices), engine_params

    def _lora_id(self, request: LoRARequest | None) -> int:
        """The engine id of the request's adapter, loading it the first time it is named (0: none)."""
        if request is None:
            return 0
        lora_id = self.loras.id_of(request.lora_name)
        if lora_id is None:
            lora_id = self.loras.add(request.lora_name, request.lora_path)
            self.engine.load_lora(lora_id, request.lora_path)
        elif request.lora_path and request.lora_path != self.loras.paths[request.lora_name]:
            raise ValueError(f"LoRA adapter {request.lora_name!r} is loaded from {self.loras.paths[request.lora_name]}, "
                             f"not {request.lora_path}")
        return lora_id

    def _submit(self, prompt: _Prompt, engine_params: list[EngineSampling], lora_id: int = 0, priority: int = 0) -> None:
        now = time.monotonic()
        for choice, sampling in zip(prompt.choices, engine_params):
            self._open[choice.req_id] = (prompt, choice)
            for out in self.engine.add(GenerateReq(choice.req_id, prompt.prompt_ids, sampling, now, lora_id,
                                                   priority=priority)):
                self._take(out, None)

    def _take(self, out: TokenOut, progress: _Progress | None) -> None:
        entry = self._open.get(out.req_id)
        if entry is None:  # ended here by a stop string: a token of the step that was in flight
            return
        prompt, choice = entry
        if out.finish_reason is FinishReason.ERROR:
            raise RuntimeError(f"request {prompt.request_id} (choice {choice.index}) failed in the engine: {out.error}")
        if out.prompt_logprobs is not None:
            prompt.prompt_logprobs = self._prompt_logprobs(prompt.prompt_ids, out.prompt_logprobs)
        choice.add(out, self._text_of)
        if choice.finish_reason is None:
            return
        del self._open[out.req_id]
        if out.finish_reason is None:  # a stop string: the engine would go on
            self.engine.abort(out.req_id)
        if progress is not None and all(c.finish_reason for c in prompt.choices):
            progress.prompt_done(prompt)

    def _abort_open(self) -> None:
        """After an error or an interrupt: end every open request, so that the engine is idle."""
        open_ids, self._open = list(self._open), {}
        try:
            for req_id in open_ids:
                self.engine.abort(req_id)
            self.engine.drain()
        except Exception:
            logger.exception("the engine failed while its requests were aborted")

    def _prompt_logprobs(self, ids: list[int], positions) -> list[dict[int, Logprob] | None]:
        """From the engine's (token's logprob, its rank, top k) per position from the 2nd."""
        return [None] + [logprob_dict(token, lp, top, self._text_of, rank)
                         for token, (lp, rank, top) in zip(ids[1:], positions)]

    def _text_of(self, token: int) -> str:
        """The text of one token id (cached)."""
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return text


def _as_list(prompts) -> list:
    """One prompt (a string, a dict, or a list of token ids) or a list of prompts."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts and _is_int(prompts[0])):
        return [prompts]
    return list(prompts)


def _per_prompt(sampling_params, count: int) -> list[SamplingParams]:
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"sampling_params: one SamplingParams, or a list of {count} (one per prompt)")
    return params
