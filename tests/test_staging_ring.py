"""model_runner.StagingRing, the kept page-locked buffers of the steps' uploads and downloads,
on plain memory (pin=False: the same logic, no GPU): buffers are taken in turn and kept, one is
reused only after the event of its last copy has been waited on, and a step larger than the
buffers grows all of them at once, so later steps allocate nothing."""

import torch

from lightllm.engine.model_runner import StagingRing


class FakeEvent:
    def __init__(self):
        self.waited = 0

    def synchronize(self):
        self.waited += 1


def test_buffers_are_taken_in_turn_and_kept_until_their_turn_comes_again():
    ring = StagingRing(size=3, pin=False)
    taken = []
    for step in range(7):
        buffer = ring.take(16, torch.int64)
        buffer.fill_(step)
        ring.used(FakeEvent())
        taken.append(buffer)
    pointers = [b.data_ptr() for b in taken]
    assert len(set(pointers)) == 3 and all(pointers[i] == pointers[i % 3] for i in range(7))
    # the last three steps' data is still there: a buffer is overwritten only three steps on
    assert [int(b[0]) for b in taken[-3:]] == [4, 5, 6]


def test_a_buffer_is_reused_only_after_its_copy_is_waited_on():
    ring = StagingRing(size=2, pin=False)
    events = []
    for _ in range(5):
        ring.take(8, torch.float64)
        events.append(FakeEvent())
        ring.used(events[-1])
    # each event but the last two (still in their buffers) was waited on once, before its buffer's next use
    assert [e.waited for e in events] == [1, 1, 1, 0, 0]


def test_a_larger_step_grows_every_buffer_once():
    ring = StagingRing(size=4, pin=False)
    small = [ring.take(10, torch.int64) for _ in range(4)]
    for _ in small:
        ring.used(FakeEvent())
    big = ring.take(1000, torch.int64)
    ring.used(FakeEvent())
    assert big.numel() == 1000
    pointers = []
    for numel, dtype in [(1000, torch.int64), (300, torch.float64), (2000, torch.float32), (1, torch.int64)] * 2:
        buffer = ring.take(numel, dtype)
        ring.used(FakeEvent())
        assert buffer.numel() == numel and buffer.dtype == dtype
        pointers.append(buffer.data_ptr())
    assert pointers[:4] == pointers[4:], "a buffer was allocated again after the growth"
