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


# A family folder's modules of data: its spec and, where it has them, its DiT's layout, its
# component-file rules and its embedded model's recipe.
DATA_MODULES = ("spec", "layout", "components", "embedded")
# The seam below the HTTP side that must import no MLX: what the registry, the listing and the
# checks of a model's settings and files run on before (or without) MLX.
MLX_FREE = (
    "gmlx_server.engine.base",
    "gmlx_server.engine.spec",
    "gmlx_server.engine.registry",
    "gmlx_server.engine.load_settings",
    "gmlx_server.engine.precision",
    "gmlx_server.engine.step_inputs",
    *(
        f"gmlx_server.engine.families.{family}.{module}"
        for family in FAMILIES
        for module in DATA_MODULES
        if (ENGINE / "families" / family / f"{module}.py").is_file()
    ),
)
NO_MLX = """
import importlib, json, sys
from pathlib import Path

class NoMLX:
    def find_spec(self, name, path=None, target=None):
        if name == "mlx" or name.startswith("mlx."):
            raise ImportError("MLX is blocked in this check")

sys.meta_path.insert(0, NoMLX())
for name in MODULES:
    importlib.import_module(name)
from gmlx_server.engine.registry import ModelRegistry

root = Path(sys.argv[1])
folders = {
    "qwen": {"_class_name": "QwenImage21Pipeline", "sample_sigmas": [1.0, 0.5]},
    "zimage": {"_class_name": "ZImagePipeline"},
    "klein": {"_class_name": "Flux2KleinKVPipeline"},
}
for name, index in folders.items():
    (root / name / "text_encoder").mkdir(parents=True)
    (root / name / "model_index.json").write_text(json.dumps(index))
    (root / name / "text_encoder" / "config.json").write_text('{"model_type": "qwen3"}')
found = {e.model_id: (e.family, e.variant) for e in ModelRegistry([root]).entries()}
assert found == {
    "qwen": ("qwen_image21", "turbo"),
    "zimage": ("z_image", "turbo"),
    "klein": ("flux2_klein_9b_kv", "distilled"),
}, found
assert not [m for m in sys.modules if m == "mlx" or m.startswith("mlx.")]
print("ok")
"""


def test_the_seam_and_the_family_data_modules_import_no_mlx(tmp_path):
    """The registry finds the family folders, identifies models and lists them with MLX
    unimportable; a spec, layout, component-file rule or embedded recipe that imported MLX
    would fail here."""
    import subprocess
    import sys

    code = NO_MLX.replace("MODULES", repr(MLX_FREE))
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
