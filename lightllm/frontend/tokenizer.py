"""The tokenizer, loaded the same way by the HTTP process, the detokenizer and the offline LLM."""

from __future__ import annotations

from lightllm.engine import tokenizer
from lightllm.frontend.chat.template import chat_template_text
from lightllm.frontend.config import FrontendConfig


def load_tokenizer(config: FrontendConfig):
    """The model's tokenizer, with --chat_template in place of its own template where given."""
    loaded = tokenizer.load_tokenizer(config.model_dir, config.tokenizer_mode, config.trust_remote_code)
    if config.chat_template is not None:
        loaded.chat_template = chat_template_text(config.chat_template)
    return loaded
