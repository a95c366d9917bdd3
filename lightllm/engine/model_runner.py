"""The model runner: one per tensor-parallel rank, it owns the device.

`step(plan)` turns a step plan into tensors in one place (batch.py's `upload`: one host-to-device copy),
runs one forward over every request's new tokens (decodes first, then prefill chunks), samples,
and leaves each sampled token on the device (`last_token[row]`), where the next step reads it
as that request's input. The tokens come back to the host asynchronously: `step` launches its
plan and then answers with the previous step's tokens, so the device always has a step queued.
Every rank is called with the same plans and reaches the same state.

On CUDA, kernel launches are asynchronous and the runner launches in the caller's thread; on
the CPU every op runs to completion, so a single "device thread" stands in for the stream and
the caller gets the previous step's tokens while the next one computes.

With `cuda_graph` (the default) every step up to `cuda_graph_max_tokens` tokens is padded to a
bucket size and, on CUDA, replayed from a CUDA graph captured at start-up (`cuda_graph.py`):
decode steps by their batch, steps with prompt chunks by their tokens.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace

import torch

from lightllm.common.host_pool import HostKVPool, record_widths
from lightllm.common.req_table import OutOfRowsError, ReqTable
from lightllm.common.state_pool import StatePool
from lightllm.common.token_table import OutOfTokensError, TokenTable
from lightllm.engine.batch import DecodeRows, LaunchedStep, RunningReq, download, int64_tensor, step_lists, upload
from lightllm.engine.config import EngineConfig
from lightllm.engine.cuda_graph import (FEW_GRAPH_CHUNKS, MAX_GRAPH_CHUNKS, META_ROWS, MIXED_TOKEN_ROWS, MixedLayout,
                                        StepGraphs, graph_memory_bytes)
from lightllm.engine.memory import snapshot_slots, state_slots, token_budget
from lightllm.engine.plan import (Adopt, DraftRequest, DropGrammar, DropLora, Evict, Insert, Load, LoadGrammar, LoadLora,
                                  Offload, Release, Reset, Snapshot, Spill, Split, StepPlan, StepResult)
from lightllm.engine.request import SamplingParams
from lightllm.engine.sampling import SamplingBatch, SamplingState, chunk_prompt_logprobs, grammar_masks, host_lists, sample
from lightllm.engine.scheduler import burst_budget
from lightllm.engine.spec.config import SpeculativeConfig
from lightllm.engine.spec.draft_runner import DraftRunner
from lightllm.engine.spec.eagle3_runner import Eagle3Runner
from lightllm.engine.spec.mtp_runner import MtpRunner
from lightllm.engine.step_trace import StepTrace
from lightllm.models import (ForwardBatch, load_model, read_config, resolve_dtype, resolve_kv_dtype,
                             resolve_mxfp4_experts, resolve_state_dtype)
from lightllm.models.lora import LoraAdapters, module_shapes
from lightllm.utils.dist import init_tp
from lightllm.utils.process import return_free_heap

logger = logging.getLogger(__name__)

# On the CPU, glibc keeps the pages that a step's activations free, and under steady load the
# worker is never idle: its RSS grew ~50 MiB/min with the heap in use flat (CPU soak, 2026-11-23,
# ed8c1ec; docs/benchmarks-history.md). Give them back every this many steps too (about 2-10 ms each).
CPU_TRIM_EVERY_STEPS = 100


def resolve_device(device: str | None, local_rank: int) -> torch.device:
    """The rank's device; a bare "cuda" means the current GPU, named by its index (set_device needs one)."""
    if device is not None:
        chosen = torch.device(device)
        return torch.device("cuda", torch.cuda.current_device()) if chosen == torch.device("cuda") else chosen
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def _moved_in_batches(op) -> type | None:
    """Offload or Load: consecutive ones are applied as one batch (None: any other op)."""
    return type(op) if isinstance(op, (Offload, Load)) else None


class ModelRunner:
    def __init__(self, config: EngineConfig, tp_rank: int = 0, *, local_rank: int | None = None,
                 device: str | None = None, check_budget: bool = True):
        """Loads `config`'s model on this rank's device (`local_rank`: the rank's index on its
        machine, tp_rank if absent) and sizes the KV budget: the largest step the scheduler can
        plan runs once (memory.py) to find what fits, or to check that a given
        max_total_token_num does. `check_budget=False`, with max_total_token_num given, skips
        that step (tests and tools that drive the runner alone).
        info["burst_chunked_prefill_size"] is the burst budget the scheduler takes."""
        self.engine_config = config
        self.device = resolve_device(device, tp_rank if local_rank is None else local_rank)
        if self.device.type == "cuda":
            # Triton launches on the current device's stream, whatever the tensors' device: a
            # --dp replica's worker (tp 1, GPU d > 0) must make its GPU the current one too.
            torch.cuda.set_device(self.device)
        cuda_graph = not config.disable_cuda_graph
        capture = cuda_graph and self.device.type == "cuda"
        # Not under fp8 weights: with the fused all-reduce + norm, bench-8b at tp 2 with
        # --quantization fp8 hung in its first graph warm-up on two H200s (both ranks waiting on
        # the device), and served without it (two H200s, 2026-11-28, 9d7354e; docs/multi_gpu.md).
        self.tp = init_tp(tp_rank, config.tp, config.nccl_port, self.device,
                          config.dist_init_addr if config.nnodes > 1 else None,
                          fused_norms=config.quantization != "fp8")
        cfg = replace(read_config(config.model_dir), quantization=config.quantization)
        dtype = resolve_dtype(config.data_type, cfg, self.device)
        gpu_bytes = (torch.cuda.get_device_properties(self.device).total_memory * config.mem_fraction
                     if self.device.type == "cuda" else None)
        experts = resolve_mxfp4_experts(config.mxfp4_experts, cfg, dtype, gpu_bytes, config.tp)
        if experts != config.mxfp4_experts:
            logger.info("--mxfp4_experts %s: %s", config.mxfp4_experts, experts)
        self.config = cfg = replace(cfg, mxfp4_experts=experts)
        self.max_req_total_len = config.max_req_total_len
        self.watermark = (config.watermark_gamma, config.watermark_delta)  # TGI's watermark, for the requests that ask
        if self.max_req_total_len > cfg.max_position_embeddings:
            logger.warning("max_req_total_len %d exceeds the model's max_position_embeddings %d",
                           self.max_req_total_len, cfg.max_position_embeddings)
        self.model = load_model(cfg, dtype=dtype, device=self.device, tp=self.tp,
                                max_positions=self.max_req_total_len, load_format=config.load_format)
        self.loras = self._load_loras(config, dtype)  # before the KV budget is sized: its slots take memory
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype, self.device)
        running = config.running_max_req_size
        spec = SpeculativeConfig.parse(config.speculative_config)
        # a verify step's decode tokens a request row at most, whose recurrence inputs the stash keeps
        verify_tokens = 1 + spec.num_speculative_tokens if spec is not None and cfg.linear_attn else 0
        self.state_dtype = resolve_state_dtype(config.mamba_ssm_cache_dtype, cfg.linear_attn)
        if cfg.linear_attn:  # as many request rows as there are recurrent states that fit
            slot_bytes = self.model.state_slot_bytes(verify_tokens, self.state_dtype)
            running = self.tp.min_int(state_slots(slot_bytes, running, self.device, config.mem_fraction,
                                                  config.mamba_full_memory_ratio), self.device)
        self.req_table = ReqTable(running, self.max_req_total_len, self.device, padding_row=cuda_graph)
        self.drafter = self._load_drafter(config, dtype, running + 1)  # weights in use before the budget is sized
        # An EAGLE-3 head's target forward, which also stores the head's features (target_forward)
        self._features_forward = self.drafter and self.drafter.target_forward(self.model)
        # The token each request feeds next, by request row (padding row included).
        self.last_token = torch.zeros(running + 1, dtype=torch.int64, device=self.device)
        # The hybrid models' recurrent states, a slot per request row (and the padding row), taken
        # before the KV budget is measured so that it counts them as in use
        self.state_pool = self.model.new_state_pool(running + 1, (running + 1) * verify_tokens, self.state_dtype) \
            if cfg.linear_attn else None
        # ... and the prefix cache's snapshots of them, slots named by the radix tree (also counted)
        self.snapshot_pool = self._new_snapshot_pool(config)
        self.graphs = None
        self.reqs: dict[int, RunningReq] = {}
        self.nodes: dict[int, torch.Tensor] = {}  # prefix-cache node id -> its slots (int32, on the device)
        self.host_pool: HostKVPool | None = None  # the prefix cache's host tier (host-resident nodes)
        self.disk_pool: HostKVPool | None = None  # ... and its disk tier
        self._pending: Future | None = None  # the launched step whose tokens are not yet returned
        self._last_launched: LaunchedStep | None = None
        self._grammars = None  # grammar.Grammars, made by prepare_grammars or the first request that needs it
        # Grammars load on their own thread, off the step: req id -> (matcher future, reported yet)
        self._grammar_thread: ThreadPoolExecutor | None = None
        self._grammar_loads: dict[int, list] = {}
        self._trace = None
        self._ops_ms = 0.0  # host time the last plan's ops took (offloads and loads of the prefix cache's tiers)
        self._device_thread = ThreadPoolExecutor(1, "device") if self.device.type == "cpu" else None
        self._steps_since_trim = 0  # CPU: launched steps since the heap's free pages went back
        burst = burst_budget(config.burst_chunked_prefill_size, config.chunked_prefill_size, self.device.type)
        self.info = {"architecture": cfg.architecture, "dtype": str(dtype).removeprefix("torch."),
                     "mxfp4_experts": experts, "vocab_size": cfg.vocab_size, "eos_token_ids": list(cfg.eos_token_ids),
                     "max_position_embeddings": cfg.max_position_embeddings, "model_dir": str(config.model_dir),
                     "sampling_defaults": list(cfg.sampling_defaults.items()),  # pairs: the wire is flat
                     "burst_chunked_prefill_size": burst, "recurrent_state": cfg.linear_attn is not None,
                     "running_max_req_size": running,
                     "state_snapshot_slots": 0 if self.snapshot_pool is None else self.snapshot_pool.slots}
        if self.loras is not None:  # what the HTTP process checks an adapter against before the engine loads it
            self.info["lora_modules"] = [(name, *shape) for name, shape in module_shapes(cfg).items()]
        graph_bytes = graph_memory_bytes(running, config.graph_max_tokens, cfg.hidden_size, cfg.intermediate_size,
                                         cfg.vocab_size, dtype.itemsize) if capture else 0
        if capture and self.drafter is not None:
            graph_bytes += self.drafter.graph_bytes(running, config.graph_max_tokens, dtype.itemsize)
        self.max_total_token_num = config.max_total_token_num
        if check_budget or self.max_total_token_num is None:
            self.max_total_token_num = token_budget(self, config.max_total_token_num, burst or self.max_req_total_len,
                                                    config.mem_fraction, graph_bytes)
        self.token_table = self.new_token_table(self.max_total_token_num)
        self.host_pool = self._new_host_pool(config.host_kv_cache_gb)
        self.info["host_kv_cache_tokens"] = 0 if self.host_pool is None else self.host_pool.capacity
        if config.disk_kv_cache_dir and self.host_pool is not None:
            path = os.path.join(config.disk_kv_cache_dir, f"lightllm-kv-{os.getpid()}.bin")
            self.disk_pool = self._new_host_pool(config.disk_kv_cache_gb, path)
        self.info["disk_kv_cache_tokens"] = 0 if self.disk_pool is None else self.disk_pool.capacity
        if cuda_graph:
            self.graphs = StepGraphs(self.model, self.token_table, self.req_table, running,
                                     config.graph_max_tokens, capture, forward=self.target_forward,
                                     verify=verify_tokens > 0, chunk_tiers=(FEW_GRAPH_CHUNKS, MAX_GRAPH_CHUNKS)
                                     if self.state_pool is not None else (MAX_GRAPH_CHUNKS,))
            if self.drafter is not None:
                self.drafter.make_graphs(self.req_table, running, capture)
        if self.device.type == "cuda":
            self._warm_sampler()
        if config.step_trace:
            path = config.step_trace if config.tp == 1 else f"{config.step_trace}.rank{tp_rank}"
            self._trace = StepTrace(path, self.device)
            atexit.register(self._trace.close)

    @torch.inference_mode()
    def _warm_sampler(self) -> None:
        """Choose one token greedily and one by a seeded draw, through the step's own upload: the
        greedy kernel is one the memory profile (every row sampled) never launches, and a kernel's
        first launch compiles it (0.3-0.6 s on an H200 host) under the first request that needs it."""
        for params in (SamplingParams(), SamplingParams(do_sample=True)):
            ints, floats = host_lists([SamplingState(params)])
            batch = SamplingBatch.from_tensors(upload(ints, floats, self.device), all_greedy=params.greedy)
            sample(torch.randn(1, self.config.vocab_size, device=self.device), batch)
        torch.cuda.synchronize(self.device)

    def _load_loras(self, config: EngineConfig, dtype: torch.dtype) -> LoraAdapters | None:
        """The LoRA slot pool and the adapters of --lora_modules (ids 1, 2, ...), or None without slots."""
        if not config.lora_slots:
            return None
        loras = LoraAdapters(self.model, self.config, config.lora_slots, config.max_lora_rank, self.device, dtype)
        for lora_id, (_, path) in enumerate(config.lora_adapters, 1):
            loras.add(lora_id, path)
        return loras

    def _load_drafter(self, config: EngineConfig, dtype: torch.dtype, rows: int) -> DraftRunner | None:
        """The draft model of --speculative_config's draft_model method, its eagle3 method's head,
        or the target's MTP layer (mtp; None for any other); ValueError for a target a head cannot draft for."""
        spec = SpeculativeConfig.parse(config.speculative_config)
        if spec is not None and spec.method == "mtp":
            return MtpRunner(self.model, self.config, dtype=dtype, kv_dtype=self.kv_dtype, device=self.device,
                             tp=self.tp, k_max=spec.num_speculative_tokens, rows=rows, load_format=config.load_format)
        if spec is not None and spec.method == "eagle3":
            return Eagle3Runner(spec.model, self.model, self.config, dtype=dtype, kv_dtype=self.kv_dtype,
                                device=self.device, tp=self.tp, max_positions=self.max_req_total_len,
                                k_max=spec.num_speculative_tokens, rows=rows, load_format=config.load_format)
        if spec is None or spec.method != "draft_model":
            return None
        if self.config.linear_attn:
            return None  # the engine serves such a model without speculation (build.py)
        return DraftRunner(spec.model, self.config.vocab_size, dtype=dtype, kv_dtype=self.kv_dtype,
                           device=self.device, tp=self.tp, max_positions=self.max_req_total_len,
                           k_max=spec.num_speculative_tokens, rows=rows, load_format=config.load_format)

    def target_forward(self, batch: ForwardBatch, kv) -> torch.Tensor:
        """The target's forward: the model's (looked up at each call), or with an EAGLE-3 head one
        that also stores each token's feature at its slot."""
        if self._features_forward is not None:
            return self._features_forward(batch, kv)
        return self.model.forward(batch, kv)

    def kv_bytes(self) -> tuple[int, int]:
        """(bytes a token of KV budget takes, bytes taken whatever the budget): the draft model's
        KV (or an EAGLE-3 head's KV and features) rides on the target's slots and adds its scratch rows."""
        per_token = 2 * sum(heads * dim for heads, dim in self.model.kv_shapes) * self.kv_dtype.itemsize
        if self.drafter is None:
            return per_token, 0
        return per_token + self.drafter.bytes_per_token(), self.drafter.scratch_bytes()

    def new_token_table(self, size: int) -> TokenTable:
        shapes = self.model.kv_shapes
        if self.drafter is not None:
            self.drafter.new_kv(size)
        return TokenTable(size, len(shapes), *shapes[0], self.kv_dtype, self.device, shapes=shapes)

    def draft(self, asks: list[DraftRequest]) -> list[tuple[tuple[int, ...], int]]:
        """The draft model's proposals (`DraftRunner.propose`), between steps. Drafts continue the
        latest tokens, so the engine collects the step in flight first; were one still in flight,
        no request gets drafts (its length may change with that step's settle)."""
        if self.drafter is None:
            raise ValueError("no draft model is served (--speculative_config method draft_model, eagle3 or mtp)")
        if self._pending is not None:
            return [((), self.reqs[a.req_id].draft_len if a.req_id in self.reqs else 0) for a in asks]
        run = lambda: self.drafter.propose(asks, self.reqs, self.req_table.req_to_token)  # noqa: E731
        return self._device_thread.submit(run).result() if self._device_thread is not None else run()

    def _new_host_pool(self, gib: float, path: str | None = None) -> HostKVPool | None:
        """--host_kv_cache_gb (or, with `path`, --disk_kv_cache_gb) of what this rank's slots hold,
        the same tokens on every rank."""
        buffers = self._slot_buffers()
        tokens = self.tp.min_int(int(gib * 2**30) // sum(record_widths(buffers)), self.device)
        if tokens <= 0:
            return None
        return HostKVPool(tokens, buffers, self.device, path)

    def _slot_buffers(self) -> list[torch.Tensor]:
        """What a token's slot holds, in the host tiers' record order: every layer's K, then every
        V, then a draft head's feature of the token (the target's step wrote it; a prefix from the
        cache is not computed again, so its features must come back with its KV)."""
        extra = self.drafter.slot_buffers() if self.drafter is not None else []
        return self.token_table.k + self.token_table.v + extra

    # ---- the step ----

    def step(self, plan: StepPlan) -> list[StepResult]:
        """Free, launch `plan`, and return the results of the steps now due: the previous one
        (one step stays in flight), or every pending one with `plan.sync` or an empty plan."""
        if plan.drafts and not plan.sync:
            raise ValueError(f"step {plan.step_id}: a plan with drafts must be sync (the next needs its tokens)")
        try:
            job = self._submit(plan, time.perf_counter()) if plan.ops or not plan.empty else None
            done = [] if self._pending is None else [self._settle(self._pending.result())]
            self._pending = None
            if job is not None and (plan.sync or plan.empty):
                launched = job.result()
                done += [] if launched is None else [self._settle(launched)]
            elif job is not None:
                self._pending = job
            if done and self._trace is not None:
                self._trace.returned([result.step_id for result in done])
            if job is None and self._trace is not None:  # nothing launched: an idle runner's trace is whole
                self._trace.collections += bool(done)  # on disk (a stop may end it before atexit runs); with
                self._trace.flush()  # a result back, the engine collected the step in flight
            return self._report_grammars(done, idle=job is None)
        except BaseException:
            self._pending = None
            raise

    def _report_grammars(self, done: list[StepResult], idle: bool) -> list[StepResult]:
        """Add the grammars loaded since the last report to the last result (or to a result of
        their own). A call with nothing launched waits a moment for one while any is loading, so
        that an engine waiting only for grammars does not spin."""
        loading = [load[0] for load in self._grammar_loads.values() if not load[1]]
        if idle and loading and not done:
            wait(loading, timeout=0.002, return_when=FIRST_COMPLETED)
        ready = []
        for req_id, load in self._grammar_loads.items():
            if not load[1] and load[0].done():
                load[1] = True
                error = load[0].exception()
                ready.append((req_id, None if error is None else str(error)))
        if not ready:
            return done
        if not done:
            return [StepResult(-1, grammars=ready)]
        done[-1].grammars = ready
        return done

    def _settle(self, launched: LaunchedStep) -> StepResult:
        """The step's result; with drafts, keep each verifying request's accepted run (its drafts
        up to the first the target did not sample, and the token sampled there), and before any
        later step: its last token is the run's last, its rejected drafts' slots are free again."""
        if not launched.verifies:
            return launched.result()
        tokens = launched.tokens()
        keep = [True] * len(tokens)
        fix_rows, fix_index, free_rows, free_positions, accepted = [], [], [], [], 0
        for r, first, drafts in launched.verifies:
            a = _accepted(drafts, tokens[first: first + len(drafts)])
            accepted += a
            keep[first + a + 1: first + len(drafts) + 1] = [False] * (len(drafts) - a)
            fix_rows.append(r.row)
            fix_index.append(first + a)
            rejected = len(drafts) - a
            if rejected:
                free_rows += [r.row] * rejected
                free_positions += range(r.seq_len - rejected, r.seq_len)
                r.seq_len -= rejected
                r.sampling.generated -= rejected
        n, m = len(fix_rows), len(free_rows)
        index = int64_tensor(fix_rows + fix_index + free_rows + free_positions).to(self.device, non_blocking=True)
        self.last_token[index[:n]] = launched.device_tokens[index[n: 2 * n]]
        if m:
            self.token_table.free(self.req_table.req_to_token[index[2 * n: 2 * n + m], index[2 * n + m:]])
        if self.state_pool is not None:
            self._commit_verified(launched.decode_runs, dict(zip(fix_rows, fix_index)))
        if self._trace is not None:
            self._trace.accepted(launched.step_id, accepted)
        return launched.result(keep)

    @torch.inference_mode()
    def _commit_verified(self, runs: list[tuple[RunningReq, int]], last_kept: dict[int, int]) -> None:
        """The linear layers' states of a verify step's decoding requests advance over the tokens each
        kept: from its first decode token to `last_kept[row]` (its last accepted one), or its one token."""
        rows, starts, lengths, first = [], [], [], 0
        for r, n in runs:
            rows.append(r.row)
            starts.append(first)
            lengths.append(last_kept.get(r.row, first) + 1 - first)
            first += n
        up = int64_tensor(rows + starts + lengths).to(self.device, non_blocking=True)
        self.model.commit_verified(*up.view(3, -1), first)

    def _submit(self, plan: StepPlan, received: float) -> Future:
        """Ops and launch run in order on the device thread (CPU) or here (CUDA); `received`: when
        the runner was handed the plan (the step trace's)."""
        if self._device_thread is not None:
            return self._device_thread.submit(self._apply_and_launch, plan, received)
        future: Future = Future()
        future.set_result(self._apply_and_launch(plan, received))
        return future

    def _apply_and_launch(self, plan: StepPlan, received: float) -> LaunchedStep | None:
        started = time.perf_counter()
        self.apply(plan.ops)
        self._ops_ms = (time.perf_counter() - started) * 1000  # the step trace's ops_ms
        if self.device.type == "cpu":
            self._trim_heap(idle=plan.empty and not self.reqs)
        return None if plan.empty else self._launch(plan, received)

    def _trim_heap(self, idle: bool) -> None:
        """When idle, and every CPU_TRIM_EVERY_STEPS steps under load (see there)."""
        self._steps_since_trim += 1
        if idle or self._steps_since_trim >= CPU_TRIM_EVERY_STEPS:
            return_free_heap()
            self._steps_since_trim = 0

    @torch.inference_mode()
    def _launch(self, plan: StepPlan, received: float | None = None) -> LaunchedStep:
        """One step: new requests take rows, the metadata goes up in one copy, one forward over
        every new token (from a graph where a bucket fits), then sampling; the tokens stay on the
        device as the next step's input and start their way back to the host."""
        self._check(plan)
        traced = self._trace.begin(received) if self._trace is not None else None
        self._record_previous_tokens()
        self._start_requests(plan)
        decodes = DecodeRows.build(plan.decodes, plan.drafts, self.reqs)
        chunks = [(self.reqs[c.req_id], c) for c in plan.chunks]
        sampled = decodes.reqs + [r for r, c in chunks if c.last]
        graphed_decode = self.graphs is not None and not chunks and len(decodes) <= self.graphs.buckets[-1]
        t, layout = self._upload_step(plan, decodes, chunks, sampled, graphed_decode)
        grammar = None if self._grammars is None else grammar_masks([r.sampling for r in sampled],
                                                                   self.config.vocab_size, self.device)
        slots = self.token_table.alloc(plan.num_tokens, contiguous=bool(chunks))  # a decode's slot is its own
        _advance(decodes, chunks)
        max_seqlen = max((r.seq_len for r, _ in decodes.runs), default=1)
        lora = self.loras is not None and (any(r.lora_slot >= 0 for r, _ in decodes.runs)
                                           or any(r.lora_slot >= 0 for r, _ in chunks))  # no pass without slots
        if graphed_decode:
            logits = self._graph_forward(t, len(decodes), slots, max_seqlen, lora, self._hybrid_verify(plan))
        elif layout is not None:  # a mixed step's graph runs its LoRA kernels whatever its rows
            logits = self._mixed_forward(t, layout, len(decodes), len(sampled), slots, max_seqlen)
        else:
            logits = self._forward(t, bool(decodes), bool(chunks), slots, max_seqlen, lora, self._hybrid_verify(plan))
        if traced is not None:
            self._trace.forwarded(traced)
        launched = self._sample(plan, t, logits, grammar, chunks, sampled, decodes)
        if traced is not None:
            self._trace.end(traced, plan.step_id, len(plan.decodes), sum(len(c.token_ids) for _, c in chunks),
                            len(chunks), graphed_decode or layout is not None,
                            sum(r.seq_len for r in decodes.reqs), sum(r.seq_len for r, _ in chunks), plan.num_drafts,
                            sync=plan.sync, ops=len(plan.ops), ops_ms=self._ops_ms)
        return launched

    def _start_requests(self, plan: StepPlan) -> None:
        """A row for each request whose first chunk this is, its cached prefix's slots copied in."""
        for chunk in plan.chunks:
            if chunk.first:
                row = self.req_table.alloc()
                if chunk.prefix:
                    self.req_table.req_to_token[row, : chunk.start] = torch.cat([self.nodes[n] for n in chunk.prefix])
                if chunk.snapshot >= 0:  # the recurrent state after the prefix: its chunk reads the slot
                    self.state_pool.copy_slot(row, self.snapshot_pool, chunk.snapshot)
                state = SamplingState(chunk.sampling, generated=len(chunk.resumed),
                                      matcher=self._loaded_matcher(chunk.req_id, chunk.sampling))
                for token in chunk.resumed:  # a preempted request's outputs: counts and recent tokens again
                    state.record(token)
                self.reqs[chunk.req_id] = RunningReq(row, chunk.start, chunk.start, state,
                                                     [] if chunk.sampling.prompt_logprobs is not None else None,
                                                     self.loras.acquire(chunk.lora) if chunk.lora else -1)

    def _upload_step(self, plan: StepPlan, decodes: DecodeRows, chunks: list, sampled: list[RunningReq],
                     graphed_decode: bool) -> tuple[dict[str, torch.Tensor], MixedLayout | None]:
        """The step's metadata and sampling parameters on the device (one copy), and the graph
        bucket of a step with chunks (None: eager, or a decode-only step)."""
        offsets = decodes.offsets + [0] * (len(sampled) - len(decodes))  # a draft's row samples a later token
        ints, floats = host_lists([r.sampling for r in sampled], self.config.eos_token_ids, offsets,
                                  lambda: decodes.ids + [c.token_ids[-1] for _, c in chunks if c.last])
        layout = None
        if graphed_decode:
            ints.update(self._graph_meta(decodes))
        else:
            lists = step_lists(decodes, chunks, self.config.head_dim)
            layout = self._mixed_layout(plan, chunks, lists)
            ints.update(lists if layout is None else self._mixed_meta(lists, len(decodes), layout))
        return upload(ints, floats, self.device), layout

    def _sample(self, plan: StepPlan, t: dict, logits: torch.Tensor, grammar, chunks: list,
                sampled: list[RunningReq], decodes: DecodeRows) -> LaunchedStep:
        """Sample the step's tokens, keep them as the next step's input, send them to the host."""
        states = [r.sampling for r, _ in decodes.runs] + [r.sampling for r, c in chunks if c.last]  # one a request
        top_k = max((s.params.top_logprobs for s in states), default=0)
        sampling = SamplingBatch.from_tensors(t, all_greedy=all(s.params.greedy for s in states), top_logprobs=top_k,
                                              grammar=grammar, last_token=self.last_token, watermark=self.watermark)
        tokens, logprobs, top = sample(logits[: len(sampled)], sampling)
        self.last_token[t["sample_rows"]] = tokens
        head = self.model.lm_head
        hidden, head.deferred = head.deferred, None
        parts = chunk_prompt_logprobs(hidden, t.get("prompt_targets"), chunks, head.logits, self.config.vocab_size)
        req_ids = decodes.req_ids + [c.req_id for c in plan.chunks if c.last]
        launched = LaunchedStep(plan.step_id, req_ids, sampled, *download(tokens, logprobs, top, parts))
        launched.verifies, launched.device_tokens, launched.decode_runs = decodes.verifies, tokens, decodes.runs
        launched.prompt_done = {c.req_id for r, c in chunks if c.last and r.prompt_logprobs is not None}
        self._last_launched = launched if any(s.needs_tokens for s in states) else None
        return launched

    def _loaded_matcher(self, req_id: int, params):
        """The grammar matcher of a request with structured output, loaded off the step (or, for a
        request whose grammar no op loaded, such as a test's, loaded now on the same thread)."""
        if not params.grammar_kind:
            return None
        load = self._grammar_loads.pop(req_id, None)
        future = load[0] if load is not None else self._load_grammar(
            LoadGrammar(req_id, params.grammar_kind, params.grammar, params.compiled_grammar))
        return future.result()

    def prepare_grammars(self) -> Future:
        """Import xgrammar and build its view of the tokenizer now, on the grammar thread, rather than
        at the first request with structured output: that is Python holding the GIL for a second or
        more (2026-12-02, the default model on 2 CPU cores: steps of a running stream 2-3x slower and
        one 0.8 s gap), while a grammar's read after it runs in xgrammar's C++ without the GIL. A
        server's worker calls it once its model is loaded and waits for the returned future before
        it reports ready, so that neither that GIL time nor the objects it makes (which the start-up
        heap's freeze then takes in) meet the first requests; the offline LLM and tests build it
        when needed."""
        return self._grammar_executor().submit(self._prepare_grammars)

    def _prepare_grammars(self) -> None:
        started = time.monotonic()
        try:
            self._loaded_grammars()
            logger.info("structured output ready in %.1f s", time.monotonic() - started)
        except Exception as exc:  # a request with structured output tries again, and gets the error
            logger.warning("structured output not prepared (%s); the first request that needs it tries again", exc)

    def _grammar_executor(self) -> ThreadPoolExecutor:
        if self._grammar_thread is None:
            self._grammar_thread = ThreadPoolExecutor(1, "grammar")
        return self._grammar_thread

    def _load_grammar(self, op: LoadGrammar) -> Future:
        """The matcher of op's grammar, on the grammar thread: its compiled form comes from the HTTP
        process (read, then cached by the grammar); only the offline LLM's compile here."""
        return self._grammar_executor().submit(self._grammar_matcher, op.kind, op.grammar, op.compiled)

    def _grammar_matcher(self, kind: str, grammar: str, compiled: str):
        grammars = self._loaded_grammars()
        # Lowered after the Python above: a thread holding the GIL should not wait for a core
        _lower_thread_priority()
        return grammars.matcher(kind, grammar, compiled)

    def _loaded_grammars(self):
        """The runner's Grammars, made on first use (on the grammar thread only)."""
        if self._grammars is None:
            from lightllm.engine.grammar import Grammars  # xgrammar: only once structured output may come

            config = self.engine_config
            grammars = Grammars(config.model_dir, self.config.vocab_size, stop_token_ids=list(self.config.eos_token_ids),
                                tokenizer_mode=config.tokenizer_mode, trust_remote_code=config.trust_remote_code)
            grammars.compiler  # the tokenizer's view, before the step's `self._grammars is None` check sees it
            self._grammars = grammars
        return self._grammars

    def _record_previous_tokens(self) -> None:
        """Penalties and grammars need the previous step's tokens on the host: wait for them only then
        (`_last_launched` is kept only for a step with such a request)."""
        last, self._last_launched = self._last_launched, None
        if last is None:
            return
        for r, (token, _) in zip(last.sampled_reqs, last.tokens()):
            r.sampling.record(token)

    def _graph_meta(self, decodes: DecodeRows) -> dict[str, list[int]]:
        positions = [r.seq_len + o for r, o in zip(decodes.reqs, decodes.offsets)]
        rows = [r.row for r in decodes.reqs]
        lora_slots = [r.lora_slot for r in decodes.reqs]
        return {"meta": self.graphs.pad_meta(decodes.ids, positions, rows, [p + 1 for p in positions], lora_slots),
                "sample_rows": rows}

    def _graph_forward(self, t: dict[str, torch.Tensor], n: int, slots: torch.Tensor, max_seqlen: int,
                       lora: bool, verify: bool = False) -> torch.Tensor:
        meta = t["meta"].view(META_ROWS, -1)  # input_ids, positions, rows, seq_lens, LoRA slots
        rows, positions = meta[2, :n], meta[1, :n]
        self._fill_last_tokens(meta[0, :n], rows)
        self.req_to_token_write(rows, positions, slots)
        return self.graphs.run(meta, n, max_seqlen, lora, verify)

    def _mixed_layout(self, plan: StepPlan, chunks, lists: dict) -> MixedLayout | None:
        """The graph bucket of a step with chunks, or None to run it eagerly (too large, too many
        chunks, prompt logprobs: their rows are not among a bucket's logit rows)."""
        if self.graphs is None or "prompt_targets" in lists or self._hybrid_verify(plan):
            return None
        return self.graphs.mixed_layout(plan.num_tokens, len(chunks), len(lists["decode_rows"]),
                                        len(lists["sample_rows"]))

    def _hybrid_verify(self, plan: StepPlan) -> bool:
        """A step verifying drafts on a model with recurrent state: its linear layers read the states
        and stash the recurrence inputs (decode steps from their own graphs; with chunks, eager)."""
        return bool(plan.num_drafts) and self.state_pool is not None

    def _mixed_meta(self, lists: dict, num_decodes: int, layout: MixedLayout) -> dict[str, list[int]]:
        return {"meta": self.graphs.pad_mixed(lists, num_decodes, layout), "sample_rows": lists["sample_rows"]}

    def _mixed_forward(self, t: dict[str, torch.Tensor], layout: MixedLayout, num_decodes: int, num_sampled: int,
                       slots: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        tokens = layout.views(t["meta"])["tokens"].view(MIXED_TOKEN_ROWS, -1)  # ids, positions, rows, ...
        input_ids, positions, rows = tokens[0], tokens[1], tokens[2]
        self._fill_last_tokens(input_ids[:num_decodes], rows[:num_decodes])
        self.req_to_token_write(rows[: len(slots)], positions[: len(slots)], slots)
        return self.graphs.run_mixed(t["meta"], layout, num_sampled, max_seqlen)

    def _forward(self, t: dict[str, torch.Tensor], decodes: bool, chunks: bool, slots: torch.Tensor,
                 max_seqlen: int, lora: bool, verify: bool = False) -> torch.Tensor:
        """lora False: no row of the step has a LoRA adapter (the model launches no LoRA kernel).
        verify: a model with recurrent state verifies drafts (ForwardBatch.decode_verify)."""
        self.req_to_token_write(t["token_rows"], t["positions"], slots)
        decode_ids = t["decode_ids"].clone()
        self._fill_last_tokens(decode_ids, t["decode_rows"])
        input_ids = torch.cat([decode_ids, t["chunk_ids"]])
        rows = len(t["decode_rows"])
        plan_for = (self.graphs.decode_plan_for(rows) if decodes and self.graphs is not None
                    and rows <= self.graphs.buckets[-1] else None)
        decode = dict(decode_rows=t["decode_rows"].int(), decode_seq_lens=t["decode_seq_lens"].int(),
                      decode_max_seqlen=max_seqlen, decode_plan_for=plan_for) if decodes else {}
        extend = dict(ext_rows=t["ext_rows"].int(), ext_cu_q=t["ext_cu_q"].int(), ext_kv_lens=t["ext_kv_lens"].int(),
                      ext_q_blocks=t["ext_q_blocks"].int().view(2, -1)) if chunks else {}
        batch = ForwardBatch(input_ids, t["positions"], slots, self.req_table.req_to_token,
                             logit_index=t["logit_index"], lora_slots=t["lora_slots"] if lora else None,
                             decode_verify=verify, **decode, **extend)
        prompt_rows = t.get("prompt_targets")  # the logit rows' last ones: scored apart, in slices (_sample)
        self.model.lm_head.defer_rows = 0 if prompt_rows is None else len(prompt_rows)
        try:
            return self.target_forward(batch, self.token_table)
        finally:
            self.model.lm_head.defer_rows = 0

    def _fill_last_tokens(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows of id -1 feed their request's last sampled token (on the device since its step)."""
        torch.where(ids < 0, self.last_token[rows], ids, out=ids)

    def req_to_token_write(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        self.req_table.req_to_token[rows, positions] = slots.int()

    # ---- ops: ended requests and the prefix cache's nodes ----

    def apply(self, ops: list) -> None:
        """Apply a plan's ops in order. Safe while the steps that wrote those slots are still
        queued: the device runs the ops and any later step in order (on the CPU: the device
        thread). Every rank applies the same ops and ends up with the same slots. Consecutive
        Offloads, and consecutive Loads, move as one batch (the scheduler emits a step's room
        before its loads: `Scheduler._load_host`)."""
        to_free = []
        for kind, group in itertools.groupby(ops, key=_moved_in_batches):
            if kind is Offload:
                to_free += self._offload([op.node_id for op in group])
            elif kind is Load:
                to_free = self._free_slots(to_free)  # the room evicted for them
                self._load([op.node_id for op in group])
            else:
                for op in group:
                    to_free = self._apply_one(op, to_free)
        self._free_slots(to_free)

    def _apply_one(self, op, to_free: list[torch.Tensor]) -> list[torch.Tensor]:
        """Any op but Offload and Load; returns the slots to free at the end (none after a Reset)."""
        table = self.req_table.req_to_token
        if isinstance(op, Release):
            r = self.reqs.pop(op.req_id)
            end = r.seq_len if op.end < 0 else op.end
            if not r.prefix_len <= op.start <= end <= r.seq_len:
                raise ValueError(f"release of request {op.req_id}: positions [{op.start}, {end}) of "
                                 f"{r.seq_len} ({r.prefix_len} from the cache)")
            to_free.append(table[r.row, op.start: end])
            self._free_row(r)
        elif isinstance(op, Adopt):
            r = self.reqs[op.req_id]
            slots = torch.cat([self.nodes[n] for n in op.node_ids])
            if not r.prefix_len <= op.start < op.end <= r.seq_len or slots.numel() != op.end - op.start:
                raise ValueError(f"{op} of a request with {r.seq_len} tokens ({r.prefix_len} from the cache)")
            to_free.append(table[r.row, op.start: op.end].clone())
            table[r.row, op.start: op.end] = slots
        elif isinstance(op, Insert):
            r = self.reqs[op.req_id]
            if not 0 <= op.start < op.end <= r.seq_len or op.node_id in self.nodes:
                raise ValueError(f"cache insert {op} of a request with {r.seq_len} tokens")
            self.nodes[op.node_id] = table[r.row, op.start: op.end].clone()
        elif isinstance(op, Split) and op.node_id not in self.nodes:
            self._pool_of(op.node_id).split(op.node_id, op.at, op.upper_id)
        elif isinstance(op, Split):
            slots = self.nodes[op.node_id]
            self.nodes[op.upper_id], self.nodes[op.node_id] = slots[: op.at], slots[op.at:]
        elif isinstance(op, Evict) and op.node_id not in self.nodes:
            self._pool_of(op.node_id).drop(op.node_id)
        elif isinstance(op, Evict):
            to_free.append(self.nodes.pop(op.node_id))
        elif isinstance(op, Snapshot):
            self.snapshot_pool.copy_slot(op.slot, self.state_pool, self.reqs[op.req_id].row)
        elif isinstance(op, Spill):
            self.disk_pool.take_from(op.node_id, self.host_pool)
        elif isinstance(op, Reset):
            self.reset()
            return []
        elif isinstance(op, LoadGrammar):
            self._grammar_loads[op.req_id] = [self._load_grammar(op), False]
        elif isinstance(op, DropGrammar):
            self._grammar_loads.pop(op.req_id, None)
        elif isinstance(op, (LoadLora, DropLora)):
            self._lora_op(op)
        else:
            raise TypeError(f"unknown op {op!r}")
        return to_free

    def _offload(self, node_ids: list[int]) -> list[torch.Tensor]:
        """The nodes' KV to the host pool in one batch; returns their slots (to free)."""
        slots = [self.nodes.pop(node_id) for node_id in node_ids]
        self.host_pool.offload(list(zip(node_ids, slots)), self._slot_buffers())
        return slots

    def _load(self, node_ids: list[int]) -> None:
        """The nodes' KV back into fresh slots, a batch for each run of nodes in one pool."""
        for pool, group in itertools.groupby(node_ids, key=self._pool_of):
            group = list(group)
            sizes = [sum(length for _, length in pool.nodes[node_id]) for node_id in group]
            slots = self.token_table.alloc(sum(sizes)).split(sizes)
            pool.load(list(zip(group, slots)), self._slot_buffers())
            self.nodes.update((node_id, s.int()) for node_id, s in zip(group, slots))

    def _new_snapshot_pool(self, config) -> StatePool | None:
        """The prefix cache's state snapshots (None: no recurrent state, no cache, or no room)."""
        if self.state_pool is None or config.disable_prefix_cache or not config.state_snapshot_slots:
            return None
        wanted = snapshot_slots(self.state_pool.slot_bytes(), config.state_snapshot_slots, self.device,
                                config.mem_fraction)
        slots = self.tp.min_int(wanted, self.device)
        return self.state_pool.like(slots) if slots else None

    def _pool_of(self, node_id: int) -> HostKVPool:
        return self.host_pool if node_id in self.host_pool.nodes else self.disk_pool

    def _free_slots(self, to_free: list[torch.Tensor]) -> list[torch.Tensor]:
        if to_free:
            self.token_table.free(torch.cat(to_free))
        return []

    def _free_row(self, r: RunningReq) -> None:
        self.req_table.free(r.row)
        if r.lora_slot >= 0:
            self.loras.release(r.lora_slot)

    def _lora_op(self, op) -> None:
        if self.loras is None:
            raise ValueError("no LoRA adapters are served (--max_loras 0)")
        if isinstance(op, LoadLora):
            self.loras.add(op.lora_id, op.path)
        else:
            self.loras.drop(op.lora_id)

    def reset(self) -> None:
        for r in self.reqs.values():
            self._free_row(r)
        self.reqs.clear()
        self.nodes.clear()
        for pool in (self.host_pool, self.disk_pool):
            if pool is not None:
                pool.reset()
        self._grammar_loads.clear()
        self.token_table.free_all()
        self._last_launched = None

    def free(self, req_ids: list[int]) -> None:
        """Release whole requests (tests and benchmarks that run without a scheduler); ids the
        runner does not hold are skipped."""
        if len(set(req_ids)) != len(req_ids):
            raise KeyError(f"cannot free requests {req_ids}: repeated ids")
        self.apply([Release(i, self.reqs[i].prefix_len) for i in req_ids if i in self.reqs])

    def stats(self) -> dict:
        return {"tokens_used": self.token_table.used_count, "max_total_token_num": self.max_total_token_num,
                "running_requests": len(self.reqs), "cache_nodes": len(self.nodes),
                "host_tokens_used": 0 if self.host_pool is None else self.host_pool.capacity - self.host_pool.free_count}

    # ---- checks before any state changes, so a refused step leaves the runner as it was ----

    def _check(self, plan: StepPlan) -> None:
        vocab = self.config.vocab_size
        new = [c for c in plan.chunks if c.first]
        ids = plan.decodes + [c.req_id for c in plan.chunks]
        if len(set(ids)) != len(ids) or any(c.req_id in self.reqs for c in new):
            raise ValueError(f"step {plan.step_id}: request ids {ids} repeat or are already running")
        unknown = [i for i in ids if i not in self.reqs and i not in {c.req_id for c in new}]
        if unknown:
            raise ValueError(f"step {plan.step_id}: unknown requests {unknown}")
        for c in plan.chunks:
            if not c.token_ids or c.start + len(c.token_ids) > self.max_req_total_len:
                raise ValueError(f"request {c.req_id}: prompt of {c.start + len(c.token_ids)} tokens, must be "
                                 f"1..{self.max_req_total_len}")
            if min(c.token_ids) < 0 or max(c.token_ids) >= vocab:
                raise ValueError(f"request {c.req_id}: token id out of range [0, {vocab})")
            if c.first and (any(n not in self.nodes for n in c.prefix)
                            or sum(len(self.nodes[n]) for n in c.prefix) != c.start):
                raise ValueError(f"request {c.req_id}: cached prefix {c.prefix} does not hold {c.start} tokens")
        stash = None if self.state_pool is None else self.model.verify_stash
        if plan.drafts and self.state_pool is not None and (
                stash is None or len(plan.decodes) + plan.num_drafts > stash.tokens):
            raise ValueError(f"step {plan.step_id}: drafts for a model with recurrent state need the verify stash "
                             f"(--speculative_config at start) to hold the step's decode tokens")
        snapshots = 0 if self.snapshot_pool is None else self.snapshot_pool.slots
        if self.state_pool is not None and any(c.first and bool(c.prefix) != (0 <= c.snapshot < snapshots)
                                               for c in plan.chunks):
            raise ValueError(f"step {plan.step_id}: a cached prefix of a model with recurrent state needs the "
                             f"snapshot of its state (one of {snapshots} slots), and only such a prefix has one")
        if not self._loras_fit({c.lora for c in new if c.lora}):
            raise ValueError(f"step {plan.step_id}: more LoRA adapters starting than free slots")
        full = [i for i in plan.decodes if self.reqs[i].seq_len + len(plan.drafts.get(i, ())) >= self.max_req_total_len]
        if full:
            raise ValueError(f"decode: requests {full} reached max_req_total_len {self.max_req_total_len}")
        drafts = [t for d in plan.drafts.values() for t in d]
        if set(plan.drafts) - set(plan.decodes) or (drafts and not 0 <= min(drafts) <= max(drafts) < vocab):
            raise ValueError(f"step {plan.step_id}: drafts for requests not decoding, or token ids out of range")
        if plan.num_tokens > self.token_table.free_count:
            raise OutOfTokensError(f"step needs {plan.num_tokens} KV cache tokens, "
                                   f"{self.token_table.free_count} free")
        if len(new) > self.req_table.free_count:
            raise OutOfRowsError(f"step needs {len(new)} request rows, {self.req_table.free_count} free")

    def _loras_fit(self, lora_ids: set[int]) -> bool:
        """Whether requests of these adapters can start now: loaded, and a slot for each."""
        if not lora_ids:
            return True
        if self.loras is None or not lora_ids <= set(self.loras.host):
            return False
        return self.loras.table.fits(lora_ids)


GRAMMAR_NICENESS = 10  # as the HTTP side's grammar compiler: a read takes what the steps leave of the cores


def _lower_thread_priority() -> None:
    """The calling thread's CPU priority (Linux keeps one a thread), for the grammar thread: xgrammar
    reads a grammar without the GIL, but on a core that the router, detokenizer and HTTP processes
    need at every step."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the same priority as the steps
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, max(GRAMMAR_NICENESS, os.getpriority(os.PRIO_PROCESS, thread)))


def _accepted(drafts: list[int], sampled: list[tuple[int, float]]) -> int:
    """How many drafts lead the target's own tokens ((token, logprob) sampled at the rows that fed them)."""
    a = 0
    while a < len(drafts) and sampled[a][0] == drafts[a]:
        a += 1
    return a


def _advance(decodes: DecodeRows, chunks: list) -> None:
    """The host's counters once the step is launched: cached tokens and tokens sampled (a row each)."""
    for r, n in decodes.runs:
        r.seq_len += n
        r.sampling.generated += n
    for r, c in chunks:
        r.seq_len += len(c.token_ids)
        if c.last:
            r.sampling.generated += 1
