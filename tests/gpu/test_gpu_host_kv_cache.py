"""The prefix cache's host tier on CUDA: pinned pool, copies on the copy stream. An offload, the
slots reused at once by the step's stream, then a load into other slots: every layer's K and V
of each token arrive at its new slot; and the engine's greedy output through evictions and
reloads equals the device-only cache's (the CPU tests, on the GPU's streams)."""

import pytest
import torch
from test_host_kv_cache import converse, engine

from lightllm.common.host_pool import HostKVPool
from lightllm.common.token_table import TokenTable
from helpers.models import make_model, make_runner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_offload_reuse_load_on_the_copy_stream():
    layers, heads, dim = 4, 8, 128
    device = torch.device("cuda")
    table = TokenTable(4096, layers, heads, dim, torch.bfloat16, device)
    for t in table.k + table.v:
        t.copy_(torch.randn_like(t))
    pool = HostKVPool(2048, table.k + table.v, device)
    assert pool.data.is_pinned()
    old = torch.randperm(4096, device=device)[:1500].int()
    expected = [t[old.long()].clone() for t in table.k + table.v]
    pool.offload([(1, old)], table.k + table.v)
    for t in table.k + table.v:  # the step's stream overwrites the freed slots at once
        t.index_fill_(0, old.long(), 0)
    new = torch.randperm(4096, device=device)[:1500]
    pool.load([(1, new)], table.k + table.v)
    for t, want in zip(table.k + table.v, expected):
        torch.testing.assert_close(t[new], want, rtol=0, atol=0)


def test_greedy_output_with_the_host_tier_equals_the_device_cache(tmp_path):
    make_model("llama_gqa_llama3_rope", tmp_path)
    per_token = 2 * 2 * 2 * 16 * 4
    runner = make_runner(tmp_path, tokens=96, device="cuda", running_max_req_size=4, max_req_total_len=96,
                         data_type="float32", host_kv_cache_gb=160 * per_token / 2**30)
    results = []
    for host in (0, 160):
        core = engine(runner, host)
        rng = torch.Generator().manual_seed(3)
        conversations = [tokens for tokens in (torch.randint(0, 101, (10,), generator=rng).tolist() for _ in range(4))]
        results.append(converse(core, conversations, [[0, 1], [2, 3], [0, 1, 2, 3], [1, 3], [0, 2]], rng))
        if host:
            assert core.scheduler.prefix_host_hit_tokens > 0
        core.scheduler.flush_cache()
        core.drain()
    assert results[0] == results[1]
