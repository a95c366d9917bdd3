from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def read_requirements():
    lines = (HERE / "requirements.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


setup(
    name="lightllm",
    version="0.1.0",
    description="Token-attention LLM inference server (HTTP + router + detokenizer over ZeroMQ)",
    python_requires=">=3.11",  # asyncio.timeout, asyncio.Runner
    # The Triton kernels live in the top-level kernels/ folder and import as `lightllm.kernels`
    # (a PyPI package named `kernels` exists, and transformers probes for it).
    packages=find_packages(include=["lightllm", "lightllm.*"]) + ["lightllm.kernels"],
    package_dir={"lightllm.kernels": "kernels"},
    install_requires=read_requirements(),
    extras_require={
        # GPU machines serving the hybrid models (kernels/gated_delta_rule.py imports it on CUDA only).
        # Not in requirements.txt: where it is installed, transformers runs fla's kernels in place of
        # its own torch code for Qwen3-Next/Qwen3.5 (the tests' oracle), and they do not run on a CPU.
        "cuda": ["fla-core>=0.6.0,<0.7"],
        "test": ["pytest>=8", "pytest-timeout>=2.2", "pytest-xdist>=3.5", "hypothesis>=6.100", "openai>=1.40",
                 "anthropic>=0.40", "schemathesis>=4.0,<5", "peft>=0.17"]
    },
    license="Apache-2.0",
)
