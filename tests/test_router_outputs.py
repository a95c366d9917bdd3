"""When the router sends a turn's outputs to the detokenizer: while busy, during the next turn's
step, once the model workers have its plan (`while_waiting`), so that a step with drafts, whose
result the engine waits for, is not held up by them; at the end of the turn when the engine goes
idle or no step carried them; and before anything else it passes on to the detokenizer."""

import shutil

import pytest
import zmq

from lightllm.engine.request import GenerateReq, SamplingParams, TokenOut
from lightllm.server.config import ServerConfig
from lightllm.server.io_struct import AbortReq, BatchTokenOut
from lightllm.server.router.manager import RouterManager


class FakeCore:
    """Each step answers the next list of outputs; while `steps_call_workers`, its step calls the
    workers' hook as ModelWorkers.step does, and records what the detokenizer had by then."""

    def __init__(self, turns: list[list[TokenOut]], detokenizer, steps_call_workers: bool = True):
        self.turns, self.detokenizer, self.steps_call_workers = list(turns), detokenizer, steps_call_workers
        self.scheduler = type("S", (), {"max_total_token_num": 100, "prompt_computed_tokens": 0, "waiting": {},
                                        "running": [], "tokens_used": 0, "cached_tokens": 0, "cache": None,
                                        "prefix_queried_tokens": 0, "prefix_hit_tokens": 0, "speculator": None,
                                        "num_preemptions": 0})()
        self.host_trace, self.while_waiting, self.seen_in_step = None, None, []
        self.added, self.aborted = [], []

    @property
    def has_work(self) -> bool:
        return bool(self.turns)

    def step(self) -> list[TokenOut]:
        if self.steps_call_workers and self.while_waiting is not None:
            self.while_waiting()
        self.seen_in_step.append(received(self.detokenizer))
        return self.turns.pop(0)

    def add(self, msg) -> list:
        self.added.append(msg.req_id)
        return []

    def abort(self, req_id: int) -> bool:
        self.aborted.append(req_id)
        return True


def received(sock) -> list:
    """What the detokenizer's socket holds now: token ids, and ("abort", id) / ("request", id)."""
    got = []
    while sock.poll(50):
        msg = sock.recv_pyobj()
        if isinstance(msg, BatchTokenOut):
            got += [out.token_id for out in msg.items]
        else:
            got.append(("abort" if isinstance(msg, AbortReq) else "request", msg.req_id))
    return got


@pytest.fixture
def router_and_sockets():
    config = ServerConfig(disable_log_stats=True).with_addresses()
    context = zmq.Context.instance()
    detokenizer = context.socket(zmq.PULL)
    detokenizer.bind(config.detokenization_address)
    http = context.socket(zmq.PULL)
    http.bind(config.http_address)
    made = []

    def make(turns, steps_call_workers=True):
        core = FakeCore(turns, detokenizer, steps_call_workers)
        router = RouterManager(config, core)
        core.while_waiting = router.while_waiting  # as start_router_process hands it to the workers
        client = context.socket(zmq.PUSH)
        client.connect(config.router_addresses[0])
        made.append((router, client))
        return router, core, client

    yield make, detokenizer
    for router, client in made:
        router.close()
        client.close(linger=0)
    detokenizer.close(linger=0)
    http.close(linger=0)
    shutil.rmtree(config.socket_dir)


def outs(*ids: int) -> list[TokenOut]:
    return [TokenOut(0, i, 0.0) for i in ids]


def test_a_busy_turns_outputs_go_out_during_the_next_step(router_and_sockets):
    make, detokenizer = router_and_sockets
    router, core, _ = make([outs(1, 2), outs(3), outs(4, 5)])
    router.run_once()
    assert received(detokenizer) == []  # busy: put by for the next step
    router.run_once()
    assert received(detokenizer) == []
    router.run_once()
    # the first step had nothing to carry; the second carried the first's, the third the second's;
    # the engine idle after the third, its outputs went at the end of its turn
    assert core.seen_in_step == [[], [1, 2], [3]]
    assert received(detokenizer) == [4, 5]


def test_without_a_step_that_carries_them_a_turns_outputs_go_at_its_end(router_and_sockets):
    make, detokenizer = router_and_sockets
    router, core, _ = make([outs(1), outs(2), outs(3)], steps_call_workers=False)
    for _ in range(3):
        router.run_once()
    assert core.seen_in_step == [[], [1], [2]]
    assert received(detokenizer) == [3]


def test_outputs_put_by_go_out_before_what_the_router_passes_on_next(router_and_sockets):
    make, detokenizer = router_and_sockets
    router, core, client = make([outs(1, 2), outs(3), outs(4)])
    router.run_once()  # busy: 1, 2 put by for the next step
    client.send_pyobj(AbortReq(7))
    client.send_pyobj(GenerateReq(8, [1, 2, 3], SamplingParams()))
    router._wait_for_work()
    for _ in range(100):  # the router's inbox is a separate socket: wait until both are in
        router._receive()
        if core.added:
            break
        router._inbox.poll(10)
    assert core.aborted == [7] and core.added == [8]
    assert received(detokenizer) == [1, 2, ("abort", 7), ("request", 8)]
