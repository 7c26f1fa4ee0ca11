"""The HTTP side and the engine's seam import no MLX: every module of `server/` and
`server/routes/`, and every top-level module of `server/engine/` but those that run the
networks (MLX_MODULES), imports with numpy alone. MLX loads on the worker, when a family's
model loads; a new module is on the numpy side unless it is named here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "server"
# engine/'s top-level modules that hold MLX arrays or networks.
MLX_MODULES = {
    "blas",
    "dit_file",
    "dit_network",
    "family",
    "ggml_blocks",
    "gguf",
    "gguf_affine",
    "kquant_folder",
    "lora",
    "module_files",
    "quantize",
    "shard",
    "step_memory",
    "upsampling",
    "weights",
}
PROBE = """
import importlib, json, sys
loaded = {}
for name in sys.argv[1:]:
    importlib.import_module(name)
    found = sorted(k for k in sys.modules if k == "mlx" or k.startswith("mlx."))
    if found:
        loaded[name] = found[:3]
        break
print(json.dumps(loaded))
"""


def module_name(path: Path) -> str:
    parts = path.relative_to(SERVER).with_suffix("").parts
    return ".".join(("gmlx_server", *(p for p in parts if p != "__init__")))


def numpy_side() -> list[str]:
    files = [*SERVER.glob("*.py"), *(SERVER / "routes").glob("*.py")]
    files += [p for p in (SERVER / "engine").glob("*.py") if p.stem not in MLX_MODULES]
    return sorted(module_name(p) for p in files if p.stem != "__main__")


def test_the_numpy_side_imports_no_mlx():
    names = numpy_side()
    assert "gmlx_server.engine.registry" in names and "gmlx_server.routes.step" in names
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, *names], capture_output=True, text=True, timeout=120
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert json.loads(probe.stdout) == {}, "the first module that loaded MLX, and what it loaded"


def test_the_named_mlx_modules_exist():
    """A module renamed or removed leaves this list: every name is a module of engine/."""
    present = {p.stem for p in (SERVER / "engine").glob("*.py")}
    assert MLX_MODULES <= present, sorted(MLX_MODULES - present)
