"""The engine core: scheduler, KV bookkeeping, the model workers and runner it drives.

The router process and the offline API both run `EngineCore` (core.py)."""
