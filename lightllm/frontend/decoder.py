"""Incremental detokenization of one request: token ids in, newly final text out.

Cost per token is independent of the output length: each step decodes only a small window,
the tokens of the previous piece of text (context for tokenizers whose pieces depend on their
neighbour) plus the tokens not yet turned into text.
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"
# A character is at most 4 UTF-8 bytes, so a window this long still ending in U+FFFD holds
# bytes that no later token can complete: give it up as it is instead of growing the window.
MAX_PENDING_TOKENS = 8


class IncrementalDecoder:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop_sequences: list[str] | tuple = (),
                 include_stop: bool = False):
        """include_stop: the text ends with the stop sequence found, not right before it (vLLM's
        include_stop_str_in_output)."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = [s for s in stop_sequences if s]
        self._include_stop = include_stop
        self.ids: list[int] = []
        self._prefix_offset = 0  # window start: the tokens of the last emitted piece
        self._read_offset = 0  # tokens before this are already text
        self._held = ""  # decoded text held back because a stop sequence may start in it
        self.stopped = False  # a stop sequence was found; the text ends right before it (or with it)
        self.stop_found: str | None = None  # which one

    def add(self, token_id: int, last: bool = False) -> str:
        """Take one token; return the text that is now final (possibly "")."""
        if self.stopped:
            raise RuntimeError("no tokens after a stop sequence: the request has ended")
        self.ids.append(token_id)
        return self._release(self._decode_new(flush=last), last)

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(
            self.ids[start:end],
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _decode_new(self, flush: bool) -> str:
        prefix = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset, len(self.ids))
        incomplete = text.endswith(REPLACEMENT_CHAR) or len(text) <= len(prefix)
        if incomplete and not flush and len(self.ids) - self._prefix_offset < MAX_PENDING_TOKENS:
            return ""  # wait: the last bytes may be the start of a multi-byte character
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return text[len(prefix):]

    def _release(self, new_text: str, last: bool) -> str:
        """Cut at the first stop sequence; otherwise hold back only a tail that could begin one."""
        text = self._held + new_text
        # The earliest stop, and of those starting there the shortest: the one completed first.
        found = min(((i, len(s), s) for s in self._stops if (i := text.find(s)) >= 0), default=None)
        if found is not None:
            cut, length, self.stop_found = found
            self.stopped, self._held = True, ""
            return text[: cut + length] if self._include_stop else text[:cut]
        keep = 0 if last else self._stop_prefix_len(text)
        self._held = text[len(text) - keep:]
        return text[: len(text) - keep]

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest end of `text` that is the start of some stop sequence."""
        longest = max((len(s) for s in self._stops), default=1) - 1
        for size in range(min(longest, len(text)), 0, -1):
            tail = text[-size:]
            if any(s.startswith(tail) for s in self._stops):
                return size
        return 0
