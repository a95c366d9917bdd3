"""HTTP side of the serving benchmark: send sampled requests to the server and time them.

Every request ignores EOS and asks for exactly its reference output length, so that a run's
token counts are fixed by the sample and the server cannot finish early; on /generate_stream
it is greedy. Requests go out all at once (rate inf) or at seeded arrival times (`arrival_offsets`:
our own Poisson process, or vLLM's `bench serve` one replayed), at most `max_concurrency` in
flight when given. A multi-turn run starts its conversations that way; each conversation sends
its next turn when the previous answer is back.

`api="completions"` sends each request as vLLM's `bench serve --backend vllm` does: a streamed
/v1/completions body with `max_tokens`, `ignore_eos`, usage in the last chunk and no temperature
unless one is given (the server's default then applies: OpenAI's 1.0, or the model's
generation_config.json), and times it the same way: TTFT at the first chunk that has a choice
(its text may be empty), an ITL between every two such chunks, the token count from the usage.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import multiprocessing
import random
import resource
import time
from typing import AsyncIterator, Callable

import aiohttp
import numpy as np
from tqdm.asyncio import tqdm

from benchmark.lib.prefix_workloads import next_history, turn_prompt
from benchmark.lib.serving_metrics import PREFIX_CACHE_COUNTERS, RequestResult, fail_if_short, unlabelled_samples
from benchmark.lib.sharegpt import SampledRequest

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 6 * 3600.0


def payload(request: SampledRequest, max_new_tokens: int | None = None) -> dict:
    parameters = {
        "max_new_tokens": max_new_tokens or request.output_len,
        "ignore_eos": True,
        "do_sample": False,
    }
    if request.adapter is not None:
        parameters["adapter_id"] = request.adapter
    return {"inputs": request.prompt, "parameters": parameters}


async def error_text(response: aiohttp.ClientResponse) -> str:
    body = await response.text()
    try:
        message = json.loads(body).get("error", body)
    except (ValueError, AttributeError):
        message = body
    return f"HTTP {response.status}: {str(message)[:300]}"


async def post_generate(session: aiohttp.ClientSession, url: str, body: dict, result: RequestResult) -> None:
    async with session.post(f"{url}/generate", json=body) as response:
        if response.status != 200:
            result.error = await error_text(response)
            return
        data = await response.json(content_type=None)
        result.output_len = data["count_output_tokens"]
        result.output_text = data["generated_text"][0]
        result.success = True


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    async for raw in response.content:
        text = raw.decode("utf-8").strip()
        if text.startswith("data:") and text[5:].strip() != "[DONE]":
            yield json.loads(text[5:])


async def post_generate_stream(session: aiohttp.ClientSession, url: str, body: dict, result: RequestResult) -> None:
    start = time.perf_counter()
    async with session.post(f"{url}/generate_stream", json=body) as response:
        if response.status != 200:
            result.error = await error_text(response)
            return
        last = start
        async for event in sse_events(response):
            if event.get("error"):
                result.error = f"stream error: {event['error']}"
                return
            if event.get("token") is not None:
                now = time.perf_counter()
                if result.output_len == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                result.output_len += 1
                result.output_ids.append(event["token"]["id"])
            if event.get("finished"):
                result.output_text = event.get("generated_text") or ""
                result.success = True
                return
        result.error = "stream ended without a finished event"


def completions_payload(request: SampledRequest, temperature: float | None = None) -> dict:
    """vLLM's `bench serve --backend vllm --ignore-eos` body; no temperature unless given."""
    body = {"prompt": request.prompt, "max_tokens": request.output_len, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "repetition_penalty": 1.0, "logprobs": None}
    if request.adapter is not None:
        body["model"] = request.adapter
    if temperature is not None:
        body["temperature"] = temperature
    return body


async def post_completions_stream(session: aiohttp.ClientSession, url: str, body: dict,
                                  result: RequestResult) -> None:
    """/v1/completions, streamed, timed as vLLM's client times it: TTFT at the first chunk with a
    choice (even one of empty text), ITL between such chunks, the token count from the usage."""
    await post_openai_stream(session, f"{url}/v1/completions", body, result, lambda choice: choice.get("text") or "")


async def post_openai_stream(session: aiohttp.ClientSession, endpoint: str, body: dict, result: RequestResult,
                             chunk_text) -> None:
    """An OpenAI route's stream into `result`: `chunk_text(choice)` is a chunk's output text, or
    None for a chunk that carries none (no TTFT, no ITL); the token count comes from the usage."""
    start = last = time.perf_counter()
    async with session.post(endpoint, json=body) as response:
        if response.status != 200:
            result.error = await error_text(response)
            return
        pieces, finished = [], False
        async for event in sse_events(response):
            if event.get("error"):
                result.error = f"stream error: {event['error']}"
                return
            result.output_len = (event.get("usage") or {}).get("completion_tokens", result.output_len)
            for choice in event.get("choices") or ():
                text = chunk_text(choice)
                if text is not None:
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    pieces.append(text)
                finished = finished or choice.get("finish_reason") is not None
        result.output_text = "".join(pieces)
        result.success = finished
        result.error = "" if finished else "stream ended without a finish reason"


async def send(session: aiohttp.ClientSession, url: str, request: SampledRequest, stream: bool,
               api: str = "generate", temperature: float | None = None) -> RequestResult:
    result = RequestResult(request.prompt_len, request.output_len)
    if api == "completions":
        post, body = post_completions_stream, completions_payload(request, temperature)
    else:
        post, body = post_generate_stream if stream else post_generate, payload(request)
    result.sent_at = time.time()
    start = time.perf_counter()
    try:
        await post(session, url, body, result)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
        result.success = False
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency = time.perf_counter() - start
    return fail_if_short(result)


ARRIVALS = ("own", "vllm")


def arrival_offsets(count: int, request_rate: float, seed: int, arrival: str = "own",
                    burstiness: float = 1.0) -> list[float]:
    """Seconds after the run's start at which each request goes out (all 0 at an infinite rate).
    Gaps have mean 1 / rate and a gamma shape of `burstiness` (1: exponential, Poisson arrivals;
    below 1 burstier, above 1 more regular).
      own   the first request at 0, then gaps drawn from random.Random(seed)
      vllm  vLLM's `bench serve` times for its --seed: numpy's legacy generator seeded with it
            (the one its `np.random.seed` seeds) draws every gap, the first one too, and the
            sums are scaled so that the last request goes out at count / rate exactly"""
    if not math.isfinite(request_rate) or count == 0:
        return [0.0] * count
    if request_rate <= 0 or burstiness <= 0 or arrival not in ARRIVALS:
        raise ValueError(f"arrivals: want a positive rate and burstiness and one of {ARRIVALS}, got "
                         f"{request_rate}, {burstiness}, {arrival!r}")
    scale = 1.0 / (request_rate * burstiness)
    if arrival == "own":
        rng = random.Random(seed)
        draw = (lambda: rng.expovariate(request_rate)) if burstiness == 1 else (lambda: rng.gammavariate(burstiness, scale))
        return list(itertools.accumulate((draw() for _ in range(count - 1)), initial=0.0))
    times = np.cumsum(np.random.RandomState(seed).gamma(burstiness, scale, size=count))
    return (times * (count / request_rate / times[-1])).tolist()


async def arrivals(offsets: list[float]) -> AsyncIterator[int]:
    """Yield request indices at their offsets from the first call (late ones at once, in order)."""
    start = time.perf_counter()
    for index, offset in enumerate(offsets):
        wait = start + offset - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        yield index


def raise_open_file_limit() -> None:
    """Every in-flight request holds a socket; the default soft limit (often 1024) is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Sender:
    """One HTTP session, one limit on requests in flight, one progress bar."""

    def __init__(self, url: str, stream: bool, max_concurrency: int | None, timeout_s: float, total: int,
                 progress: bool, api: str = "generate", temperature: float | None = None):
        self.url, self.stream, self.api, self.temperature = url, stream, api, temperature
        self.limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        connector = aiohttp.TCPConnector(limit=max_concurrency or 0)  # 0: no pool cap
        self.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s))
        self.bar = tqdm(total=total, desc="requests", disable=not progress)

    async def send(self, request: SampledRequest) -> RequestResult:
        return await self.limited(lambda: send(self.session, self.url, request, self.stream, self.api, self.temperature))

    async def limited(self, start_one) -> RequestResult:
        """`start_one()` awaited within the limit on requests in flight."""
        if self.limit is None:
            result = await start_one()
        else:
            async with self.limit:
                result = await start_one()
        self.bar.update(1)
        return result

    async def close(self) -> None:
        await self.session.close()
        self.bar.close()


async def run_requests(
    url: str,
    requests: list[SampledRequest],
    stream: bool,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    progress: bool = True,
    arrival: str = "own",
    burstiness: float = 1.0,
    api: str = "generate",
    temperature: float | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every request; return their results (in request order) and the wall time. `arrival`
    and `burstiness`: arrival_offsets'; `api` "completions": vLLM's client's body and timing
    (streamed whatever `stream` says), with `temperature` when given."""
    raise_open_file_limit()
    sender = Sender(url, stream, max_concurrency, timeout_s, len(requests), progress, api, temperature)
    offsets = arrival_offsets(len(requests), request_rate, seed, arrival, burstiness)
    return await send_at_arrivals(sender, offsets, lambda i: sender.send(requests[i]))


def run_requests_in_processes(
    url: str,
    requests: list[SampledRequest],
    stream: bool,
    processes: int,
    request_rate: float = math.inf,
    seed: int = 0,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[list[RequestResult], float, float]:
    """run_requests from `processes` client processes, so that one Python process's parsing of
    every stream does not cap what is measured (a process near 100% of a core: see the CPU
    seconds this returns). Request i goes to process i mod `processes`; at a finite rate each
    sends its share at rate/processes (together: Poisson arrivals at the rate). They start
    together (a barrier); returns the results in request order, the wall time from the first
    start to the last end, and the client processes' CPU seconds."""
    if processes <= 1:
        before = resource.getrusage(resource.RUSAGE_SELF)
        results, duration = asyncio.run(run_requests(url, requests, stream, request_rate, seed=seed, timeout_s=timeout_s))
        after = resource.getrusage(resource.RUSAGE_SELF)
        return results, duration, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    context = multiprocessing.get_context("spawn")
    barrier, out = context.Barrier(processes), context.Queue()
    shares = [list(range(k, len(requests), processes)) for k in range(processes)]
    workers = [context.Process(target=_send_share, daemon=True,
                               args=(k, url, [requests[i] for i in share], stream, request_rate / processes, seed + k,
                                     timeout_s, barrier, out)) for k, share in enumerate(shares)]
    for worker in workers:
        worker.start()
    try:
        done = [out.get(timeout=timeout_s + 120) for _ in workers]  # before join: the queue's pipe must drain
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
    results: list[RequestResult | None] = [None] * len(requests)
    for k, start, end, cpu, share_results in done:
        for i, result in zip(shares[k], share_results):
            results[i] = result
    duration = max(end for _, _, end, _, _ in done) - min(start for _, start, _, _, _ in done)
    return results, duration, sum(cpu for _, _, _, cpu, _ in done)


def _send_share(k: int, url: str, requests: list[SampledRequest], stream: bool, request_rate: float, seed: int,
                timeout_s: float, barrier, out) -> None:
    barrier.wait()
    start = time.time()
    results, duration = asyncio.run(run_requests(url, requests, stream, request_rate, seed=seed, timeout_s=timeout_s,
                                                 progress=k == 0))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out.put((k, start, start + duration, usage.ru_utime + usage.ru_stime, results))


async def send_at_arrivals(sender: Sender, offsets: list[float], start_one) -> tuple[list, float]:
    """Start `start_one(i)` for each i at its offset (seconds from now); their results in that
    order and the wall time. Closes the sender."""
    try:
        start = time.perf_counter()
        tasks = [asyncio.create_task(start_one(i)) async for i in arrivals(offsets)]
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start
    finally:
        await sender.close()


async def converse(
    sender: Sender, messages: list[str], output_len: int, count_tokens: Callable[[str], list[int]]
) -> list[RequestResult]:
    """Send the turns one after another, each with the history so far and its answer."""
    history, results = "", []
    for turn, message in enumerate(messages):
        prompt = turn_prompt(history, message)
        result = await sender.send(SampledRequest(prompt, count_tokens(prompt), output_len))
        results.append(result)
        if not result.success:  # the later turns would resend a history that never happened
            skipped = len(messages) - turn - 1
            results += [RequestResult(0, output_len, error=f"not sent: turn {turn + 1} failed") for _ in range(skipped)]
            sender.bar.update(skipped)
            break
        history = next_history(prompt, result.output_text)
    return results


async def run_conversations(
    url: str,
    conversations: list[list[str]],
    output_len: int,
    count_tokens: Callable[[str], list[int]],
    stream: bool,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    progress: bool = True,
) -> tuple[list[RequestResult], float]:
    """Replay every conversation (starts at the arrival times); return every turn's result
    (conversation by conversation, turn by turn) and the wall time."""
    raise_open_file_limit()
    total = sum(len(messages) for messages in conversations)
    sender = Sender(url, stream, max_concurrency, timeout_s, total, progress)
    results, duration = await send_at_arrivals(
        sender, arrival_offsets(len(conversations), request_rate, seed),
        lambda i: converse(sender, conversations[i], output_len, count_tokens))
    return [result for turns in results for result in turns], duration


def chat_payload(messages: list[dict], max_tokens: int) -> dict:
    """A greedy streamed chat request that stops at EOS, its usage (token count) in the last chunk."""
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}


async def post_chat_stream(session: aiohttp.ClientSession, url: str, body: dict, result: RequestResult) -> None:
    """/v1/chat/completions, streamed: TTFT at the first text, ITL between chunks (a chunk may carry
    several tokens), the token count from the usage chunk."""
    await post_openai_stream(session, f"{url}/v1/chat/completions", body, result,
                             lambda choice: (choice.get("delta") or {}).get("content") or None)


async def send_chat(session: aiohttp.ClientSession, url: str, messages: list[dict], max_tokens: int) -> RequestResult:
    result = RequestResult(0, max_tokens)
    result.sent_at = time.time()
    start = time.perf_counter()
    try:
        await post_chat_stream(session, url, chat_payload(messages, max_tokens), result)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
        result.success, result.error = False, f"{type(exc).__name__}: {exc}"
    result.latency = time.perf_counter() - start
    return result


async def run_chats(url: str, chats: list[tuple[list[dict], int]], max_concurrency: int | None = None,
                    timeout_s: float = DEFAULT_TIMEOUT_S, progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send every (messages, max_tokens) chat at once, at most `max_concurrency` in flight; their
    results in order and the wall time. Greedy, ending at EOS: a result has the length it has."""
    raise_open_file_limit()
    sender = Sender(url, True, max_concurrency, timeout_s, len(chats), progress)
    return await send_at_arrivals(sender, [0.0] * len(chats),
                                  lambda i: sender.limited(lambda: send_chat(sender.session, url, *chats[i])))


async def read_prefix_cache_counters(url: str) -> dict[str, float]:
    """The prefix-cache counters on the server's /metrics; empty when it has none (or no /metrics)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with session.get(f"{url}/metrics") as response:
                if response.status != 200:
                    logger.warning("GET /metrics answered %d: no prefix-cache counters", response.status)
                    return {}
                text = await response.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        logger.warning("GET /metrics failed (%s): no prefix-cache counters", exc)
        return {}
    counters = unlabelled_samples(text, PREFIX_CACHE_COUNTERS.values())
    if len(counters) < len(PREFIX_CACHE_COUNTERS):
        logger.info("/metrics has no prefix-cache counters (%s)", ", ".join(PREFIX_CACHE_COUNTERS.values()))
    return counters


async def warm_up(url: str, requests: list[SampledRequest], max_new_tokens: int = 16) -> None:
    """Send a few short streamed requests together; raise if any of them fails."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        short = [SampledRequest(r.prompt, r.prompt_ids, min(r.output_len, max_new_tokens)) for r in requests]
        results = await asyncio.gather(*(send(session, url, r, stream=True) for r in short))
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} warm-up requests failed, first: {failed[0]}")
    logger.info("warm-up: %d requests succeeded", len(results))
