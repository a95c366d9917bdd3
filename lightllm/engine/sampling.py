"""Token choice for one step: penalties, then greedy or seeded top-k/top-p sampling.

The random draw for request b at step s (tokens it has generated so far) uses
u = random_uniform(seed_b, s, vocab), a counter hash, and picks argmax(p / -log(u)) (the
exponential race, an exact sample from p). So a seed gives the same tokens whatever
batch the request runs in.

Host lists are built here (`host_lists`) and turned into tensors by the model runner's one
upload; `SamplingBatch` then views them on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightllm.server.io_struct import SamplingParams
from lightllm_kernels import apply_penalties_, random_uniform

_INT64_SPAN = 1 << 64


@dataclass
class SamplingState:
    """Host-side sampling state of one running request."""

    params: SamplingParams
    generated: int = 0  # tokens sampled in launched steps (counted at launch, known without them)
    output_counts: dict[int, int] = field(default_factory=dict)  # kept only when penalties are used

    @property
    def uses_penalties(self) -> bool:
        p = self.params
        return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0

    def record(self, token: int) -> None:
        """Count a sampled token for the penalties (only those requests wait for their tokens)."""
        if self.uses_penalties:
            self.output_counts[token] = self.output_counts.get(token, 0) + 1


def _signed64(seed: int) -> int:
    """Any integer seed as the int64 with the same low 64 bits."""
    seed %= _INT64_SPAN
    return seed - _INT64_SPAN if seed >= _INT64_SPAN // 2 else seed


def _penalty_lists(states: list[SamplingState], ints: dict, floats: dict) -> None:
    ids, counts, offsets = [], [], [0]
    for s in states:
        ids.extend(s.output_counts)
        counts.extend(s.output_counts.values())
        offsets.append(len(ids))
    ints.update(penalty_ids=ids, penalty_counts=counts, penalty_offsets=offsets)
    floats.update(presence=[s.params.presence_penalty for s in states],
                  frequency=[s.params.frequency_penalty for s in states],
                  repetition=[s.params.repetition_penalty for s in states])


def host_lists(states: list[SamplingState]) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    """The batch's sampling inputs as named int and float lists (one entry per request)."""
    greedy = [s.params.greedy for s in states]
    ints = {"seeds": [_signed64(s.params.seed) for s in states],
            "steps": [s.generated for s in states],
            "top_ks": [s.params.top_k if s.params.top_k > 0 else -1 for s in states],
            "greedy": [int(g) for g in greedy]}
    floats = {"temperatures": [1.0 if g else s.params.temperature for s, g in zip(states, greedy)],
              "top_ps": [s.params.top_p for s in states]}
    if any(s.uses_penalties for s in states):
        _penalty_lists(states, ints, floats)
    return ints, floats


@dataclass
class SamplingBatch:
    """Device views of `host_lists`, plus the host flags that choose the code path."""

    seeds: torch.Tensor
    steps: torch.Tensor
    top_ks: torch.Tensor
    greedy: torch.Tensor  # bool
    temperatures: torch.Tensor
    top_ps: torch.Tensor
    all_greedy: bool
    penalties: tuple | None  # (presence, frequency, repetition, ids, counts, offsets)

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], all_greedy: bool) -> "SamplingBatch":
        penalties = None
        if "penalty_ids" in t:
            penalties = (t["presence"], t["frequency"], t["repetition"], t["penalty_ids"].int(),
                         t["penalty_counts"].int(), t["penalty_offsets"].int())
        return cls(t["seeds"], t["steps"], t["top_ks"], t["greedy"].bool(), t["temperatures"], t["top_ps"],
                   all_greedy, penalties)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids int64 [B], their logprobs fp32 [B]) from fp32 logits [B, V] (modified in place)."""
    if batch.penalties is not None:
        apply_penalties_(logits, *batch.penalties)
    greedy_tokens = logits.argmax(-1)
    if batch.all_greedy:
        return greedy_tokens, _logprobs(logits, greedy_tokens)
    scaled = logits / batch.temperatures[:, None]
    tokens = torch.where(batch.greedy, greedy_tokens, _sample_filtered(scaled, batch))
    return tokens, _logprobs(scaled, tokens)


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)


def _sample_filtered(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Seeded draw from softmax(scaled) restricted to top_k, then to the top_p nucleus."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(-1, descending=True)
    probs = sorted_logits.softmax(-1)
    rank = torch.arange(vocab, device=scaled.device)
    top_ks = torch.where(batch.top_ks > 0, batch.top_ks, vocab)
    probs = probs.masked_fill(rank[None, :] >= top_ks[:, None], 0.0)
    # top_p over the top-k renormalised distribution; the best token always stays
    cum_before = (probs.cumsum(-1) - probs) / probs.sum(-1, keepdim=True)
    probs = probs.masked_fill((cum_before >= batch.top_ps[:, None]) & (rank[None, :] > 0), 0.0)
    u = random_uniform(batch.seeds, batch.steps, vocab).gather(1, order)
    choice = (probs / -torch.log(u)).argmax(-1, keepdim=True)
    return order.gather(1, choice).squeeze(1)
