"""/metrics families (metrics.py) without a server: what RequestTimer counts from a request's
outputs, the router's figures as samples, and one registry per app.

test_server_api.py::test_metrics reads them through a running server."""

import random
from pathlib import Path
from types import SimpleNamespace

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lightllm.frontend.lora import LoraNames
from lightllm.server.httpserver import metrics as metrics_module
from lightllm.server.httpserver.metrics import Metrics, RequestTimer
from lightllm.engine.request import FinishReason
from lightllm.server.io_struct import RouterStats, TextOut


def samples(metrics: Metrics) -> dict:
    """Every sample of the rendered text, by name and labels (as the Prometheus text parser reads it)."""
    found = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return found


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock(1000.0)
    monkeypatch.setattr(metrics_module.time, "monotonic", clock)
    return clock


def token(count: int, finish: FinishReason | None = None, **extra) -> TextOut:
    return TextOut(req_id=7, token_id=count, text="x", logprob=0.0, special=False, count_output_tokens=count,
                   finish_reason=finish, **extra)


def test_a_request_is_counted_and_timed_from_its_outputs(clock):
    metrics = Metrics([1000])
    prompt_len, start = random.randint(1, 500), clock.now
    timer = RequestTimer(metrics, prompt_len, start)
    ttft, queue_time = random.uniform(0.01, 2.0), random.uniform(0.0, 1.0)
    gaps = [random.uniform(0.001, 0.2) for _ in range(random.randint(2, 20))]
    clock.now += ttft
    timer.observe(token(1, cached_tokens=3, queue_time=queue_time))
    for i, gap in enumerate(gaps, start=2):
        clock.now += gap
        timer.observe(token(i, FinishReason.LENGTH if i == len(gaps) + 1 else None))

    got = samples(metrics)
    assert timer.cached_tokens == 3
    assert got["lightllm:prompt_tokens_total"] == prompt_len
    assert got["lightllm:generation_tokens_total"] == len(gaps) + 1
    assert got['lightllm:request_success_total{finished_reason="length"}'] == 1
    assert got["lightllm:time_to_first_token_seconds_count"] == 1
    assert got["lightllm:time_to_first_token_seconds_sum"] == pytest.approx(ttft)
    assert got["lightllm:request_queue_time_seconds_sum"] == pytest.approx(queue_time)
    # One observation per interval between two tokens.
    assert got["lightllm:time_per_output_token_seconds_count"] == len(gaps)
    assert got["lightllm:time_per_output_token_seconds_sum"] == pytest.approx(sum(gaps))
    assert got["lightllm:e2e_request_latency_seconds_sum"] == pytest.approx(ttft + sum(gaps))
    largest_gap_bucket = min(b for b in metrics_module.TOKEN_INTERVAL_BUCKETS if b >= max(gaps))
    assert got[f'lightllm:time_per_output_token_seconds_bucket{{le="{largest_gap_bucket}"}}'] == len(gaps)


def test_a_finished_request_has_its_lengths_and_phases(clock):
    """vLLM's per-request families: prompt and generated tokens, and prefill (scheduling to the
    first token: the router's queue time counts from the hand-off, after tokenizing), decode and
    inference times; none for an aborted request, no phases for one that failed before a token."""
    metrics = Metrics([1000], max_len=3000)
    prompt_len, tokenizing = random.randint(1, 2000), random.uniform(0.001, 0.05)
    timer = RequestTimer(metrics, prompt_len, clock.now - tokenizing)  # handed off now, arrived earlier
    ttft = random.uniform(0.01, 2.0)
    queue_time = random.uniform(0.0, ttft)
    clock.now += ttft
    timer.observe(token(1, queue_time=queue_time))
    gaps = [random.uniform(0.001, 0.2) for _ in range(random.randint(2, 20))]
    for i, gap in enumerate(gaps, start=2):
        clock.now += gap
        timer.observe(token(i, FinishReason.EOS if i == len(gaps) + 1 else None))
    RequestTimer(metrics, 7, clock.now).observe_abort()  # aborted: counts in none of them
    RequestTimer(metrics, 9, clock.now).observe(token(0, FinishReason.ERROR))  # failed before a token

    got = samples(metrics)
    assert got["lightllm:request_prompt_tokens_count"] == 2 and got["lightllm:request_prompt_tokens_sum"] == prompt_len + 9
    assert got["lightllm:request_generation_tokens_sum"] == len(gaps) + 1
    assert got['lightllm:request_prompt_tokens_bucket{le="2000.0"}'] == 2
    assert got['lightllm:request_prompt_tokens_bucket{le="+Inf"}'] == 2
    assert got["lightllm:time_to_first_token_seconds_sum"] == pytest.approx(tokenizing + ttft)
    assert got["lightllm:request_prefill_time_seconds_count"] == 1
    assert got["lightllm:request_prefill_time_seconds_sum"] == pytest.approx(ttft - queue_time)
    assert got["lightllm:request_decode_time_seconds_sum"] == pytest.approx(sum(gaps))
    assert got["lightllm:request_inference_time_seconds_sum"] == pytest.approx(ttft - queue_time + sum(gaps))


def test_length_buckets_are_vllms_1_2_5_series():
    assert metrics_module.length_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert metrics_module.length_buckets(5) == [1, 2, 5]


def test_an_output_of_several_tokens_counts_each_interval_as_its_share(clock):
    metrics = Metrics([1000])
    timer = RequestTimer(metrics, 5, clock.now)
    clock.now += 0.5
    timer.observe(token(1))
    clock.now += 0.3
    timer.observe(token(4, FinishReason.EOS))
    got = samples(metrics)
    assert got["lightllm:generation_tokens_total"] == 4
    assert got["lightllm:time_per_output_token_seconds_count"] == 1
    assert got["lightllm:time_per_output_token_seconds_sum"] == pytest.approx(0.1)


def test_errors_and_aborts_are_finish_reasons_too(clock):
    metrics = Metrics([1000])
    failed = RequestTimer(metrics, 4, clock.now)
    failed.observe(token(1))
    failed.observe(token(2))
    # fail_all ends open requests with an error output that counts no tokens.
    failed.observe(TextOut(7, -1, "", 0.0, False, 0, FinishReason.ERROR, error="worker died"))
    aborted = RequestTimer(metrics, 4, clock.now)
    aborted.observe(token(1))
    aborted.observe_abort()
    got = samples(metrics)
    assert got['lightllm:request_success_total{finished_reason="error"}'] == 1
    assert got['lightllm:request_success_total{finished_reason="abort"}'] == 1
    assert got["lightllm:generation_tokens_total"] == 3
    assert got["lightllm:prompt_tokens_total"] == 8
    assert got["lightllm:e2e_request_latency_seconds_count"] == 1  # the aborted request has no last token


def test_every_finish_reason_is_there_from_the_start():
    got = samples(Metrics([1000]))
    for reason in FinishReason:
        assert got[f'lightllm:request_success_total{{finished_reason="{reason.value}"}}'] == 0


def test_the_routers_figures_become_gauges_and_counters():
    metrics = Metrics([1000])
    used, capacity = random.randint(0, 4000), 4000
    metrics.routers[0] = RouterStats(waiting_reqs=3, running_reqs=5, tokens_used=used, max_total_token_num=capacity,
                                 prefix_cached_tokens=11, prefix_queried_tokens=900, prefix_hit_tokens=400)
    got = samples(metrics)
    assert got["lightllm:num_requests_waiting"] == 3 and got["lightllm:num_requests_running"] == 5
    assert got["lightllm:kv_cache_usage_perc"] == pytest.approx(used / capacity)
    assert got["lightllm:kv_cache_used_tokens"] == used and got["lightllm:kv_cache_capacity_tokens"] == capacity
    assert got["lightllm:prefix_cache_tokens"] == 11
    assert got["lightllm:prefix_cache_queries_total"] == 900
    assert got["lightllm:prefix_cache_hits_total"] == 400
    types = {family.name: family.type for family in text_string_to_metric_families(metrics.render().decode())}
    assert types["lightllm:prefix_cache_hits"] == "counter" and types["lightllm:kv_cache_usage_perc"] == "gauge"


def test_each_app_has_its_own_registry():
    first, second = Metrics([10]), Metrics([10])
    first.rejected.inc()
    first.queue_full.inc(2)
    assert samples(first)["lightllm:requests_rejected_total"] == 1
    assert samples(first)["lightllm:requests_queue_full_total"] == 2
    assert samples(second)["lightllm:requests_rejected_total"] == 0
    assert samples(second)["lightllm:requests_queue_full_total"] == 0
    global_names = {family.name for family in prometheus_client.REGISTRY.collect()}
    assert not any(name.startswith("lightllm:") for name in global_names)


def test_prefix_cache_hits_are_counted_by_tier_over_replicas():
    metrics = Metrics([1000, 1000])
    for replica, (hits, host, disk, held) in enumerate([(400, 150, 40, 70), (90, 0, 0, 5)]):
        metrics.routers[replica] = RouterStats(0, 0, 0, 4000, prefix_hit_tokens=hits, replica=replica,
                                               prefix_host_hit_tokens=host, prefix_disk_hit_tokens=disk,
                                               prefix_host_tokens=held)
    got = samples(metrics)
    assert got['lightllm:prefix_cache_hits_by_tier_total{tier="host"}'] == 150 - 40
    assert got['lightllm:prefix_cache_hits_by_tier_total{tier="disk"}'] == 40
    assert got['lightllm:prefix_cache_hits_by_tier_total{tier="device"}'] == 400 + 90 - 150
    assert got["lightllm:prefix_cache_host_tokens"] == 75


def test_lora_adapters_in_use_are_labels_over_replicas(monkeypatch):
    """vLLM's lora_requests_info: the running and the waiting requests' adapters by name (one that was
    unloaded while its requests run keeps its name), --max_loras, the time of the last report."""
    loras = LoraNames(SimpleNamespace(lora_slots=4, max_lora_rank=8, lora_adapters=[("a", "/a"), ("b", "/b")]), {})
    metrics = Metrics([1000, 1000], loras)
    assert samples(metrics)['lightllm:lora_requests_info{max_lora="4",running_lora_adapters="",'
                            'waiting_lora_adapters=""}'] == pytest.approx(metrics.reported)
    loras.remove("b")
    monkeypatch.setattr(metrics_module.time, "time", lambda: 1234.5)
    metrics.report(RouterStats(0, 2, 0, 1000, replica=0, lora_running=(1,), lora_waiting=(2,)))
    metrics.report(RouterStats(1, 1, 0, 1000, replica=1, lora_running=(1, 2)))
    got = {k: v for k, v in samples(metrics).items() if k.startswith("lightllm:lora_requests_info")}
    assert got == {'lightllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",'
                   'waiting_lora_adapters="b"}': 1234.5}
    assert not any(k.startswith("lightllm:lora") for k in samples(Metrics([1000])))  # no adapters served


def test_every_family_is_in_the_api_docs():
    """docs/api.md's table under GET /metrics names every family /metrics can have (counters with
    their `_total`), with speculative decoding and LoRA adapters on."""
    loras = LoraNames(SimpleNamespace(lora_slots=2, max_lora_rank=8, lora_adapters=[("a", "/a")]), {})
    metrics = Metrics([1000], loras)
    metrics.report(RouterStats(0, 0, 0, 1000, spec_drafts=1, spec_accepted_per_pos=(1,)))
    docs = (Path(__file__).parents[1] / "docs" / "api.md").read_text().split("## GET /metrics\n", 1)[1]
    docs = docs.split("\n## ", 1)[0]
    for family in text_string_to_metric_families(metrics.render().decode()):
        if family.name.endswith("_created"):  # prometheus_client's own samples of counters and histograms
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        assert f"`{name}`" in docs, name
