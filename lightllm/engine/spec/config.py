"""--speculative_config, in vLLM's shape: a JSON object with the draft method and its settings."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# Draft sources; "module:Class" names one from elsewhere (benchmarks' controlled draft).
METHODS = ("ngram", "suffix", "draft_model", "eagle3", "mtp")  # mtp: the target checkpoint's MTP layer
MODEL_METHODS = {"draft_model": "the draft model's directory", "eagle3": "the EAGLE-3 head's directory"}
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4  # most drafts a request gets in one step (the controller picks 0..this)
    prompt_lookup_min: int = 2  # ngram: shortest n-gram matched (vLLM's names)
    prompt_lookup_max: int = 5  # ngram: longest n-gram matched
    model: str | None = None  # draft model's or EAGLE-3 head's directory (MODEL_METHODS)
    options: dict = field(default_factory=dict)  # any other key, for the draft source's constructor

    @classmethod
    def parse(cls, text: str | dict | None) -> SpeculativeConfig | None:
        """The config from its JSON text (or dict); None when absent. ValueError names what is wrong."""
        if text is None or text == "":
            return None
        try:
            values = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative_config is not JSON: {exc}") from None
        if not isinstance(values, dict) or "method" not in values:
            raise ValueError('--speculative_config must be a JSON object with a "method"')
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}
        config = cls(**{k: v for k, v in values.items() if k in known},
                     options={k: v for k, v in values.items() if k not in known})
        config.check()
        return config

    def check(self) -> None:
        if not isinstance(self.method, str):
            raise ValueError(f"speculative method must be a string, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):  # JSON "4" or true would compare wrongly
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.method not in METHODS and ":" not in self.method:
            raise ValueError(f"speculative method {self.method!r}: choose one of {', '.join(METHODS)} "
                             "(or module:Class for a draft source of your own)")
        if self.method in MODEL_METHODS and not isinstance(self.model, str):
            raise ValueError(f'speculative method {self.method} needs "model": {MODEL_METHODS[self.method]}')
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be 1..{MAX_SPECULATIVE_TOKENS}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be at least 1 and at most prompt_lookup_max")

    def describe(self) -> dict:
        """What /info shows."""
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                **({"model": self.model} if self.model else {}), **self.options}
