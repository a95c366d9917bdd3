"""The model runner: one per tensor-parallel rank, it owns the device.

It keeps each running request's host state (request row, tokens in the cache, last sampled
token, sampling state), turns a step's lists into tensors in one place (`_upload`: one
host-to-device copy), runs the model, samples, and reads the tokens back in one copy
(`_download`). Every rank is called with the same arguments and reaches the same state.

With `cuda_graph` (the default) a decode step is padded to a bucket size and, on CUDA,
replayed from a CUDA graph captured at start-up (`cuda_graph.py`); without it a decode step
runs eagerly at the batch's own size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from lightllm.common import OutOfRowsError, OutOfTokensError, ReqTable, TokenTable
from lightllm.models import ForwardBatch, load_model, read_config, resolve_dtype
from lightllm.server.io_struct import SamplingParams
from lightllm.utils.dist import init_tp

from .cuda_graph import META_ROWS, DecodeGraphs, graph_memory_bytes
from .sampling import SamplingBatch, SamplingState, host_lists, sample

logger = logging.getLogger(__name__)

CPU_DEFAULT_TOKENS = 16384
GPU_HEADROOM_FRACTION = 0.1  # of total memory, kept for activations, logits and the allocator
GPU_HEADROOM_MIN_BYTES = 2 << 30


@dataclass
class RunningReq:
    row: int  # in ReqTable.req_to_token
    seq_len: int  # tokens whose K/V are in the cache
    last_token: int  # sampled, not yet fed to the model
    sampling: SamplingState


def resolve_device(device: str | None, tp_rank: int) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", tp_rank) if torch.cuda.is_available() else torch.device("cpu")


class ModelRunner:
    def __init__(self, model_dir: str, *, max_total_token_num: int | None, max_req_total_len: int,
                 running_max_req_size: int, data_type: str = "auto", load_format: str = "auto",
                 tp_rank: int = 0, world_size: int = 1, nccl_port: int = 28765, device: str | None = None,
                 cuda_graph: bool = True):
        self.device = resolve_device(device, tp_rank)
        capture = cuda_graph and self.device.type == "cuda"
        self.tp = init_tp(tp_rank, world_size, nccl_port, self.device)
        self.config = cfg = read_config(model_dir)
        self._warn_long_context(max_req_total_len)
        dtype = resolve_dtype(data_type, cfg, self.device)
        self.model = load_model(cfg, dtype=dtype, device=self.device, tp=self.tp,
                                max_positions=max_req_total_len,
                                load_format=load_format)
        graph_bytes = graph_memory_bytes(running_max_req_size, cfg.vocab_size) if capture else 0
        self.max_total_token_num = self._token_budget(max_total_token_num, graph_bytes)
        self.max_req_total_len = max_req_total_len
        self.token_table = TokenTable(self.max_total_token_num, cfg.num_layers, self.model.kv_heads,
                                      cfg.head_dim, dtype, self.device)
        self.req_table = ReqTable(running_max_req_size, max_req_total_len, self.device, padding_row=cuda_graph)
        self.graphs = (DecodeGraphs(self.model, self.token_table, self.req_table, running_max_req_size, capture)
                       if cuda_graph else None)
        self.reqs: dict[int, RunningReq] = {}
        self.info = {"architecture": cfg.architecture, "dtype": str(dtype).removeprefix("torch."),
                     "vocab_size": cfg.vocab_size, "eos_token_ids": list(cfg.eos_token_ids),
                     "max_position_embeddings": cfg.max_position_embeddings, "model_dir": str(model_dir)}

    def _warn_long_context(self, max_req_total_len: int) -> None:
        cfg = self.config
        if max_req_total_len > cfg.max_position_embeddings:
            logger.warning("max_req_total_len %d exceeds the model's max_position_embeddings %d",
                           max_req_total_len, cfg.max_position_embeddings)
        if cfg.sliding_window and max_req_total_len > cfg.sliding_window:
            logger.warning("attention is not windowed: tokens past sliding_window %d see the whole "
                           "context, unlike the reference model", cfg.sliding_window)

    def _token_budget(self, requested: int | None, graph_bytes: int) -> int:
        """The KV budget; on CUDA what is free after the weights, less the headroom, which
        includes what the decode graphs (captured after the KV cache) will take."""
        if requested is not None:
            return requested
        if self.device.type != "cuda":
            logger.info("max_total_token_num: %d (CPU default)", CPU_DEFAULT_TOKENS)
            return CPU_DEFAULT_TOKENS
        torch.cuda.empty_cache()  # blocks cached while loading would read as used
        free, total = torch.cuda.mem_get_info(self.device)
        headroom = max(GPU_HEADROOM_MIN_BYTES, int(total * GPU_HEADROOM_FRACTION)) + graph_bytes
        cfg = self.config
        per_token = 2 * cfg.num_layers * self.model.kv_heads * cfg.head_dim * self.model.dtype.itemsize
        tokens = self.tp.min_int(max(0, (free - headroom) // per_token), self.device)
        if tokens == 0:
            raise RuntimeError(f"no GPU memory left for the KV cache: {free / 2**30:.1f} GiB free after "
                               f"the weights, {headroom / 2**30:.1f} GiB kept as headroom")
        logger.info("max_total_token_num: %d (%.1f GiB free after weights, %.1f GiB headroom, %d B/token)",
                    tokens, free / 2**30, headroom / 2**30, per_token)
        return tokens

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

    def _download(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> list[tuple[int, float]]:
        """The step's one device-to-host copy (and its one sync); float64 holds token ids exactly."""
        host = torch.stack([tokens.double(), logprobs.double()]).cpu()
        return [(int(t), lp) for t, lp in zip(host[0].tolist(), host[1].tolist())]

    # ---- steps ----

    @torch.inference_mode()
    def prefill(self, reqs: list[tuple[int, list[int], SamplingParams]]) -> list[tuple[int, float]]:
        self._check_new(reqs)
        rows = [self.req_table.alloc() for _ in reqs]
        lens = [len(prompt) for _, prompt, _ in reqs]
        states = [SamplingState(params) for _, _, params in reqs]
        ints, floats = host_lists(states)
        ints.update(_prefill_lists(reqs, rows, lens))
        slots = self.token_table.alloc(sum(lens))
        t = self._upload(ints, floats)
        self.req_table.req_to_token[t["token_rows"], t["positions"]] = slots.int()
        batch = ForwardBatch(True, t["input_ids"], t["positions"], slots, max(lens),
                             cu_seqlens=t["cu_seqlens"].int(), last_index=t["last_index"])
        for (req_id, _, _), row, n, state in zip(reqs, rows, lens, states):
            self.reqs[req_id] = RunningReq(row, n, -1, state)
        logits = self.model.forward(batch, self.token_table)
        return self._sample_and_record(logits, [r[0] for r in reqs], t, states)

    @torch.inference_mode()
    def decode(self, req_ids: list[int]) -> list[tuple[int, float]]:
        running = self._check_decode(req_ids)
        states = [r.sampling for r in running]
        ints, floats = host_lists(states)
        n, max_seqlen = len(running), max(r.seq_len for r in running) + 1
        columns = ([r.last_token for r in running], [r.seq_len for r in running], [r.row for r in running],
                   [r.seq_len + 1 for r in running])
        ints["meta"] = self.graphs.pad_meta(*columns) if self.graphs is not None else sum(columns, [])
        slots = self.token_table.alloc(n)
        t = self._upload(ints, floats)
        meta = t["meta"].view(META_ROWS, -1)  # input_ids, positions, rows, seq_lens
        self.req_table.req_to_token[meta[2, :n], meta[1, :n]] = slots.int()
        for r in running:
            r.seq_len += 1
        logits = (self.graphs.run(meta, n, max_seqlen) if self.graphs is not None
                  else self._eager_decode_forward(meta, slots, max_seqlen))
        return self._sample_and_record(logits, req_ids, t, states)

    def _eager_decode_forward(self, meta: torch.Tensor, slots: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        input_ids, positions, rows, seq_lens = meta
        batch = ForwardBatch(False, input_ids, positions, slots, max_seqlen, req_to_token=self.req_table.req_to_token,
                             req_rows=rows.int(), seq_lens=seq_lens.int())
        return self.model.forward(batch, self.token_table)

    def _sample_and_record(self, logits: torch.Tensor, req_ids: list[int], t: dict[str, torch.Tensor],
                           states: list[SamplingState]) -> list[tuple[int, float]]:
        sampling = SamplingBatch.from_tensors(t, all_greedy=all(s.params.greedy for s in states))
        results = self._download(*sample(logits, sampling))
        for req_id, (token, _) in zip(req_ids, results):
            self.reqs[req_id].last_token = token
            self.reqs[req_id].sampling.record(token)
        return results

    def free(self, req_ids: list[int]) -> None:
        unknown = [i for i in req_ids if i not in self.reqs]
        if unknown or len(set(req_ids)) != len(req_ids):
            raise KeyError(f"cannot free requests {req_ids}: unknown or repeated ids {unknown}")
        running = [self.reqs.pop(i) for i in req_ids]
        if not running:
            return
        table = self.req_table.req_to_token
        self.token_table.free(torch.cat([table[r.row, : r.seq_len] for r in running]))
        for r in running:
            self.req_table.free(r.row)

    def stats(self) -> dict:
        return {"tokens_used": self.token_table.used_count, "max_total_token_num": self.max_total_token_num,
                "running_requests": len(self.reqs)}

    # ---- checks before any state changes, so a refused step leaves the runner as it was ----

    def _check_new(self, reqs: list[tuple[int, list[int], SamplingParams]]) -> None:
        ids = [r[0] for r in reqs]
        if len(set(ids)) != len(ids) or any(i in self.reqs for i in ids):
            raise ValueError(f"prefill: request ids {ids} repeat or are already running")
        vocab = self.config.vocab_size
        for req_id, prompt, _ in reqs:
            if not 0 < len(prompt) <= self.max_req_total_len:
                raise ValueError(f"request {req_id}: prompt of {len(prompt)} tokens, must be 1.."
                                 f"{self.max_req_total_len}")
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"request {req_id}: token id out of range [0, {vocab})")
        total = sum(len(r[1]) for r in reqs)
        if total > self.token_table.free_count:
            raise OutOfTokensError(f"prefill needs {total} KV cache tokens, {self.token_table.free_count} free")
        if len(reqs) > self.req_table.free_count:
            raise OutOfRowsError(f"prefill needs {len(reqs)} request rows, {self.req_table.free_count} free")

    def _check_decode(self, req_ids: list[int]) -> list[RunningReq]:
        unknown = [i for i in req_ids if i not in self.reqs]
        if unknown or len(set(req_ids)) != len(req_ids) or not req_ids:
            raise ValueError(f"decode: request ids {req_ids} are empty, unknown ({unknown}) or repeated")
        running = [self.reqs[i] for i in req_ids]
        full = [i for i, r in zip(req_ids, running) if r.seq_len >= self.max_req_total_len]
        if full:
            raise ValueError(f"decode: requests {full} reached max_req_total_len {self.max_req_total_len}")
        if len(running) > self.token_table.free_count:
            raise OutOfTokensError(f"decode needs {len(running)} KV cache tokens, "
                                   f"{self.token_table.free_count} free")
        return running


def _split(flat: torch.Tensor, lists: dict[str, list]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, values in lists.items():
        out[name] = flat[offset: offset + len(values)]
        offset += len(values)
    return out


def _prefill_lists(reqs, rows: list[int], lens: list[int]) -> dict[str, list[int]]:
    """Packed token ids, positions, request row per token, prompt bounds, last-token indices."""
    input_ids, positions, token_rows, cu_seqlens = [], [], [], [0]
    for (_, prompt, _), row, n in zip(reqs, rows, lens):
        input_ids.extend(prompt)
        positions.extend(range(n))
        token_rows.extend([row] * n)
        cu_seqlens.append(cu_seqlens[-1] + n)
    return {"input_ids": input_ids, "positions": positions, "token_rows": token_rows,
            "cu_seqlens": cu_seqlens, "last_index": [c - 1 for c in cu_seqlens[1:]]}
