"""Every step in fixed shapes (buckets), replayed from CUDA graphs on CUDA devices.

Two families of graphs, both captured once at start-up (`capture=True`), largest first, into
one shared memory pool; the runner keeps `graph_memory_bytes` of headroom for them when it sizes
the KV cache:

- decode steps (no prompt chunk): the smallest decode bucket >= the batch (`decode_buckets`);
  a model serving LoRA adapters captures each decode bucket twice, with its LoRA kernels and
  without them (for steps where no row has an adapter: `run(lora=False)`), in the same pool (the
  two take the same activations, so the second costs capture time and the graphs' own nodes);
- mixed steps (decodes beside prompt chunks, or chunks alone): the smallest token bucket >= the
  step's tokens (`mixed_buckets`), with up to MAX_GRAPH_CHUNKS chunks (a model with recurrent
  state also captures each bucket with FEW_GRAPH_CHUNKS chunk slots, for the steps that hold that
  few: every chunk slot costs its linear layers a state read and written). Larger steps, steps with
  more chunks and steps that want prompt logprobs run eagerly: a step of more than
  `max_tokens` tokens takes longer on the device than its eager launch takes on the host.

Padding is harmless: a padding token has token 0 at position 0 in the request table's padding
row, whose first entry is the token table's scratch slot (outside the budget); its decode
attention has seq_len 1. So padding writes K/V only to the scratch slot, attends only to it,
never touches a request's row or the prefix cache, and its logits are dropped. In a mixed step
decode attention covers the first min(bucket, max batch) tokens (its grid fixed by the bucket:
no step has more decodes than that); the rows of chunk tokens and padding among them attend to
the scratch slot only, and extend attention then writes the chunk tokens' rows over them. The
padding tokens past them get no attention output at all: their rows of the step's activations
are whatever the memory held, which no real row reads (each row is its own through the GEMMs,
norms and all-reduces) and whose logits are dropped. Padding chunks are empty (kv_len 0) and
extend attention's block table has padding slots that leave at once, so its grid is fixed too.
A hybrid model's linear layers (models/qwen3_next.py) keep a state slot per request row, read
and written only for real rows: a padding decode row (sequence length 1; in a mixed step also
those over chunk tokens) and a padding chunk (empty) touch no state at all, so padding costs a
mixed step nothing there, and the chunks' kernels (bounds read on the device) write the chunk
tokens' rows after the decode step's.

A captured forward reads its step from one static metadata buffer, derives the new tokens' KV
slots from the request table inside the graph, and writes one static logits buffer. Decode
attention gets the fixed bound max_req_total_len, so its split plan (the number of splits, the
grid) depends only on the bucket; each request cuts its own keys into those splits on the device,
so a short request still spreads over them. Without capture (CPU) the same
padded forwards run eagerly, bounded by the batch's own longest request, so CI tests the padding.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import time
from dataclasses import dataclass

import torch

from lightllm.common.req_table import ReqTable
from lightllm.common.token_table import TokenTable
from lightllm.models import ForwardBatch, LlamaModel
from lightllm.kernels.extend_attention import max_q_blocks, pad_q_blocks

logger = logging.getLogger(__name__)

# Dense where batches are small (launch-bound: padding is almost free), then every 32 and,
# past 256, every 64 (the step turns compute-bound, so padding there costs time); the largest
# bucket is running_max_req_size itself.
SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
LARGE_BUCKET_STEP = 64
META_ROWS = 5  # decode steps: input_ids, positions, request rows, sequence lengths, LoRA slots
# Mixed steps, in tokens: every 64 up to 1024 (a mixed step of a few hundred tokens is at the
# GEMMs' compute knee, so padding costs about its share of tokens), every 128 above.
MIXED_SMALL = (16, 32, 64)
MIXED_STEPS = ((1024, 64), (4096, 128), (16384, 512))
# Chunks a graphed step may hold: a burst's step of 8192 prompt tokens takes whole ShareGPT
# prompts (a few hundred tokens each) by the dozen. Each chunk costs a logit row and an extend-
# attention block slot that leaves at once when unused.
MAX_GRAPH_CHUNKS = 64
# A hybrid model's second chunk tier: fla's kernels read an initial state and write a final one for
# every chunk slot, empty or not (a padding slot of qwen3.5-27b: 1.5 MiB read, 3 MiB written in each
# of 48 layers), so a step of a few chunks (the steady state's arrivals, a shared prefix's
# followers) replays a bucket with this many slots instead of 64.
FEW_GRAPH_CHUNKS = 8
MIXED_TOKEN_ROWS = 4  # input_ids, positions, token rows, LoRA slots (then decode attention's rows and seq lens, `decodes` each)


def decode_buckets(max_batch: int) -> list[int]:
    small = [b for b in SMALL_BUCKETS if b < max_batch]
    large = range(SMALL_BUCKETS[-1] + LARGE_BUCKET_STEP, max_batch, LARGE_BUCKET_STEP)
    return small + list(large) + [max_batch]


def mixed_buckets(max_tokens: int) -> list[int]:
    buckets, size = [b for b in MIXED_SMALL if b < max_tokens], MIXED_SMALL[-1]
    for limit, stride in MIXED_STEPS:
        while size + stride <= min(limit, max_tokens):
            size += stride
            buckets.append(size)
    return buckets if buckets and buckets[-1] == max_tokens else buckets + [max_tokens]


def graph_memory_bytes(max_batch: int, max_tokens: int, hidden: int, intermediate: int, vocab_size: int,
                       itemsize: int) -> int:
    """What capture needs beyond the weights and KV cache, roughly: the static fp32 logits of the
    most sampled rows plus the largest forward's transient logits, and the largest mixed step's
    activations (hidden states, residual, q/k/v and attention output, gate/up and their product)."""
    logit_rows = max(max_batch, min(max_tokens, max_batch + MAX_GRAPH_CHUNKS))
    activations = max_tokens * (8 * hidden + 3 * intermediate) * itemsize
    return 3 * logit_rows * vocab_size * 4 + activations


@contextlib.contextmanager
def no_collection():
    """Python's cyclic garbage collector held off (after one collection) for a capture: an earlier
    runner dropped in a reference cycle holds CUDA graphs, and a collection that came inside a
    capture destroyed them there, which CUDA does not permit while a stream captures: it
    invalidated the capture (a second `LLM` in one process, or the GPU tests' runners one after
    another, failed at start 'operation failed due to a previous error during capture')."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def first_replays(graphs) -> None:
    """Replay each captured graph once on its padding-only metadata ((fill the metadata, graph) pairs):
    a graph's first launch uploads it to the device, which on an H200 held a qwen3.5-27b step's
    launch 30-160 ms (a decode bucket's about 30, against 1.5 for its later launches) the first time
    a serving step met each bucket (2026-12-03). Padding touches only the scratch slot, as capture's
    warm-up does."""
    for pad_only, graph in graphs:
        pad_only()
        graph.replay()


@dataclass(frozen=True)
class MixedLayout:
    """Where each array of a mixed step of `tokens` (bucket) sits in the flat int64 metadata."""

    tokens: int
    blocks: int  # extend attention's block slots
    logit_rows: int
    decodes: int  # decode attention's rows: the most decodes a step of `tokens` can hold
    chunks: int = MAX_GRAPH_CHUNKS  # chunk slots

    @property
    def sizes(self) -> dict[str, int]:
        c = self.chunks
        return {"tokens": MIXED_TOKEN_ROWS * self.tokens, "decodes": 2 * self.decodes, "ext_rows": c,
                "ext_cu_q": c + 1, "ext_kv_lens": c, "q_blocks": 2 * self.blocks, "logit_index": self.logit_rows}

    @property
    def size(self) -> int:
        return sum(self.sizes.values())

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for name, n in self.sizes.items():
            out[name] = flat[offset: offset + n]
            offset += n
        return out


class StepGraphs:
    def __init__(self, model: LlamaModel, token_table: TokenTable, req_table: ReqTable, max_batch: int,
                 max_tokens: int, capture: bool, forward=None, verify: bool = False,
                 chunk_tiers: tuple[int, ...] = (MAX_GRAPH_CHUNKS,)):
        """forward: what the graphs run, model.forward's signature (None: model.forward; one that
        also stores an EAGLE-3 head's features, which the graphs then store too). verify: a model
        with recurrent state that verifies drafts: each decode bucket also as a verify step.
        chunk_tiers: the chunk slots mixed buckets are captured with, ascending (each bucket once
        a tier; a step takes the fewest slots that hold its chunks)."""
        if req_table.padding_row is None:
            raise ValueError("padded steps need the request table's padding row")
        self.model, self.token_table = model, token_table
        self.forward = forward or model.forward
        self.req_to_token = req_table.req_to_token
        self.padding_row = req_table.padding_row
        self.max_seqlen = req_table.max_req_total_len
        self.buckets = decode_buckets(max_batch)
        self.chunk_tiers = tuple(sorted(chunk_tiers))
        assert self.chunk_tiers[-1] == MAX_GRAPH_CHUNKS, chunk_tiers  # graph_memory_bytes sizes for it
        # the layouts of each tier, by tokens (bisected every step with chunks); self.mixed: all of them
        self.tiers = {c: [self._layout(n, max_batch, c) for n in mixed_buckets(max_tokens)] for c in self.chunk_tiers}
        self.mixed_tokens = [m.tokens for m in self.tiers[MAX_GRAPH_CHUNKS]]
        self.mixed = [m for c in self.chunk_tiers for m in self.tiers[c]]
        self.max_tokens = max_tokens
        self.req_to_token[self.padding_row, 0] = token_table.scratch_slot
        device = token_table.device
        largest = self.buckets[-1]
        self.meta = torch.tensor([[0] * largest, [0] * largest, [self.padding_row] * largest, [1] * largest,
                                  [-1] * largest], device=device)
        self.mixed_meta = torch.zeros(max(m.size for m in self.mixed), dtype=torch.int64, device=device)
        logit_rows = max(largest, max(m.logit_rows for m in self.mixed))  # the static logits only graphs write
        self.logits = torch.empty(logit_rows if capture else 0, model.config.vocab_size, dtype=torch.float32,
                                  device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.base_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # decode buckets without LoRA (model.lora set)
        self.verify = verify
        self.verify_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # decode buckets verifying drafts (verify set)
        self.mixed_graphs: dict[MixedLayout, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture_all()

    def _layout(self, tokens: int, max_batch: int, chunks: int) -> MixedLayout:
        head_dim = self.model.config.head_dim
        return MixedLayout(tokens, max_q_blocks(tokens, chunks, head_dim), min(tokens, max_batch + chunks),
                           min(tokens, max_batch), chunks)

    # ---- decode steps ----

    def bucket(self, n: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    def decode_plan_for(self, n: int) -> tuple[int, int]:
        """(batch, max_seqlen) of the graph n decodes replay: an eager step's decode attention takes
        that graph's launch plan, a kernel the capture compiled (decode_attention_triton)."""
        return self.bucket(n), self.max_seqlen

    def pad_meta(self, input_ids: list[int], positions: list[int], rows: list[int],
                 seq_lens: list[int], lora_slots: list[int]) -> list[int]:
        """The step's metadata padded to its bucket, flattened for the runner's one upload."""
        n = len(input_ids)
        pad = self.bucket(n) - n
        return (input_ids + [0] * pad + positions + [0] * pad + rows + [self.padding_row] * pad
                + seq_lens + [1] * pad + lora_slots + [-1] * pad)

    def run(self, meta: torch.Tensor, n: int, max_seqlen: int, lora: bool = True, verify: bool = False
            ) -> torch.Tensor:
        """fp32 logits [n, vocab] of the real rows; meta is [META_ROWS, bucket] on the device.
        A captured bucket's logits live in the static buffer until the next step. lora False: no
        row has a LoRA adapter (the LoRA kernels are left out). verify: the rows verify drafts on a
        model with recurrent state (ForwardBatch.decode_verify: its own graphs)."""
        bucket = meta.shape[1]
        self.meta[:, :bucket].copy_(meta)
        family = self.verify_graphs if verify else (self.graphs if lora or self.model.lora is None
                                                    else self.base_graphs)
        graph = family.get(bucket)
        if graph is None:
            return self._forward(bucket, max_seqlen, lora, verify)[:n]
        graph.replay()
        return self.logits[:n]

    def _forward(self, bucket: int, max_seqlen: int, lora: bool = True, verify: bool = False) -> torch.Tensor:
        input_ids, positions, rows, seq_lens, lora_slots = self.meta[:, :bucket]
        slots = self.req_to_token[rows, positions].long()  # the runner wrote them before the step
        batch = ForwardBatch(input_ids, positions, slots, self.req_to_token, decode_rows=rows.int(),
                             decode_seq_lens=seq_lens.int(), decode_max_seqlen=max_seqlen,
                             lora_slots=lora_slots if lora else None, decode_verify=verify)
        return self.forward(batch, self.token_table)

    # ---- mixed steps ----

    def mixed_layout(self, tokens: int, chunks: int, decodes: int, logit_rows: int) -> MixedLayout | None:
        """The layout of the bucket that takes a step of `tokens` tokens in `chunks` chunks, of
        which `decodes` decode rows, sampling `logit_rows` rows; None: eager."""
        if tokens > self.max_tokens or chunks > MAX_GRAPH_CHUNKS:
            return None
        tier = self.chunk_tiers[bisect.bisect_left(self.chunk_tiers, chunks)]
        layout = self.tiers[tier][bisect.bisect_left(self.mixed_tokens, tokens)]
        return layout if decodes <= layout.decodes and logit_rows <= layout.logit_rows else None

    def pad_mixed(self, lists: dict[str, list[int]], num_decodes: int, layout: MixedLayout) -> list[int]:
        """A mixed step's metadata (the runner's eager lists: decodes first, then the chunks, with
        absolute chunk bounds) padded to `layout` and flattened in its order for the one upload.
        Decode rows of id -1 are filled on the device from the last sampled tokens."""
        pad_row, n = self.padding_row, len(lists["positions"])
        pad, undecoded = layout.tokens - n, layout.decodes - num_decodes
        cu_q = lists["ext_cu_q"]
        chunk_pad = layout.chunks - len(lists["ext_rows"])
        return (lists["decode_ids"] + lists["chunk_ids"] + [0] * pad
                + lists["positions"] + [0] * pad
                + lists["token_rows"] + [pad_row] * pad
                + lists["lora_slots"] + [-1] * pad
                + lists["decode_rows"] + [pad_row] * undecoded
                + lists["decode_seq_lens"] + [1] * undecoded
                + lists["ext_rows"] + [pad_row] * chunk_pad
                + cu_q + cu_q[-1:] * chunk_pad
                + lists["ext_kv_lens"] + [0] * chunk_pad
                + pad_q_blocks(lists["ext_q_blocks"], layout.blocks)
                + lists["logit_index"] + [0] * (layout.logit_rows - len(lists["logit_index"])))

    def _pad_only(self, layout: MixedLayout) -> None:
        """The static metadata of `layout` as a step of padding alone (warm-up and capture): each
        layout reads the buffer at its own offsets, so each is filled before it runs."""
        empty = {name: [] for name in ("decode_ids", "chunk_ids", "positions", "token_rows", "lora_slots", "decode_rows",
                                       "decode_seq_lens", "ext_rows", "ext_kv_lens", "ext_q_blocks", "logit_index")}
        meta = self.pad_mixed({**empty, "ext_cu_q": [0]}, 0, layout)
        self.mixed_meta[: layout.size].copy_(torch.tensor(meta))

    def run_mixed(self, meta: torch.Tensor, layout: MixedLayout, n: int, max_seqlen: int) -> torch.Tensor:
        """fp32 logits [n, vocab] of the first n logit rows; meta is the flat layout on the device."""
        self.mixed_meta[: layout.size].copy_(meta)
        graph = self.mixed_graphs.get(layout)
        if graph is None:
            return self._mixed_forward(layout, max_seqlen)[:n]
        graph.replay()
        return self.logits[:n]

    def _mixed_forward(self, layout: MixedLayout, max_seqlen: int) -> torch.Tensor:
        v = layout.views(self.mixed_meta)
        input_ids, positions, token_rows, lora_slots = v["tokens"].view(MIXED_TOKEN_ROWS, -1)
        decode_rows, decode_lens = v["decodes"].view(2, -1)
        slots = self.req_to_token[token_rows, positions].long()
        batch = ForwardBatch(input_ids, positions, slots, self.req_to_token, decode_rows=decode_rows.int(),
                             decode_seq_lens=decode_lens.int(), decode_max_seqlen=max_seqlen,
                             ext_rows=v["ext_rows"].int(), ext_cu_q=v["ext_cu_q"].int(),
                             ext_kv_lens=v["ext_kv_lens"].int(), ext_q_blocks=v["q_blocks"].int().view(2, -1),
                             logit_index=v["logit_index"], lora_slots=lora_slots)
        return self.forward(batch, self.token_table)

    # ---- capture ----

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Warm up and capture every bucket of both families, largest first so that the smaller
        ones reuse the pool; the static metadata holds padding only, so warm-up and capture touch
        nothing but the scratch slot."""
        device = self.token_table.device
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
        # (family, key, logit rows, padding-only metadata for the warm-up, forward, (tokens, chunk slots))
        forwards = [(self.mixed_graphs, m, m.logit_rows, lambda m=m: self._pad_only(m),
                     lambda m=m: self._mixed_forward(m, self.max_seqlen), (m.tokens, m.chunks)) for m in self.mixed]
        forwards += [(self.graphs, b, b, lambda: None, lambda b=b: self._forward(b, self.max_seqlen), (b, 0))
                     for b in self.buckets]
        if self.model.lora is not None:
            forwards += [(self.base_graphs, b, b, lambda: None, lambda b=b: self._forward(b, self.max_seqlen, False),
                          (b, 0)) for b in self.buckets]
        if self.verify:
            forwards += [(self.verify_graphs, b, b, lambda: None,
                          lambda b=b: self._forward(b, self.max_seqlen, verify=True), (b, 0)) for b in self.buckets]
        forwards.sort(key=lambda f: f[5], reverse=True)
        with torch.cuda.device(device), no_collection():
            pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            for family, key, rows, pad_only, forward, _ in forwards:
                with torch.cuda.stream(stream):
                    pad_only()
                    forward()  # compiles kernels, creates NCCL communicators
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[:rows].copy_(forward())
                family[key] = graph
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            captured = time.perf_counter()
            first_replays([(pad_only, family[key]) for family, key, _, pad_only, _, _ in forwards])
            torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured %d decode CUDA graphs (batch %s; %d more without LoRA, %d more verifying drafts) and "
                    "%d mixed-step graphs (tokens %s; chunk slots %s) in %.1f s, %.2f GiB; their first replays "
                    "took %.1f s", len(self.graphs), ",".join(map(str, self.buckets)), len(self.base_graphs),
                    len(self.verify_graphs), len(self.mixed_graphs), ",".join(map(str, self.mixed_tokens)),
                    ",".join(map(str, self.chunk_tiers)), captured - start, used / 2**30,
                    time.perf_counter() - captured)
