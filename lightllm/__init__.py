"""LightLLM-style token-attention inference server.

`from lightllm import LLM, SamplingParams` is the offline Python API (lightllm/llm.py), loaded on
first use so that `import lightllm` alone stays light (no torch, no transformers).
"""

import os as _os

__version__ = "0.1.0"

# The Triton kernels live in the repository's top-level kernels/ folder and import as
# `lightllm.kernels`: an install maps them there (setup.py); a checkout run without installing
# (PYTHONPATH=., as on a GPU machine with no network) finds them through this search path.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "kernels")) and _os.path.isfile(
        _os.path.join(_checkout, "kernels", "_triton.py")):
    __path__.append(_checkout)

_OFFLINE_API = ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "LoRARequest")


def __getattr__(name: str):
    if name in _OFFLINE_API:
        from lightllm import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'lightllm' has no attribute {name!r}")
