"""What every MLX family's loaded model shares: `FamilyModel`, the generic half of the seam.

A family's model class subclasses `FamilyModel` and adds what is its own: `encode`,
`denoise_step`, `step_peak_bytes` and, for a family with prefix states, the planning methods
that know them (`plan_step`, `step_keys`, `shed_states`, `held_bytes`, `end_run`). The rest comes
from here: the status copy, the manifest (the family module's, read from the folder), the LoRA
patch tables, the VAE routes' checks and the planning defaults of a family that holds no
states beyond its patch tables.

A family's VAE provides `encode` and `decode` over batched MLX arrays (1, C, h, w) <-> (1, H, W,
C), `out_channels`, `peak_bytes(height, width, decode)` and `from_model_space` (the DiT's latent
space -> the VAE's own).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .base import Capabilities, EngineInputError, StepRow
from .lora import TableWeights
from .weights import QUANTIZED, tensor_infos

# Stored dtypes a manifest names (docs/contract.md §2.4), by their safetensors names; a weight
# stored quantized (`gmlx model quantize`) is `quant`.
MANIFEST_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", QUANTIZED: "quant"}


def dit_manifest(family: str, transformer_dir: Path, title: str) -> dict:
    """GET models/{model}/manifest less `model`, naming "diffusers": the DiT's tensors by their
    file names with their logical shapes (weights.tensor_infos), sorted by name. A tensor stored
    in a dtype the families load from neither is refused, naming it (`title`: the family's name
    in prose)."""
    tensors = []
    for info in tensor_infos(transformer_dir):
        if info.dtype not in MANIFEST_DTYPES:
            raise EngineInputError(
                f"tensor {info.name} is stored as {info.dtype}; {title} weights must be"
                " F32, F16 or BF16, or quantized by `gmlx model quantize`"
            )
        tensors.append(
            {"name": info.name, "shape": list(info.shape), "dtype": MANIFEST_DTYPES[info.dtype]}
        )
    tensors.sort(key=lambda tensor: tensor["name"])
    return {
        "family": family,
        "naming": "diffusers",
        "arch": None,
        "count": len(tensors),
        "tensors": tensors,
        "inline": {},
    }


class FamilyModel:
    """The generic part of a loaded model of an MLX family (see the module's docstring).

    `status` is the family's status of the loaded folder; `read_manifest(model_dir)` the family
    module's `manifest`; `tables` the DiT's LoRA tables (lora.TableWeights); `weight_bytes` the
    loaded weights, counted from the arrays (weights.tree_bytes)."""

    family: str = ""  # the family's name, set by the subclass
    capabilities = Capabilities()

    def __init__(
        self,
        model_dir: Path,
        model_id: str,
        variant: str,
        *,
        vae: Any,
        tables: TableWeights,
        status: dict,
        read_manifest: Callable[[Path], dict],
        weight_bytes: int,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.model_id = model_id
        self.variant = variant
        self.vae = vae
        self.tables = tables
        self.weight_bytes = weight_bytes
        self._status = status
        self._read_manifest = read_manifest

    # -- what the routes read -----------------------------------------------------------

    def status(self) -> dict:
        return json.loads(json.dumps(self._status))  # a copy the caller may change

    def manifest(self) -> dict:
        return self._read_manifest(self.model_dir)

    def check_patch_table(self, table: Any) -> None:
        """Refuse a patch table whose keys or shapes do not fit this DiT (called at PUT time)."""
        self.tables.check(table)

    # -- memory plan: the defaults of a family without prefix states ----------------------

    def held_bytes(self) -> int:
        """What the model holds beyond its weights: the patched weight trees."""
        return self.tables.held_bytes

    def plan_step(self, x_shape: tuple, rows: list[StepRow], table: Any = None) -> Any:
        return None

    def step_peak_bytes(
        self, x_shape: tuple, rows: list[StepRow] | None, table: Any = None, plans: Any = None
    ) -> int:
        raise NotImplementedError(f"{type(self).__name__} must estimate its step's peak")

    def step_keys(
        self, x_shape: tuple, rows: list[StepRow], table: Any = None, plans: Any = None
    ) -> set:
        return set()

    def shed_states(self, need_bytes: int, keep: set) -> int:
        return 0

    def end_run(self, run: str) -> None:
        """Nothing is kept per run."""

    # -- sharded over ranks (server/distributed.py): rank 0's held states, mirrored ----------

    def state_keys(self) -> list:
        """The keys of the states the model holds (a family with prefix states lists them)."""
        return []

    def keep_states(self, keys) -> None:
        """Drop every held state but those of `keys` (what rank 0 holds)."""

    def vae_peak_bytes(self, height: int, width: int, decode: bool) -> int:
        return self.vae.peak_bytes(height, width, decode)

    # -- the VAE routes -------------------------------------------------------------------

    def vae_space(self, latents: np.ndarray) -> np.ndarray:
        """Model-space latents (C, h, w) -> the VAE's own space, in MLX float32."""
        vae_space = self.vae.from_model_space(mx.array(np.asarray(latents, np.float32))[None])[0]
        return np.array(vae_space.astype(mx.float32))

    def vae_decode(self, latents: np.ndarray, alpha: bool) -> np.ndarray:
        latents = np.asarray(latents, np.float32)
        if latents.ndim != 3:
            raise EngineInputError(f"latents must be (C, h, w), got {latents.shape}")
        if alpha and self.vae.out_channels < 4:
            raise EngineInputError("this VAE has no alpha channel; decode without alpha")
        image = self.vae.decode(mx.array(latents)[None])[0]
        image = image if alpha else image[..., :3]
        return np.array(image.astype(mx.float32))

    def vae_encode(self, image: np.ndarray) -> np.ndarray:
        image = np.asarray(image, np.float32)
        if image.ndim != 3:
            raise EngineInputError(f"image must be (H, W, C), got {image.shape}")
        latents = self.vae.encode(mx.array(image)[None])[0]
        return np.array(latents.astype(mx.float32))

    def close(self) -> None:
        self.tables.clear()
        self.vae = None
        mx.clear_cache()
