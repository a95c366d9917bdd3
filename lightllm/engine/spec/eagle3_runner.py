"""The EAGLE-3 head of `{"method": "eagle3", "model": HEAD_DIR}`, run by every worker beside the target.

Features. While a head is served every target step (prompt chunks, decodes, verify rows; eager or
replayed from a CUDA graph) runs with the head's aux layers and stores, for each of its tokens,
the head's input feature g = fc(the hidden states entering those three layers) [hidden, the
model's dtype] at the token's KV slot: one row per target slot, and one for the padding rows'
scratch slot, allocated beside the KV. Its bytes count in each token of the KV budget
(`bytes_per_token`), so admission covers it as it covers the KV. The store is part of the
target's forward (`target_forward`), so a captured graph does it too, at the slots the graph
derives from its metadata. fc runs then rather than at proposal time: it keeps a third of the
bytes (hidden, not 3 x hidden), and under tensor parallelism its all-reduce leaves the whole g on
every rank (each rank's head takes the whole feature).

Rows. The head's row at position p pairs g at p (the target's state after reading the token at p,
the one that predicted p + 1) with the token at p + 1, and predicts the token at p + 2. Its K/V go
to a token table of its own (one layer) with the draft model's layout (DraftRunner: one row per
target slot, k_max scratch rows per request row). A proposal's catch-up runs the rows its KV
lacks, from draft_len up to seq_len - 1: g exists for every position in the target's cache, and
the last of them pairs with the last sampled token. That row's logits give the first draft; then
k - 1 chained steps, each feeding the head's own output hidden state of the step before (not
through fc) with the draft before, at scratch slots (replayed from the head's own decode graphs, `HeadGraphs`; the catch-up runs eagerly).
Draft ids map to the target's with d2t. As
with a draft model, draft_len ends at seq_len and a request's head KV is only read by its own
proposals after its own catch-up wrote it; the features of a prefix shared through the cache were
stored by the target step that computed its KV, and the host and disk tiers keep them in each
token's record beside its KV (`slot_buffers`), so a prefix loaded back drafts from its own.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time

import torch

from lightllm.engine.batch import RunningReq, upload
from lightllm.engine.cuda_graph import decode_buckets, first_replays, graph_memory_bytes, no_collection
from lightllm.engine.plan import DraftRequest
from lightllm.engine.spec.draft_runner import DraftRunner, draft_batch, draft_lists
from lightllm.models import ForwardBatch, LlamaModel, ModelConfig, load_eagle3, read_eagle3_config

logger = logging.getLogger(__name__)


class Eagle3Runner(DraftRunner):
    lag = 1  # the row at p feeds the token at p + 1

    def __init__(self, head_dir: str, target: LlamaModel, target_config: ModelConfig, *, dtype: torch.dtype,
                 kv_dtype: torch.dtype, device: torch.device, tp, max_positions: int, k_max: int, rows: int,
                 load_format: str = "auto"):
        """`target`: the loaded target (its embedding is shared unless the head has its own);
        ValueError where it cannot be served with a head."""
        cfg = read_eagle3_config(head_dir)
        check_target(cfg, target, target_config)
        self.config = cfg.layer
        self.aux_layers = cfg.aux_layers(target_config.num_layers)
        self.head = load_eagle3(cfg, dtype=dtype, device=device, tp=tp, max_positions=max_positions,
                                load_format=load_format, target_embed=target.embed)  # dummy_echo: an echo head
        self.features: torch.Tensor | None = None  # [target slots + 1, hidden]: g of each slot's token
        self._init_kv(self.head.kv_shapes, device, kv_dtype, k_max, rows)

    def feature_bytes(self) -> int:
        return self.config.hidden_size * self.head.dtype.itemsize

    def bytes_per_token(self) -> int:
        return super().bytes_per_token() + self.feature_bytes()

    def scratch_bytes(self) -> int:
        """The head KV's scratch rows, and the padding rows' slot of both buffers."""
        return (1 + self.rows * self.k_max) * super().bytes_per_token() + self.feature_bytes()

    def new_kv(self, size: int) -> None:
        self.features = None
        super().new_kv(size)
        self.features = torch.zeros(size + 1, self.config.hidden_size, dtype=self.head.dtype, device=self.device)

    def slot_buffers(self) -> list[torch.Tensor]:
        """The features: a prefix loaded back from a host tier is not run through the target again."""
        return [self.features]

    def target_forward(self, model: LlamaModel):
        """The target's forward that also stores each token's feature at its slot (see above)."""
        layers, head = self.aux_layers, self.head

        def forward(batch, kv):
            logits, aux = model.forward(dataclasses.replace(batch, aux_layers=layers), kv)
            self.features.index_copy_(0, batch.slots, head.feature(aux))
            return logits

        return forward

    def graph_bytes(self, max_batch: int, target_graph_tokens: int, itemsize: int) -> int:
        """The aux hidden states (three copies and their concatenation) and g in the target's
        graphs, and the head's chained steps' graphs (HeadGraphs)."""
        cfg = self.config
        return (target_graph_tokens * (2 * self.head.fc_in + cfg.hidden_size) * itemsize
                + graph_memory_bytes(max_batch, max_batch, cfg.hidden_size, cfg.intermediate_size,
                                     self.head.config.draft_vocab_size, itemsize))

    def make_graphs(self, req_table, max_batch: int, capture: bool) -> None:
        """The chained steps replay decode graphs of the head (the catch-up runs eagerly)."""
        self.graphs = HeadGraphs(self.head, self.kv, req_table, max_batch, capture)

    def _catch_up(self, reqs: list[RunningReq], asks: list[DraftRequest], req_to_token: torch.Tensor,
                  drafting: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows start .. start + len(tokens) - 2 of each ask, each with the token after it."""
        tokens = [t for a in asks for t in a.tokens[1:]]
        return self._head_step([r.row for r in reqs], [a.start for a in asks], [len(a.tokens) - 1 for a in asks],
                               tokens, None, req_to_token, drafting)

    def _step(self, rows: list[int], positions: list[int], ids: torch.Tensor, state: torch.Tensor,
              req_to_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graphs is not None and len(rows) <= self.graphs.buckets[-1]:
            return self.graphs.run(rows, positions, ids, state)
        return self._head_step(rows, positions, [1] * len(rows), ids, state, req_to_token, list(range(len(rows))))

    def _head_step(self, rows: list[int], starts: list[int], lengths: list[int], input_ids: list[int] | torch.Tensor,
                   features: torch.Tensor | None, req_to_token: torch.Tensor,
                   wanted: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One head step (rows[i] feeds lengths[i] tokens from starts[i]), its features the given
        hidden states or (None) the stored g of the rows' slots: the target ids of the drafts and
        the output hidden states at the last token of each chunk in `wanted`."""
        batch = draft_batch(draft_lists(rows, starts, lengths, wanted, self.config.head_dim), input_ids,
                             req_to_token, self.device)
        if features is None:
            features = self.features[batch.slots]
        logits, hidden = self.head.forward(batch, self.kv, features)
        n = len(wanted)
        return self.head.target_ids(logits[:n].argmax(-1)), hidden[batch.logit_index[:n]]


def check_target(cfg, target, target_config: ModelConfig) -> None:
    """ValueError unless the head can draft for this target: one of llama.py's family (its forward
    returns the aux hidden states; not a hybrid model), fc over its hidden size, its vocabulary."""
    where = f"EAGLE-3 head {cfg.layer.model_dir}"
    if target_config.linear_attn is not None:
        raise ValueError(f"{where}: the target {target_config.architecture} keeps a recurrent state; heads are "
                         "served for the Llama family (its checkpoint's MTP layer drafts for it: method mtp)")
    if type(target) is not LlamaModel:
        raise ValueError(f"{where}: heads are served for targets of the Llama family (Llama, Mistral, Qwen2/3, ...), "
                         f"not {target_config.architecture}")
    if cfg.target_hidden_size != target_config.hidden_size:
        raise ValueError(f"{where} reads hidden states of size {cfg.target_hidden_size}; the target's are "
                         f"{target_config.hidden_size}")
    if cfg.layer.vocab_size != target_config.vocab_size:
        raise ValueError(f"{where} has a vocabulary of {cfg.layer.vocab_size} tokens, the target "
                         f"{target_config.vocab_size}: a head is trained for one target")


class HeadGraphs:
    """The head's chained steps (one token a request row, its feature the head's own hidden state
    of the step before) as decode steps padded to the target's decode buckets, replayed from CUDA
    graphs where captured (eagerly, padded, otherwise: the CPU tests the padding). Padding rows
    are the request table's padding row at position 0, whose slot is the scratch slot of the
    head's KV too, with seq_len 1 and a zero feature. Static buffers: the metadata (ids,
    positions, rows, seq_lens), the features in, the drafts (target ids) and hidden states out."""

    def __init__(self, head, kv, req_table, max_batch: int, capture: bool):
        self.head, self.kv, self.req_to_token = head, kv, req_table.req_to_token
        self.padding_row, self.max_seqlen = req_table.padding_row, req_table.max_req_total_len
        self.buckets = decode_buckets(max_batch)
        largest, hidden, device = self.buckets[-1], head.hidden_size, kv.device
        self.meta = torch.tensor([[0] * largest, [0] * largest, [self.padding_row] * largest, [1] * largest],
                                 device=device)
        self.features = torch.zeros(largest, hidden, dtype=head.dtype, device=device)
        self.ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(largest, hidden, dtype=head.dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture_all()

    def run(self, rows: list[int], positions: list[int], ids: torch.Tensor,
            features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(drafts [n], hidden states [n, hidden]) of one token a row at its position."""
        n = len(rows)
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        pad = bucket - n
        flat = ([0] * bucket + positions + [0] * pad + rows + [self.padding_row] * pad
                + [p + 1 for p in positions] + [1] * pad)
        self.meta[:, :bucket].copy_(upload({"meta": flat}, {}, self.kv.device)["meta"].view(4, -1))
        self.meta[0, :n] = ids
        self.features[:n].copy_(features)
        self.features[n:bucket].zero_()
        graph = self.graphs.get(bucket)
        if graph is None:
            drafts, hidden = self._forward(bucket, max(positions) + 1)
            return drafts[:n], hidden[:n]
        graph.replay()
        return self.ids[:n], self.hidden[:n]  # until the next run: the chain copies them

    def _forward(self, bucket: int, max_seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, positions, rows, seq_lens = self.meta[:, :bucket]
        slots = self.req_to_token[rows, positions].long()
        batch = ForwardBatch(ids, positions, slots, self.req_to_token, decode_rows=rows.int(),
                             decode_seq_lens=seq_lens.int(), decode_max_seqlen=max_seqlen)
        logits, hidden = self.head.forward(batch, self.kv, self.features[:bucket])
        return self.head.target_ids(logits.argmax(-1)), hidden

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Every bucket, largest first into one pool, the metadata padding only (as StepGraphs)."""
        device = self.kv.device
        started = time.perf_counter()
        with torch.cuda.device(device), no_collection():
            pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            for bucket in reversed(self.buckets):
                with torch.cuda.stream(stream):
                    self._forward(bucket, self.max_seqlen)  # compiles the kernels
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    drafts, hidden = self._forward(bucket, self.max_seqlen)
                    self.ids[:bucket].copy_(drafts)
                    self.hidden[:bucket].copy_(hidden)
                self.graphs[bucket] = graph
            torch.cuda.current_stream().wait_stream(stream)
            first_replays([(lambda: None, graph) for graph in self.graphs.values()])  # metadata: padding still
            torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs of the EAGLE-3 head's chained steps in %.1f s", len(self.graphs),
                    time.perf_counter() - started)
