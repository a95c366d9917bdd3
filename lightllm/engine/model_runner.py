"""The model runner: one per tensor-parallel rank, it owns the device.

`step(plan)` turns a step plan into tensors in one place (`_upload`: one host-to-device copy),
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
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from lightllm.common.req_table import OutOfRowsError, ReqTable
from lightllm.common.token_table import OutOfTokensError, TokenTable
from lightllm.engine.plan import Chunk, Evict, Insert, Release, Reset, SampledToken, Split, StepPlan, StepResult
from lightllm.models import ForwardBatch, load_model, read_config, resolve_dtype, resolve_kv_dtype
from lightllm.utils.dist import init_tp
from lightllm.utils.process import return_free_heap
from lightllm.kernels.extend_attention import extend_q_blocks

from .cuda_graph import META_ROWS, MIXED_TOKEN_ROWS, MixedLayout, StepGraphs, graph_memory_bytes
from .memory import PROFILE_SAMPLING, PROFILE_SAMPLING_CPU, MemoryBudget, PeakMemory, largest_step, memory_info
from .step_trace import StepTrace
from .sampling import SamplingBatch, SamplingState, host_lists, prompt_logprobs, sample
from .scheduler import burst_budget

logger = logging.getLogger(__name__)

CPU_DEFAULT_TOKENS = 16384  # the most a CPU runner takes unless given more
# On the CPU, glibc keeps the pages that a step's activations free, and under steady load the
# worker is never idle: its RSS grew ~50 MiB/min with the heap in use flat (docs/benchmarks.md,
# soak). Give them back every this many steps too (about 2-10 ms each).
CPU_TRIM_EVERY_STEPS = 100


@dataclass
class RunningReq:
    row: int  # in ReqTable.req_to_token
    prefix_len: int  # positions [0, prefix_len) came from prefix-cache nodes
    seq_len: int  # tokens whose K/V are in the cache (or written by a launched step)
    sampling: SamplingState
    prompt_logprobs: list | None = None  # (logprob, top) per prompt position from the 2nd, as computed


class LaunchedStep:
    """A step whose tokens are on their way to the host (pinned buffers + event on CUDA).

    `host` is [2 + 2k, B] float64: token ids, their logprobs, then the top k ids and logprobs;
    `prompt_parts` are (request, host tensors of prompt_logprobs()) of the chunks that asked."""

    def __init__(self, step_id: int, req_ids: list[int], sampled_reqs: list[RunningReq], host: torch.Tensor,
                 prompt_parts: list, event):
        self.step_id, self.req_ids, self.sampled_reqs = step_id, req_ids, sampled_reqs
        self._host, self._prompt_parts, self._event = host, prompt_parts, event
        self.prompt_done: set[int] = set()  # req ids whose last chunk (with prompt logprobs) is in this step
        self._tokens: list[tuple[int, float]] | None = None

    def tokens(self) -> list[tuple[int, float]]:
        if self._tokens is None:
            if self._event is not None:
                self._event.synchronize()
            self._tokens = list(zip(map(int, self._host[0].tolist()), self._host[1].tolist()))
        return self._tokens

    def result(self) -> StepResult:
        tokens = self.tokens()
        if self._host.shape[0] == 2 and not self._prompt_parts and not self.prompt_done:  # no logprobs asked for
            return StepResult(self.step_id, [SampledToken(r, t, lp) for r, (t, lp) in zip(self.req_ids, tokens)])
        for r, chosen, top in self._prompt_parts:
            r.prompt_logprobs.extend(zip(chosen.tolist(), _top_lists(top, len(chosen))))
        out = []
        k = (self._host.shape[0] - 2) // 2
        tops = _top_lists((self._host[2: 2 + k].T, self._host[2 + k:].T) if k else None, len(tokens))
        for req_id, r, (token, logprob), top in zip(self.req_ids, self.sampled_reqs, tokens, tops):
            wanted = r.sampling.params.top_logprobs
            prompt = tuple(r.prompt_logprobs) if req_id in self.prompt_done else None
            out.append(SampledToken(req_id, token, logprob, top[:wanted] if wanted else None, prompt))
        return StepResult(self.step_id, out)


def _top_lists(top, n: int) -> list[tuple]:
    """Per row ((token, logprob), ...) of top = (ids [n, k], logprobs [n, k]) on the host, or ()."""
    if top is None:
        return [()] * n
    ids, values = top
    return [tuple(zip(map(int, i), v)) for i, v in zip(ids.tolist(), values.tolist())]


def resolve_device(device: str | None, local_rank: int) -> torch.device:
    """The rank's device; a bare "cuda" means the current GPU, named by its index (set_device needs one)."""
    if device is not None:
        chosen = torch.device(device)
        return torch.device("cuda", torch.cuda.current_device()) if chosen == torch.device("cuda") else chosen
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


class ModelRunner:
    def __init__(self, model_dir: str, *, max_total_token_num: int | None, max_req_total_len: int,
                 running_max_req_size: int, chunked_prefill_size: int | None = None,
                 burst_chunked_prefill_size: int | None = 0, mem_fraction: float = 0.9,
                 data_type: str = "auto", load_format: str = "auto",
                 tp_rank: int = 0, world_size: int = 1, nccl_port: int = 28765, device: str | None = None,
                 cuda_graph: bool = True, local_rank: int | None = None, dist_init_addr: str | None = None,
                 step_trace: str | None = None, quantization: str | None = None, kv_cache_dtype: str = "auto",
                 cuda_graph_max_tokens: int = 2048, tokenizer_mode: str = "auto", trust_remote_code: bool = False):
        """`chunked_prefill_size` (the scheduler's chunk budget), or the burst budget that
        `burst_chunked_prefill_size` means on this device (scheduler.burst_budget; None: the
        device's default; 0: off), and `running_max_req_size` bound the largest step, which runs
        once to size or check the KV budget (memory.py); None, with a budget given, skips that
        step (tests and tools that drive the runner alone). info["burst_chunked_prefill_size"]
        is the burst budget the scheduler takes (None with no chunk budget).
        `local_rank`: this rank's index on its machine (its GPU), tp_rank if absent;
        `dist_init_addr`: HOST:PORT of the rendezvous when the ranks span machines;
        `step_trace`: a JSON-lines file for the device's per-step timeline (step_trace.py);
        `tokenizer_mode`, `trust_remote_code`: how structured output loads the tokenizer."""
        self._tokenizer_options = {"tokenizer_mode": tokenizer_mode, "trust_remote_code": trust_remote_code}
        self.device = resolve_device(device, tp_rank if local_rank is None else local_rank)
        if self.device.type == "cuda":
            # Triton launches on the current device's stream, whatever the tensors' device: a
            # --dp replica's worker (tp 1, GPU d > 0) must make its GPU the current one too.
            torch.cuda.set_device(self.device)
        capture = cuda_graph and self.device.type == "cuda"
        # Not under fp8 weights: with the fused all-reduce + norm, bench-8b at tp 2 with
        # --quantization fp8 hung in its first graph warm-up on two H200s (both ranks waiting on
        # the device), and served without it (docs/multi_gpu.md, 2026-11-28, fifteenth session).
        self.tp = init_tp(tp_rank, world_size, nccl_port, self.device, dist_init_addr,
                          fused_norms=quantization != "fp8")
        self.config = cfg = replace(read_config(model_dir), quantization=quantization)
        self._warn_long_context(max_req_total_len)
        dtype = resolve_dtype(data_type, cfg, self.device)
        self.model = load_model(cfg, dtype=dtype, device=self.device, tp=self.tp,
                                max_positions=max_req_total_len,
                                load_format=load_format)
        self.kv_dtype = resolve_kv_dtype(kv_cache_dtype, dtype, self.device)
        self.max_req_total_len = max_req_total_len
        self.req_table = ReqTable(running_max_req_size, max_req_total_len, self.device, padding_row=cuda_graph)
        # The token each request feeds next, by request row (padding row included).
        self.last_token = torch.zeros(running_max_req_size + 1, dtype=torch.int64, device=self.device)
        self.graphs = None
        self.reqs: dict[int, RunningReq] = {}
        self.nodes: dict[int, torch.Tensor] = {}  # prefix-cache node id -> its slots (int32, on the device)
        self._pending: Future | None = None  # the launched step whose tokens are not yet returned
        self._last_launched: LaunchedStep | None = None
        self._grammars = None  # grammar.Grammars, made when the first request with structured output comes
        self._trace = None
        self._device_thread = ThreadPoolExecutor(1, "device") if self.device.type == "cpu" else None
        self._steps_since_trim = 0  # CPU: launched steps since the heap's free pages went back
        self.info = {"architecture": cfg.architecture, "dtype": str(dtype).removeprefix("torch."),
                     "vocab_size": cfg.vocab_size, "eos_token_ids": list(cfg.eos_token_ids),
                     "max_position_embeddings": cfg.max_position_embeddings, "model_dir": str(model_dir),
                     "sampling_defaults": list(cfg.sampling_defaults.items()),  # pairs: the wire is flat
                     "burst_chunked_prefill_size": None if chunked_prefill_size is None else burst_budget(
                         burst_chunked_prefill_size, chunked_prefill_size, self.device.type)}
        graph_bytes = graph_memory_bytes(running_max_req_size, cuda_graph_max_tokens, cfg.hidden_size,
                                         cfg.intermediate_size, cfg.vocab_size, dtype.itemsize) if capture else 0
        largest_chunk = self.info["burst_chunked_prefill_size"]  # the largest step's prompt tokens
        self.max_total_token_num = self._token_budget(max_total_token_num, largest_chunk, mem_fraction,
                                                      graph_bytes)
        self.token_table = self._token_table(self.max_total_token_num)
        if cuda_graph:
            self.graphs = StepGraphs(self.model, self.token_table, self.req_table, running_max_req_size,
                                     cuda_graph_max_tokens, capture)
        if step_trace:
            self._trace = StepTrace(step_trace if world_size == 1 else f"{step_trace}.rank{tp_rank}", self.device)
            atexit.register(self._trace.close)

    def _warn_long_context(self, max_req_total_len: int) -> None:
        cfg = self.config
        if max_req_total_len > cfg.max_position_embeddings:
            logger.warning("max_req_total_len %d exceeds the model's max_position_embeddings %d",
                           max_req_total_len, cfg.max_position_embeddings)

    def _token_table(self, size: int) -> TokenTable:
        cfg = self.config
        return TokenTable(size, cfg.num_layers, self.model.kv_heads, cfg.head_dim, self.kv_dtype, self.device)

    def _token_budget(self, requested: int | None, chunk_budget: int | None, mem_fraction: float,
                      graph_bytes: int) -> int:
        """The KV budget: what fits beside the largest step's peak (memory.py), the same on every
        rank (the smallest); one given by hand must fit. On the CPU at most CPU_DEFAULT_TOKENS
        unless given: the host is shared, and a larger cache buys a CPU server nothing."""
        if requested is not None and chunk_budget is None:
            return requested
        found = self._profile(chunk_budget or self.max_req_total_len, mem_fraction, graph_bytes)
        cfg = self.config
        per_token = 2 * cfg.num_layers * self.model.kv_heads * cfg.head_dim * self.kv_dtype.itemsize
        fits = self.tp.min_int(found.tokens(per_token), self.device)
        where = f"{found.describe(self.device)}, {per_token} B a token"
        if requested is not None:
            if requested > fits:
                raise ValueError(f"--max_total_token_num {requested} does not fit: at most {fits} tokens fit in {where}; "
                                 "give at most that, or a larger --mem_fraction")
            logger.info("max_total_token_num: %d as given (at most %d fit in %s)", requested, fits, where)
            return requested
        tokens = min(fits, CPU_DEFAULT_TOKENS) if self.device.type == "cpu" else fits
        if tokens < 2:
            raise ValueError(f"no memory left for the KV cache: {where}")
        logger.info("max_total_token_num: %d (%d fit in %s)", tokens, fits, where)
        return tokens

    def _profile(self, chunk_budget: int, mem_fraction: float, graph_bytes: int) -> MemoryBudget:
        """Run the largest step on a token table just large enough for it; measure its peak."""
        sampling = PROFILE_SAMPLING_CPU if self.device.type == "cpu" else PROFILE_SAMPLING
        plans = largest_step(self.req_table.max_reqs, chunk_budget, self.max_req_total_len, self.config.vocab_size,
                             sampling)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # blocks cached while loading would read as used
        total, free = memory_info(self.device)
        self.token_table = self._token_table(sum(p.num_tokens for p in plans))
        start = time.perf_counter()
        with PeakMemory(self.device) as peak:
            # Where serving runs them: on the CPU the device thread, which in an in-process runner
            # allocates from a heap of its own (a model worker has one heap: use_one_heap).
            for plan in plans:
                self._submit(plan).result().tokens()
        self._reset()
        del self.token_table
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            return_free_heap()
        # What the step left in use outside its buffers counts too: kernels loaded on first use,
        # communicators, heap pages not given back.
        free = min(free, memory_info(self.device)[1])
        logger.info("profile step (%d decodes, %d prompt tokens) in %.1f s: %.2f GiB at its peak",
                    len(plans[-1].decodes), plans[-1].num_tokens - len(plans[-1].decodes),
                    time.perf_counter() - start, peak.bytes / 2**30)
        return MemoryBudget(total, total - free, peak.bytes, graph_bytes, mem_fraction)

    # ---- the step ----

    def step(self, plan: StepPlan) -> list[StepResult]:
        """Free, launch `plan`, and return the results of the steps now due: the previous one
        (one step stays in flight), or every pending one with `plan.sync` or an empty plan."""
        try:
            job = self._submit(plan) if plan.ops or not plan.empty else None
            done = [] if self._pending is None else [self._pending.result().result()]
            self._pending = None
            if job is not None and (plan.sync or plan.empty):
                launched = job.result()
                done += [] if launched is None else [launched.result()]
            elif job is not None:
                self._pending = job
            return done
        except BaseException:
            self._pending = None
            raise

    def _submit(self, plan: StepPlan) -> Future:
        """Ops and launch run in order on the device thread (CPU) or here (CUDA)."""
        if self._device_thread is not None:
            return self._device_thread.submit(self._apply_and_launch, plan)
        future: Future = Future()
        future.set_result(self._apply_and_launch(plan))
        return future

    def _apply_and_launch(self, plan: StepPlan) -> LaunchedStep | None:
        self.apply(plan.ops)
        if self.device.type == "cpu":
            self._trim_heap(idle=plan.empty and not self.reqs)
        return None if plan.empty else self._launch(plan)

    def _trim_heap(self, idle: bool) -> None:
        """When idle, and every CPU_TRIM_EVERY_STEPS steps under load (see there)."""
        self._steps_since_trim += 1
        if idle or self._steps_since_trim >= CPU_TRIM_EVERY_STEPS:
            return_free_heap()
            self._steps_since_trim = 0

    @torch.inference_mode()
    def _launch(self, plan: StepPlan) -> LaunchedStep:
        self._check(plan)
        traced = self._trace.begin() if self._trace is not None else None
        self._record_previous_tokens()
        for chunk in plan.chunks:
            if chunk.first:
                row = self.req_table.alloc()
                if chunk.prefix:
                    self.req_table.req_to_token[row, : chunk.start] = torch.cat([self.nodes[n] for n in chunk.prefix])
                state = SamplingState(chunk.sampling, matcher=self._matcher(chunk.sampling))
                self.reqs[chunk.req_id] = RunningReq(row, chunk.start, chunk.start, state,
                                                     [] if chunk.sampling.prompt_logprobs is not None else None)
        decodes = [self.reqs[i] for i in plan.decodes]
        chunks = [(self.reqs[c.req_id], c) for c in plan.chunks]
        sampled = decodes + [r for r, c in chunks if c.last]
        states = [r.sampling for r in sampled]
        ints, floats = host_lists(states, self.config.eos_token_ids)
        decode_graph = self.graphs is not None and not chunks
        layout = None  # a mixed step's graph bucket, None: eager
        if decode_graph:
            ints.update(self._graph_meta(decodes))
        else:
            lists = _step_lists(decodes, chunks, self.config.head_dim)
            layout = self._mixed_layout(plan, chunks, lists)
            ints.update(lists if layout is None else self._mixed_meta(lists, len(decodes), layout))
        grammar = self._grammar_masks(states)
        slots = self.token_table.alloc(plan.num_tokens, contiguous=bool(chunks))  # a decode's slot is its own
        t = self._upload(ints, floats)
        for r in decodes:
            r.seq_len += 1
        for r, c in chunks:
            r.seq_len += len(c.token_ids)
        for r in sampled:
            r.sampling.generated += 1
        max_seqlen = max((r.seq_len for r in decodes), default=1)
        if decode_graph:
            logits = self._graph_forward(t, len(decodes), slots, max_seqlen)
        elif layout is not None:
            logits = self._mixed_forward(t, layout, len(decodes), len(sampled), slots, max_seqlen)
        else:
            logits = self._forward(t, bool(decodes), bool(chunks), slots, max_seqlen)
        top_k = max((s.params.top_logprobs for s in states), default=0)
        sampling = SamplingBatch.from_tensors(t, all_greedy=all(s.params.greedy for s in states), top_logprobs=top_k,
                                              grammar=grammar)
        tokens, logprobs, top = sample(logits[: len(sampled)], sampling)
        self.last_token[t["sample_rows"]] = tokens
        parts = self._prompt_logprobs(logits[len(sampled):], t, chunks)
        host, host_parts, event = self._download(tokens, logprobs, top, parts)
        launched = LaunchedStep(plan.step_id, plan.sampled, sampled, host, host_parts, event)
        launched.prompt_done = {c.req_id for r, c in chunks if c.last and r.prompt_logprobs is not None}
        self._last_launched = launched
        if traced is not None:
            self._trace.end(traced, plan.step_id, len(decodes), sum(len(c.token_ids) for _, c in chunks), len(chunks),
                            decode_graph or layout is not None, sum(r.seq_len for r in decodes),
                            sum(r.seq_len for r, _ in chunks))
        return launched

    def _matcher(self, params):
        """The grammar matcher of a request with structured output: its grammar comes compiled
        from the HTTP process (read once, cached); only the offline LLM's compile here."""
        if not params.grammar_kind:
            return None
        if self._grammars is None:
            from lightllm.engine.grammar import Grammars  # xgrammar: only once a request needs it

            self._grammars = Grammars(self.info["model_dir"], self.config.vocab_size,
                                      stop_token_ids=list(self.config.eos_token_ids), **self._tokenizer_options)
        return self._grammars.matcher(params.grammar_kind, params.grammar, params.compiled_grammar)

    def _grammar_masks(self, states: list[SamplingState]) -> tuple | None:
        """(bitmask, rows) on the device for the constrained requests of the batch, or None."""
        if self._grammars is None:  # no request has asked for structured output yet
            return None
        rows = [b for b, s in enumerate(states) if s.matcher is not None and not s.matcher.terminated]
        if not rows:
            return None
        from lightllm.engine.grammar import allocate_bitmask

        bitmask = allocate_bitmask(len(states), self.config.vocab_size)  # rows of the other requests stay unread
        for b in rows:
            states[b].matcher.fill(bitmask, b)
        return bitmask.to(self.device, non_blocking=True), torch.tensor(rows, device=self.device)

    def _prompt_logprobs(self, logits: torch.Tensor, t: dict, chunks) -> list:
        """(request, chosen, top) per chunk that wants prompt logprobs; its rows follow the sampled ones."""
        parts, offset = [], 0
        targets = t.get("prompt_targets")
        for r, c in chunks:
            n = len(c.token_ids) - (1 if c.last else 0)
            if r.prompt_logprobs is None or n == 0:  # a one-token last chunk: its row is the sampled one
                continue
            chosen, top = prompt_logprobs(logits[offset: offset + n], targets[offset: offset + n],
                                          r.sampling.params.prompt_logprobs)
            parts.append((r, chosen, top))
            offset += n
        return parts

    def _record_previous_tokens(self) -> None:
        """Penalties and grammars need the previous step's tokens on the host: wait for them only then."""
        last, self._last_launched = self._last_launched, None
        if last is None or not any(r.sampling.needs_tokens for r in last.sampled_reqs):
            return
        for r, (token, _) in zip(last.sampled_reqs, last.tokens()):
            r.sampling.record(token)

    def _graph_meta(self, decodes: list[RunningReq]) -> dict[str, list[int]]:
        columns = ([0] * len(decodes), [r.seq_len for r in decodes], [r.row for r in decodes],
                   [r.seq_len + 1 for r in decodes])
        return {"meta": self.graphs.pad_meta(*columns), "sample_rows": [r.row for r in decodes]}

    def _graph_forward(self, t: dict[str, torch.Tensor], n: int, slots: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        meta = t["meta"].view(META_ROWS, -1)  # input_ids, positions, rows, seq_lens
        rows, positions = meta[2, :n], meta[1, :n]
        meta[0, :n] = self.last_token[rows]
        self.req_to_token_write(rows, positions, slots)
        return self.graphs.run(meta, n, max_seqlen)

    def _mixed_layout(self, plan: StepPlan, chunks, lists: dict) -> MixedLayout | None:
        """The graph bucket of a step with chunks, or None to run it eagerly (too large, too many
        chunks, prompt logprobs: their rows are not among a bucket's logit rows)."""
        if self.graphs is None or "prompt_targets" in lists:
            return None
        return self.graphs.mixed_layout(plan.num_tokens, len(chunks))

    def _mixed_meta(self, lists: dict, num_decodes: int, layout: MixedLayout) -> dict[str, list[int]]:
        return {"meta": self.graphs.pad_mixed(lists, num_decodes, layout), "sample_rows": lists["sample_rows"]}

    def _mixed_forward(self, t: dict[str, torch.Tensor], layout: MixedLayout, num_decodes: int, num_sampled: int,
                       slots: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        tokens = layout.views(t["meta"])["tokens"].view(MIXED_TOKEN_ROWS, -1)  # ids, positions, rows, ...
        input_ids, positions, rows = tokens[0], tokens[1], tokens[2]
        input_ids[:num_decodes] = self.last_token[rows[:num_decodes]]
        self.req_to_token_write(rows[: len(slots)], positions[: len(slots)], slots)
        return self.graphs.run_mixed(t["meta"], layout, num_sampled, max_seqlen)

    def _forward(self, t: dict[str, torch.Tensor], decodes: bool, chunks: bool, slots: torch.Tensor,
                 max_seqlen: int) -> torch.Tensor:
        self.req_to_token_write(t["token_rows"], t["positions"], slots)
        input_ids = torch.cat([self.last_token[t["decode_rows"]], t["chunk_ids"]])
        plan_for = self.graphs.decode_plan_for(len(t["decode_rows"])) if decodes and self.graphs is not None else None
        decode = dict(decode_rows=t["decode_rows"].int(), decode_seq_lens=t["decode_seq_lens"].int(),
                      decode_max_seqlen=max_seqlen, decode_plan_for=plan_for) if decodes else {}
        extend = dict(ext_rows=t["ext_rows"].int(), ext_cu_q=t["ext_cu_q"].int(), ext_kv_lens=t["ext_kv_lens"].int(),
                      ext_q_blocks=t["ext_q_blocks"].int().view(2, -1)) if chunks else {}
        batch = ForwardBatch(input_ids, t["positions"], slots, self.req_table.req_to_token,
                             logit_index=t["logit_index"], **decode, **extend)
        return self.model.forward(batch, self.token_table)

    def req_to_token_write(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        self.req_table.req_to_token[rows, positions] = slots.int()

    # ---- one place that turns lists into tensors, one place that reads results back ----

    def _upload(self, ints: dict[str, list[int]], floats: dict[str, list[float]]) -> dict[str, torch.Tensor]:
        """All of a step's metadata in one host-to-device copy: ints as int64, then floats as
        float32 packed two per int64 slot; returns named device views."""
        flat_ints = [v for values in ints.values() for v in values]
        flat_floats = [v for values in floats.values() for v in values]
        flat_floats += [0.0] * (len(flat_floats) % 2)
        host = torch.cat([torch.tensor(flat_ints, dtype=torch.int64),
                          torch.tensor(flat_floats, dtype=torch.float32).view(torch.int64)])
        if self.device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(self.device, non_blocking=True)
        out = _split(dev[: len(flat_ints)], ints)
        out.update(_split(dev[len(flat_ints):].view(torch.float32), floats))
        return out

    def _download(self, tokens: torch.Tensor, logprobs: torch.Tensor, top, parts: list):
        """(host buffer, host prompt parts, event): float64 holds token ids exactly; on CUDA the
        copies are asynchronous into pinned memory and the event says when they have landed."""
        rows = [tokens.double()[None], logprobs.double()[None]]
        if top is not None:
            rows += [top[0].T.double(), top[1].T.double()]
        stacked = torch.cat(rows)
        if self.device.type != "cuda":
            return stacked, parts, None
        host = _pinned_copy(stacked)
        host_parts = [(r, _pinned_copy(chosen), None if top is None else tuple(map(_pinned_copy, top)))
                      for r, chosen, top in parts]
        event = torch.cuda.Event()
        event.record()
        return host, host_parts, event

    # ---- ops: ended requests and the prefix cache's nodes ----

    def apply(self, ops: list) -> None:
        """Apply a plan's ops in order. Safe while the steps that wrote those slots are still
        queued: the device runs the ops and any later step in order (on the CPU: the device
        thread). Every rank applies the same ops and ends up with the same slots."""
        table = self.req_table.req_to_token
        to_free = []
        for op in ops:
            if isinstance(op, Release):
                r = self.reqs.pop(op.req_id)
                end = r.seq_len if op.end < 0 else op.end
                if not r.prefix_len <= op.start <= end <= r.seq_len:
                    raise ValueError(f"release of request {op.req_id}: positions [{op.start}, {end}) of "
                                     f"{r.seq_len} ({r.prefix_len} from the cache)")
                to_free.append(table[r.row, op.start: end])
                self.req_table.free(r.row)
            elif isinstance(op, Insert):
                r = self.reqs[op.req_id]
                if not 0 <= op.start < op.end <= r.seq_len or op.node_id in self.nodes:
                    raise ValueError(f"cache insert {op} of a request with {r.seq_len} tokens")
                self.nodes[op.node_id] = table[r.row, op.start: op.end].clone()
            elif isinstance(op, Split):
                slots = self.nodes[op.node_id]
                self.nodes[op.upper_id], self.nodes[op.node_id] = slots[: op.at], slots[op.at:]
            elif isinstance(op, Evict):
                to_free.append(self.nodes.pop(op.node_id))
            elif isinstance(op, Reset):
                self._reset()
                to_free = []
            else:
                raise TypeError(f"unknown op {op!r}")
        if to_free:
            self.token_table.free(torch.cat(to_free))

    def _reset(self) -> None:
        for r in self.reqs.values():
            self.req_table.free(r.row)
        self.reqs.clear()
        self.nodes.clear()
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
                "running_requests": len(self.reqs), "cache_nodes": len(self.nodes)}

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
        full = [i for i in plan.decodes if self.reqs[i].seq_len >= self.max_req_total_len]
        if full:
            raise ValueError(f"decode: requests {full} reached max_req_total_len {self.max_req_total_len}")
        if plan.num_tokens > self.token_table.free_count:
            raise OutOfTokensError(f"step needs {plan.num_tokens} KV cache tokens, "
                                   f"{self.token_table.free_count} free")
        if len(new) > self.req_table.free_count:
            raise OutOfRowsError(f"step needs {len(new)} request rows, {self.req_table.free_count} free")


def _pinned_copy(x: torch.Tensor) -> torch.Tensor:
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    return host


def _split(flat: torch.Tensor, lists: dict[str, list]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, values in lists.items():
        out[name] = flat[offset: offset + len(values)]
        offset += len(values)
    return out


def _step_lists(decodes: list[RunningReq], chunks: list, head_dim: int) -> dict[str, list[int]]:
    """Packed metadata: decodes first (one token each), then chunks; row and position per
    token, per-chunk extend bounds (absolute: the first chunk starts after the decodes) and
    extend attention's block table, the logits rows to sample and their request rows, then the
    rows (and next tokens) of the chunks that want prompt logprobs."""
    positions = [r.seq_len for r in decodes]
    token_rows = [r.row for r in decodes]
    chunk_ids, cu_q, kv_lens, logit_index = [], [len(decodes)], [], list(range(len(decodes)))
    prompt_rows, prompt_targets = [], []
    for r, c in chunks:
        n = len(c.token_ids)
        chunk_ids.extend(c.token_ids)
        positions.extend(range(c.start, c.start + n))
        token_rows.extend([r.row] * n)
        first = cu_q[-1]
        cu_q.append(first + n)
        kv_lens.append(c.start + n)
        if c.last:
            logit_index.append(cu_q[-1] - 1)
        if r.prompt_logprobs is not None:  # row j predicts the chunk's token j + 1 (then the next chunk's first)
            targets = c.token_ids[1:] + ([] if c.last else [c.next_id])
            prompt_rows.extend(range(first, first + len(targets)))
            prompt_targets.extend(targets)
    sample_rows = [r.row for r in decodes] + [r.row for r, c in chunks if c.last]
    lists = {"chunk_ids": chunk_ids, "positions": positions, "token_rows": token_rows,
             "decode_rows": [r.row for r in decodes], "decode_seq_lens": [r.seq_len + 1 for r in decodes],
             "ext_rows": [r.row for r, _ in chunks], "ext_cu_q": cu_q, "ext_kv_lens": kv_lens,
             "ext_q_blocks": extend_q_blocks([len(c.token_ids) for _, c in chunks], head_dim),
             "logit_index": logit_index + prompt_rows, "sample_rows": sample_rows}
    if prompt_targets:
        lists["prompt_targets"] = prompt_targets
    return lists


_direct_steps = iter(range(-1, -(1 << 62), -1))  # ids of direct steps, apart from the scheduler's


def run_step(runner: ModelRunner, decodes: list[int] = (), prompts: list[tuple] = ()) -> list[tuple[int, float]]:
    """One synchronous step without a scheduler (tests and benchmarks): `decodes` are running
    request ids, `prompts` whole prompts as (req_id, token ids, SamplingParams); returns
    (token, logprob) per request, decodes first."""
    chunks = [Chunk(req_id, list(ids), 0, True, params) for req_id, ids, params in prompts]
    (result,) = runner.step(StepPlan(next(_direct_steps), list(decodes), chunks, sync=True))
    return [(t.token_id, t.logprob) for t in result.tokens]
