"""Speculative decoding in tests: a draft source that knows the answer, and an engine that drafts."""

import random

from benchmark.engine.spec_host_time import pin_step_costs
from helpers.models import engine

from lightllm.engine.spec.config import SpeculativeConfig
from lightllm.engine.spec.controller import Speculator


class OracleDraft:
    """Proposes transformers' greedy continuation (ORACLE, by prompt), each token wrong with
    probability WRONG: acceptance is partial, so runs of every length are verified."""

    ORACLE: dict[tuple, list[int]] = {}
    WRONG = 0.3

    def __init__(self, vocab_size: int):
        self.vocab, self.reqs, self.rng = vocab_size, {}, random.Random(1)

    def start(self, req_id, prompt_ids):
        self.reqs[req_id] = (tuple(prompt_ids), [])

    def extend(self, req_id, token_ids):
        self.reqs[req_id][1].extend(token_ids)

    def propose(self, req_id, k):
        prompt, out = self.reqs[req_id]
        truth = self.ORACLE.get(prompt, [])[len(out): len(out) + k]
        return [t if self.rng.random() >= self.WRONG else (t + 1) % self.vocab for t in truth]

    def finish(self, req_id):
        self.reqs.pop(req_id, None)


def speculating_engine(runner, chunk, method, overlap=True, prefix_cache=True, **config):
    """An engine core on `runner` whose controller speculates whenever drafts are accepted."""
    core = engine(runner, chunk, overlap=overlap, prefix_cache=prefix_cache)
    max_rows = runner.req_table.max_reqs * 6
    spec = Speculator(SpeculativeConfig(method, num_speculative_tokens=5, **config), runner.config.vocab_size, max_rows)
    pin_step_costs(spec, (1, 4, 16, 64, 256, max(max_rows, 1024)))  # drafts pay while they are accepted
    spec.guard = None  # and no epochs held off: what is under test is verification
    spec.global_alpha = 0.9
    core.scheduler.speculator = spec
    return core
