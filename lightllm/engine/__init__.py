"""The engine: a request's types, the scheduler, the core, the model workers and runner it drives.

The router process and the offline API both build it with `lightllm/engine/build.py` and run
`EngineCore` (core.py). Nothing here imports lightllm.server (tests/test_layers.py)."""
