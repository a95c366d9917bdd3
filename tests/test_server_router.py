"""The router loop against a fake model runner: real zmq sockets, no model, no processes."""

import itertools
import random

import pytest
import zmq

from lightllm.server.config import ServerConfig
from lightllm.server.io_struct import AbortReq, BatchTokenOut, FinishReason, GenerateReq, RouterStats, SamplingParams
from lightllm.server.router.manager import RouterManager

EOS = 2
_names = itertools.count()


class FakeWorkers:
    """ModelWorkers' interface; counts KV tokens like a runner (prompt at prefill, +1 per decode)."""

    sentinels: list = []

    def __init__(self, eos_after: dict[int, int] | None = None, poison: int | None = None):
        self.tokens: dict[int, int] = {}  # req_id -> KV tokens held
        self.generated: dict[int, int] = {}
        self.eos_after = eos_after or {}
        self.poison = poison  # a prompt token that makes prefill raise
        self.peak = 0

    def _next(self, req_id: int) -> tuple[int, float]:
        self.generated[req_id] += 1
        if self.generated[req_id] == self.eos_after.get(req_id):
            return EOS, -0.5
        return 100 + req_id, -1.0

    def prefill(self, reqs):
        if any(self.poison in prompt for _, prompt, _ in reqs):
            raise ValueError("poisoned prompt")
        for req_id, prompt, _ in reqs:
            self.tokens[req_id], self.generated[req_id] = len(prompt), 0
        self.peak = max(self.peak, sum(self.tokens.values()))
        return tuple(self._next(req_id) for req_id, _, _ in reqs)

    def decode(self, req_ids):
        for req_id in req_ids:
            self.tokens[req_id] += 1
        self.peak = max(self.peak, sum(self.tokens.values()))
        return tuple(self._next(req_id) for req_id in req_ids)

    def free(self, req_ids):
        missing = [i for i in req_ids if i not in self.tokens]
        if missing:
            raise KeyError(f"unknown {missing}")
        for req_id in req_ids:
            del self.tokens[req_id]

    def stats(self):
        return {"tokens_used": sum(self.tokens.values())}


class Harness:
    def __init__(self, workers: FakeWorkers, budget: int = 10_000, **config):
        self.config = ServerConfig(disable_log_stats=True, **config)
        # inproc (the router uses the same zmq context): a sent message is readable at once.
        name = next(_names)
        self.config.router_address = f"inproc://router-{name}"
        self.config.detokenization_address = f"inproc://detokenizer-{name}"
        self.config.http_address = f"inproc://http-{name}"
        context = zmq.Context.instance()
        self.detokenizer = context.socket(zmq.PULL)
        self.detokenizer.bind(self.config.detokenization_address)
        self.http = context.socket(zmq.PULL)
        self.http.bind(self.config.http_address)
        self.router = RouterManager(self.config, workers, budget, eos_token_ids=[EOS])
        self.to_router = context.socket(zmq.PUSH)
        self.to_router.connect(self.config.router_address)
        self.workers = workers

    def send(self, msg) -> None:
        self.to_router.send_pyobj(msg)

    def run_until_idle(self, max_turns: int = 10_000) -> None:
        """Turn the loop until nothing waits, runs or is unread (an idle turn would block)."""
        for _ in range(max_turns):
            if self.router.idle and not self.router._inbox.poll(0):
                return
            self.router.run_once()
        raise AssertionError("router never became idle")

    def detokenizer_messages(self) -> list:
        return drain(self.detokenizer)

    def close(self) -> None:
        for sock in (self.detokenizer, self.http, self.to_router, self.router._inbox,
                     self.router._to_detokenizer, self.router._to_http):
            sock.close(linger=0)


def drain(sock) -> list:
    messages = []
    while sock.poll(0):
        messages.append(sock.recv_pyobj())
    return messages


def request(req_id: int, prompt_len: int, max_new_tokens: int, **sampling) -> GenerateReq:
    return GenerateReq(req_id, [5] * prompt_len, SamplingParams(max_new_tokens=max_new_tokens, **sampling))


def tokens_by_request(messages) -> dict[int, list]:
    out: dict[int, list] = {}
    for msg in messages:
        if isinstance(msg, BatchTokenOut):
            for item in msg.items:
                out.setdefault(item.req_id, []).append(item)
    return out


@pytest.fixture
def harness_factory():
    made = []

    def make(*args, **kwargs):
        made.append(Harness(*args, **kwargs))
        return made[-1]

    yield make
    for harness in made:
        harness.close()


def test_requests_run_to_max_new_tokens_or_eos(harness_factory):
    h = harness_factory(FakeWorkers(eos_after={1: 3}))
    h.send(request(0, 4, 5))
    h.send(request(1, 4, 5))
    h.send(request(2, 4, 5, ignore_eos=True))
    h.workers.eos_after[2] = 2  # ignored: ignore_eos
    h.run_until_idle()
    messages = h.detokenizer_messages()
    by_req = tokens_by_request(messages)
    assert [len(by_req[i]) for i in range(3)] == [5, 3, 5]
    assert [by_req[i][-1].finish_reason for i in range(3)] == [FinishReason.LENGTH, FinishReason.EOS, FinishReason.LENGTH]
    assert all(out.finish_reason is None for i in range(3) for out in by_req[i][:-1])
    # The detokenizer hears of each request before its first token.
    first_token_at = {i: next(n for n, m in enumerate(messages) if isinstance(m, BatchTokenOut) and any(t.req_id == i for t in m.items)) for i in range(3)}
    announced_at = {m.req_id: n for n, m in enumerate(messages) if isinstance(m, GenerateReq)}
    assert all(announced_at[i] < first_token_at[i] for i in range(3))
    assert h.workers.tokens == {}
    stats = [m for m in drain(h.http) if isinstance(m, RouterStats)]
    assert stats[-1] == RouterStats(0, 0, 0, 10_000)


def test_abort_frees_a_running_request_and_tells_the_detokenizer(harness_factory):
    h = harness_factory(FakeWorkers())
    h.send(request(0, 4, 1000))
    h.send(request(1, 4, 3))
    for _ in range(5):
        h.router.run_once()
    assert 0 in h.workers.tokens
    h.send(AbortReq(0))
    h.router.run_once()
    assert 0 not in h.workers.tokens
    h.run_until_idle()
    messages = h.detokenizer_messages()
    assert any(isinstance(m, AbortReq) and m.req_id == 0 for m in messages)
    assert tokens_by_request(messages)[1][-1].finish_reason is FinishReason.LENGTH
    h.send(AbortReq(1))  # already finished: ignored
    h.send(AbortReq(99))  # never seen: ignored
    h.router.run_once()
    assert h.workers.tokens == {}


def test_abort_of_a_waiting_request_never_runs_it(harness_factory):
    h = harness_factory(FakeWorkers(), budget=20)
    h.send(request(0, 4, 16))  # 20: the whole budget
    h.send(request(1, 4, 10))  # together: 5 + 5 + 2 * 9 > 20
    h.router.run_once()
    h.send(AbortReq(1))
    h.run_until_idle()
    assert set(tokens_by_request(h.detokenizer_messages())) == {0}


def test_a_failing_batch_gets_errors_and_the_rest_goes_on(harness_factory):
    h = harness_factory(FakeWorkers(poison=666), router_max_wait_tokens=1)
    h.send(request(0, 4, 20))
    h.router.run_once()
    h.send(GenerateReq(1, [5, 666], SamplingParams(max_new_tokens=5)))
    h.run_until_idle()
    by_req = tokens_by_request(h.detokenizer_messages())
    assert len(by_req[1]) == 1 and by_req[1][0].finish_reason is FinishReason.ERROR
    assert "poisoned prompt" in by_req[1][0].error
    assert len(by_req[0]) == 20 and by_req[0][-1].finish_reason is FinishReason.LENGTH
    assert h.workers.tokens == {}


def test_kv_usage_stays_within_the_budget(harness_factory):
    rng = random.Random()
    budget = 200
    h = harness_factory(FakeWorkers(), budget=budget, router_max_wait_tokens=rng.randrange(1, 8))
    lengths = [(rng.randrange(1, 60), rng.randrange(1, 60)) for _ in range(40)]
    for req_id, (prompt_len, max_new_tokens) in enumerate(lengths):
        h.send(request(req_id, prompt_len, max_new_tokens))
    h.run_until_idle()
    by_req = tokens_by_request(h.detokenizer_messages())
    assert [len(by_req[i]) for i in range(len(lengths))] == [n for _, n in lengths]
    assert budget / 2 < h.workers.peak <= budget
