"""Z-Image as an `ImageModel`: the DiT, the VAE and the prompt encoder of one folder.

The folder is diffusers' `ZImagePipeline` layout: model_index.json (`_class_name`
"ZImagePipeline"), transformer/, vae/ (the FLUX.1 AutoencoderKL), text_encoder/ (Qwen3, its
config's `model_type` "qwen3"), tokenizer/, scheduler/. The variant is the one whose static
shift is nearest the scheduler's `shift` (turbo: 3, base: 6). The family takes no reference
images and keeps no prefix states. The constants of the family live here.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ...base import Capabilities, EncodeResult, EngineInputError, StepResult, StepRow
from ...family import FamilyModel, dit_manifest
from ...lora import TableWeights
from ...nn import cpu_ops
from ...nn.dtypes import default_compute_dtype, dtype_name
from ...shard import Shard
from ...vaes.autoencoder_kl import latent_normalisation
from ...weights import component_bytes, read_config
from .dit import DiTConfig, ZImageDiT, linear_slots, padded
from .prompt import TEMPLATE

FAMILY = "z_image"
TITLE = "Z-Image"
PIPELINE_CLASS = "ZImagePipeline"
TEXT_ENCODER_TYPE = "qwen3"  # text_encoder/config.json's model_type (Qwen3Model, Qwen3ForCausalLM)
COMFY = {"model_class": "ZImage", "image_model": "lumina2"}
# What a client needs to condition this family (as Qwen-Image 2.1 publishes it): no references,
# and an empty prompt is encoded as it is (the chat template's own tokens remain).
CONDITIONING = {"ref_method": None, "empty_prompt": TEMPLATE.empty_prompt}
LATENT_STRIDE = 8
LATENT_PATCH = 2
VAE_STRIDE = 8
# The variants' own settings (docs/contract.md §5.3); neither has fixed sigmas or a size rule.
SAMPLING = {
    "turbo": {"steps": 8, "cfg": 1.0, "shift": 3.0},
    "base": {"steps": 50, "cfg": 5.0, "shift": 6.0},
}
FEATURES = ("noise_mask",)
# Step conventions (docs/contract.md §5.2): both read the timestep as sigma (scale 1, shift 0)
# and answer +dx/dsigma; the DiT itself runs at t = 1 - sigma and its output is negated.
CONVENTIONS = ("comfy", "reference")

# ------------------------------------------------------ memory plan (docs/contract.md §3.5)
# A step's peak beyond the weights, counted in buffers of the DiT's shapes, per token of a row:
TOKEN_WIDTH_BUFFERS = 10  # hidden, its normed form, q, k, v, the attention out, residual sums
TOKEN_F32_BUFFERS = 4  # q and k in float32 around their RMS norm and RoPE
MLP_BUFFERS = 8  # gate and up, SiLU's temporaries and the product, at the MLP's width
# cpu_ops.attention (the CPU backend in float32) holds one block of scores at a time per row.
SCORE_BLOCK_BUFFERS = 8


def _model_index(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "model_index.json").read_text(encoding="utf-8"))


def _scheduler_shift(model_dir: Path) -> float | None:
    path = Path(model_dir) / "scheduler" / "scheduler_config.json"
    if not path.is_file():
        return None
    shift = json.loads(path.read_text(encoding="utf-8")).get("shift")
    return None if shift is None else float(shift)


def identify(model_dir: Path) -> tuple[str, str] | None:
    """(family, variant) of a ZImagePipeline folder whose text encoder is Qwen3, else None.
    The variant is the one whose shift is nearest the scheduler's (turbo when the folder has
    no scheduler shift)."""
    if _model_index(model_dir).get("_class_name") != PIPELINE_CLASS:
        return None
    if read_config(Path(model_dir) / "text_encoder").get("model_type") != TEXT_ENCODER_TYPE:
        return None
    shift = _scheduler_shift(model_dir)
    if shift is None:
        return FAMILY, "turbo"
    variant = min(SAMPLING, key=lambda name: abs(SAMPLING[name]["shift"] - shift))
    return FAMILY, variant


def sampling_row(variant: str) -> dict:
    """The variant's own settings (docs/contract.md §2.3)."""
    return {**SAMPLING[variant], "sigmas": None, "schedule": None, "neg_skip": []}


def describe(model_dir: Path, model_id: str | None = None, dtype: mx.Dtype | None = None) -> dict:
    """The family part of the status (docs/contract.md §2.3), from config files alone."""
    model_dir = Path(model_dir)
    found = identify(model_dir)
    if found is None:
        raise EngineInputError(f"{model_dir} is not a {TITLE} folder")
    dit_config = read_config(model_dir / "transformer")
    vae_config = read_config(model_dir / "vae")
    mean, std = latent_normalisation(vae_config)
    return {
        "comfy": dict(COMFY),
        "latent": {
            "channels": dit_config.get("in_channels", 16),
            "stride": LATENT_STRIDE,
            "patch": LATENT_PATCH,
        },
        "vae": {
            "channels_out": vae_config.get("out_channels", 3),
            "stride": VAE_STRIDE,
            # Extension of docs/contract.md §2.3 (as Qwen-Image 2.1 publishes it): model space
            # is (z - latents_mean) / latents_std, here (z - shift_factor) * scaling_factor.
            "latents_mean": mean,
            "latents_std": std,
        },
        "edit_capable": False,
        "conditioning": dict(CONDITIONING),
        "sampling": sampling_row(found[1]),
        "compute_dtype": dtype_name(dtype or default_compute_dtype()),
        "memory": {
            "dit_bytes": component_bytes(model_dir / "transformer"),
            "encoder_bytes": component_bytes(model_dir / "text_encoder"),
            "vae_bytes": component_bytes(model_dir / "vae"),
        },
    }


def manifest(model_dir: Path) -> dict:
    """The DiT's tensors by their diffusers names (docs/contract.md §2.4, naming "diffusers")."""
    return dit_manifest(FAMILY, Path(model_dir) / "transformer", TITLE)


def load(model_dir: Path, model_id: str, shard: Shard | None = None) -> ZImageModel:
    """The model of a folder; with a `shard`, the DiT is this rank's part of it
    (dit.shard_plan), and the VAE and the text encoder load on rank 0 only."""
    from ...vaes.autoencoder_kl import AutoencoderKL
    from .prompt import ZImagePromptEncoder

    model_dir = Path(model_dir)
    found = identify(model_dir)
    if found is None:
        raise EngineInputError(f"{model_dir} is not a {TITLE} folder")
    dit = ZImageDiT.load(model_dir / "transformer", shard=shard)
    if shard is not None and shard.rank != 0:
        return ZImageModel(model_dir, model_id, found[1], dit, None, None)
    vae = AutoencoderKL.load(model_dir / "vae")
    encoder = ZImagePromptEncoder.load(model_dir)
    if encoder.hidden_size != dit.config.cap_feat_dim:
        raise ValueError(
            f"the text encoder's width {encoder.hidden_size} differs from the DiT's caption"
            f" width {dit.config.cap_feat_dim}"
        )
    return ZImageModel(model_dir, model_id, found[1], dit, vae, encoder)


def step_peak_bytes(config: DiTConfig, itemsize: int, lengths: list[int], blocked: bool) -> int:
    """Peak bytes of one step beyond the weights for rows of `lengths` tokens each (image and
    caption, padded): the batch runs padded to the longest. Pure: no allocation."""
    if not lengths:
        return 0
    longest = max(lengths)
    per_token = (
        TOKEN_WIDTH_BUFFERS * config.dim * itemsize
        + TOKEN_F32_BUFFERS * config.dim * 4
        + MLP_BUFFERS * config.hidden_dim * itemsize
    )
    total = len(lengths) * longest * per_token
    if blocked:  # a block of scores per row (the rows' attentions may run side by side)
        rows, group = cpu_ops._block_shape(config.num_heads, longest, longest)
        total += len(lengths) * SCORE_BLOCK_BUFFERS * min(rows, longest) * group * longest * 4
    return total


class ZImageModel(FamilyModel):
    family = FAMILY
    capabilities = Capabilities(max_refs=0, conventions=CONVENTIONS)

    def __init__(self, model_dir: Path, model_id: str, variant: str, dit, vae, encoder):
        super().__init__(
            model_dir,
            model_id,
            variant,
            vae=vae,
            tables=TableWeights(
                dit.weights, linear_slots(dit.config), dit.dtype, shard=dit.stages.tree_shard
            ),
            status=describe(model_dir, model_id, dit.dtype),
            read_manifest=manifest,
            weight_bytes=sum(p.weight_bytes for p in (dit, vae, encoder) if p is not None),
        )
        self.dit = dit
        self.encoder = encoder

    def encode(self, text: str, images: list[np.ndarray], refs: bool) -> EncodeResult:
        if images:
            raise EngineInputError(f"{TITLE} takes no reference images")
        return EncodeResult(cond=self.encoder.encode(text))

    def step_peak_bytes(
        self, x_shape: tuple, rows: list[StepRow] | None, table=None, plans=None
    ) -> int:
        """Without rows (the quick plan) the image tokens alone; with them each row's caption."""
        batch, _, h, w = x_shape
        image = padded((h // LATENT_PATCH) * (w // LATENT_PATCH))
        captions = [0] * batch if rows is None else [padded(_cond_rows(row)) for row in rows]
        # dit.cpu_ops was read at load: the quick plan runs on an HTTP thread, never asks MLX
        return step_peak_bytes(
            self.dit.config, self.dit.dtype.size, [image + n for n in captions], self.dit.cpu_ops
        )

    def denoise_step(
        self,
        x: np.ndarray,
        timestep: np.ndarray,
        rows: list[StepRow],
        *,
        convention: str = "comfy",
        run: str | None = None,
        table: object | None = None,
        plans=None,
        ref_cache: bool = False,
        skip: tuple[int, ...] = (),
        sample_sigmas: np.ndarray | None = None,
    ) -> StepResult:
        """dx/dsigma for x (B, C, h, w) at sigma = timestep (both conventions), one row per
        batch entry: the DiT's raw output at t = 1 - sigma, negated."""
        x = self._check_latents(x, rows)
        if convention not in CONVENTIONS:
            raise EngineInputError(
                f"unknown convention {convention!r} for {FAMILY}; use one of {list(CONVENTIONS)}"
            )
        sigma = _row_sigmas(timestep, x.shape[0])
        caps = [mx.array(self._check_cond(row, index)) for index, row in enumerate(rows)]
        started = time.perf_counter()
        t = mx.array(np.float32(1.0) - sigma)
        raw = self.dit.forward(mx.array(x), t, caps, self.tables.weights_for(table))
        out = -raw.astype(mx.float32)
        mx.eval(out)
        forward_ms = (time.perf_counter() - started) * 1000.0
        return StepResult(out=np.array(out), prefix_cache="none", forward_ms=forward_ms)

    def _check_latents(self, x: np.ndarray, rows: list[StepRow]) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        channels = self.dit.config.in_channels
        if x.ndim != 4 or x.shape[0] != len(rows) or x.shape[1] != channels:
            raise EngineInputError(
                f"x must be (rows, {channels}, h, w) with one row per batch entry,"
                f" got {x.shape} for {len(rows)} rows"
            )
        _, _, h, w = x.shape
        if h == 0 or w == 0 or h % LATENT_PATCH or w % LATENT_PATCH:
            raise EngineInputError(
                f"latents {h}x{w}: h and w must be positive multiples of the patch {LATENT_PATCH}"
            )
        return x

    def _check_cond(self, row: StepRow, index: int) -> np.ndarray:
        if row.ref_latents:
            raise EngineInputError(f"rows[{index}]: {TITLE} takes no reference latents")
        cond = np.asarray(row.cond, dtype=np.float32)
        if cond.ndim == 3 and cond.shape[0] == 1:
            cond = cond[0]
        width = self.dit.config.cap_feat_dim
        if cond.ndim != 2 or cond.shape[1] != width or cond.shape[0] < 1:
            raise EngineInputError(
                f"rows[{index}]: conditioning must be (1, L, {width}) or (L, {width}) with L >= 1,"
                f" got {tuple(np.shape(row.cond))}"
            )
        return cond

    def close(self) -> None:
        self.dit = self.encoder = None
        super().close()


def _cond_rows(row: StepRow) -> int:
    shape = np.shape(row.cond)
    return int(shape[-2]) if len(shape) >= 2 else 0


def _row_sigmas(timestep: np.ndarray, batch: int) -> np.ndarray:
    """The per-row sigma (float32): the timestep itself under both conventions."""
    values = np.asarray(timestep, dtype=np.float64).reshape(-1)
    if values.size == 1:
        values = np.repeat(values, batch)
    if values.size != batch:
        raise EngineInputError(f"timestep has {values.size} values for {batch} rows")
    return values.astype(np.float32)
