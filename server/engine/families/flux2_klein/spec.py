"""FLUX.2 klein's facts (4B, 9B and 9B KV: three families of one folder), as data and without
MLX (engine/spec.py).

The folder is diffusers' `Flux2KleinPipeline` layout (or `Flux2KleinKVPipeline`'s) whose text
encoder is Qwen3. The family is the KV one for the KV pipeline, else the 9B one for a DiT of
9B's depth (8 double-stream blocks), else the 4B one; the variant is `distilled` when
model_index.json says `is_distilled` (always for the KV pipeline), else `base`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ...base import ReferenceSizes
from ...spec import (
    Conditioning,
    FamilySpec,
    Published,
    model_index,
    pipeline_components,
    read_config,
)

FAMILY_4B = "flux2_klein"
FAMILY_9B = "flux2_klein_9b"
FAMILY_9B_KV = "flux2_klein_9b_kv"
PIPELINE_CLASS = "Flux2KleinPipeline"
KV_PIPELINE_CLASS = "Flux2KleinKVPipeline"
TEXT_ENCODER_TYPE = "qwen3"
NINE_B_DOUBLE_BLOCKS = 8  # the 9B DiT's double-stream blocks (the 4B has 5)
MAX_REFS = 10
# The pipeline's text_encoder_out_layers (9, 18, 27) index hidden_states, whose entry 0 is the
# embeddings: decoder layers 8, 17 and 26, side by side.
TAPPED_LAYERS = (8, 17, 26)
# The decoder layers the encoder loads: the tapped ones and those before them (Qwen3-4B and
# Qwen3-8B have 36; the last 9 are never read).
LOADED_LAYERS = max(TAPPED_LAYERS) + 1
# The klein checkpoints' scheduler (FlowMatchEulerDiscreteScheduler, dynamic shifting).
SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}


def model_index_of(family: str, variant: str) -> dict:
    """model_index.json of a folder of `family` and `variant` (the KV pipeline's is always
    distilled)."""
    kv = family == FAMILY_9B_KV
    return {
        "_class_name": KV_PIPELINE_CLASS if kv else PIPELINE_CLASS,
        "is_distilled": kv or variant == "distilled",
        **pipeline_components(
            "Flux2Transformer2DModel",
            "AutoencoderKLFlux2",
            "Qwen3ForCausalLM",
            "Qwen2TokenizerFast",
        ),
    }


def identify(model_dir: Path) -> tuple[str, str] | None:
    """(family, variant) of a FLUX.2 klein folder whose text encoder is Qwen3, else None."""
    model_dir = Path(model_dir)
    index = model_index(model_dir)
    kind = index.get("_class_name")
    if kind not in (PIPELINE_CLASS, KV_PIPELINE_CLASS):
        return None
    if read_config(model_dir / "text_encoder").get("model_type") != TEXT_ENCODER_TYPE:
        return None
    if kind == KV_PIPELINE_CLASS:
        return FAMILY_9B_KV, "distilled"
    depth = read_config(model_dir / "transformer").get("num_layers", 0)
    family = FAMILY_9B if depth >= NINE_B_DOUBLE_BLOCKS else FAMILY_4B
    return family, "distilled" if index.get("is_distilled", False) else "base"


SPEC_4B = FamilySpec(
    name=FAMILY_4B,
    title="FLUX.2 klein",
    identify=identify,
    comfy={"model_class": "Flux2", "image_model": "flux2"},
    # ComfyUI's Flux2 places references by index (time coordinates 10, 20, ...); an empty
    # prompt is encoded as it is. Inpainting as Flux2KleinInpaintPipeline: the init image is
    # also the first reference, the mask reaches the latent grid bilinearly.
    conditioning=Conditioning(ref_method="index", inpaint_mask="bilinear", inpaint_reference=True),
    max_refs=MAX_REFS,
    # Flux2KleinPipeline's reference images: sides of at least 64, aspect at most 8, area at
    # most 1024x1024 (it resizes larger ones), sides multiples of 16 (it crops others).
    reference_sizes=ReferenceSizes(min_side=64, max_aspect=8, max_area=1024 * 1024),
    features=("noise_mask", "ref_cache"),
    sampling={
        "distilled": {"steps": 4, "cfg": 1.0, "shift": 1.0},
        "base": {"steps": 50, "cfg": 4.0, "shift": 1.0},
    },
    schedule={"rule": "flux2"},  # gmlx_contract.schedules.flux2_sigmas
    files=("dit", "text_encoder"),
    package=__package__,
)
# The three families: name, title, the checkpoints BFL publishes of each (repository
# black-forest-labs/FLUX.2-klein-<checkpoint>, `gmlx pull` name flux2-klein-<checkpoint>), and
# the conventions under which its DiT steps in parts: the KV model's under `reference`, where
# it runs its references first and keeps their K/V as the row's state.
SIZES = (
    (FAMILY_4B, "FLUX.2 klein", ("4B", "base-4B"), ()),
    (FAMILY_9B, "FLUX.2 klein 9B", ("9B", "base-9B"), ()),
    (FAMILY_9B_KV, "FLUX.2 klein 9B KV", ("9b-kv",), ("reference",)),
)
SPECS = tuple(
    replace(
        SPEC_4B,
        name=name,
        title=title,
        published=tuple(
            Published(f"flux2-klein-{c.lower()}", f"black-forest-labs/FLUX.2-klein-{c}")
            for c in checkpoints
        ),
        in_parts=in_parts,
    )
    for name, title, checkpoints, in_parts in SIZES
)
