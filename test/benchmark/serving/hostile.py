"""The soak's hostile mix: tool calls, forced calls, structured output, large schemas,
slow clients and clients that hang up mid-body or mid-stream. Each request returns
(outcome, detail) like soak.py's own; the statuses it saw go to `seen()` (the HTTP ones through
`trace_config()`, the raw sockets' by hand) so that the report counts every non-2xx by route.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import random
import urllib.parse

import aiohttp

SEEN: contextvars.ContextVar[list] = contextvars.ContextVar("seen")  # (route, status) of the request running
LARGE_SCHEMA_PROPERTIES = 400  # about 60 KB of schema
REF_CHAIN_LENGTH = 300
SLOW_BODY_BYTES = 4096  # what Content-Length promises; 16 bytes of it are sent
SLOW_GRACE_S = 15.0  # how long past the server's receive bound a slow client waits for its answer


def seen() -> list:
    return SEEN.get()


def trace_config() -> aiohttp.TraceConfig:
    async def on_end(session, context, params):
        seen().append((params.url.path, params.response.status))

    config = aiohttp.TraceConfig()
    config.on_request_end.append(on_end)
    return config


def tool(name: str, properties: dict) -> dict:
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    return {"type": "function", "function": {"name": name, "description": f"{name} for the user", "parameters": schema}}


TOOLS = [
    tool("get_weather", {"city": {"type": "string"}}),
    tool("add", {"a": {"type": "integer"}, "b": {"type": "integer"}}),
    tool("search", {"query": {"type": "string"}, "limit": {"type": "integer"}}),
]
SMALL_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"]}


def large_schema(properties: int = LARGE_SCHEMA_PROPERTIES) -> dict:
    props = {f"field_{i:04d}": {"type": "string", "description": f"the value number {i} of this record, free text " * 2}
             for i in range(properties)}
    return {"type": "object", "properties": props, "required": list(props)[:3]}


def ref_chain(length: int = REF_CHAIN_LENGTH) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(length)}
    defs[f"d{length}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def chat(rng: random.Random, text: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": rng.randint(4, 24), **fields}


def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


async def post_expecting(session, url: str, path: str, body: dict, accepted: tuple[int, ...]) -> tuple[str, str]:
    async with session.post(f"{url}{path}", json=body) as reply:
        text = await reply.text()
        if reply.status not in accepted:
            return "unexpected", f"{path}: {reply.status} {text[:200]}"
        return ("ok", "") if reply.status == 200 else ("rejected", "")


async def tool_auto(session, url, rng):
    body = chat(rng, "What is the weather in Paris?", tools=TOOLS, tool_choice="auto")
    return await post_expecting(session, url, "/v1/chat/completions", body, (200,))


async def tool_required(session, url, rng):
    body = chat(rng, "Add two and three.", tools=TOOLS, tool_choice="required")
    return await post_expecting(session, url, "/v1/chat/completions", body, (200,))


MODEL_NAMES: dict[str, str] = {}  # url: the name /v1/models gives, which /v1/messages requires


async def served_model(session, url: str) -> str:
    if url not in MODEL_NAMES:
        async with session.get(f"{url}/v1/models") as reply:
            MODEL_NAMES[url] = (await reply.json())["data"][0]["id"]
    return MODEL_NAMES[url]


async def messages_any(session, url, rng):
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    body = {"model": await served_model(session, url), "messages": [{"role": "user", "content": "Search for rivers."}],
            "max_tokens": rng.randint(4, 24), "tools": tools, "tool_choice": {"type": "any"}}
    return await post_expecting(session, url, "/v1/messages", body, (200,))


async def structured(session, url, rng):
    body = chat(rng, "Give a name and an age.", response_format=json_format(SMALL_SCHEMA))
    return await post_expecting(session, url, "/v1/chat/completions", body, (200,))


async def large_schema_request(session, url, rng):
    # a size bound on grammars may refuse it: 400 is an answer, a 5xx or a hang is not
    body = chat(rng, "Fill the record.", response_format=json_format(large_schema()))
    return await post_expecting(session, url, "/v1/chat/completions", body, (200, 400))


async def ref_chain_request(session, url, rng):
    body = chat(rng, "Say a word.", response_format=json_format(ref_chain()))
    return await post_expecting(session, url, "/v1/chat/completions", body, (200, 400))


async def leave_mid_stream(session, url: str, path: str, body: dict, rng) -> tuple[str, str]:
    """Read 1-5 events of a stream, then go away (the soak's aborted streams use it too)."""
    async with session.post(f"{url}{path}", json=body) as reply:
        if reply.status != 200:
            return "unexpected", f"{reply.status} {await reply.text()}"
        events, wanted = 0, rng.randint(1, 5)
        async for line in reply.content:
            events += line.startswith(b"data:")
            if events >= wanted:
                reply.close()  # the client goes away mid-stream
                return "aborted", ""
    return "unexpected", "the stream ended before the client left"


async def chat_stream_dropped(session, url, rng):
    body = chat(rng, "Tell a long story.", stream=True, max_tokens=1000)
    return await leave_mid_stream(session, url, "/v1/chat/completions", body, rng)


# ---- raw sockets ----


def request_head(url: str, path: str, content_length: int) -> list[bytes]:
    host = urllib.parse.urlsplit(url).netloc
    return [f"POST {path} HTTP/1.1\r\n".encode(), f"Host: {host}\r\n".encode(),
            b"Content-Type: application/json\r\n", f"Content-Length: {content_length}\r\n".encode(), b"\r\n"]


async def open_raw(url: str):
    parts = urllib.parse.urlsplit(url)
    return await asyncio.open_connection(parts.hostname, parts.port)


async def answer_status(reader: asyncio.StreamReader, timeout_s: float) -> str:
    """The status the server answered with, "closed" if it closed without one, "none" if silent."""
    try:
        async with asyncio.timeout(timeout_s):
            line = await reader.readline()
    except TimeoutError:
        return "none"
    except ConnectionError:
        return "closed"
    fields = line.split()
    return fields[1].decode() if len(fields) > 1 else "closed"


def slow_outcome(route: str, status: str) -> tuple[str, str]:
    seen().append((route, status))
    if status in ("408", "closed"):
        return "rejected", ""
    return "unexpected", f"{route}: a slow client got {status} (408 or a closed socket expected)"


async def short_body(url, rng, receive_timeout_s: float):
    """A Content-Length larger than the body, then silence."""
    reader, writer = await open_raw(url)
    try:
        writer.writelines([*request_head(url, "/generate", SLOW_BODY_BYTES), b'{"inputs": "a",'])
        await writer.drain()
        status = await answer_status(reader, receive_timeout_s + SLOW_GRACE_S)
    finally:
        writer.close()
    return slow_outcome("/generate (short body)", status)


async def headers_line_by_line(url, rng, receive_timeout_s: float):
    """Header lines one a second, never ending: the server must answer or close within its bound."""
    reader, writer = await open_raw(url)
    status = "none"
    try:
        writer.writelines(request_head(url, "/generate", 20)[:2])
        for i in range(int(receive_timeout_s + SLOW_GRACE_S)):
            writer.write(f"X-Slow-{i}: {i}\r\n".encode())
            await writer.drain()
            status = await answer_status(reader, 1.0)
            if status != "none":
                break
    except ConnectionError:
        status = "closed"
    finally:
        writer.close()
    return slow_outcome("/generate (slow headers)", status)


async def hang_up_mid_body(url, rng, receive_timeout_s: float):
    body = json.dumps({"inputs": "a river " * 200, "parameters": {"max_new_tokens": 8}}).encode()
    reader, writer = await open_raw(url)
    writer.writelines([*request_head(url, "/generate", len(body)), body[: rng.randint(1, len(body) - 1)]])
    await writer.drain()
    writer.close()
    return "aborted", ""


SOCKET_MIX = {"short_body": (short_body, 1), "slow_headers": (headers_line_by_line, 1),
              "hang_up_mid_body": (hang_up_mid_body, 2)}

HTTP_MIX = {
    "tool_auto": (tool_auto, 2),
    "tool_required": (tool_required, 2),
    "messages_any": (messages_any, 1),
    "structured": (structured, 2),
    "large_schema": (large_schema_request, 1),
    "ref_chain": (ref_chain_request, 1),
    "chat_stream_dropped": (chat_stream_dropped, 1),
}
