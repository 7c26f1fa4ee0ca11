"""What the embedded random-weight models share: a folder generated on first use, stamped and
moved into place atomically, and weights drawn so that every input visibly moves the output.

An embedded model's module (a family's `embedded.py`, named by its spec's `embedded`)
provides MODEL_NAME, `default_cache_dir()` and `ensure_embedded_model(cache_dir=None)` -> its
folder, which it builds with `ensure` below: the folder is written by the module's `write`
into a temporary folder renamed into place, with a stamp whose fingerprint covers the
generator's version, seed and configs (the module's recipe): a different generator
regenerates, the same one reuses the folder. Made with numpy, safetensors and tokenizers only
(no torch, diffusers or transformers).

Weights: default initialisation makes the prompt move the output by about 0.1 %, so matrices
get a full 1/sqrt(fan_in) spread (MATRIX), and parameters that start constant get a little
noise around one (GAIN: norm scales) or zero (SHIFT: biases, pad tokens), as the project's tiny
test checkpoints do.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

STAMP_FILE = "gmlx_embedded.json"
# The diffusers release whose file layout and config keys the embedded folders follow.
DIFFUSERS_FORMAT = "0.42.1"
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
TRANSFORMERS_WEIGHTS = "model.safetensors"
MATRIX, GAIN, SHIFT = "matrix", "gain", "shift"

Inventory = dict[str, tuple[tuple[int, ...], str]]  # tensor name -> (shape, kind)


def default_cache_dir() -> Path:
    """~/.cache/gmlx-steps/models, or under $XDG_CACHE_HOME when that is set."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gmlx-steps" / "models"


def stamp(name: str, generator: int, recipe: dict) -> dict:
    """Who made a folder: its name, the generator's version and a fingerprint of `recipe`
    (everything that decides the folder's contents)."""
    fingerprint = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()
    return {
        "name": name,
        "note": "random weights from a fixed seed, for trying the pipeline; not a trained model",
        "generator": generator,
        "fingerprint": fingerprint,
    }


def ensure(cache_dir: Path | None, name: str, wanted: dict, write: Callable[[Path], None]) -> Path:
    """The folder `name` under `cache_dir` (default: `default_cache_dir()`) stamped `wanted`,
    written first by `write(folder)` if it is missing or was made by a different generator."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / name
    if read_stamp(target) == wanted:
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(cache_dir, name)
    building = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
    try:
        write(building)
        (building / STAMP_FILE).write_text(dumps(wanted))
        _move_into_place(building, target, wanted)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target


def read_stamp(folder: Path) -> dict | None:
    try:
        return json.loads((folder / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None


def _remove_abandoned_builds(cache_dir: Path, name: str, older_than_s: float = 3600.0) -> None:
    """Temporary folders that an interrupted generation left behind (a live one is seconds old)."""
    cutoff = time.time() - older_than_s
    for folder in cache_dir.glob(f".{name}-*"):
        try:
            if folder.is_dir() and folder.stat().st_mtime < cutoff:
                shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            pass


def _move_into_place(building: Path, target: Path, wanted: dict) -> None:
    """Rename the finished folder to `target`; an outdated `target` is moved aside first. If
    another process placed a current one meanwhile, keep theirs."""
    if target.exists():
        if read_stamp(target) == wanted:
            return
        outdated = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
        os.replace(target, outdated / target.name)
        shutil.rmtree(outdated, ignore_errors=True)
    try:
        os.rename(building, target)
    except OSError:
        if read_stamp(target) != wanted:
            raise


def draw(inventory: Inventory, rng, constant_noise: float) -> dict[str, np.ndarray]:
    """Random float32 tensors for an inventory, in sorted-name order: MATRIX ~ N(0, 1/fan_in),
    GAIN ~ 1 + constant_noise N(0, 1), SHIFT ~ constant_noise N(0, 1)."""
    weights = {}
    for name in sorted(inventory):
        shape, kind = inventory[name]
        noise = rng.standard_normal(shape, dtype=np.float32)
        if kind == MATRIX:
            fan_in = int(np.prod(shape[1:]))
            weights[name] = noise / np.float32(np.sqrt(fan_in))
        elif kind == GAIN:
            weights[name] = np.float32(1.0) + np.float32(constant_noise) * noise
        else:
            weights[name] = np.float32(constant_noise) * noise
    return weights


def write_component(folder: Path, config: dict, weights: dict, file_name: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(dumps(config))
    save_file(weights, str(folder / file_name), metadata={"format": "pt"})


def dumps(document: dict) -> str:
    return json.dumps(document, indent=2, sort_keys=True) + "\n"
