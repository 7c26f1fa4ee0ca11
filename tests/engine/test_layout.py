"""The engine's layout holds: a family imports nothing from a sibling family, and the shared
parts (encoders, VAEs, network pieces, the seam) import no family."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "server" / "engine"
FAMILIES = sorted(p.name for p in (ENGINE / "families").iterdir() if (p / "__init__.py").exists())


def engine_imports(path: Path) -> set[str]:
    """The engine modules a file imports, as dotted paths under the engine ("families.x.dit")."""
    package = path.relative_to(ENGINE).parent.parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                found.add(".".join([*base, *(node.module.split(".") if node.module else [])]))
            elif node.module and node.module.startswith("gmlx_server.engine."):
                found.add(node.module.removeprefix("gmlx_server.engine."))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("gmlx_server.engine."):
                    found.add(alias.name.removeprefix("gmlx_server.engine."))
    return found


def test_there_is_a_family_to_check():
    assert "qwen_image21" in FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_imports_no_sibling(family):
    for path in (ENGINE / "families" / family).rglob("*.py"):
        for module in engine_imports(path):
            parts = module.split(".")
            if parts[0] == "families" and len(parts) > 1:
                assert parts[1] == family, f"{path.name} imports {module}"


@pytest.mark.parametrize(
    "part", ["base.py", "family.py", "weights.py", "lora.py", "nn", "encoders", "vaes"]
)
def test_shared_parts_import_no_family(part):
    paths = [ENGINE / part] if part.endswith(".py") else list((ENGINE / part).rglob("*.py"))
    for path in paths:
        bad = [m for m in engine_imports(path) if m.startswith("families")]
        assert not bad, f"{path.relative_to(ENGINE)} imports {bad}"
