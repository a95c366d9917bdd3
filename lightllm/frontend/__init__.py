"""Request preparation that needs no HTTP: the tokenizer, chat templates and the parsers of their
output, sampling ranges and defaults, length checks, the incremental decoder and request errors.
The HTTP server and the offline `LLM` both build on it; it builds on the engine."""
