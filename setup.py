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
        "test": ["pytest>=8", "pytest-timeout>=2.2", "hypothesis>=6.100", "openai>=1.40", "anthropic>=0.40", "schemathesis>=4.0,<5",
                 "peft>=0.17"]
    },
    license="Apache-2.0",
)
