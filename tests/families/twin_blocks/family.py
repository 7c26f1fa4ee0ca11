"""The twin-blocks family (tests only): a DiT of two block kinds with fused and unfused
projections and no prefix cache, its own prompt encoder and VAE, laid out as a family of the
engine is, to prove the seam: this folder and its spec are all it takes.

Status facts come from the config files alone (`describe`); the generic half of the loaded
model (status copy, manifest, patch tables, VAE routes, planning defaults) is FamilyModel's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from gmlx_server.engine.base import Capabilities, EncodeResult, EngineInputError, StepResult
from gmlx_server.engine.family import FamilyModel, dit_manifest
from gmlx_server.engine.lora import TableWeights
from gmlx_server.engine.nn.dtypes import default_compute_dtype, dtype_name
from gmlx_server.engine.spec import Family, FamilySpec
from gmlx_server.engine.weights import component_bytes, read_config

from .checkpoint import PIPELINE_CLASS
from .dit import TwinBlocksDiT, linear_slots
from .parts import ByteEncoder, PatchVAE

FAMILY = "twin_blocks"
SAMPLING = {"steps": 4, "cfg": 1.0, "shift": 1.0, "sigmas": None, "neg_skip": []}
SCHEDULE = {"rule": "flux2"}
STEP_BUFFERS = 16  # activations of one token per row, in widths of the hidden size


def identify(model_dir: Path) -> tuple[str, str] | None:
    index = json.loads((Path(model_dir) / "model_index.json").read_text())
    return (FAMILY, "base") if index.get("_class_name") == PIPELINE_CLASS else None


def describe(model_dir: Path, model_id: str | None = None) -> dict:
    model_dir = Path(model_dir)
    dit, vae = read_config(model_dir / "transformer"), read_config(model_dir / "vae")
    channels, stride = int(dit["channels"]), int(vae["stride"])
    return {
        "comfy": {"model_class": "TwinBlocks", "image_model": FAMILY},
        "latent": {"channels": channels, "stride": stride, "patch": 1},
        "vae": {
            "channels_out": 3,
            "stride": stride,
            "latents_mean": [0.0] * channels,
            "latents_std": [1.0 / float(vae["scaling_factor"])] * channels,
        },
        "edit_capable": False,
        "sampling": {**SAMPLING, "schedule": dict(SCHEDULE)},
        "compute_dtype": dtype_name(default_compute_dtype()),
        "memory": {
            "dit_bytes": component_bytes(model_dir / "transformer"),
            "encoder_bytes": component_bytes(model_dir / "text_encoder"),
            "vae_bytes": component_bytes(model_dir / "vae"),
        },
    }


def manifest(model_dir: Path) -> dict:
    return dit_manifest(FAMILY, Path(model_dir) / "transformer", "twin-blocks")


def load(model_dir: Path, model_id: str) -> TwinBlocksModel:
    model_dir = Path(model_dir)
    dit = TwinBlocksDiT.load(model_dir / "transformer", default_compute_dtype())
    vae = PatchVAE.load(model_dir / "vae")
    encoder = ByteEncoder.load(model_dir / "text_encoder")
    return TwinBlocksModel(model_dir, model_id, dit, vae, encoder)


class TwinBlocks(Family):
    """The family as the registry takes it: status and manifest from the files."""

    def describe(self, model_dir: Path, model_id: str | None = None, **files) -> dict:
        return describe(model_dir, model_id)

    def manifest(self, model_dir: Path, **files) -> dict:
        return manifest(model_dir)


SPEC = FamilySpec(
    name=FAMILY,
    title="twin-blocks",
    identify=identify,
    implementation=f"{__name__}:TWIN_BLOCKS",
    features=("noise_mask",),
    quantizes=False,
    encoder_vae_dtype=False,
)
TWIN_BLOCKS = TwinBlocks(SPEC, load)


class TwinBlocksModel(FamilyModel):
    family = FAMILY
    capabilities = Capabilities(max_refs=0)

    def __init__(self, model_dir: Path, model_id: str, dit, vae, encoder):
        super().__init__(
            model_dir,
            model_id,
            "base",
            vae=vae,
            tables=TableWeights(dit.weights, linear_slots(dit.config), dit.dtype),
            status=describe(model_dir, model_id),
            read_manifest=manifest,
            weight_bytes=dit.weight_bytes + vae.weight_bytes + encoder.weight_bytes,
        )
        self.dit, self.encoder = dit, encoder

    def encode(self, text: str, images: list[np.ndarray], refs: bool) -> EncodeResult:
        if images:
            raise EngineInputError("the twin-blocks family takes no reference images")
        return EncodeResult(cond=self.encoder.encode(text))

    def step_peak_bytes(self, x_shape, rows, table=None, plans=None) -> int:
        """Every row's text (as long as its conditioning) and image tokens at the DiT's width."""
        batch, channels, h, w = x_shape
        text = max((np.shape(row.cond)[-2] for row in rows), default=0) if rows else 0
        tokens = text + h * w
        width = STEP_BUFFERS * max(self.dit.config.hidden, self.dit.config.mlp)
        return batch * tokens * (width * self.dit.dtype.size + tokens * 4 * self.dit.config.heads)

    def denoise_step(
        self,
        x,
        timestep,
        rows,
        *,
        convention="comfy",
        run=None,
        table=None,
        plans=None,
        ref_cache=False,
        skip=(),
        sample_sigmas=None,
    ) -> StepResult:
        x = np.asarray(x, np.float32)
        config = self.dit.config
        if x.ndim != 4 or x.shape[0] != len(rows) or x.shape[1] != config.channels:
            raise EngineInputError(f"x must be (rows, {config.channels}, h, w), got {x.shape}")
        batch, channels, h, w = x.shape
        sigmas = np.broadcast_to(np.asarray(timestep, np.float32).reshape(-1), (batch,))
        weights = self.tables.weights_for(table)
        started = time.perf_counter()
        outs = []
        for index, row in enumerate(rows):
            cond = np.asarray(row.cond, np.float32).reshape(1, -1, config.text_width)
            tokens = mx.array(x[index].reshape(channels, h * w).T[None])
            out = self.dit.forward(weights, tokens, float(sigmas[index]), mx.array(cond))
            outs.append(out.astype(mx.float32)[0].T.reshape(channels, h, w))
        out = mx.stack(outs)
        mx.eval(out)
        return StepResult(np.array(out), "none", (time.perf_counter() - started) * 1000.0)
