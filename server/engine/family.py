"""What every MLX family's loaded model shares: `FamilyModel`, the generic half of the seam.

A family's model class subclasses `FamilyModel` and adds what is its own: `encode`,
`denoise_step`, `step_peak_bytes` and, for a family with prefix states, the planning methods
that know them (`plan_step`, `step_keys`, `shed_states`, `held_bytes`, `end_run`). The rest comes
from here: the status copy, the manifest (the family module's, read from the folder), the LoRA
patch tables, the VAE routes' checks, the planning defaults of a family that holds no
states beyond its patch tables, and the text encoder's residency: a model given a way to load
its encoder again (`load_encoder`) may drop the encoder's weights between encodes
(`release_encoder`) and loads them again on the next one (`prompt_encoder`); server/memory.py
decides when (`[server.image] encoder_residency`).

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
from .gguf import DiTFile
from .lora import TableWeights
from .nn.dtypes import dtype_name
from .weights import (
    QUANTIZED,
    TensorInfo,
    component_bytes,
    estimated_bytes,
    stored_quantization,
    tensor_infos,
)

# Stored dtypes a manifest names (docs/contract.md §2.4), by their safetensors names; a weight
# stored quantized (`gmlx model quantize`, or any quantized GGUF type) is `quant`.
MANIFEST_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", QUANTIZED: "quant"}


def dit_manifest(
    family: str, transformer_dir: Path, title: str, gguf: DiTFile | None = None
) -> dict:
    """GET models/{model}/manifest less `model`, naming "diffusers": the DiT's tensors by their
    file names with their logical shapes (weights.tensor_infos; for a DiT read from a GGUF file,
    the family's names and shapes with the file's types: `gguf.DiTFile.infos`), sorted by name.
    A tensor stored in a dtype the families load from neither is refused, naming it (`title`:
    the family's name in prose)."""
    if gguf is not None:
        infos = [TensorInfo(*info) for info in gguf.infos()]
    else:
        infos = tensor_infos(transformer_dir)
    tensors = []
    for info in infos:
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


def memory_row(sizes: dict, weights: int, activation_reserve: int, resident: bool) -> dict:
    """Status `memory` (docs/contract.md §2.3): `sizes`, the components' file sizes
    (`dit_bytes`, `encoder_bytes`, `vae_bytes`); the activation reserve (the plan's footprint,
    `weights` plus the family's `activation_reserve` for its reference workload, less the file
    sizes) and the resident bytes (the footprint if `resident`, else 0). `weights`: a loaded
    model's `weight_bytes`, counted from its arrays (quantized or not), else the family's
    estimate from the file headers."""
    footprint = weights + activation_reserve
    return {
        **sizes,
        "activation_reserve_bytes": max(0, footprint - sum(sizes.values())),
        "resident_bytes": footprint if resident else 0,
    }


def component_row(resident: bool, nbytes: int, dtype: mx.Dtype, quantization: dict | None) -> dict:
    """One component of status `residency` (docs/contract.md §2.3, an extension): whether its
    weights are held now, their bytes (as loaded, or estimated for a model not loaded), the
    dtype it computes in and its weights' quantization (null: float)."""
    return {
        "resident": resident,
        "bytes": int(nbytes),
        "dtype": dtype_name(dtype),
        "quantization": quantization,
    }


def loaded_row(part: Any, quantization: dict | None, unloaded: dict) -> dict:
    """A loaded model's `residency` row of one component: held, as loaded (`part`'s
    `weight_bytes` and `dtype`); a component this process did not load (None: a rank > 0 of a
    sharded model holds its DiT part alone) keeps its `unloaded` row, not held."""
    if part is None:
        return unloaded
    return component_row(True, part.weight_bytes, part.dtype, quantization)


class FamilyModel:
    """The generic part of a loaded model of an MLX family (see the module's docstring).

    `status` is the family's status of the loaded folder, with its `residency` as loaded;
    `read_manifest(model_dir)` the family module's `manifest`; `tables` the DiT's LoRA tables
    (lora.TableWeights); `weight_bytes` the loaded weights, counted from the arrays
    (weights.tree_bytes). `encoder` (with its `weight_bytes`) and `load_encoder`, a function
    that loads the same encoder again, make the encoder releasable."""

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
        encoder: Any = None,
        load_encoder: Callable[[], Any] | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.model_id = model_id
        self.variant = variant
        self.vae = vae
        self.tables = tables
        self.encoder = encoder
        self.encoder_bytes = encoder.weight_bytes if encoder is not None else 0
        self._loaded_bytes = weight_bytes
        self._load_encoder = load_encoder
        self._status = status
        self._read_manifest = read_manifest

    # -- what the routes read -----------------------------------------------------------

    def status(self) -> dict:
        status = json.loads(json.dumps(self._status))  # a copy the caller may change
        if "residency" in status:
            status["residency"]["encoder"]["resident"] = self.encoder_resident
        return status

    # -- the text encoder's residency ---------------------------------------------------

    @property
    def weight_bytes(self) -> int:
        """The weights held now: all of them as loaded, less the encoder's while released."""
        return self._loaded_bytes - (0 if self.encoder_resident else self.encoder_bytes)

    @property
    def encoder_resident(self) -> bool:
        return self.encoder is not None or self._load_encoder is None

    @property
    def encoder_releasable(self) -> bool:
        """Whether releasing the encoder would free its bytes now."""
        return self.encoder is not None and self._load_encoder is not None

    def release_encoder(self) -> int:
        """Drop the text encoder's weights (the next encode loads them again, `prompt_encoder`);
        the bytes freed (0 when it cannot be released or is released already)."""
        if not self.encoder_releasable:
            return 0
        self.encoder = None
        mx.clear_cache()
        return self.encoder_bytes

    def prompt_encoder(self) -> Any:
        """The text encoder, loaded again first when it was released."""
        if self.encoder is None:
            self.encoder = self._load_encoder()
        return self.encoder

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

    def ref_cache_bytes(self, rows: list[StepRow], table: Any, run: str) -> int:
        """The reference K/V a `ref_cache` step would add to the run (asked by the memory plan
        only of a model whose capabilities have `ref_cache`)."""
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
        self.vae = self.encoder = self._load_encoder = None
        mx.clear_cache()


def quantized_file_names(
    slots: dict,
    dit_quantized: Callable[[str], bool],
    encoder_module: Callable[[str], str | None],
    encoder_quantized: Callable[[str], bool],
) -> dict[str, Callable[[str], bool]]:
    """A family's `quantized_files`: by component folder, a predicate on file tensor names
    picking the weights a quantized load quantizes. `slots`: the DiT's `linear_slots` (file
    name -> tree place), `dit_quantized` its predicate on tree paths; `encoder_module` maps a
    text-encoder file name to its module path (None: not loaded), `encoder_quantized` is the
    encoder's predicate on module paths."""

    def dit_name(name: str) -> bool:
        slot = slots.get(name.removesuffix(".weight"))
        return slot is not None and dit_quantized(".".join(map(str, (*slot.path, slot.key))))

    def encoder_name(name: str) -> bool:
        module = encoder_module(name)
        return module is not None and encoder_quantized(module.removesuffix(".weight"))

    return {"transformer": dit_name, "text_encoder": encoder_name}


def dit_bytes(transformer_dir: Path, single=None, dtype: mx.Dtype | None = None) -> int:
    """A DiT's bytes for status `memory` and `residency`: its single file's tensor data
    (`single`: the family's gguf.DiTFile, a GGUF or single safetensors file; None: the
    folder's safetensors), else its folder's. No `dtype`: as stored; with one, as a load at
    `dtype` would hold it (a file's quantized weights at their MLX width, floats at `dtype`)."""
    if single is not None:
        return single.stored_bytes() if dtype is None else single.estimated_bytes(dtype.size)
    folder = Path(transformer_dir)
    return component_bytes(folder) if dtype is None else estimated_bytes(folder, dtype)


def encoder_bytes(
    component_dir: Path,
    gguf=None,
    dtype: mx.Dtype | None = None,
    include: Callable[[str], bool] | None = None,
) -> int:
    """A text encoder's bytes for status `memory` and `residency`: its GGUF files' tensor data
    (`gguf`: its gguf.ModuleFiles, None for safetensors), else its folder's. No `dtype`: as
    stored (the files' sizes); with one, as a load at `dtype` would hold it (the tensors the
    GGUF module reads; the folder's tensors `include` picks by file name, None: all, float ones
    at `dtype`: weights.estimated_bytes)."""
    if gguf is not None:
        return gguf.stored_bytes() if dtype is None else gguf.read_bytes()
    folder = Path(component_dir)
    return component_bytes(folder) if dtype is None else estimated_bytes(folder, dtype, include)


def stored_precision(component_dir: Path, gguf=None) -> dict | None:
    """A component's precision as its files hold it, for status `quantization`: a GGUF file's
    types (`gguf`: its gguf.DiTFile or gguf.ModuleFiles, None for safetensors), else the
    folder's stored quantization, else None (float)."""
    if gguf is not None:
        return gguf.status()
    stored = stored_quantization(component_dir)
    return None if stored is None else stored.status()
