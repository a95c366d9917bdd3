"""Layers point down: server and llm.py -> frontend -> engine -> models / common -> kernels (and utils,
which any layer may use). The offline API (llm.py) and the detokenizer prepare requests and decode
text through the frontend alone, never through the HTTP server's modules.

Reads every module's imports with ast (function-level and TYPE_CHECKING imports included, since
they still make one layer depend on another), so a forbidden import fails here even when no test
happens to execute it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

ABOVE_ENGINE = ("lightllm.server", "lightllm.llm", "lightllm.frontend")
# Folder or file (relative to the repository) -> module prefixes its files must not import.
FORBIDDEN = {
    "lightllm/llm.py": ("lightllm.server",),
    "lightllm/server": ("lightllm.llm",),
    "lightllm/server/detokenization": ("lightllm.server.httpserver",),
    "lightllm/frontend": ("lightllm.server", "lightllm.llm"),
    "lightllm/engine": ABOVE_ENGINE,
    "lightllm/models": (*ABOVE_ENGINE, "lightllm.engine"),
    "lightllm/common": (*ABOVE_ENGINE, "lightllm.engine", "lightllm.models"),
    "lightllm/utils": (*ABOVE_ENGINE, "lightllm.engine", "lightllm.models", "lightllm.common"),
    "kernels": ("lightllm",),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "kernels":
        parts[0] = "lightllm.kernels"
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module `source` imports, relative imports resolved against `module`."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(folder: str) -> list[str]:
    forbidden = FORBIDDEN[folder]
    place = ROOT / folder
    own = module_name(place if place.is_file() else place / "__init__.py")  # a package may import itself
    found = []
    for path in [place] if place.is_file() else sorted(place.rglob("*.py")):
        module = module_name(path)
        for name in imported_modules(path.read_text(), module, path.name == "__init__.py"):
            if within(name, own):
                continue
            if any(within(name, prefix) for prefix in forbidden):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_layer_imports_point_down(folder):
    assert (ROOT / folder).exists()
    assert violations(folder) == []


def test_checker_sees_every_form_of_import():
    """The check above can fail: each of these forms is one import of the server."""
    source = (
        "import lightllm.server.io_struct\n"
        "from lightllm.server import io_struct\n"
        "def f():\n    from ..server.io_struct import TokenOut\n"
        "if False:\n    from lightllm.server.config import ServerConfig\n"
    )
    names = imported_modules(source, "lightllm.engine.core")
    assert {"lightllm.server.io_struct", "lightllm.server", "lightllm.server.config"} <= names
    assert sum(1 for n in names if n.startswith("lightllm.server")) >= 4
    assert imported_modules("from . import plan\n", "lightllm.engine.core") == {"lightllm.engine", "lightllm.engine.plan"}
    assert imported_modules("from .config import X\n", "lightllm.models", is_package=True) >= {"lightllm.models.config"}
