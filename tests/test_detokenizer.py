"""IncrementalDecoder against tokenizer.decode(all_ids) on the default model's tokenizer.
Relies on transformers' tokenizer decode (byte-level BPE, skip_special_tokens) as the oracle."""

import random

import pytest
from transformers import AutoTokenizer

from lightllm.frontend.decoder import IncrementalDecoder
from lightllm.tools.default_model import ensure_default_model
from seeds import fresh_rng  # noqa: E402

MULTILINGUAL = [
    "Héllo wörld, naïve café — «ok» ñandú",
    "你好世界，今天天气很好。我们去公园散步吧！",
    "こんにちは、世界。カタカナとひらがな",
    "안녕하세요 세계",
    "Привет, мир! Ελληνικά γράμματα",
    "emoji: 🤖🎉👩‍👩‍👧‍👦🇫🇷 and 🧑🏽‍🚀 done",
    "math ∑∫√∞ ≤ ≥ ≠ and arrows → ⇒ ⟶",
    "mixed: abc 你好 🤖 é\n\tnew line\r\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_default_model(), local_files_only=True)


def random_text(rng: random.Random) -> str:
    alphabet = "abcdefghij XYZ .,!?\n" + "éüñçø" + "你好世界天" + "🤖🎉🇫🇷" + "€£¥" + "ßæœ"
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 80)))


def stream(tokenizer, ids, **kwargs) -> tuple[list[str], IncrementalDecoder]:
    decoder = IncrementalDecoder(tokenizer, **kwargs)
    pieces = []
    for i, token in enumerate(ids):
        pieces.append(decoder.add(token, last=i == len(ids) - 1))
        if decoder.stopped:
            break
    return pieces, decoder


def full_decode(tokenizer, ids, skip_special_tokens=True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_multilingual_text_streams_exactly(tokenizer, text):
    ids = tokenizer.encode(text)
    pieces, _ = stream(tokenizer, ids)
    assert "".join(pieces) == full_decode(tokenizer, ids) == text
    assert all("\ufffd" not in piece for piece in pieces), "no half characters are ever emitted"


def test_random_texts_stream_exactly(tokenizer):
    rng = fresh_rng()
    for _ in range(200):
        text = random_text(rng)
        ids = tokenizer.encode(text)
        pieces, _ = stream(tokenizer, ids)
        assert "".join(pieces) == full_decode(tokenizer, ids)
        assert "\ufffd" not in "".join(pieces)


def test_random_token_ids_match_full_decode_when_it_is_clean(tokenizer):
    rng = fresh_rng()
    for _ in range(100):
        ids = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        expected = full_decode(tokenizer, ids)
        pieces, _ = stream(tokenizer, ids)
        if "\ufffd" not in expected:  # stray byte tokens: no exact answer exists mid-stream
            assert "".join(pieces) == expected


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    ids = [tokenizer.convert_tokens_to_ids("<|im_start|>")] + tokenizer.encode("hi 🤖") + [tokenizer.eos_token_id]
    pieces, _ = stream(tokenizer, ids, skip_special_tokens=skip)
    assert "".join(pieces) == full_decode(tokenizer, ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(pieces)) is not skip


def test_work_per_token_is_bounded(tokenizer):
    """Linear, not quadratic: every decode call sees a short window, however long the output."""
    ids = tokenizer.encode(" ".join(MULTILINGUAL) * 20)
    seen = []
    original = tokenizer.decode

    def counting_decode(token_ids, **kwargs):
        seen.append(len(token_ids))
        return original(token_ids, **kwargs)

    tokenizer.decode = counting_decode
    try:
        pieces, _ = stream(tokenizer, ids)
    finally:
        del tokenizer.decode
    assert "".join(pieces) == full_decode(tokenizer, ids)
    assert len(ids) > 1000 and max(seen) <= 16


@pytest.mark.parametrize(
    "text, stops",
    [
        ("The answer is 42. Next question: why?", ["question"]),
        ("abc你好世界def", ["世界"]),
        ("one 🤖🎉 two", ["🎉 t"]),
        ("alpha beta gamma delta", ["delta", "beta g"]),  # the earliest occurrence wins
        ("no stop here at all", ["xyz"]),
        ("ends with stop", ["stop"]),
        ("aaab", ["aab"]),  # a held tail that is not a stop itself
    ],
)
def test_stop_sequences_cut_exactly(tokenizer, text, stops):
    ids = tokenizer.encode(text)
    pieces, decoder = stream(tokenizer, ids, stop_sequences=stops)
    full = full_decode(tokenizer, ids)
    found = [i for i in (full.find(s) for s in stops) if i >= 0]
    expected = full[: min(found)] if found else full
    assert "".join(pieces) == expected
    assert decoder.stopped == bool(found)
    if found:
        # It stops at the token that completes the stop string, not later.
        completes = next(n for n in range(1, len(ids) + 1) if any(s in full_decode(tokenizer, ids[:n]) for s in stops))
        assert len(decoder.ids) == completes


@pytest.mark.parametrize("text, stops, kept", [
    ("The answer is 42. Next question: why?", ["question"], "The answer is 42. Next question"),
    ("alpha beta gamma delta", ["delta", "beta g"], "alpha beta g"),  # the earliest, whole
    ("one abcd two", ["abcd", "ab"], "one ab"),  # the one completed first, however the tokens fall
])
def test_a_kept_stop_sequence_ends_the_text(tokenizer, text, stops, kept):
    """include_stop (vLLM's include_stop_str_in_output): the text ends with the stop found."""
    pieces, decoder = stream(tokenizer, tokenizer.encode(text), stop_sequences=stops, include_stop=True)
    assert "".join(pieces) == kept and decoder.stopped and kept.endswith(decoder.stop_found)
    _, cut = stream(tokenizer, tokenizer.encode(text), stop_sequences=stops)
    assert cut.stop_found == decoder.stop_found and cut.ids == decoder.ids


def test_stop_sequence_prefix_is_held_only_while_it_can_match(tokenizer):
    decoder = IncrementalDecoder(tokenizer, stop_sequences=["STOP"])
    out = [decoder.add(t) for t in tokenizer.encode("hello ST")]
    assert "".join(out) == "hello "  # "ST" may begin "STOP"
    out += [decoder.add(t) for t in tokenizer.encode("ream")]
    assert "".join(out) == "hello STream"
