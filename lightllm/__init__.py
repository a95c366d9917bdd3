"""LightLLM-style token-attention inference server.

`from lightllm import LLM, SamplingParams` is the offline Python API (lightllm/llm.py), loaded on
first use so that `import lightllm` alone stays light (no torch, no transformers).
"""

__version__ = "0.1.0"

_OFFLINE_API = ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob")


def __getattr__(name: str):
    if name in _OFFLINE_API:
        from lightllm import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'lightllm' has no attribute {name!r}")
