"""What every MLX family's loaded model shares: `FamilyModel`, the generic half of the seam.

A family's model class subclasses `FamilyModel`, names what the family is made of (`DIT`,
`PROMPT`, `VAE`, `reserve_bytes`) and adds what is its own: `step`, `step_peak_bytes`,
`encode` where its text encoder reads images and, for a family with prefix states, the
planning methods that know them (`plan_step`, `step_keys`, `shed_states`, `held_bytes`,
`end_run`). The rest comes from here: the encoding, the reference images' sizes (the spec's
`reference_sizes`), the convention check, the status copy, the manifest (the family module's,
read from the folder), the LoRA patch tables, the VAE routes' checks, the planning defaults of
a family that holds no states beyond its patch tables, and the text encoder's residency: a
model given a way to load its encoder again (`load_encoder`) may drop the encoder's weights
between encodes (`release_encoder`) and loads them again on the next one (`prompt_encoder`);
server/memory.py decides when (`[server.image] encoder_residency`).

A family's VAE provides `encode` and `decode` over batched MLX arrays (1, C, h, w) <-> (1, H, W,
C), `out_channels`, `peak_bytes(height, width, decode)` and `from_model_space` (the DiT's latent
space -> the VAE's own).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .base import (
    Capabilities,
    EncodeResult,
    EngineInputError,
    Facts,
    StepCall,
    StepResult,
    StepRow,
)
from .dit_file import DiTFile
from .lora import TableWeights
from .nn import dtypes
from .nn.dtypes import default_compute_dtype, dtype_name
from .precision import AUTO
from .quantize import quantization_status
from .spec import Family, FamilySpec
from .step_inputs import checked_convention, checked_ref_latents
from .weights import (
    QUANTIZED,
    TensorInfo,
    component_bytes,
    estimated_bytes,
    read_config,
    read_header,
    stored_quantization,
    tensor_infos,
    weight_files,
)

# Stored dtypes a manifest names (docs/contract.md §2.4), by their safetensors names; a weight
# stored quantized (`gmlx model quantize`, or any quantized GGUF type) is `quant`.
MANIFEST_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", QUANTIZED: "quant"}
# The reference workload's image side behind status `activation_reserve_bytes` (docs/contract.md
# §3.5): a guided step (RESERVE_ROWS rows) on an image of this side, or one VAE pass of it,
# whichever is larger.
RESERVE_PIXELS = 1024
RESERVE_ROWS = 2


def dit_manifest(
    family: str, transformer_dir: Path, title: str, gguf: DiTFile | None = None
) -> dict:
    """GET models/{model}/manifest less `model`, naming "diffusers": the DiT's tensors by their
    file names with their logical shapes (weights.tensor_infos; for a DiT read from a GGUF file,
    the family's names and shapes with the file's types: `dit_file.DiTFile.infos`), sorted by name.
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


@dataclass(frozen=True)
class MemoryRow:
    """Status `memory` (docs/contract.md §2.3), typed: `sizes`, the components' file sizes
    (`dit_bytes`, `encoder_bytes`, `vae_bytes`); the activation reserve (the plan's footprint
    less the file sizes) and the resident bytes (the footprint of a model loaded, else 0)."""

    sizes: dict[str, int]
    activation_reserve_bytes: int
    resident_bytes: int

    def status(self) -> dict:
        return {
            **self.sizes,
            "activation_reserve_bytes": self.activation_reserve_bytes,
            "resident_bytes": self.resident_bytes,
        }


def memory_row(sizes: dict, weights: int, activation_reserve: int, resident: bool) -> MemoryRow:
    """The memory row of a folder: its footprint is `weights` plus the family's
    `activation_reserve` for its reference workload. `weights`: a loaded model's
    `weight_bytes`, counted from its arrays (quantized or not), else the family's estimate from
    the file headers; `resident`: whether the model is loaded."""
    footprint = weights + activation_reserve
    return MemoryRow(
        dict(sizes), max(0, footprint - sum(sizes.values())), footprint if resident else 0
    )


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

    Its arguments are what FolderFamily.model_arguments gives: the family's name (`family`),
    its name in prose for messages (`title`) and what it can do (`capabilities`: the spec's, as
    the DiT's weights make them, `DiTNetwork.capabilities`);
    the networks (`dit`, `vae`, `encoder`); `status`, the family's status of the loaded folder
    with its `residency` as loaded, and `facts` (base.Facts) the values of it the routes and
    the memory plan read; `read_manifest(model_dir)` the family module's `manifest`; `tables`
    the DiT's LoRA tables (lora.TableWeights); `weight_bytes` the loaded weights, counted from
    the arrays (weights.tree_bytes). `encoder` (with its `weight_bytes`) and `load_encoder`, a
    function that loads the same encoder again, make the encoder releasable."""

    # What the family is made of (FolderFamily reads them): its DiT's class (a
    # dit_network.DiTNetwork, whose PART is its files' facts), its prompt encoder's class (an
    # encoders.prompt.PromptEncoder, whose PART is its text encoder's) and its VAE's part (a
    # `...Part` of vaes/).
    DIT: Any
    PROMPT: Any
    VAE: Any

    @classmethod
    def reserve_bytes(cls, config: Any, image_tokens: int, dtype: mx.Dtype) -> int:
        """The activations beyond the weights of a guided step (RESERVE_ROWS rows) of the
        reference workload, `image_tokens` the tokens of a RESERVE_PIXELS square, on a DiT of
        `config`: the family's memory plan before it loads."""
        raise NotImplementedError(f"{cls.__name__} must estimate its reference workload")

    def __init__(
        self,
        model_dir: Path,
        model_id: str,
        variant: str,
        *,
        family: str,
        title: str,
        capabilities: Capabilities,
        dit: Any,
        vae: Any,
        tables: TableWeights,
        status: dict,
        facts: Facts,
        read_manifest: Callable[[Path], dict],
        weight_bytes: int,
        encoder: Any = None,
        load_encoder: Callable[[], Any] | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.model_id = model_id
        self.variant = variant
        self.family, self.title, self.capabilities = family, title, capabilities
        self.dit = dit
        self.vae = vae
        self.tables = tables
        self.encoder = encoder
        self.encoder_bytes = encoder.weight_bytes if encoder is not None else 0
        self._loaded_bytes = weight_bytes
        self._load_encoder = load_encoder
        self._status = status
        self.facts = facts
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

    def encode(self, text: str, images: list[np.ndarray], refs: bool) -> EncodeResult:
        """The prompt's conditioning, and with `refs` each image's VAE latents in model space
        (`reference_latents`: a family whose text encoder reads no images); a family that
        takes no references refuses images (one whose encoder reads them overrides this).
        With `refs`, every image's size is checked before any encoder runs."""
        if images and not self.capabilities.max_refs:
            raise EngineInputError(f"{self.title} takes no reference images")
        if refs:
            for index, image in enumerate(images):
                self.check_reference(index, image.shape[0], image.shape[1], len(images))
        cond = self.prompt_encoder().encode(text)
        if not refs:
            return EncodeResult(cond=cond)
        return EncodeResult(cond=cond, ref_latents=[self.reference_latents(i) for i in images])

    def reference_latents(self, image: np.ndarray) -> np.ndarray:
        """An image (H, W, 3 or 4, uint8) of a size `check_reference` takes as VAE latents in
        model space, (1, C, h, w) float32."""
        pixels = mx.array(np.asarray(image[..., :3], np.float32) / 255.0)[None]
        latents = self.vae.to_model_space(self.vae.encode(pixels))
        return np.array(latents.astype(mx.float32))

    def check_reference(self, index: int, height: int, width: int, count: int) -> None:
        """Refuse a reference image of a size the family's pipeline would resize (the spec's
        `reference_sizes`; an EngineInputError naming the image and the sizes it takes)."""
        sizes = self.capabilities.reference_sizes
        if sizes is not None:
            sizes.check(index, height, width, count, self.vae.stride, self.title)

    @staticmethod
    def reference_arrays(rows: list[StepRow], channels: int) -> list[list[mx.array]]:
        """Each row's reference latents (step_inputs.checked_ref_latents, of `channels`) as
        MLX arrays."""
        return [
            [mx.array(r) for r in checked_ref_latents(row, index, channels)]
            for index, row in enumerate(rows)
        ]

    def check_patch_table(self, table: Any) -> None:
        """Refuse a patch table whose keys or shapes do not fit this DiT (called at PUT time)."""
        self.tables.check(table)

    # -- the step -------------------------------------------------------------------------

    def denoise_step(
        self, x: np.ndarray, timestep: np.ndarray, rows: list[StepRow], **how: Any
    ) -> StepResult:
        """The seam's step (base.ImageModel.denoise_step): its convention checked against the
        family's, its keywords (StepCall's fields, its defaults theirs) handed to the family's
        `step` as one StepCall."""
        call = StepCall(**how)
        checked_convention(call.convention, self.capabilities.conventions, self.family)
        return self.step(x, timestep, rows, call)

    def step(
        self, x: np.ndarray, timestep: np.ndarray, rows: list[StepRow], call: StepCall
    ) -> StepResult:
        raise NotImplementedError(f"{type(self).__name__} must run its step")

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

    def vae_peak_bytes(self, height: int, width: int, decode: bool, tiled: bool = False) -> int:
        return self.vae.peak_bytes(height, width, decode, tiled)

    def vae_tileable(self, height: int, width: int, decode: bool) -> bool:
        """Whether a pass of this image could run in tiles, which are not the whole pass: the
        memory plan's fallback where the whole pass does not fit."""
        return self.vae.tileable(height, width, decode)

    # -- the VAE routes -------------------------------------------------------------------

    def vae_space(self, latents: np.ndarray) -> np.ndarray:
        """Model-space latents (C, h, w) -> the VAE's own space, in MLX float32."""
        vae_space = self.vae.from_model_space(mx.array(np.asarray(latents, np.float32))[None])[0]
        return np.array(vae_space.astype(mx.float32))

    def model_space(self, latents: np.ndarray) -> np.ndarray:
        """The VAE's own latents (C, h, w) -> model space, in MLX float32."""
        model_space = self.vae.to_model_space(mx.array(np.asarray(latents, np.float32))[None])[0]
        return np.array(model_space.astype(mx.float32))

    def vae_decode(self, latents: np.ndarray, alpha: bool, tiled: bool = False) -> np.ndarray:
        latents = np.asarray(latents, np.float32)
        if latents.ndim != 3:
            raise EngineInputError(f"latents must be (C, h, w), got {latents.shape}")
        if alpha and self.vae.out_channels < 4:
            raise EngineInputError("this VAE has no alpha channel; decode without alpha")
        image = self.vae.decode(mx.array(latents)[None], tiled)[0]
        image = image if alpha else image[..., :3]
        return np.array(image.astype(mx.float32))

    def vae_encode(self, image: np.ndarray, tiled: bool = False) -> np.ndarray:
        image = np.asarray(image, np.float32)
        if image.ndim != 3:
            raise EngineInputError(f"image must be (H, W, C), got {image.shape}")
        latents = self.vae.encode(mx.array(image)[None], tiled)[0]
        return np.array(latents.astype(mx.float32))

    def close(self) -> None:
        """Drop the networks (a family's model holds its DiT as `dit`) and the LoRA tables."""
        self.tables.clear()
        self.dit = self.vae = self.encoder = self._load_encoder = None
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
    (`single`: the family's dit_file.DiTFile, a GGUF or single safetensors file; None: the
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
    (`gguf`: its module_files.ModuleFiles, None for safetensors), else its folder's. No `dtype`: as
    stored (the files' sizes); with one, as a load at `dtype` would hold it (the tensors the
    GGUF module reads; the folder's tensors `include` picks by file name, None: all, float ones
    at `dtype`: weights.estimated_bytes)."""
    if gguf is not None:
        return gguf.stored_bytes() if dtype is None else gguf.read_bytes()
    folder = Path(component_dir)
    return component_bytes(folder) if dtype is None else estimated_bytes(folder, dtype, include)


def stored_precision(component_dir: Path, gguf=None) -> dict | None:
    """A component's precision as its files hold it, for status `quantization`: a GGUF file's
    types (`gguf`: its dit_file.DiTFile or module_files.ModuleFiles, None for safetensors), else the
    folder's stored quantization, else None (float)."""
    if gguf is not None:
        return gguf.status()
    stored = stored_quantization(component_dir)
    return None if stored is None else stored.status()


@dataclass
class LoadedParts:
    """A folder's networks as FolderFamily.load_parts loads them: the DiT, and on rank 0 the
    VAE and the prompt encoder with a function that loads it again (None on another rank)."""

    family: str
    variant: str
    dit: Any
    vae: Any = None
    encoder: Any = None
    load_encoder: Callable[[], Any] | None = None


class FolderFamily(Family):
    """A family served from a diffusers folder (transformer/, text_encoder/, vae/, ...): the
    status, manifest, checks and `gmlx model quantize`'s choice written once, from the spec and
    the family's model class (`model`, a FamilyModel built as `model(model_dir, model_id,
    **model_arguments)`) and the parts it names:

    - `DIT`: its DiT's class (a dit_network.DiTNetwork), whose `PART` is the DiTPart read;
    - `PROMPT`: its prompt encoder's class (an encoders.prompt.PromptEncoder), whose `PART`
      is its text encoder (encoders.qwen3.text.Qwen3Part, encoders.qwen3.vl.Qwen3VLPart,
      encoders.qwen35.text.Qwen35Part): `gguf(component_dir, files)` its GGUF files (None:
      safetensors), `include` the folder's tensors a load reads (None: all), `module_name(name)`
      and `quantized(path)` what a quantized load quantizes;
    - `VAE`: its VAE (a `...Part` of `vaes/`): `load(vae_dir, dtype)`, `latent(config)` (None:
      the DiT's channels at the spec's strides), `channels_out(config)`, `status_row(config)`,
      `estimate(vae_dir, dtype)` and `reserve_bytes(config, pixels)`;
    - `reserve_bytes(config, image_tokens, dtype)`: the activations of a guided step of the
      reference workload (RESERVE_PIXELS square), the family's own memory plan.

    `files` are a model entry's weight files (`dit`, `text_encoder`, `mmproj`: those the spec
    lists); `specs` are the families it serves where a folder holds several (default: its
    spec), each its own title and capabilities, `spec`'s the rest."""

    def __init__(self, spec: FamilySpec, model: Any, specs: tuple[FamilySpec, ...] = ()):
        super().__init__(spec)
        self.model, self.network, self.prompt = model, model.DIT, model.PROMPT
        self.dit, self.encoder, self.vae = model.DIT.PART, model.PROMPT.PART, model.VAE
        self.specs = {served.name: served for served in specs or (spec,)}

    def serves(self, name: str) -> bool:
        return name in self.specs

    def load(
        self,
        model_dir: Path,
        model_id: str,
        quantization: Any = None,
        encoder_vae_dtype: str = AUTO,
        shard: Any = None,
        **files: Path | None,
    ):
        """The model of a folder (`model`, built from `load_parts`), its parts' widths checked
        against each other first (`fits`: a ValueError names the mismatch). The keywords are
        a model entry's load settings (load_settings.LoadSettings.options): the registry hands
        over only those the spec takes."""
        parts = self.load_parts(model_dir, quantization, encoder_vae_dtype, files, shard)
        if parts.encoder is not None:
            self.fits(parts, model_dir)
        return self.build(model_dir, model_id, parts, files)

    def fits(self, parts: LoadedParts, model_dir: Path) -> None:
        """Refuse parts that do not fit each other (a ValueError naming both widths): the text
        encoder's conditioning must be as wide as the DiT reads (its config's `cond_width`),
        and the latents the VAE gives (its part's `latent`, where it names them) must have the
        channels the DiT takes (`latent_channels`)."""
        config = parts.dit.config
        if parts.encoder.hidden_size != config.cond_width:
            raise ValueError(
                f"the text encoder gives conditioning {parts.encoder.hidden_size} wide; the DiT"
                f" reads conditioning {config.cond_width} wide"
            )
        latent = self.vae.latent(read_config(Path(model_dir) / "vae"))
        if latent is not None and latent["channels"] != config.latent_channels:
            raise ValueError(
                f"the VAE's latents have {latent['channels']} channels; the DiT takes"
                f" {config.latent_channels}"
            )

    def build(self, model_dir: Path, model_id: str, parts: LoadedParts, files: dict | None = None):
        """The family's model of loaded `parts` (`model`, its FamilyModel class, given
        `model_arguments`)."""
        return self.model(model_dir, model_id, **self.model_arguments(model_dir, parts, files))

    def load_parts(
        self,
        model_dir: Path,
        quantization: Any,
        encoder_vae_dtype: str,
        files: dict,
        shard: Any = None,
    ) -> LoadedParts:
        """A folder's networks, its files checked first (`check`): the DiT (`network`, a
        dit_network.DiTNetwork class; with a `shard` this rank's part of it) and, on rank 0,
        the VAE (its part's network) and the prompt encoder (`prompt`, its class, weights from
        the folder or the entry's GGUF files), both at the `encoder_vae_dtype` setting's dtype
        (nn.dtypes.encoder_vae_dtype); with a `quantization`, the layers each part picks are
        quantized as they load."""
        model_dir = Path(model_dir)
        family, variant = self.identified(model_dir)
        self.check(model_dir, **files)
        transformer = model_dir / "transformer"
        dit = self.network.load(
            transformer, quantization=quantization, dit=files.get("dit"), shard=shard
        )
        if shard is not None and shard.rank != 0:
            return LoadedParts(family, variant, dit)
        side = dtypes.encoder_vae_dtype(encoder_vae_dtype)
        source = self.encoder.source(model_dir / "text_encoder", files)

        def load_encoder() -> Any:
            return self.prompt.load(model_dir, side, quantization, gguf=source)

        vae_network = self.vae.load(model_dir / "vae", side)
        return LoadedParts(family, variant, dit, vae_network, load_encoder(), load_encoder)

    def encoder_files(self, model_dir: Path, files: dict):
        return self.encoder.gguf(Path(model_dir) / "text_encoder", files)

    def encoder_estimate(self, model_dir: Path, files: dict, dtype: mx.Dtype) -> int:
        """The text encoder's bytes as it would load at `dtype` (encoder_bytes)."""
        folder = Path(model_dir) / "text_encoder"
        gguf = self.encoder_files(model_dir, files)
        return encoder_bytes(folder, gguf, dtype, self.encoder.include)

    def model_facts(self, model_dir: Path, memory: MemoryRow) -> Facts:
        """The facts of a folder (base.Facts) from its configs: the latents the VAE gives (or,
        for a VAE that names none, the DiT's channels at the spec's stride), whose cells the
        VAE routes' latents are too, the conditioning width the DiT's config reads, the spec's
        patch, and the plan's footprint of `memory`."""
        model_dir = Path(model_dir)
        vae_config = read_config(model_dir / "vae")
        latent = self.latent(model_dir, vae_config)
        dit_config = self.dit.config.from_dict(read_config(model_dir / "transformer"))
        return Facts(
            latent_channels=latent["channels"],
            latent_stride=latent["stride"],
            vae_stride=latent["stride"],
            vae_channels_out=self.vae.channels_out(vae_config),
            edit_capable=self.spec.edit_capable,
            cond_width=dit_config.cond_width,
            latent_patch=self.spec.latent_patch,
            resident_bytes=memory.resident_bytes,
        )

    def latent(self, model_dir: Path, vae_config: dict) -> dict:
        """The latents of a folder, {"channels", "stride"}: those the VAE of `vae_config`
        gives, or for a VAE that names none the DiT's channels at the spec's stride."""
        latent = self.vae.latent(vae_config)
        if latent is None:
            channels = read_config(Path(model_dir) / "transformer")["in_channels"]
            latent = {"channels": channels, "stride": self.spec.latent_stride}
        return latent

    def sampling_row(self, model_dir: Path, variant: str) -> dict:
        """The variant's own settings (docs/contract.md §2.3): its row of the spec's sampling,
        under the spec's schedule rule unless the row names its own (None: none)."""
        row = dict(self.spec.sampling[variant])
        schedule = row.pop("schedule", self.spec.schedule)
        schedule = dict(schedule) if schedule else None
        neg_skip = list(row.pop("neg_skip", ()))
        return {**row, "sigmas": None, "schedule": schedule, "neg_skip": neg_skip}

    def activation_reserve(self, model_dir: Path, dtype: mx.Dtype) -> int:
        """The activations of the reference workload: the larger of a guided step over a
        RESERVE_PIXELS square's image tokens (its latent cells over the spec's patch) and a
        VAE pass of it."""
        model_dir = Path(model_dir)
        config = self.dit.config.from_dict(read_config(model_dir / "transformer"))
        vae_config = read_config(model_dir / "vae")
        side = RESERVE_PIXELS // (
            self.latent(model_dir, vae_config)["stride"] * self.spec.latent_patch
        )
        vae = self.vae.reserve_bytes(vae_config, RESERVE_PIXELS)
        return max(self.model.reserve_bytes(config, side * side, dtype), vae)

    # -- from those: the family's answers ------------------------------------------------

    def identified(self, model_dir: Path) -> tuple[str, str]:
        found = self.spec.identify(model_dir)
        if found is None:
            raise EngineInputError(f"{model_dir} is not a {self.spec.title} folder")
        return found

    def describe(
        self, model_dir: Path, model_id: str | None = None, dtype: mx.Dtype | None = None, **files
    ) -> dict:
        """The family part of the status (docs/contract.md §2.3), from config files and
        headers alone, the DiT at `dtype` (its default compute dtype), the encoder and VAE at
        theirs by default (`encoder_vae_dtype` auto)."""
        model_dir = Path(model_dir)
        _, variant = self.identified(model_dir)
        dtype = dtype or default_compute_dtype()
        side = dtypes.encoder_vae_dtype()
        vae_config = read_config(model_dir / "vae")
        quantization = {
            "dit": stored_precision(model_dir / "transformer", self._dit(model_dir, files)),
            "encoder": stored_precision(
                model_dir / "text_encoder", self.encoder_files(model_dir, files)
            ),
            "vae": None,
        }
        memory = self.memory(model_dir, dtype, None, files)
        facts = self.model_facts(model_dir, memory)
        return {
            "comfy": dict(self.spec.comfy),
            "latent": {
                "channels": facts.latent_channels,
                "stride": facts.latent_stride,
                "patch": facts.latent_patch,
            },
            "vae": {
                "channels_out": facts.vae_channels_out,
                "stride": facts.vae_stride,
                **self.vae.status_row(vae_config),
            },
            "edit_capable": facts.edit_capable,
            "conditioning": self.spec.conditioning_status(),
            # the timestep's scale (docs/contract.md §5.2) is an extension of §2.3's row
            "sampling": {
                **self.sampling_row(model_dir, variant),
                "timestep_scale": self.spec.timestep_scale,
            },
            "compute_dtype": dtype_name(dtype),
            # Extensions of docs/contract.md §2.3: each component's weight precision as the
            # files store it, and what is held (here nothing) with the bytes each component
            # would hold loaded; a loaded model reports its own (`loaded_status`).
            "quantization": quantization,
            "residency": {
                "dit": component_row(
                    False, self.dit_size(model_dir, files, dtype), dtype, quantization["dit"]
                ),
                "encoder": component_row(
                    False,
                    self.encoder_estimate(model_dir, files, side),
                    side,
                    quantization["encoder"],
                ),
                "vae": component_row(False, self.vae.estimate(model_dir / "vae", side), side, None),
            },
            "memory": memory.status(),
        }

    def loaded_status(
        self, model_dir: Path, dit: Any, vae: Any, encoder: Any, files: dict
    ) -> tuple[Facts, dict]:
        """The facts and status of a loaded model: `describe`'s, with each component's
        precision and residency as held (bytes counted from the arrays) and its memory as
        loaded. A component this process did not load (None: a rank > 0 of a sharded model
        holds its DiT part alone) keeps its row as not held."""
        status = self.describe(model_dir, None, dit.dtype, **files)
        dit_gguf = self._dit(model_dir, files)
        encoder_gguf = self.encoder_files(model_dir, files)
        if encoder is None:
            encoder_status = status["quantization"]["encoder"]
        elif encoder_gguf is None:
            encoder_status = quantization_status(encoder.network)
        else:
            encoder_status = encoder_gguf.status()
        # a float single file (a safetensors one) reports what the load made of it, as a folder
        dit_file_status = None if dit_gguf is None else dit_gguf.status()
        quantization = {
            "dit": quantization_status(dit.weights) if dit_file_status is None else dit_file_status,
            "encoder": encoder_status,
            "vae": None,
        }
        unloaded = status["residency"]
        status["quantization"] = quantization
        status["residency"] = {
            "dit": component_row(True, dit.weight_bytes, dit.dtype, quantization["dit"]),
            "encoder": loaded_row(encoder, quantization["encoder"], unloaded["encoder"]),
            "vae": loaded_row(vae, None, unloaded["vae"]),
        }
        weight_bytes = sum(part.weight_bytes for part in (dit, vae, encoder) if part is not None)
        memory = self.memory(model_dir, dit.dtype, weight_bytes, files)
        status["memory"] = memory.status()
        return self.model_facts(model_dir, memory), status

    def model_arguments(self, model_dir: Path, parts: LoadedParts, files: dict | None) -> dict:
        """FamilyModel's arguments for a loaded model of `parts`: its variant, family, title and
        capabilities, its networks (the function that loads the encoder again with them), the
        DiT's LoRA tables, the status and its facts, the manifest reader and the weight bytes
        (`files`: the model entry's weight files; none: the folder's)."""
        files = {key: path for key, path in (files or {}).items() if path is not None}
        dit, vae, encoder = parts.dit, parts.vae, parts.encoder
        slots = (self.dit.table_slots or self.dit.linear_slots)(dit.config)
        networks = (dit, vae, encoder)
        facts, status = self.loaded_status(model_dir, dit, vae, encoder, files)
        return {
            "variant": parts.variant,
            "family": parts.family,
            "title": self.specs[parts.family].title,
            "capabilities": dit.capabilities(self.specs[parts.family].capabilities()),
            "dit": dit,
            "vae": vae,
            "encoder": encoder,
            "load_encoder": parts.load_encoder,
            "tables": TableWeights(dit.weights, slots, dit.dtype, shard=dit.stages.tree_shard),
            "status": status,
            "facts": facts,
            "read_manifest": lambda folder: self.manifest(folder, **files),
            "weight_bytes": sum(part.weight_bytes for part in networks if part is not None),
        }

    def memory(
        self, model_dir: Path, dtype: mx.Dtype, weight_bytes: int | None, files: dict
    ) -> MemoryRow:
        """Status `memory` (memory_row): the file sizes, the reserve of the reference
        workload, and the weights: a loaded model's `weight_bytes`, else (None) estimated
        from the headers."""
        model_dir = Path(model_dir)
        sizes = {
            "dit_bytes": self.dit_size(model_dir, files),
            "encoder_bytes": encoder_bytes(
                model_dir / "text_encoder", self.encoder_files(model_dir, files)
            ),
            "vae_bytes": component_bytes(model_dir / "vae"),
        }
        if weight_bytes is None:
            weights = self.estimated_weight_bytes(model_dir, dtype, files)
        else:
            weights = weight_bytes
        reserve = self.activation_reserve(model_dir, dtype)
        return memory_row(sizes, weights, reserve, resident=weight_bytes is not None)

    def estimated_weight_bytes(
        self, model_dir: Path, dit_dtype: mx.Dtype, files: dict | None = None
    ) -> int:
        """The weights of a folder as they would load (for the status of a model not
        loaded): the DiT at its compute dtype (a GGUF DiT's quantized weights at their MLX
        width), the VAE and the text encoder at theirs by default, weights stored quantized as
        stored, counted from the file headers. A loaded model counts its arrays instead."""
        side = dtypes.encoder_vae_dtype()
        files = files or {}
        return (
            self.dit_size(model_dir, files, dit_dtype)
            + self.vae.estimate(Path(model_dir) / "vae", side)
            + self.encoder_estimate(model_dir, files, side)
        )

    def dit_size(self, model_dir: Path, files: dict, dtype: mx.Dtype | None = None) -> int:
        """dit_bytes of this family's DiT (its single file, or its folder)."""
        transformer = Path(model_dir) / "transformer"
        return dit_bytes(transformer, self._dit(model_dir, files), dtype)

    def _dit(self, model_dir: Path, files: dict):
        return self.dit.file(Path(model_dir) / "transformer", files.get("dit"))

    def manifest(self, model_dir: Path, **files) -> dict:
        """The DiT's tensors by their diffusers names (docs/contract.md §2.4, naming
        "diffusers"), whatever the naming of its single file."""
        family, _ = self.identified(model_dir)
        transformer = Path(model_dir) / "transformer"
        tensors = dit_manifest(
            family, transformer, self.specs[family].title, self._dit(model_dir, files)
        )
        return {**tensors, **self.dit.manifest_extras(tensors)}

    def check(self, model_dir: Path, **files) -> None:
        """Refuse, before anything loads, a DiT or text encoder file that is cut short, is not
        this family's or holds a tensor of a shape the config does not give (gguf.GGUFError,
        naming the file and the tensor); likewise a DiT folder (DiTPart.check_folder), and a
        text encoder or VAE folder whose safetensors are not whole. The registry asks before
        it lets the resident model go."""
        model_dir = Path(model_dir)
        dit, encoder = self._dit(model_dir, files), self.encoder_files(model_dir, files)
        for found in (dit, encoder):
            if found is not None:
                found.open()
        if dit is None:
            self.dit.check_folder(model_dir / "transformer")
        folders = [model_dir / "vae"] + ([model_dir / "text_encoder"] if encoder is None else [])
        for folder in folders:
            for path in weight_files(folder):
                read_header(path)

    def quantized_files(self, model_dir: Path) -> dict:
        """What `gmlx model quantize` quantizes, by component folder and file tensor name:
        the weights a quantized load quantizes."""
        config = self.dit.config.from_dict(read_config(Path(model_dir) / "transformer"))
        return quantized_file_names(
            self.dit.linear_slots(config),
            self.dit.quantized,
            self.encoder.module_name,
            self.encoder.quantized,
        )
