"""--chat_template: a model without a chat template serves the chat routes with the one given
(a file or the template's text), the rendered prompt is the template's own (jinja2 renders the
oracle), and a template that cannot work is refused at start."""

import json

import jinja2
import pytest
from transformers import AutoTokenizer

from lightllm.frontend.chat.template import ChatTemplateError, chat_template_text, render_chat
from lightllm.server.config import ServerConfig, parse_config
from lightllm.frontend.tokenizer import load_tokenizer
from server_utils import start_server

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role | upper }}: {{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>ASSISTANT: {% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is AI?"}]
# A request's own template (vLLM's chat_template field), unlike the server's
OTHER = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory):
    """The tiny preset with its chat template taken out (as a base model ships)."""
    from lightllm.tools.bench_model import write_bench_model

    model_dir = write_bench_model(tmp_path_factory.mktemp("bare"), "tiny")
    (model_dir / "chat_template.jinja").unlink()
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    return model_dir


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


def test_a_file_or_the_text_gives_the_template(template_file):
    assert chat_template_text(str(template_file)) == TEMPLATE
    assert chat_template_text(TEMPLATE) == TEMPLATE


@pytest.mark.parametrize("value, message", [
    ("no_such_template.jinja", "is neither a file nor a template's text"),
    ("{% for m in messages %}{{ m.content }}", "does not parse"),
    ("{{ messages[0].content }", "does not parse"),
])
def test_a_template_that_cannot_work_is_refused_at_start(value, message, capsys):
    with pytest.raises(ValueError, match=message):
        chat_template_text(value)
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--chat_template", value])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_flag_replaces_the_models_template_in_every_renderer(bare_model, template_file):
    plain = load_tokenizer(ServerConfig(model_dir=str(bare_model)))
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        render_chat(plain, CHAT)
    given = load_tokenizer(ServerConfig(model_dir=str(bare_model), chat_template=str(template_file)))
    expected = jinja2.Template(TEMPLATE).render(messages=CHAT, add_generation_prompt=True)
    assert render_chat(given, CHAT) == expected


def test_the_server_chats_with_the_given_template(bare_model, template_file, tmp_path):
    """--chat_template's template on every chat, and with --trust_request_chat_template a
    request's own in its place (vLLM's field): the prompt is that template's, each time."""
    server = start_server(["--model_dir", str(bare_model), "--chat_template", str(template_file),
                           "--trust_request_chat_template"], tmp_path / "server.log")
    try:
        tokenizer = AutoTokenizer.from_pretrained(bare_model, local_files_only=True)
        for own in (None, OTHER, None):  # a request's template is its own: the next one's is the server's
            extra = {} if own is None else {"chat_template": own}
            rendered = jinja2.Template(own or TEMPLATE).render(messages=CHAT, add_generation_prompt=True)
            ids = tokenizer.encode(rendered, add_special_tokens=False)
            tokenized = server.post("/tokenize", {"messages": CHAT, **extra})
            assert tokenized.status_code == 200 and tokenized.json()["tokens"] == ids
            chat = server.post("/v1/chat/completions", {"messages": CHAT, "temperature": 0, "max_tokens": 6,
                                                        "ignore_eos": True, **extra})
            completion = server.post("/v1/completions", {"prompt": ids, "temperature": 0, "max_tokens": 6,
                                                         "ignore_eos": True})
            assert chat.status_code == completion.status_code == 200, (chat.text, completion.text)
            assert chat.json()["usage"]["prompt_tokens"] == len(ids)
            assert chat.json()["choices"][0]["message"]["content"] == completion.json()["choices"][0]["text"]
        broken = server.post("/v1/chat/completions", {"messages": CHAT, "chat_template": "{% for m in messages %}"})
        assert broken.status_code == 400 and "'chat_template' does not parse" in broken.json()["error"]["message"]
    finally:
        assert server.stop() == 0


def test_a_requests_template_needs_the_servers_trust(default_server):
    chat = default_server.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "chat_template": OTHER})
    assert chat.status_code == 400 and "--trust_request_chat_template" in chat.json()["error"]["message"], chat.text
    tokenized = default_server.post("/tokenize", {"messages": CHAT, "chat_template": OTHER})
    assert tokenized.status_code == 400 and "--trust_request_chat_template" in tokenized.text


def test_the_offline_llm_takes_it_too(bare_model):
    from lightllm import LLM, SamplingParams

    with LLM(bare_model, chat_template=TEMPLATE, max_total_token_num=1024, max_req_input_len=128,
             max_req_total_len=256) as llm:
        (out,) = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        (own,) = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False, chat_template=OTHER)
        with pytest.raises(ValueError, match="chat_template does not parse"):
            llm.chat(CHAT, use_tqdm=False, chat_template="{{ messages[0].content }")
    assert out.prompt == jinja2.Template(TEMPLATE).render(messages=CHAT, add_generation_prompt=True)
    assert own.prompt == jinja2.Template(OTHER).render(messages=CHAT, add_generation_prompt=True)
