"""The tokenizer, loaded the same way by the HTTP process and the detokenizer."""

from __future__ import annotations

from lightllm.server.config import ServerConfig


def load_tokenizer(config: ServerConfig):
    from transformers import AutoTokenizer  # slow import: only the processes that tokenize pay it

    return AutoTokenizer.from_pretrained(
        config.model_dir,
        use_fast=config.tokenizer_mode != "slow",
        trust_remote_code=config.trust_remote_code,
        local_files_only=True,
    )
