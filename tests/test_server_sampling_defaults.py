"""--sampling_defaults: the OpenAI-style routes take the sampling fields a request leaves out from the
model's generation_config.json (as vLLM does), within the routes' ranges; a request's own values win;
`openai` keeps OpenAI's defaults."""

import json
import logging

import pytest

from lightllm.models import read_config
from lightllm.server.config import ServerConfig
from lightllm.server.httpserver.app import sampling_defaults
from lightllm.frontend.sampling_ranges import model_sampling_defaults
from lightllm.server.httpserver.openai_params import ChatRequest, CompletionRequest
from server_utils import start_server

QWEN_LIKE = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
             "max_new_tokens": 50}


def with_generation_config(model_dir, **fields):
    path = model_dir / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return model_dir


@pytest.fixture
def tiny_dir(tmp_path):
    """A fresh tiny preset for each test, whose generation_config.json it may change."""
    from lightllm.tools.bench_model import write_bench_model

    return write_bench_model(tmp_path / "tiny", "tiny")


def test_the_model_config_holds_the_sampling_fields_of_generation_config(tiny_dir):
    defaults = read_config(with_generation_config(tiny_dir, **QWEN_LIKE)).sampling_defaults
    assert defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def test_a_default_outside_the_ranges_is_left_out(caplog):
    with caplog.at_level(logging.WARNING):
        assert model_sampling_defaults({"temperature": 0.6, "top_p": 0.0, "top_k": -5}) == {"temperature": 0.6}
    assert "top_p=0.0 is not used as a default" in caplog.text and "top_k=-5" in caplog.text


def test_a_request_s_own_values_win_and_openai_mode_has_none():
    defaults = {"temperature": 0.7, "top_k": 20, "repetition_penalty": 1.05}
    given = CompletionRequest.model_validate({"prompt": "x", "temperature": 0, "top_k": 5}).sampling(defaults)
    assert (given.temperature, given.top_k, given.repetition_penalty) == (0, 5, 1.05)
    left_out = ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}]}).sampling(defaults)
    assert (left_out.temperature, left_out.top_k, left_out.top_p) == (0.7, 20, 1.0)
    info = {"sampling_defaults": list(defaults.items())}  # as model_info carries them
    assert sampling_defaults(ServerConfig(sampling_defaults="openai"), info) == {}
    assert sampling_defaults(ServerConfig(), info) == defaults


def test_the_server_samples_with_the_models_defaults(tiny_dir, tmp_path):
    """top_k 1 in generation_config.json: a request that gives no sampling fields is greedy on both
    routes, whatever its seed; one that asks for the whole vocabulary (top_k -1) samples."""
    model_dir = with_generation_config(tiny_dir, top_k=1, top_p=0.0)  # top_p 0 is out of range: left out
    server = start_server(["--model_dir", str(model_dir)], tmp_path / "server.log")
    try:
        def complete(**fields):
            body = {"prompt": "The capital of France is", "max_tokens": 8, "ignore_eos": True, **fields}
            return server.post("/v1/completions", body).json()["choices"][0]["text"]

        def chat(**fields):
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "ignore_eos": True, **fields}
            return server.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]

        for ask in (complete, chat):
            greedy = ask(temperature=0)
            assert [ask(seed=seed) for seed in range(3)] == [greedy] * 3
            assert ask(seed=0, top_k=-1) != greedy
        log = server.log_text()
        assert "sampling defaults of the /v1 routes from the model's generation_config.json: {'top_k': 1}" in log
        assert "top_p=0.0 is not used as a default" in log
    finally:
        assert server.stop() == 0


def test_the_offline_llm_defaults_to_the_models_sampling_too(tiny_dir):
    from lightllm import LLM, SamplingParams

    model_dir = with_generation_config(tiny_dir, top_k=1, temperature=0.7)
    limits = dict(max_total_token_num=1024, max_req_input_len=128, max_req_total_len=256)
    with LLM(model_dir, **limits) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(top_k=1, temperature=0.7)
        (greedy,) = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        (default,) = llm.generate("Hello", use_tqdm=False)  # top_k 1: greedy, whatever seed it draws
        assert default.outputs[0].token_ids == greedy.outputs[0].token_ids
    with LLM(model_dir, sampling_defaults="openai", **limits) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
