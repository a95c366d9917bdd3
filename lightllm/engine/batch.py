"""A step's batch on its way to the device and back: the running requests' rows, the packed
metadata of a step (`step_lists`), its one host-to-device copy (`upload`) and the sampled tokens'
asynchronous way back (`download`, `LaunchedStep`)."""

from __future__ import annotations

import array
from dataclasses import dataclass
from itertools import compress

import torch

from lightllm.engine.plan import SampledToken, StepResult
from lightllm.engine.sampling import SamplingState
from lightllm.kernels.extend_attention import extend_q_blocks


@dataclass
class RunningReq:
    row: int  # in ReqTable.req_to_token
    prefix_len: int  # positions [0, prefix_len) came from prefix-cache nodes
    seq_len: int  # tokens whose K/V are in the cache (or written by a launched step)
    sampling: SamplingState
    prompt_logprobs: list | None = None  # (logprob, rank, top) per prompt position from the 2nd, as computed
    lora_slot: int = -1  # the device slot of its LoRA adapter (-1: none)
    draft_len: int = 0  # positions whose K/V the draft model holds (spec/draft_runner.py)


@dataclass
class DecodeRows:
    """A step's decode section, one row per token fed: each decoding request's last sampled token
    (id -1: the runner reads it from `last_token` on the device), then its drafts, if it has any,
    each one position further. Every row is sampled; a drafting request's rows verify its drafts."""

    reqs: list[RunningReq]
    req_ids: list[int]
    offsets: list[int]  # position past the request's seq_len
    ids: list[int]
    verifies: list[tuple[RunningReq, int, list[int]]]  # (request, its first row, its drafts)
    runs: list[tuple[RunningReq, int]]  # each request and its rows, in order

    @classmethod
    def build(cls, decodes: list[int], drafts: dict[int, list[int]], reqs: dict[int, RunningReq]) -> DecodeRows:
        running = [reqs[i] for i in decodes]
        if not drafts:  # the common step: one row per request, no per-row Python
            n = len(decodes)
            return cls(running, list(decodes), [0] * n, [-1] * n, [], [(r, 1) for r in running])
        rows, req_ids, offsets, ids, verifies, runs = [], [], [], [], [], []  # locals: a verify step has hundreds
        for req_id, r in zip(decodes, running):
            fed = drafts.get(req_id, ())
            n = 1 + len(fed)
            if fed:
                verifies.append((r, len(rows), list(fed)))
            rows += [r] * n
            req_ids += [req_id] * n
            offsets += range(n)
            ids.append(-1)
            ids += fed
            runs.append((r, n))
        return cls(rows, req_ids, offsets, ids, verifies, runs)

    def __len__(self) -> int:
        return len(self.reqs)


class LaunchedStep:
    """A step whose tokens are on their way to the host (pinned buffers + event on CUDA).

    `host` is [2, B] float64, token ids and their logprobs, or with top logprobs [3 + 2k, B]: then
    the top k ids and logprobs and the sampled tokens' ranks;
    `prompt_parts` are (request, host tensors of prompt_logprobs()) of the chunks that asked."""

    def __init__(self, step_id: int, req_ids: list[int], sampled_reqs: list[RunningReq], host: torch.Tensor,
                 prompt_parts: list, event):
        self.step_id, self.req_ids, self.sampled_reqs = step_id, req_ids, sampled_reqs  # one per sampled row
        self._host, self._prompt_parts, self._event = host, prompt_parts, event
        self.prompt_done: set[int] = set()  # req ids whose last chunk (with prompt logprobs) is in this step
        self._tokens: list[tuple[int, float]] | None = None

    def tokens(self) -> list[tuple[int, float]]:
        if self._tokens is None:
            if self._event is not None:
                self._event.synchronize()
            self._tokens = list(zip(map(int, self._host[0].tolist()), self._host[1].tolist()))
        return self._tokens

    def result(self, keep: list[bool] | None = None) -> StepResult:
        """The step's tokens, of the rows `keep` marks (all without it: rejected drafts' rows are left out)."""
        tokens = self.tokens()
        kept = (lambda rows: rows) if keep is None else (lambda rows: compress(rows, keep))
        if self._host.shape[0] == 2 and not self._prompt_parts and not self.prompt_done:  # no logprobs asked for
            return StepResult(self.step_id, [SampledToken(r, t, lp) for r, (t, lp) in kept(zip(self.req_ids, tokens))])
        for r, chosen, ranks, top in self._prompt_parts:
            r.prompt_logprobs.extend(zip(chosen.tolist(), ranks.tolist(), _top_lists(top, len(chosen))))
        out = []
        k = max(self._host.shape[0] - 3, 0) // 2
        tops = _top_lists((self._host[2: 2 + k].T, self._host[2 + k: 2 + 2 * k].T) if k else None, len(tokens))
        ranks = map(int, self._host[-1].tolist()) if k else [None] * len(tokens)
        for req_id, r, (token, logprob), top, rank in kept(zip(self.req_ids, self.sampled_reqs, tokens, tops, ranks)):
            wanted = r.sampling.params.top_logprobs
            prompt = tuple(r.prompt_logprobs) if req_id in self.prompt_done else None
            out.append(SampledToken(req_id, token, logprob, top[:wanted] if wanted else None, prompt,
                                    rank if wanted else None))
        return StepResult(self.step_id, out)


def _top_lists(top, n: int) -> list[tuple]:
    """Per row ((token, logprob), ...) of top = (ids [n, k], logprobs [n, k]) on the host, or ()."""
    if top is None:
        return [()] * n
    ids, values = top
    return [tuple(zip(map(int, i), v)) for i, v in zip(ids.tolist(), values.tolist())]


def upload(ints: dict[str, list[int]], floats: dict[str, list[float]], device: torch.device) -> dict[str, torch.Tensor]:
    """All of a step's metadata in one host-to-device copy: ints as int64, then floats as
    float32 packed two per int64 slot; returns named device views, each starting on a 16-byte
    boundary (lists padded with zeros to 2 ints or 4 floats). Triton compiles a kernel for each
    alignment of its pointer arguments: a view at an odd int64 offset (the random draw's `steps`
    after an odd number of rows) made a new kernel while serving, 0.3-0.6 s on an H200 host."""
    flat_ints, flat_floats = _padded(ints, INTS_A_BOUNDARY), _padded(floats, FLOATS_A_BOUNDARY)
    packed = array.array("q", flat_ints)
    packed.frombytes(array.array("f", flat_floats).tobytes())  # a multiple of 4 floats: whole int64 slots
    host = int64_tensor(packed)
    if device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    out = _split(dev[: len(flat_ints)], ints, INTS_A_BOUNDARY)
    out.update(_split(dev[len(flat_ints):].view(torch.float32), floats, FLOATS_A_BOUNDARY))
    return out


INTS_A_BOUNDARY, FLOATS_A_BOUNDARY = 2, 4  # int64s and float32s in 16 bytes


def int64_tensor(values: list[int] | array.array) -> torch.Tensor:
    """A host int64 tensor of `values` through array.array: a quarter of torch.tensor's time on a
    list (26 against 92 us for 1,500 ints on the CPU machine), which a synchronous step waits for."""
    packed = values if isinstance(values, array.array) else array.array("q", values)
    return torch.frombuffer(packed, dtype=torch.int64) if packed else torch.empty(0, dtype=torch.int64)


def _padded(lists: dict[str, list], per_boundary: int) -> list:
    flat = []
    for values in lists.values():
        flat += values
        flat += [0] * (-len(values) % per_boundary)
    return flat


def download(tokens: torch.Tensor, logprobs: torch.Tensor, top, parts: list):
    """(host buffer, host prompt parts, event): float64 holds token ids exactly; on CUDA the
    copies are asynchronous into pinned memory and the event says when they have landed."""
    rows = [tokens.double()[None], logprobs.double()[None]]
    if top is not None:
        rows += [top[0].T.double(), top[1].T.double(), top[2].double()[None]]
    stacked = torch.cat(rows)
    if not stacked.is_cuda:
        return stacked, parts, None
    host = _pinned_copy(stacked)
    host_parts = [(r, _pinned_copy(chosen), _pinned_copy(ranks), None if top is None else tuple(map(_pinned_copy, top)))
                  for r, chosen, ranks, top in parts]
    event = torch.cuda.Event()
    event.record()
    return host, host_parts, event


def _pinned_copy(x: torch.Tensor) -> torch.Tensor:
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    return host


def _split(flat: torch.Tensor, lists: dict[str, list], per_boundary: int) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, values in lists.items():
        out[name] = flat[offset: offset + len(values)]
        offset += len(values) + (-len(values) % per_boundary)
    return out


def step_lists(decodes: DecodeRows, chunks: list, head_dim: int) -> dict[str, list[int]]:
    """Packed metadata: the decode rows first (one token each), then chunks; row and position per
    token, per-chunk extend bounds (absolute: the first chunk starts after the decodes) and
    extend attention's block table, the logits rows to sample and their request rows, then the
    rows (and next tokens) of the chunks that want prompt logprobs."""
    positions = [r.seq_len + o for r, o in zip(decodes.reqs, decodes.offsets)]
    token_rows = [r.row for r in decodes.reqs]
    lora_slots = [r.lora_slot for r in decodes.reqs]
    chunk_ids, cu_q, kv_lens, logit_index = [], [len(decodes)], [], list(range(len(decodes)))
    prompt_rows, prompt_targets = [], []
    for r, c in chunks:
        n = len(c.token_ids)
        chunk_ids.extend(c.token_ids)
        positions.extend(range(c.start, c.start + n))
        token_rows.extend([r.row] * n)
        lora_slots.extend([r.lora_slot] * n)
        first = cu_q[-1]
        cu_q.append(first + n)
        kv_lens.append(c.start + n)
        if c.last:
            logit_index.append(cu_q[-1] - 1)
        if r.prompt_logprobs is not None:  # row j predicts the chunk's token j + 1 (then the next chunk's first)
            targets = c.token_ids[1:] + ([] if c.last else [c.next_id])
            prompt_rows.extend(range(first, first + len(targets)))
            prompt_targets.extend(targets)
    sample_rows = token_rows[: len(decodes)] + [r.row for r, c in chunks if c.last]
    lists = {"decode_ids": decodes.ids, "chunk_ids": chunk_ids, "positions": positions, "token_rows": token_rows,
             "decode_rows": token_rows[: len(decodes)], "decode_seq_lens": [p + 1 for p in positions[: len(decodes)]],
             "ext_rows": [r.row for r, _ in chunks], "ext_cu_q": cu_q, "ext_kv_lens": kv_lens,
             "ext_q_blocks": extend_q_blocks([len(c.token_ids) for _, c in chunks], head_dim),
             "logit_index": logit_index + prompt_rows, "sample_rows": sample_rows, "lora_slots": lora_slots}
    if prompt_targets:
        lists["prompt_targets"] = prompt_targets
    return lists
