"""A tiny deterministic image-model family for the route tests (tests only; the product ships
no fake model).

Every output is an exact numpy function of its inputs, so a test can compute what a route must
answer from the arrays it sent: `row_output` is that function for one row of a step. The model
can hold a step in flight (`hold_steps`) so interrupt tests can act while it runs.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
from gmlx_server.engine.base import (
    EncodeResult,
    EngineInputError,
    Facts,
    StepCall,
    StepResult,
    StepRow,
)

from ..numpy_models import NumpyImageModel, numpy_family

FAMILY = "test_linear"
PIPELINE_CLASS = "GmlxTestLinearPipeline"
CHANNELS = 4
STRIDE = 8
WIDTH = 8  # conditioning width D


def make_model_folder(root: Path, name: str, **index) -> Path:
    """A model folder of this family (model_index.json only; extra keys go into it)."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"_class_name": PIPELINE_CLASS, **index}
    (folder / "model_index.json").write_text(json.dumps(doc))
    return folder


def identify(model_dir: Path):
    index = json.loads((Path(model_dir) / "model_index.json").read_text())
    if index.get("_class_name") != PIPELINE_CLASS:
        return None
    return FAMILY, index.get("variant", "base")


def load(model_dir: Path, model_id: str) -> LinearModel:
    index = json.loads((Path(model_dir) / "model_index.json").read_text())
    if index.get("broken"):
        raise EngineInputError("the transformer does not match the family")
    return LinearModel(model_id, index.get("variant", "base"))


LINEAR = numpy_family(FAMILY, "test linear", identify, load)


# ---------------------------------------------------------------- the arithmetic


def text_cond(text: str) -> np.ndarray:
    """(1, L, D): one row per byte of the text (at least one row)."""
    codes = np.frombuffer((text or " ").encode("utf-8"), dtype=np.uint8).astype(np.float32)
    rows = codes[:, None] / 255.0 + np.arange(WIDTH, dtype=np.float32)[None, :] / WIDTH
    return rows[None].astype(np.float32)


def image_latent(image: np.ndarray) -> np.ndarray:
    """(1, C, H/8, W/8): the mean of each 8x8 block of channel c mod the image's channels."""
    values = np.asarray(image, dtype=np.float32)
    if values.max(initial=0) > 1.0:
        values = values / 255.0
    return vae_encode_array(values)[None]


def vae_encode_array(image: np.ndarray) -> np.ndarray:
    height, width, channels = image.shape
    h, w = height // STRIDE, width // STRIDE
    blocks = image[: h * STRIDE, : w * STRIDE].reshape(h, STRIDE, w, STRIDE, channels)
    means = blocks.mean(axis=(1, 3))  # (h, w, channels)
    return np.stack([means[..., c % channels] for c in range(CHANNELS)]).astype(np.float32)


def vae_decode_array(latents: np.ndarray, alpha: bool) -> np.ndarray:
    planes = latents[: 4 if alpha else 3]
    image = np.repeat(np.repeat(planes, STRIDE, axis=1), STRIDE, axis=2).transpose(1, 2, 0)
    return np.clip(image, 0.0, 1.0).astype(np.float32)


def row_output(x_row, t, cond, refs=(), slots=(), strength=0.0) -> np.ndarray:
    """The model output for one row: x * (1 + t) + a number made of the row's conditioning
    (cut to its token count), its references, its slots and the table's strength."""
    cond = np.asarray(cond, dtype=np.float32)
    shift = float(cond.astype(np.float64).mean()) + 0.001 * cond.shape[0]
    shift += sum(float(np.asarray(r, np.float64).mean()) for r in refs)
    shift += 0.01 * sum(slots) + 0.1 * len(refs) + strength
    x_row = np.asarray(x_row, dtype=np.float32)
    return (x_row * np.float32(1.0 + t) + np.float32(shift)).astype(np.float32)


def table_strength(table) -> float:
    if table is None:
        return 0.0
    return float(sum(p.strength * p.scale for e in table.entries for p in e.patches))


# ---------------------------------------------------------------- the model


class LinearModel(NumpyImageModel):
    """The whole `ImageModel` seam: its arithmetic here, the rest in tests/numpy_models.py
    (none inherited from the product), so a member the seam gains and this family lacks fails
    the registry's load."""

    family = FAMILY
    facts = Facts(CHANNELS, STRIDE, STRIDE, vae_channels_out=4, edit_capable=True, cond_width=WIDTH)
    weight_bytes = 64  # status memory.dit_bytes
    comfy = {"model_class": "TestLinear", "image_model": "test_linear"}
    tensors = ({"name": "proj.weight", "shape": [CHANNELS, CHANNELS], "dtype": "f32"},)

    def __init__(self, model_id: str, variant: str) -> None:
        self.model_id = model_id
        self.variant = variant
        self.closed = False
        self.ended_runs: list[str] = []
        self.step_calls = 0
        self.seen_keys: set = set()
        self.step_started = threading.Event()
        self._release = threading.Event()
        self._release.set()
        self.crash_next = False

    # test controls
    def hold_steps(self) -> None:
        self._release.clear()
        self.step_started.clear()

    def release_steps(self) -> None:
        self._release.set()

    # ImageModel
    def encode(self, text: str, images: list[np.ndarray], refs: bool) -> EncodeResult:
        cond = text_cond(text)
        length = cond.shape[1]
        slots = [min(i, length) for i in range(len(images))]
        latents = [image_latent(image) for image in images] if refs else []
        return EncodeResult(cond=cond, ref_latents=latents, image_slots=slots)

    def step(self, x, timestep, rows: list[StepRow], call: StepCall) -> StepResult:
        self.step_started.set()
        self._release.wait(30)
        self.step_calls += 1
        if self.crash_next:
            self.crash_next = False
            raise RuntimeError("the test model crashed on purpose")
        keys = [(r.cond_key, r.ref_keys, r.image_slots, x.shape[2:]) for r in rows]
        if any(not r.prefix_cache for r in rows):
            header = "off"
        else:
            header = "hit" if all(k in self.seen_keys for k in keys) else "miss"
            self.seen_keys.update(keys)
        strength = table_strength(call.table)
        out = np.stack(
            [
                row_output(x[i], float(timestep[i]), r.cond, r.ref_latents, r.image_slots, strength)
                for i, r in enumerate(rows)
            ]
        )
        return StepResult(out=out, prefix_cache=header, forward_ms=0.25)

    def check_patch_table(self, table) -> None:
        """Every key fits: the family applies a table as the sum of its strengths."""

    def end_run(self, run: str) -> None:
        self.ended_runs.append(run)

    def vae_decode(self, latents: np.ndarray, alpha: bool, tiled: bool = False) -> np.ndarray:
        if latents.shape[0] != CHANNELS:
            raise EngineInputError(f"latents need {CHANNELS} channels")
        return vae_decode_array(latents, alpha)

    def vae_encode(self, image: np.ndarray, tiled: bool = False) -> np.ndarray:
        return vae_encode_array(np.asarray(image, np.float32))

    def close(self) -> None:
        self.closed = True
