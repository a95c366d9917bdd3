"""The tokenizer, loaded one way by every process that needs one: the HTTP process and the
detokenizer (through lightllm/frontend/tokenizer.py), and a model runner's structured
output (grammar.py), so that --tokenizer_mode and --trust_remote_code reach all of them."""

from __future__ import annotations


def load_tokenizer(model_dir: str, tokenizer_mode: str = "auto", trust_remote_code: bool = False):
    from transformers import AutoTokenizer  # slow import: only the processes that tokenize pay it

    return AutoTokenizer.from_pretrained(
        model_dir,
        use_fast=tokenizer_mode != "slow",
        trust_remote_code=trust_remote_code,
        local_files_only=True,
    )
