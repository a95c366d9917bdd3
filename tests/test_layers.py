"""Layers point down: llm.py -> server -> engine -> models / common -> kernels (and utils, which any layer may use).

Reads every module's imports with ast (function-level and TYPE_CHECKING imports included, since
they still make one layer depend on another), so a forbidden import fails here even when no test
happens to execute it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Folder (relative to the repository) -> module prefixes its files must not import.
FORBIDDEN = {
    "lightllm/server": ("lightllm.llm",),
    "lightllm/engine": ("lightllm.server", "lightllm.llm"),
    "lightllm/models": ("lightllm.server", "lightllm.llm", "lightllm.engine"),
    "lightllm/common": ("lightllm.server", "lightllm.llm", "lightllm.engine", "lightllm.models"),
    "lightllm/utils": ("lightllm.server", "lightllm.llm", "lightllm.engine", "lightllm.models", "lightllm.common"),
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
    own = module_name(ROOT / folder / "__init__.py")  # a package may import itself
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        module = module_name(path)
        for name in imported_modules(path.read_text(), module, path.name == "__init__.py"):
            if within(name, own):
                continue
            if any(within(name, prefix) for prefix in forbidden):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_layer_imports_point_down(folder):
    assert (ROOT / folder).is_dir()
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
