"""The engine core: the scheduler and the model workers it drives, one step always in flight.

Each `step()` plans step N+1 from what the scheduler knows (tokens up to step N-1), launches it
on every rank, and takes back step N's tokens while the device runs N+1. With `overlap` off,
each step's tokens come back before the next is planned (a synchronous loop, for debugging).
The router process and the offline API both run this class; it knows no sockets.
"""

from __future__ import annotations

import atexit
import json
import logging
import time

from lightllm.engine.plan import StepPlan
from lightllm.engine.request import FinishReason, GenerateReq, Req, TokenOut
from lightllm.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


class WorkerDied(RuntimeError):
    """A model worker process is gone; the engine cannot go on."""


def describe_error(exc: Exception) -> str:
    """One line: rpyc appends the remote traceback to the message of an exception it carries."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


class HostTrace:
    """The engine's side of the step trace (`--step_trace PATH` writes it to PATH.host): a JSON line
    per engine step with the moments its parts ended, in `time.perf_counter()` seconds, one clock
    for every process of a machine (the device trace's `origin_perf_s` puts them on its own):
    `turn` (the router's loop began the turn), `start`, `collected` (the step in flight taken back,
    where the engine did), `planned`, `called` (the workers answered: with a sync step's own tokens,
    else the previous step's), `processed`, `sent` (the router's turn ended: its outputs sent, or
    put by for the next step's wait), with the plan's `step` and `sync`."""

    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1 << 16)
        self._line: dict = {}
        atexit.register(self.close)

    def mark(self, name: str, value=None) -> None:
        self._line[name] = round(time.perf_counter(), 6) if value is None else value

    def next(self, unless_open: bool = False) -> None:
        """End the line of the last turn; the next marks start a new one. `unless_open`: only if it
        has a step already (the router began this turn's line; an engine without one did not)."""
        if unless_open and "step" not in self._line:
            return
        if self._line:
            self.file.write(json.dumps(self._line) + "\n")
        self._line = {}

    def close(self) -> None:
        if not self.file.closed:
            self.next()
            self.file.close()


class EngineCore:
    def __init__(self, scheduler: Scheduler, workers, eos_token_ids, overlap: bool = True,
                 vocab_size: int | None = None, host_trace: HostTrace | None = None):
        self.scheduler = scheduler
        self.host_trace = host_trace
        self._workers = workers  # ModelWorkers, or anything with step(plan) -> list[StepResult]
        self._eos_token_ids = frozenset(eos_token_ids)
        self._vocab_size = vocab_size
        self._overlap = overlap
        self._in_flight = False
        # Speculative decoding's step costs: (start of the last step, (tokens, drafted) of the plan
        # whose result it waited for), and (tokens, drafted) of the plan in flight.
        self._timing: tuple[float, tuple | None] | None = None
        self._flight: tuple[int, bool] | None = None
        self._flushed = False  # this step collected the one in flight first

    def add(self, msg: GenerateReq) -> list[TokenOut]:
        """Queue a request; a prompt the model cannot take ends at once with an error, here, so
        that it never fails a step that other requests share."""
        error = self._refusal(msg)
        if error is not None:
            return [TokenOut(msg.req_id, -1, 0.0, FinishReason.ERROR, error=f"ValueError: {error}")]
        self.scheduler.add(Req(msg, self._eos_token_ids))
        return []

    def _refusal(self, msg: GenerateReq) -> str | None:
        ids, vocab, p = msg.prompt_ids, self._vocab_size, msg.sampling
        if not ids:
            return "empty prompt"
        if msg.lora_id and msg.lora_id not in self.scheduler.lora_ids:
            return f"unknown LoRA adapter {msg.lora_id}"
        nothing = p.nothing_allowed(self._eos_token_ids)
        if nothing is not None:
            return nothing
        if vocab is None:
            return None
        if not 0 <= min(ids) <= max(ids) < vocab:
            return f"prompt of {len(ids)} tokens with a token id out of range [0, {vocab})"
        others = [*p.stop_token_ids, *p.logit_bias, *p.allowed_token_ids]
        if others and not 0 <= min(others) <= max(others) < vocab:
            return f"stop_token_ids, logit_bias or allowed_token_ids name a token id out of range [0, {vocab})"
        if max(p.top_logprobs, p.prompt_logprobs or 0) > vocab:
            return f"more top logprobs asked for than the vocabulary's {vocab} tokens"
        return None

    def load_lora(self, lora_id: int, path: str) -> None:
        """Serve the LoRA adapter at `path` under `lora_id` (never an id used before) from the next step."""
        self.scheduler.load_lora(lora_id, path)

    def drop_lora(self, lora_id: int) -> list[TokenOut]:
        """Stop serving adapter `lora_id`; its requests that have not started end with an error."""
        return self.scheduler.drop_lora(lora_id)

    def abort(self, req_id: int) -> bool:
        return self.scheduler.abort(req_id)

    @property
    def has_work(self) -> bool:
        return self._in_flight or self.scheduler.has_work

    def step(self) -> list[TokenOut]:
        """Plan and launch one step; return the outputs of the steps that completed."""
        start = time.perf_counter()
        if self.host_trace is not None:
            self.host_trace.next(unless_open=True)
        outs = self._measure_and_collect(start)
        collected = time.perf_counter()  # planning (a draft model's proposals too) is in the period
        plan = self.scheduler.schedule()
        if plan.empty and not plan.ops and not self._in_flight and not self.scheduler.awaiting_grammars:
            self._timing = None
            return outs
        plan.sync = not self._overlap or plan.empty or bool(plan.drafts)
        if self.scheduler.speculator is not None:
            self._time(collected if self._flushed else start, plan)
        trace = self.host_trace
        if trace is not None:
            trace.mark("start", round(start, 6))
            trace.mark("collected", round(collected, 6))
            trace.mark("planned")
            trace.mark("step", plan.step_id)
            trace.mark("sync", plan.sync)
        return outs + self._run(plan, trace)

    def _run(self, plan: StepPlan, trace: HostTrace | None = None) -> list[TokenOut]:
        try:
            results = self._workers.step(plan)
            if trace is not None:
                trace.mark("called")
        except WorkerDied:
            raise
        except Exception as exc:  # the engine failed: every request gets an error, serving goes on
            logger.exception("model step %d failed", plan.step_id)
            self._in_flight = False
            return self.scheduler.fail_all(describe_error(exc))
        self._in_flight = not plan.sync
        outs = [out for result in results for out in self.scheduler.process(result)]
        if trace is not None:
            trace.mark("processed")
        return outs

    def _measure_and_collect(self, now: float) -> list[TokenOut]:
        """With speculative decoding: measure the last step, and before a step that would
        speculate collect the one in flight (drafts continue the latest tokens)."""
        spec = self.scheduler.speculator
        if spec is None:
            return []
        if self._timing is not None and self._timing[1] is not None:
            start, (tokens, drafted) = self._timing
            spec.measured(drafted, tokens, now - start)
        self._timing, self._flushed = None, False
        if not self._in_flight or not self.scheduler.wants_drafts():
            return []
        self._flight, self._flushed = None, True
        return self._run(StepPlan(-1, sync=True))  # empty: answers with the step in flight

    def _time(self, start: float, plan: StepPlan) -> None:
        """A step's period (its start, or the end of the collection before it, to the next step's
        start) is what the step whose result it waits for cost the batch: this plan's when it is
        sync, else the one in flight before it. A period that waits for two measures nothing."""
        shape = None if plan.empty else (plan.num_tokens, bool(plan.drafts))
        collected = shape if plan.sync else self._flight
        if plan.sync and self._flight is not None:
            collected = None
        self._flight = None if plan.sync else shape
        self._timing = (start, collected)

    def drain(self) -> list[TokenOut]:
        """Run until nothing waits, runs or is in flight (the offline API's loop)."""
        outs = []
        while self.has_work:
            outs += self.step()
        return outs

