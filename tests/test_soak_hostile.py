"""test/benchmark/serving/soak.py and hostile.py without a model: the report's aggregation (non-2xx
by route and status, the gap bound, the memory table), the large schemas' sizes and shapes, and the
slow clients' verdicts against stub servers that answer 408, close, or stay silent."""

from __future__ import annotations

import asyncio
import json
import random

from benchmark.serving import hostile, soak
from seeds import fresh_rng


def test_outcomes_count_non_2xx_by_route_and_status_expected_apart():
    outcomes = soak.Outcomes()
    outcomes.add("invalid", "rejected", 0.1, seen=[("/generate", 400)])
    outcomes.add("invalid", "rejected", 0.1, seen=[("/generate", 400)])
    outcomes.add("generate", "unexpected", 0.1, "boom", seen=[("/generate", 500)])
    outcomes.add("generate", "ok", 0.1, seen=[("/generate", 200)], gaps=[0.1, 0.2])
    assert outcomes.statuses == {("/generate", "400", True): 2, ("/generate", "500", False): 1}
    assert outcomes.gaps == [0.1, 0.2]
    table = "\n".join(soak.status_table(outcomes.statuses))
    assert "| expected | /generate | 400 | 2 |" in table and "| UNEXPECTED | /generate | 500 | 1 |" in table
    assert table.index("| expected |") < table.index("| UNEXPECTED |")


def test_gap_check_fails_only_past_the_ratio_of_the_median():
    rng = fresh_rng()
    gaps = [rng.uniform(0.04, 0.06) for _ in range(101)]
    median = sorted(gaps)[50]
    assert soak.gap_check([*gaps, median * 9.9], 10.0)[1]
    line, ok = soak.gap_check([*gaps, median * 10.5], 10.0)
    assert not ok and "EXCEEDED" in line
    assert soak.gap_check([], 10.0)[1]


def test_memory_table_has_one_row_per_process_and_one_column_per_sample():
    def state(mib):
        return {"rss_mib": 4 * mib, "kv": 0, "by_role": {role: mib for role in soak.ROLES}}

    lines = soak.memory_table({"idle": state(100), "after warm-up": state(110), "end": state(120)})
    assert lines[0] == "| idle sample | idle | after warm-up | end |"
    assert "| RSS router, MiB | 100 | 110 | 120 |" in lines and "| RSS all, MiB | 400 | 440 | 480 |" in lines
    assert lines[-1] == "| KV tokens in use | 0 | 0 | 0 |"


def test_large_schemas_are_the_sizes_the_issue_names():
    assert 50_000 <= len(json.dumps(hostile.large_schema())) <= 100_000
    chain = hostile.ref_chain(300)
    target, hops = chain["$ref"], 0
    while target:  # the chain is unbroken and ends in a plain type
        node = chain["$defs"][target.rsplit("/", 1)[1]]
        target, hops = node.get("$ref"), hops + 1
    assert hops == 301 and node == {"type": "string"}


def test_hostile_mix_only_with_the_flag():
    assert set(soak.request_mix(False, 5.0)) == set(soak.MIX)
    assert set(soak.request_mix(True, 5.0)) == set(soak.MIX) | set(hostile.HTTP_MIX) | set(hostile.SOCKET_MIX)


async def slow_client_against(answer: bytes | None, request) -> tuple[str, list]:
    """The slow client's outcome against a stub that sends `answer` (None: silence) after a line."""
    async def handle(reader, writer):
        await reader.readline()
        if answer is not None:
            writer.write(answer)
            await writer.drain()
            writer.close()
        else:
            await asyncio.sleep(5)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    seen = []
    hostile.SEEN.set(seen)
    async with server:
        outcome = await request(f"http://127.0.0.1:{port}", random.Random(0), 0.0)
    return outcome, seen


def test_slow_clients_accept_408_or_close_and_fail_on_silence_or_200(monkeypatch):
    monkeypatch.setattr(hostile, "SLOW_GRACE_S", 1.5)
    for request in (hostile.short_body, hostile.headers_line_by_line):
        timed_out = asyncio.run(slow_client_against(b"HTTP/1.1 408 Request Timeout\r\n\r\n", request))
        assert timed_out[0] == ("rejected", "") and timed_out[1][0][1] == "408"
        assert asyncio.run(slow_client_against(b"", request))[0] == ("rejected", "")
        assert asyncio.run(slow_client_against(b"HTTP/1.1 200 OK\r\n\r\n", request))[0][0] == "unexpected"
        assert asyncio.run(slow_client_against(None, request))[0][0] == "unexpected"


def test_soak_adapters_are_ones_the_server_accepts(tmp_path, monkeypatch):
    """--loras: the adapters written for the model pass the server's own check (names, shapes, rank),
    the flags serve them on half as many slots, and only then does the mix hold the load-and-unload
    round trip."""
    from lightllm.common.lora_files import read_adapter
    from lightllm.models import read_config
    from lightllm.models.lora import module_shapes
    from lightllm.tools.bench_model import write_bench_model

    monkeypatch.setattr(soak, "ADAPTERS", {})
    assert "lora_round_trip" not in soak.request_mix(False, 5.0)
    model_dir = write_bench_model(tmp_path / "tiny", "tiny")
    flags = soak.write_adapters(4, tmp_path / "loras", str(model_dir))
    assert flags[flags.index("--max_loras") + 1] == "2"
    served = flags[flags.index("--lora_modules") + 1: flags.index("--max_loras")]
    assert served == [f"{name}={path}" for name, path in soak.ADAPTERS.items()] and len(served) == 4
    shapes = module_shapes(read_config(model_dir))
    for path in soak.ADAPTERS.values():
        spec = read_adapter(path, shapes, int(flags[flags.index("--max_lora_rank") + 1]))
        assert set(spec.modules) == set(shapes)
    assert "lora_round_trip" in soak.request_mix(False, 5.0) and "lora_round_trip" in soak.request_mix(True, 5.0)
    rng = fresh_rng()
    picked = [soak.pick_adapter(rng) for _ in range(200)]
    assert {p for p in picked if p} == set(soak.ADAPTERS) and 60 < picked.count(None) < 140
