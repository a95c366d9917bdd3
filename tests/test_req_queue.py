"""The admission check, without a model: the peak formula, the budget, FIFO order."""

import itertools

import numpy as np
import pytest

from lightllm.server.io_struct import GenerateReq, SamplingParams
from lightllm.server.router.req import Req, ReqStatus
from lightllm.server.router.req_queue import ReqQueue, peak_token_usage

_ids = itertools.count()


def make_req(prompt_len: int, max_new_tokens: int) -> Req:
    msg = GenerateReq(next(_ids), [7] * prompt_len, SamplingParams(max_new_tokens=max_new_tokens))
    return Req(msg, eos_token_ids=frozenset({0}))


def simulated_peak(held: list[int], left: list[int]) -> int:
    """Step the batch one token at a time; a request frees its tokens right after its last step."""
    held, left = list(held), list(left)
    peak = sum(held)
    while held:
        held = [h + 1 for h in held]
        left = [n - 1 for n in left]
        peak = max(peak, sum(held))
        keep = [i for i, n in enumerate(left) if n > 0]
        held, left = [held[i] for i in keep], [left[i] for i in keep]
    return peak


def test_peak_formula_matches_step_simulation():
    rng = np.random.default_rng()
    for _ in range(300):
        n = int(rng.integers(1, 12))
        held = rng.integers(1, 60, n)
        left = rng.integers(1, 40, n)
        assert peak_token_usage(held, left) == simulated_peak(held.tolist(), left.tolist())


def test_peak_of_empty_batch_is_zero():
    assert peak_token_usage(np.array([], dtype=int), np.array([], dtype=int)) == 0


def test_a_lone_request_needs_prompt_plus_max_new_tokens():
    assert peak_token_usage(np.array([10]), np.array([5])) == 15


def run_router_simulation(rng, budget: int, n_reqs: int, max_wait_steps: int) -> list[int]:
    """A router without a model: admit, prefill, decode, finish (max_new_tokens or a random EOS).
    Returns the admission order; asserts that usage never exceeds the budget."""
    queue = ReqQueue(max_total_token_num=budget, batch_max_tokens=budget, running_max_req_size=16)
    pending = [make_req(int(rng.integers(1, budget // 3)), int(rng.integers(1, budget // 3))) for _ in range(n_reqs)]
    running: list[Req] = []
    admitted_order: list[int] = []
    steps_since_admit = max_wait_steps
    while pending or len(queue) or running:
        for _ in range(int(rng.integers(0, 3))):
            if pending:
                queue.append(pending.pop(0))
        new = queue.admit(running) if steps_since_admit >= max_wait_steps or not running else []
        batch = new if new else running
        steps_since_admit = 0 if new else steps_since_admit + 1
        for req in new:
            req.status = ReqStatus.RUNNING
            admitted_order.append(req.req_id)
        running += new
        finished = [req for req in batch if req.append(7) or rng.random() < 0.05]
        # Usage as a runner would see it at the end of the step, before finished requests are freed.
        assert sum(req.tokens_held for req in running) <= budget
        running = [req for req in running if req not in finished]
    return admitted_order


@pytest.mark.parametrize("max_wait_steps", [1, 4])
def test_admission_never_exceeds_budget(max_wait_steps):
    rng = np.random.default_rng()
    for _ in range(30):
        budget = int(rng.integers(40, 200))
        order = run_router_simulation(rng, budget, n_reqs=25, max_wait_steps=max_wait_steps)
        assert order == sorted(order), "admission must be FIFO"
        assert len(order) == 25


def test_large_request_is_not_overtaken():
    queue = ReqQueue(max_total_token_num=100, batch_max_tokens=100, running_max_req_size=8)
    running = [make_req(30, 40)]
    running[0].status = ReqStatus.RUNNING
    big, small = make_req(20, 30), make_req(2, 2)
    queue.append(big)
    queue.append(small)
    # Together 50 + 2 * 30 > 100: the big one does not fit; the small one would, but must wait.
    assert queue.admit(running) == []
    assert len(queue) == 2
    assert queue.admit([]) == [big, small]


def test_batch_limits():
    queue = ReqQueue(max_total_token_num=10_000, batch_max_tokens=50, running_max_req_size=3)
    reqs = [make_req(20, 5) for _ in range(4)]
    for req in reqs:
        queue.append(req)
    assert queue.admit([]) == reqs[:2]  # a third prompt would pass batch_max_tokens
    assert queue.admit(reqs[:2]) == reqs[2:3]  # running_max_req_size
    assert queue.remove(reqs[3].req_id) is reqs[3]
    assert len(queue) == 0
