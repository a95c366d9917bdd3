"""Decode in fixed batch sizes (buckets), replayed from CUDA graphs on CUDA devices.

A decode step of n requests runs the forward of the smallest bucket >= n. Its padding rows
are harmless: each has token 0 at position 0 in the request table's padding row, whose first
entry is the token table's scratch slot (outside the budget), and seq_len 1; so a padding
row writes K/V only to the scratch slot, attends only to it, and its logits are dropped.

On CUDA every bucket is captured once at start-up (`capture=True`), largest first, into one
shared memory pool; the runner sizes the KV cache first and keeps `graph_memory_bytes` of
headroom for this. A captured forward reads the step from one static metadata buffer (token
ids, positions, request rows, sequence lengths), derives the new tokens' KV slots from the
request table inside the graph, and writes one static logits buffer. Decode attention gets
the fixed bound max_req_total_len, so its split plan (the grid) depends only on the bucket;
split blocks past a request's length return at once. Without capture (CPU) the same padded
forward runs eagerly, bounded by the batch's own longest request, so CI tests the padding.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from lightllm.common.req_table import ReqTable
from lightllm.common.token_table import TokenTable
from lightllm.models import ForwardBatch, LlamaModel

logger = logging.getLogger(__name__)

# Dense where batches are small (launch-bound: padding is almost free), then every 32 and,
# past 256, every 64 (the step turns compute-bound, so padding there costs time); the largest
# bucket is running_max_req_size itself.
SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
LARGE_BUCKET_STEP = 64
META_ROWS = 4  # input_ids, positions, request rows, sequence lengths


def decode_buckets(max_batch: int) -> list[int]:
    small = [b for b in SMALL_BUCKETS if b < max_batch]
    large = range(SMALL_BUCKETS[-1] + LARGE_BUCKET_STEP, max_batch, LARGE_BUCKET_STEP)
    return small + list(large) + [max_batch]


def graph_memory_bytes(max_batch: int, vocab_size: int) -> int:
    """What capture needs beyond the weights and KV cache, roughly: the static fp32 logits of
    the largest bucket plus the largest forward's transient logits (its other activations
    are far smaller)."""
    return 3 * max_batch * vocab_size * 4


class DecodeGraphs:
    def __init__(self, model: LlamaModel, token_table: TokenTable, req_table: ReqTable, max_batch: int,
                 capture: bool):
        assert req_table.padding_row is not None, "padding needs the request table's padding row"
        self.model, self.token_table = model, token_table
        self.req_to_token = req_table.req_to_token
        self.padding_row = req_table.padding_row
        self.max_seqlen = req_table.max_req_total_len
        self.buckets = decode_buckets(max_batch)
        self.req_to_token[self.padding_row, 0] = token_table.scratch_slot
        device = token_table.device
        largest = self.buckets[-1]
        self.meta = torch.tensor([[0] * largest, [0] * largest, [self.padding_row] * largest, [1] * largest],
                                 device=device)
        self.logits = torch.empty(largest, model.config.vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture_all()

    def bucket(self, n: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    def pad_meta(self, input_ids: list[int], positions: list[int], rows: list[int],
                 seq_lens: list[int]) -> list[int]:
        """The step's metadata padded to its bucket, flattened for the runner's one upload."""
        n = len(input_ids)
        pad = self.bucket(n) - n
        return (input_ids + [0] * pad + positions + [0] * pad + rows + [self.padding_row] * pad
                + seq_lens + [1] * pad)

    def run(self, meta: torch.Tensor, n: int, max_seqlen: int) -> torch.Tensor:
        """fp32 logits [n, vocab] of the real rows; meta is [META_ROWS, bucket] on the device.
        A captured bucket's logits live in the static buffer until the next step."""
        bucket = meta.shape[1]
        self.meta[:, :bucket].copy_(meta)
        graph = self.graphs.get(bucket)
        if graph is None:
            return self._forward(bucket, max_seqlen)[:n]
        graph.replay()
        return self.logits[:n]

    def _forward(self, bucket: int, max_seqlen: int) -> torch.Tensor:
        input_ids, positions, rows, seq_lens = self.meta[:, :bucket]
        slots = self.req_to_token[rows, positions].long()  # the runner wrote them before the step
        batch = ForwardBatch(input_ids, positions, slots, self.req_to_token, num_decodes=bucket,
                             decode_rows=rows.int(), decode_seq_lens=seq_lens.int(), decode_max_seqlen=max_seqlen)
        return self.model.forward(batch, self.token_table)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Warm up and capture every bucket, largest first so that the smaller ones reuse its
        pool; the static meta holds padding rows only, so warm-up and capture touch nothing
        but the scratch slot."""
        device = self.token_table.device
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
        with torch.cuda.device(device):
            pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            for bucket in reversed(self.buckets):
                with torch.cuda.stream(stream):
                    self._forward(bucket, self.max_seqlen)  # compiles kernels, creates NCCL communicators
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[:bucket].copy_(self._forward(bucket, self.max_seqlen))
                self.graphs[bucket] = graph
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured %d decode CUDA graphs (batch %s) in %.1f s, %.2f GiB", len(self.graphs),
                    ",".join(map(str, self.buckets)), time.perf_counter() - start, used / 2**30)
