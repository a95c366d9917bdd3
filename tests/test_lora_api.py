"""LoRA adapters through the offline LLM and the HTTP server, on a tiny random fp32 Llama with the
default model's tokenizer: greedy tokens under each adapter equal PEFT's on transformers; the HTTP
round trip: /v1/models lists the adapters, a request names one by `model` or `adapter_id`, an
unknown name is 404, /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key) load
and unload one at run time."""

import time

import pytest
import requests
from helpers.lora import ALL_TARGETS, make_adapter, peft_greedy
from transformers import AutoTokenizer

from prometheus_client.parser import text_string_to_metric_families

from lightllm.engine.config import DEFAULT_MAX_LORAS
from lightllm.llm import LLM, LoRARequest, SamplingParams
from lightllm.tools.bench_model import write_bench_model
from server_utils import start_server

NEW_TOKENS = 6
KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "the river stone light runs over"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, {name: adapter dir}, prompt ids, {name or None: PEFT's greedy tokens})."""
    model_dir = write_bench_model(tmp_path_factory.mktemp("tiny"), "tiny")
    adapters = {"a": make_adapter(model_dir, tmp_path_factory.mktemp("a"), 8, 16, ALL_TARGETS, seed=1),
                "b": make_adapter(model_dir, tmp_path_factory.mktemp("b"), 4, 8, ["q_proj", "down_proj"], True, seed=2)}
    ids = AutoTokenizer.from_pretrained(model_dir).encode(PROMPT)
    expected = {name: peft_greedy(model_dir, path, [ids], NEW_TOKENS)[0] for name, path in [(None, None),
                                                                                            *adapters.items()]}
    assert len({tuple(e) for e in expected.values()}) == 3, "an adapter changes nothing: the test would not see it"
    return model_dir, adapters, ids, expected


def test_offline_lora_request_matches_peft(tiny):
    """One adapter from lora_modules, one loaded by the first request that names it, beside the base."""
    model_dir, adapters, ids, expected = tiny
    with LLM(model_dir, max_total_token_num=512, max_req_input_len=64, max_req_total_len=128, max_lora_rank=8,
             running_max_req_size=8, chunked_prefill_size=64, lora_modules=(f"a={adapters['a']}",)) as llm:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        loras = [None, LoRARequest("a", 1, str(adapters["a"])), LoRARequest("b", 2, str(adapters["b"]))]
        outs = llm.generate([{"prompt_token_ids": ids}] * 3, params, use_tqdm=False, lora_request=loras)
        assert [o.outputs[0].token_ids for o in outs] == [expected[None], expected["a"], expected["b"]]
        with pytest.raises(ValueError, match="has no adapter_config.json"):  # a model, not an adapter
            llm.generate([ids], params, lora_request=LoRARequest("not_one", 3, str(model_dir)))


def tokens(server, adapter: str | None) -> list[int]:
    parameters = {"max_new_tokens": NEW_TOKENS, "details": True, "ignore_eos": True}
    if adapter is not None:
        parameters["adapter_id"] = adapter
    response = requests.post(f"{server.url}/generate", json={"inputs": PROMPT, "parameters": parameters},
                             headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["details"]["tokens"]]


def post(server, path: str, body: dict, headers=AUTH) -> requests.Response:
    return requests.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def model_ids(server) -> list[str]:
    return [m["id"] for m in requests.get(f"{server.url}/v1/models", headers=AUTH, timeout=10).json()["data"]]


def lora_info(server) -> dict:
    """The labels of /metrics' lightllm:lora_requests_info."""
    text = requests.get(f"{server.url}/metrics", headers=AUTH, timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (sample,) = families["lightllm:lora_requests_info"].samples
    return sample.labels


def wait_for_lora_info(server, key: str, value: str, timeout_s: float = 10.0) -> None:
    """Until the router's reports (every 50 ms at most while busy) show `value` under label `key`."""
    deadline = time.monotonic() + timeout_s
    while (got := lora_info(server)[key]) != value:
        assert time.monotonic() < deadline, f"{key} = {got!r}, not {value!r}"
        time.sleep(0.05)


def test_http_adapters_load_and_unload(tiny, tmp_path_factory):
    model_dir, adapters, ids, expected = tiny
    args = ["--model_dir", str(model_dir), "--lora_modules", f"a={adapters['a']}", "--max_lora_rank", "8",
            "--api_key", KEY, "--max_total_token_num", "8192", "--max_req_total_len", "8192", "--served_model_name", "base",
            "--running_max_req_size", "8", "--chunked_prefill_size", "64"]  # a small start-up profile step
    server = start_server(args, tmp_path_factory.mktemp("lora_server") / "server.log")
    try:
        assert model_ids(server) == ["base", "a"]
        assert tokens(server, None) == expected[None] and tokens(server, "a") == expected["a"]
        wait_for_lora_info(server, "running_lora_adapters", "")  # the router's report comes apart from the answer
        assert lora_info(server) == {"max_lora": str(DEFAULT_MAX_LORAS), "running_lora_adapters": "", "waiting_lora_adapters": ""}
        # Tens of seconds of tokens (~3 ms each on a CPU): it still runs however late a loaded machine's
        # HTTP process hands over its first line (the router does not wait for the client); closing
        # the stream aborts it.
        long = {"inputs": PROMPT, "parameters": {"max_new_tokens": 8000, "ignore_eos": True, "adapter_id": "a"}}
        with requests.post(f"{server.url}/generate_stream", json=long, headers=AUTH, stream=True, timeout=60) as stream:
            lines = stream.iter_lines()  # kept: a dropped line iterator may close the connection (an abort)
            next(lines)  # its first token: it runs
            wait_for_lora_info(server, "running_lora_adapters", "a")
        wait_for_lora_info(server, "running_lora_adapters", "")
        hi = [{"role": "user", "content": "hi"}]
        for path, body in [("/v1/chat/completions", {"model": "a", "max_tokens": 2, "messages": hi}),
                           ("/v1/messages", {"model": "a", "max_tokens": 2, "messages": hi}),
                           ("/v1/responses", {"model": "a", "max_output_tokens": 2, "input": "hi"})]:
            answer = post(server, path, body)
            assert answer.status_code == 200 and answer.json()["model"] == "a", (path, answer.text)
        for path, body in [("/v1/completions", {"model": "b", "prompt": "x"}),
                           ("/v1/messages", {"model": "b", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}),
                           ("/generate", {"inputs": "x", "parameters": {"adapter_id": "b"}})]:
            refused = post(server, path, body)
            assert refused.status_code == 404 and "'b' does not exist" in refused.text, (path, refused.text)

        load = {"lora_name": "b", "lora_path": str(adapters["b"])}
        assert post(server, "/v1/load_lora_adapter", load, headers={}).status_code == 401
        bad = post(server, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(model_dir)})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"], bad.text
        assert post(server, "/v1/load_lora_adapter", load).status_code == 200
        assert post(server, "/v1/load_lora_adapter", load).status_code == 400  # the name is taken
        assert model_ids(server) == ["base", "a", "b"]
        assert tokens(server, "b") == expected["b"] and tokens(server, "a") == expected["a"]

        assert post(server, "/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 200
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 404
        assert model_ids(server) == ["base", "a"]
        assert post(server, "/generate", {"inputs": "x", "parameters": {"adapter_id": "b"}}).status_code == 404
        assert post(server, "/v1/load_lora_adapter", load).status_code == 200  # again, under a new id
        assert tokens(server, "b") == expected["b"]
    finally:
        assert server.stop() == 0
