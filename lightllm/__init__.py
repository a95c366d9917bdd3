"""LightLLM-style token-attention inference server."""

__version__ = "0.1.0"
