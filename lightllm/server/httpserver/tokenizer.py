"""The tokenizer, loaded the same way by the HTTP process and the detokenizer."""

from __future__ import annotations

from lightllm.engine import tokenizer
from lightllm.server.config import ServerConfig


def load_tokenizer(config: ServerConfig):
    return tokenizer.load_tokenizer(config.model_dir, config.tokenizer_mode, config.trust_remote_code)
