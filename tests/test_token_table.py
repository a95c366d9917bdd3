"""TokenTable and ReqTable: exact bookkeeping under random alloc/free sequences."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightllm.common.req_table import OutOfRowsError, ReqTable
from lightllm.common.token_table import DoubleFreeError, OutOfTokensError, TokenTable

SIZE = 64


def make_table(size=SIZE):
    return TokenTable(size, num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")


def longest_free_run(mem_state):
    best = run = 0
    for free in mem_state.tolist():
        run = run + 1 if free else 0
        best = max(best, run)
    return best


def check_alloc(table, held, n, contiguous=True):
    had_run = longest_free_run(table.mem_state) >= n
    first_free = torch.nonzero(table.mem_state).flatten()[:n].tolist()
    slots = table.alloc(n, contiguous).tolist()
    assert len(slots) == n == len(set(slots))
    assert not set(slots) & held, "a slot was handed out twice"
    if not contiguous:
        assert slots == first_free, "not the first free slots"
    elif had_run and n > 0:
        assert slots == list(range(slots[0], slots[0] + n)), "a contiguous run existed but was not used"
    held |= set(slots)


# Each op: ("alloc", n, contiguous) or ("free", fraction of the held slots, as a random subset seed, unused).
ops = st.lists(st.one_of(st.tuples(st.just("alloc"), st.integers(0, 24), st.booleans()),
                         st.tuples(st.just("free"), st.integers(0, 2**16), st.just(False))), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_alloc_free_keeps_exact_counts(op_list):
    table = make_table()
    held = set()
    for op, arg, contiguous in op_list:
        if op == "alloc" and arg <= table.free_count:
            check_alloc(table, held, arg, contiguous)
        elif op == "alloc":
            with pytest.raises(OutOfTokensError):
                table.alloc(arg, contiguous)
        elif held:
            gen = torch.Generator().manual_seed(arg)
            order = torch.randperm(len(held), generator=gen).tolist()
            pool = sorted(held)
            chosen = [pool[i] for i in order[: 1 + arg % len(held)]]
            table.free(torch.tensor(chosen))
            held -= set(chosen)
        assert table.free_count == SIZE - len(held) == int(table.mem_state.sum())
        assert set(torch.nonzero(table.mem_state == 0).flatten().tolist()) == held
    if held:
        table.free(torch.tensor(sorted(held)))
    assert table.free_count == SIZE == int(table.mem_state.sum())


def test_contiguous_run_preferred_over_first_free():
    table = make_table(16)
    table.alloc(16)
    table.free(torch.tensor([1, 3, 8, 9, 10, 11, 12]))  # scattered 1, 3 and a run 8..12
    assert table.alloc(4).tolist() == [8, 9, 10, 11]
    assert table.alloc(3).tolist() == [1, 3, 12]  # no run of 3 left: first free slots


def test_decode_slots_are_the_first_free_even_beside_a_run():
    table = make_table(16)
    table.alloc(16)
    table.free(torch.tensor([1, 3, 8, 9, 10, 11, 12]))
    assert table.alloc(4, contiguous=False).tolist() == [1, 3, 8, 9]


def test_over_allocation_raises():
    table = make_table(8)
    table.alloc(5)
    with pytest.raises(OutOfTokensError, match="only 3 of 8"):
        table.alloc(4)
    assert table.free_count == 3


def test_double_free_raises():
    table = make_table(8)
    slots = table.alloc(4)
    table.free(slots[:2])
    with pytest.raises(DoubleFreeError):
        table.free(slots[:1])
    with pytest.raises(DoubleFreeError):
        table.free(torch.tensor([slots[2].item(), slots[2].item()]))
    assert table.free_count == 6


def test_req_table_rows():
    rows = ReqTable(max_reqs=3, max_req_total_len=8, device="cpu")
    taken = [rows.alloc() for _ in range(3)]
    assert sorted(taken) == [0, 1, 2]
    with pytest.raises(OutOfRowsError):
        rows.alloc()
    rows.free(taken[1])
    with pytest.raises(ValueError, match="not in use"):
        rows.free(taken[1])
    assert rows.alloc() == taken[1]
    assert rows.req_to_token.shape == (3, 8) and rows.req_to_token.dtype == torch.int32
