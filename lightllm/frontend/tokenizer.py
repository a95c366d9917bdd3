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


def bad_word_forms(words: list[str]) -> list[str]:
    """The texts whose token ids bad_words_ids reads: each word as the text's start, then after a space."""
    return [form for word in words for form in (word.lstrip(), " " + word.lstrip())]


def bad_words_ids(tokenizer, encoded: list[list[int]]) -> list[tuple[int, ...]]:
    """vLLM's bad_words as token sequences, from `encoded`, the ids of bad_word_forms(words) (the
    HTTP process encodes them on its encoder's thread): each word as the text's start, and as it
    comes mid-text after a space (byte-level BPE folds the space into the word's first token,
    "Ġlamp", where the bare word may split, "l" "amp"). A leading token that is only the space
    (SentencePiece's "▁" alone) is left out of the second form, so that the ban falls on the word,
    never on a space."""
    sequences: dict[tuple[int, ...], None] = {}
    for bare, spaced in zip(encoded[::2], encoded[1::2]):
        while len(spaced) > 1 and not tokenizer.decode(spaced[:1]).strip():
            spaced = spaced[1:]
        for ids in (tuple(bare), tuple(spaced)):
            if ids:
                sequences[ids] = None
    return list(sequences)


def bad_words_of(tokenizer, words: list[str]) -> list[tuple[int, ...]]:
    """bad_words_ids of `words`, encoded here (the offline LLM's; the HTTP process batches them)."""
    return bad_words_ids(tokenizer, [tokenizer.encode(form, add_special_tokens=False) for form in bad_word_forms(words)])
