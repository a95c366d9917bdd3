"""The LoRA adapters a client may name, by name -> the engine's id of each (the HTTP process's and
the offline LLM's view; the engine knows only ids). Adapters of --lora_modules have ids 1, 2, ...;
each adapter loaded later takes a new id, never one used before, so that the prefix cache (which
keys on the id) never serves a new adapter the KV of an old one of the same name."""

from __future__ import annotations

from lightllm.common.lora_files import LoraAdapterError, read_adapter
from lightllm.engine.config import EngineConfig


class LoraNames:
    def __init__(self, config: EngineConfig, model_info: dict):
        self.slots, self.max_rank = config.lora_slots, config.max_lora_rank
        self._shapes = {name: (out, inp) for name, out, inp in model_info.get("lora_modules", ())}
        self.paths = {name: path for name, path in config.lora_adapters}
        self.ids = {name: i for i, (name, _) in enumerate(config.lora_adapters, 1)}
        self._names = {i: name for name, i in self.ids.items()}  # every id ever given: unloaded ones too
        self._next_id = len(self.ids) + 1

    def id_of(self, name: str | None) -> int | None:
        """The engine id of adapter `name` (None: no adapter of that name)."""
        return self.ids.get(name)

    def name_of(self, lora_id: int) -> str:
        """The name adapter `lora_id` was given (also after it was unloaded: requests may still run on it)."""
        return self._names.get(lora_id, str(lora_id))

    def add(self, name: str, path: str) -> int:
        """Check the adapter at `path` and give it a new id (LoraAdapterError: it cannot be served)."""
        if not self.slots:
            raise LoraAdapterError("this server serves no LoRA adapters (start it with --max_loras or --lora_modules)")
        if not name or name in self.ids:
            raise LoraAdapterError(f"an adapter named {name!r} is already loaded" if name else "lora_name is empty")
        read_adapter(path, self._shapes, self.max_rank)
        lora_id, self._next_id = self._next_id, self._next_id + 1
        self.ids[name], self.paths[name], self._names[lora_id] = lora_id, path, name
        return lora_id

    def remove(self, name: str) -> int:
        """The id of adapter `name`, forgotten (KeyError: no such adapter)."""
        self.paths.pop(name)
        return self.ids.pop(name)
