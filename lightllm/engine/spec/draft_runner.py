"""The draft model of `{"method": "draft_model", "model": DIR}`, run by every worker beside the target.

Proposals are greedy chains of the draft model: point masses, so verification is the same as for
the n-gram sources (a draft is accepted exactly when the target samples it).

KV. The draft keeps its own K/V buffers with one row per slot of the target's token table: the
draft's K/V of a request's position lives at the slot the target gave that position, so the
target's allocation and the scheduler's admission proof cover the draft's KV too (its bytes a
token are counted in the KV budget, `ModelRunner.kv_bytes_per_token`). Past them, `k_max` scratch
rows per request row hold the positions a proposal runs ahead of the target (the request's last
sampled token and the drafts but the last): a proposal writes those slots into the request's
row of `req_to_token` past its length, where the target's next step overwrites them before it
reads them.

Catch-up. A proposal for a request runs the draft over the tokens its draft KV lacks (the host
side, `drafts.ModelDraft`, sends them: it keeps every request's tokens), then k - 1 single-token
steps. `RunningReq.draft_len` counts the positions whose draft K/V is in place; it ends at the
request's length, since the last sampled token's K/V went to a scratch row and the drafts may be
rejected. A request's draft KV is only ever read by its own proposals after its own catch-up has
written it, so a prefix shared through the cache (whose draft KV another request wrote, or none
did) is recomputed, the same values, at the first proposal.
"""

from __future__ import annotations

import logging
import torch

from lightllm.kernels.extend_attention import extend_q_blocks
from lightllm.common.token_table import TokenTable
from lightllm.engine.batch import RunningReq, upload
from lightllm.engine.cuda_graph import META_ROWS, StepGraphs, graph_memory_bytes
from lightllm.engine.plan import DraftRequest
from lightllm.models import ForwardBatch, load_model, read_config

logger = logging.getLogger(__name__)

# A draft model's graphs: its single-token steps replay decode graphs, its catch-up (a few tokens a
# request after each verify step, one chunk each) mixed-step graphs of up to this many tokens.
DRAFT_GRAPH_TOKENS = 1024


class DraftRunner:
    """The draft model's runner; its KV on the target's slots, scratch rows, asks and chains are
    shared with the EAGLE-3 head's (`eagle3_runner.Eagle3Runner`), which changes what a row reads."""

    # Positions between a row and the token it feeds: 0 here (a row feeds its own position's
    # token); an EAGLE-3 head's row at p feeds the token at p + 1
    lag = 0

    def __init__(self, model_dir: str, target_vocab: int, *, dtype: torch.dtype, kv_dtype: torch.dtype,
                 device: torch.device, tp, max_positions: int, k_max: int, rows: int, load_format: str = "auto"):
        """`rows`: request rows of the target's table (padding row included), each with k_max scratch rows."""
        self.config = cfg = read_config(model_dir)
        self.vocab = min(cfg.vocab_size, target_vocab)  # a draft's padded vocabulary beyond the target's never wins
        if abs(cfg.vocab_size - target_vocab) > 1024:
            raise ValueError(f"draft model {model_dir}: vocabulary of {cfg.vocab_size} tokens against the target's "
                             f"{target_vocab}: the draft must share the target's tokenizer")
        self.model = load_model(cfg, dtype=dtype, device=device, tp=tp, max_positions=max_positions,
                                load_format=load_format)
        self._init_kv(self.model.kv_shapes, device, kv_dtype, k_max, rows)

    def _init_kv(self, shapes: list[tuple[int, int]], device: torch.device, kv_dtype: torch.dtype, k_max: int,
                 rows: int) -> None:
        self.kv_shapes, self.device, self.kv_dtype, self.k_max, self.rows = shapes, device, kv_dtype, k_max, rows
        self.kv: TokenTable | None = None
        self._base = 0  # first scratch row: past the target's slots and its padding slot
        self.graphs = None  # StepGraphs of the draft model on `kv` (make_graphs)

    def bytes_per_token(self) -> int:
        return 2 * sum(heads * dim for heads, dim in self.kv_shapes) * self.kv_dtype.itemsize

    def scratch_bytes(self) -> int:
        return (1 + self.rows * self.k_max) * self.bytes_per_token()

    def new_kv(self, size: int) -> None:
        """Buffers for a target token table of `size` slots, and the scratch rows past them. Slot
        `size` is the target's scratch slot, where padding rows write (the request table's padding
        row names it for both models' graphs): it stays that here too."""
        self.kv = None  # the old buffers go before the new ones are taken
        shapes = self.kv_shapes
        self.kv = TokenTable(size + 1 + self.rows * self.k_max, len(shapes), *shapes[0], self.kv_dtype, self.device,
                             shapes=shapes)
        self.kv.scratch_slot = size
        self._base = size + 1

    def target_forward(self, model):
        """The target's forward as this draft needs it run; None: the model's own (a draft model)."""
        return None

    def slot_buffers(self) -> list[torch.Tensor]:
        """Buffers by target slot that the target's steps write and a draft reads, which the prefix
        cache's host tiers keep with the KV. None here: a draft model's own KV is written by each
        request's catch-up, a cached prefix included."""
        return []

    def graph_bytes(self, max_batch: int, target_graph_tokens: int, itemsize: int) -> int:
        """Memory its CUDA graphs take beside the target's (graph_memory_bytes' estimate)."""
        cfg = self.config
        return graph_memory_bytes(max_batch, DRAFT_GRAPH_TOKENS, cfg.hidden_size, cfg.intermediate_size,
                                  cfg.vocab_size, itemsize)

    def make_graphs(self, req_table, max_batch: int, capture: bool) -> None:
        """Its single-token steps replay decode graphs of the draft model, its catch-up mixed-step ones."""
        self.graphs = StepGraphs(self.model, self.kv, req_table, max_batch, DRAFT_GRAPH_TOKENS, capture)

    @torch.inference_mode()
    def propose(self, asks: list[DraftRequest], reqs: dict[int, RunningReq],
                req_to_token: torch.Tensor) -> list[tuple[tuple[int, ...], int]]:
        """For each ask, (its drafts, the request's draft_len after): no drafts where the draft KV
        lacks positions before `start` (the host then sends from draft_len) or the ask is stale,
        or (EAGLE-3) it brings no token past its first."""
        out: list[tuple[tuple[int, ...], int]] = [((), 0)] * len(asks)
        runs = []  # (index in asks, request, ask) of the asks that run
        for i, ask in enumerate(asks):
            if ask.k > self.k_max:  # its scratch rows hold k_max positions
                raise ValueError(f"request {ask.req_id}: {ask.k} drafts asked for, at most {self.k_max}")
            r = reqs.get(ask.req_id)
            if r is None:
                continue
            end = ask.start + len(ask.tokens)
            fits = end == r.seq_len + 1 if ask.k else end <= r.seq_len
            if ask.start > r.draft_len or not fits or len(ask.tokens) <= self.lag:
                out[i] = ((), r.draft_len)
                continue
            runs.append((i, r, ask))
        if not runs:
            return out
        drafts = self._run([r for _, r, _ in runs], [a for _, _, a in runs], req_to_token)
        for (i, r, ask), chain in zip(runs, drafts):
            r.draft_len = min(r.seq_len, ask.start + len(ask.tokens) - self.lag)
            out[i] = (tuple(chain[: ask.k]), r.draft_len)
        return out

    def _run(self, reqs: list[RunningReq], asks: list[DraftRequest], req_to_token: torch.Tensor) -> list[list[int]]:
        """The catch-up step over every ask's tokens, then single-token steps down the chains (each
        carrying `state` where the draft has one: an EAGLE-3 head's hidden states)."""
        drafting = [j for j, a in enumerate(asks) if a.k]
        for j in drafting:  # the scratch rows of the positions run ahead of the request's length
            r = reqs[j]
            scratch = self._base + r.row * self.k_max + torch.arange(asks[j].k, device=self.device)
            req_to_token[r.row, r.seq_len: r.seq_len + asks[j].k] = scratch.int()
        ids, state = self._catch_up(reqs, asks, req_to_token, drafting)
        chains = [ids]
        k = max((asks[j].k for j in drafting), default=0)
        for step in range(1, k):
            alive = [n for n, j in enumerate(drafting) if asks[j].k > step]
            rows = [reqs[drafting[n]].row for n in alive]
            positions = [reqs[drafting[n]].seq_len + step - self.lag for n in alive]
            index = torch.tensor(alive, device=self.device)
            ids, fed = self._step(rows, positions, chains[-1][index], None if state is None else state[index],
                                  req_to_token)
            latest = chains[-1].clone()
            latest[index] = ids
            chains.append(latest)
            if state is not None:
                state = state.index_copy(0, index, fed)
        if not drafting:
            return [[] for _ in asks]
        by_drafting = torch.stack(chains, dim=1).tolist()  # one copy back: [drafting, k]
        out = [[] for _ in asks]
        for n, j in enumerate(drafting):
            out[j] = by_drafting[n][: asks[j].k]
        return out

    def _catch_up(self, reqs: list[RunningReq], asks: list[DraftRequest], req_to_token: torch.Tensor,
                  drafting: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step over every ask's tokens: the first draft of each drafting ask, and no state."""
        tokens = [t for a in asks for t in a.tokens]
        logits = self._forward([r.row for r in reqs], [a.start for a in asks], [len(a.tokens) for a in asks],
                               tokens, req_to_token, wanted=drafting)
        return logits.argmax(-1), None

    def _step(self, rows: list[int], positions: list[int], ids: torch.Tensor, state: None,
              req_to_token: torch.Tensor) -> tuple[torch.Tensor, None]:
        """One token of each row at its position: the next drafts."""
        if self.graphs is not None and len(rows) <= self.graphs.buckets[-1]:
            logits = self._graph_step(rows, positions, ids)
        else:
            logits = self._forward(rows, positions, [1] * len(rows), ids, req_to_token,
                                   wanted=list(range(len(rows))))
        return logits.argmax(-1), None

    def _graph_step(self, rows: list[int], positions: list[int], ids: torch.Tensor) -> torch.Tensor:
        """A single-token step of every row as a decode step of the draft, from its CUDA graph
        (padded eagerly where none was captured)."""
        n = len(rows)
        meta = self.graphs.pad_meta([0] * n, positions, rows, [p + 1 for p in positions], [-1] * n)
        meta = upload({"meta": meta}, {}, self.device)["meta"].view(META_ROWS, -1)
        meta[0, :n] = ids
        return self.graphs.run(meta, n, max(positions) + 1, lora=False)[:, : self.vocab]

    def _forward(self, rows: list[int], starts: list[int], lengths: list[int], input_ids: list[int] | torch.Tensor,
                 req_to_token: torch.Tensor, wanted: list[int]) -> torch.Tensor:
        """One draft step: request rows[i] feeds lengths[i] tokens from position starts[i] (ids on
        the host, or on the device); the logits (over the vocabulary both models share) of the last
        token of each chunk in `wanted`. From a mixed-step graph where one fits (host ids only)."""
        lists = draft_lists(rows, starts, lengths, wanted, self.config.head_dim)
        layout = None
        if self.graphs is not None and isinstance(input_ids, list):
            layout = self.graphs.mixed_layout(len(lists["positions"]), len(rows), 0, len(wanted))
        if layout is not None:
            lists.update(decode_ids=[], chunk_ids=input_ids, lora_slots=[-1] * len(lists["positions"]), decode_rows=[],
                         decode_seq_lens=[])
            meta = upload({"meta": self.graphs.pad_mixed(lists, 0, layout)}, {}, self.device)["meta"]
            return self.graphs.run_mixed(meta, layout, len(wanted), max(lists["ext_kv_lens"]))[:, : self.vocab]
        batch = draft_batch(lists, input_ids, req_to_token, self.device)
        logits = self.model.forward(batch, self.kv)
        return logits[: len(wanted), : self.vocab]


def draft_lists(rows: list[int], starts: list[int], lengths: list[int], wanted: list[int],
               head_dim: int) -> dict[str, list[int]]:
    """A draft step's metadata: request rows[i] feeds lengths[i] tokens from position starts[i];
    the logit rows are the last token of each chunk in `wanted`."""
    cu_q = [0]
    for n in lengths:
        cu_q.append(cu_q[-1] + n)
    return {"positions": [p for start, n in zip(starts, lengths) for p in range(start, start + n)],
            "token_rows": [row for row, n in zip(rows, lengths) for _ in range(n)], "ext_rows": rows,
            "ext_cu_q": cu_q, "ext_kv_lens": [s + n for s, n in zip(starts, lengths)],
            "ext_q_blocks": extend_q_blocks(lengths, head_dim), "logit_index": [cu_q[i + 1] - 1 for i in wanted]}


def draft_batch(lists: dict[str, list[int]], input_ids: list[int] | torch.Tensor, req_to_token: torch.Tensor,
                 device: torch.device) -> ForwardBatch:
    """The eager ForwardBatch of `draft_lists` (one upload); its slots are the rows' entries of
    req_to_token at the positions."""
    t = upload({**lists, "logit_index": lists["logit_index"] or [0]}, {}, device)
    ids = torch.tensor(input_ids, device=device) if isinstance(input_ids, list) else input_ids
    slots = req_to_token[t["token_rows"], t["positions"]].long()
    return ForwardBatch(ids.long(), t["positions"], slots, req_to_token, ext_rows=t["ext_rows"].int(),
                        ext_cu_q=t["ext_cu_q"].int(), ext_kv_lens=t["ext_kv_lens"].int(),
                        ext_q_blocks=t["ext_q_blocks"].int().view(2, -1), logit_index=t["logit_index"])
