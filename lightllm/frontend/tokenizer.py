"""The tokenizer, loaded the same way by the HTTP process, the detokenizer and the offline LLM."""

from __future__ import annotations

import logging

from lightllm.engine import tokenizer
from lightllm.frontend.chat.template import chat_template_text
from lightllm.frontend.config import FrontendConfig


def unchecked_length_warning(record: logging.LogRecord) -> bool:
    """False for transformers' warning that a text encodes to more tokens than the model takes:
    what uses this tokenizer checks lengths itself (--max_req_input_len: a 400 that says so), and
    the warning would read as a fault in the log of every prompt refused for its length."""
    return not str(record.msg).startswith("Token indices sequence length is longer than")


def load_tokenizer(config: FrontendConfig):
    """The model's tokenizer, with --chat_template in place of its own template where given."""
    # Only this logger and only this message: every other tokenizer warning stays in the log.
    logging.getLogger("transformers.tokenization_utils_base").addFilter(unchecked_length_warning)
    loaded = tokenizer.load_tokenizer(config.model_dir, config.tokenizer_mode, config.trust_remote_code)
    if config.chat_template is not None:
        loaded.chat_template = chat_template_text(config.chat_template)
    return loaded


def bad_words_ids(tokenizer, words: list[str]) -> list[tuple[int, ...]]:
    """vLLM's bad_words as token sequences: each word as the text's start, and as it comes mid-text
    after a space (byte-level BPE folds the space into the word's first token, "Ġlamp", where the
    bare word may split, "l" "amp"). A leading token that is only the space (SentencePiece's "▁"
    alone) is left out of the second form, so that the ban falls on the word, never on a space."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        word = word.lstrip()
        spaced = tokenizer.encode(" " + word, add_special_tokens=False)
        while len(spaced) > 1 and not tokenizer.decode(spaced[:1]).strip():
            spaced = spaced[1:]
        for ids in (tuple(tokenizer.encode(word, add_special_tokens=False)), tuple(spaced)):
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
