"""Workloads whose prompts share prefixes, for measuring the prefix cache.

shared-prefix: `groups` system prompts of `prefix_len` tokens, each followed by `group_size`
distinct questions of `question_len` tokens. The requests of all groups are shuffled together,
so the cache must hold several system prompts at once to hit.

multi-turn: `conversations` of `turns` user messages, each cut to `turn_len` tokens. Every turn
resends the whole history (earlier messages and the server's answers, as text) plus the next
message, so turn k+1's prompt starts with turn k's prompt and answer. The prompts depend on the
answers; serving_client.run_conversations sends them.

The text is ShareGPT's: messages are tokenized with the served tokenizer, cut by tokens and
decoded, so that the text re-tokenizes to (about) the intended count.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmark.lib.sharegpt import SampledRequest

OUTPUT_LEN = 256  # tokens asked of every request of both workloads
MAX_TEXT_CHARS = 4000  # per message: long messages would make a few texts the whole pool
TOKENIZE_CHUNK = 256
FIT_ROUNDS = 4
SYSTEM_SEPARATOR = "\n\n"


@dataclass
class SharedPrefixSpec:
    groups: int = 32
    group_size: int = 32
    prefix_len: int = 1024  # tokens of each group's system prompt
    question_len: int = 128  # tokens of each request's own question
    output_len: int = OUTPUT_LEN


@dataclass
class MultiTurnSpec:
    conversations: int = 32
    turns: int = 4
    turn_len: int = 128  # most tokens of one user message
    output_len: int = OUTPUT_LEN


def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False).input_ids


def fit_text(tokenizer, ids: list[int]) -> str:
    """Decode `ids` to text that re-tokenizes to at most len(ids) tokens, usually exactly.

    A cut can split a multi-byte character or a word that re-tokenizes into more pieces;
    cutting the re-tokenized ids again converges in a round or two."""
    text = tokenizer.decode(ids)
    for _ in range(FIT_ROUNDS):
        (again,) = encode(tokenizer, [text])
        if len(again) <= len(ids):
            break
        text = tokenizer.decode(again[: len(ids)])
    return text


class TokenStream:
    """The token ids of shuffled texts, one after another; `take(n)` cuts the next n as text."""

    def __init__(self, texts: list[str], tokenizer, rng: random.Random):
        self.texts = [text[:MAX_TEXT_CHARS] for text in texts if text.strip()]
        rng.shuffle(self.texts)
        self.tokenizer = tokenizer
        self.pending: list[int] = []
        self.next_text = 0

    def take(self, count: int) -> str:
        while len(self.pending) < count:
            self.refill()
        ids, self.pending = self.pending[:count], self.pending[count:]
        return fit_text(self.tokenizer, ids)

    def refill(self) -> None:
        if self.next_text >= len(self.texts):
            raise ValueError(f"the dataset's {len(self.texts)} messages ran out of text")
        chunk = self.texts[self.next_text : self.next_text + TOKENIZE_CHUNK]
        self.next_text += len(chunk)
        for ids in encode(self.tokenizer, chunk):
            self.pending.extend(ids)


def message_texts(records: list[dict]) -> list[str]:
    """Every message of every ShareGPT conversation."""
    return [turn["value"] for record in records for turn in record.get("conversations") or []]


def shared_prefix_requests(
    stream: TokenStream, tokenizer, spec: SharedPrefixSpec, rng: random.Random
) -> tuple[list[str], list[SampledRequest]]:
    """The groups' system prompts, and every group's requests shuffled together."""
    systems = [stream.take(spec.prefix_len) for _ in range(spec.groups)]
    prompts = [
        f"{system}{SYSTEM_SEPARATOR}{stream.take(spec.question_len)}"
        for system in systems
        for _ in range(spec.group_size)
    ]
    rng.shuffle(prompts)
    ids = tokenizer(prompts).input_ids  # with the special tokens the server adds too
    return systems, [SampledRequest(p, list(i), spec.output_len) for p, i in zip(prompts, ids)]


def user_messages(record: dict) -> list[str]:
    """The user's side of a ShareGPT conversation: every other message, from the first."""
    return [turn["value"] for turn in (record.get("conversations") or [])[::2]]


def multi_turn_conversations(
    records: list[dict], tokenizer, spec: MultiTurnSpec, rng: random.Random
) -> list[list[str]]:
    """`spec.conversations` lists of `spec.turns` user messages of at most `turn_len` tokens."""
    candidates = [r for r in records if sum(1 for m in user_messages(r)[: spec.turns] if m.strip()) == spec.turns]
    rng.shuffle(candidates)
    conversations = []
    for record in candidates[: spec.conversations]:
        messages = [m[:MAX_TEXT_CHARS] for m in user_messages(record)[: spec.turns]]
        conversations.append([fit_text(tokenizer, ids[: spec.turn_len]) for ids in encode(tokenizer, messages)])
    if len(conversations) < spec.conversations:
        raise ValueError(
            f"only {len(conversations)} conversations have {spec.turns} user messages; "
            f"{spec.conversations} were asked for"
        )
    return conversations


def turn_prompt(history: str, message: str) -> str:
    """The prompt of one turn: the history so far, the user's message, the answer's cue."""
    return f"{history}User: {message}\nAssistant:"


def next_history(prompt: str, answer: str) -> str:
    return f"{prompt}{answer}\n"
