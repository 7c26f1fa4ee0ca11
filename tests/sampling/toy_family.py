"""A deterministic image model for the sampler's transport tests (tests only).

It implements the ImageModel seam in numpy with arithmetic that depends on every input a step
carries (x, the timestep, each row's conditioning, its length, reference latents and slots), so
a transport that changed any of them would change the final latents. It is registered with the
server's registry as the family "toy" for folders whose model_index.json names `ToyPipeline`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from gmlx_server.engine.base import (
    EncodeResult,
    EngineInputError,
    Facts,
    StepCall,
    StepResult,
)

from ..numpy_models import NumpyImageModel, numpy_family

FAMILY = "toy"
PIPELINE_CLASS = "ToyPipeline"
CHANNELS = 4
WIDTH = 8  # conditioning width D
STRIDE = 16


def make_folder(root: Path, name: str = "toy-model", sigmas: list[float] | None = None) -> Path:
    """A toy model folder; with `sigmas` (ending in 0) a turbo variant that samples only them."""
    folder = Path(root) / name
    folder.mkdir(parents=True, exist_ok=True)
    index = {"_class_name": PIPELINE_CLASS, "sigmas": sigmas}
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def _index(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "model_index.json").read_text())


def identify(model_dir: Path):
    index = _index(model_dir)
    if index.get("_class_name") != PIPELINE_CLASS:
        return None
    return FAMILY, "turbo" if index.get("sigmas") else "base"


def load(model_dir: Path, model_id: str) -> ToyModel:
    return ToyModel(model_id, _index(model_dir).get("sigmas"))


TOY = numpy_family(FAMILY, "toy", identify, load)


def _text_rows(text: str) -> np.ndarray:
    """(1, L, D) float32 from the text alone: L = words + 1, values from a hash-seeded rng."""
    seed = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little")
    length = len(text.split()) + 1
    return np.random.default_rng(seed).standard_normal((1, length, WIDTH), dtype=np.float32)


class ToyModel(NumpyImageModel):
    family = FAMILY
    facts = Facts(CHANNELS, STRIDE, STRIDE, vae_channels_out=3, edit_capable=True, cond_width=WIDTH)
    comfy = {"model_class": "Toy", "image_model": "toy"}

    def __init__(self, model_id: str, sigmas: list[float] | None = None) -> None:
        self.model_id = model_id
        self.sigmas = sigmas
        self.variant = "turbo" if sigmas else "base"
        self.mixer = np.random.default_rng(1).standard_normal((CHANNELS, WIDTH), dtype=np.float32)
        self.calls: list[tuple[int, str | None]] = []  # (rows, run) per step
        self.ended: list[str] = []

    def sampling(self) -> dict:
        return {
            "steps": len(self.sigmas) - 1 if self.sigmas else 4,
            "cfg": 1.0,
            "shift": 1.0,
            "sigmas": self.sigmas,
            "schedule": None,
            "neg_skip": [],
        }

    def encode(self, text: str, images: list[np.ndarray], refs: bool) -> EncodeResult:
        cond = _text_rows(text)
        latents, slots = [], []
        for i, image in enumerate(images):
            pixels = np.asarray(image, dtype=np.float32)[..., :3] / 255.0
            h, w = pixels.shape[0] // STRIDE, pixels.shape[1] // STRIDE
            pooled = pixels[: h * STRIDE, : w * STRIDE].reshape(h, STRIDE, w, STRIDE, 3)
            pooled = pooled.mean(axis=(1, 3)).transpose(2, 0, 1)  # (3, h, w)
            latent = np.concatenate([pooled, pooled[:1] * 0.5], axis=0)[None].astype(np.float32)
            if refs:
                latents.append(latent)
            slots.append(min(i, cond.shape[1]))
        return EncodeResult(cond=cond, ref_latents=latents, image_slots=slots)

    def step(self, x, timestep, rows, call: StepCall) -> StepResult:
        if x.shape[0] != len(rows):
            raise EngineInputError("one row per batch entry")
        self.calls.append((len(rows), call.run))
        out = np.empty_like(x, dtype=np.float32)
        for i, row in enumerate(rows):
            t = np.float32(timestep[i])
            context = self.mixer @ row.cond.mean(axis=0)  # (C,)
            context = context * np.float32(1.0 + 0.1 * row.cond.shape[0])
            refs = row.ref_latents
            slots = row.image_slots + (0,) * (len(refs) - len(row.image_slots))
            for ref, slot in zip(refs, slots, strict=True):
                context = context + ref.mean(axis=(1, 2)) * np.float32(1 + slot)
            out[i] = np.tanh(x[i] * (np.float32(1.0) - t) + context[:, None, None] * t)
        return StepResult(out=out, prefix_cache="none", forward_ms=0.01)

    def end_run(self, run: str) -> None:
        self.ended.append(run)

    def check_patch_table(self, table) -> None:
        raise EngineInputError("the toy model takes no patch tables")

    def vae_decode(self, latents: np.ndarray, alpha: bool, tiled: bool = False) -> np.ndarray:
        image = 1.0 / (1.0 + np.exp(-latents[:3].transpose(1, 2, 0)))
        return np.repeat(np.repeat(image, STRIDE, axis=0), STRIDE, axis=1).astype(np.float32)

    def vae_encode(self, image: np.ndarray, tiled: bool = False) -> np.ndarray:
        raise EngineInputError("the toy model encodes no images")

    def close(self) -> None:
        pass
