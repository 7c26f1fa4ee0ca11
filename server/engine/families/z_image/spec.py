"""Z-Image's facts, as data and without MLX (engine/spec.py): read by the registry, the
command line's listing and the embedded model's generator without loading the family.

The folder is diffusers' `ZImagePipeline` layout whose text encoder is Qwen3; the variant is
the one whose static shift is nearest the scheduler's `shift` (turbo: 3, base: 6).
"""

from __future__ import annotations

from pathlib import Path

from ...spec import (
    Conditioning,
    FamilySpec,
    Published,
    model_index,
    pipeline_components,
    read_config,
    read_json,
)

FAMILY = "z_image"
PIPELINE_CLASS = "ZImagePipeline"
TEXT_ENCODER_TYPE = "qwen3"  # text_encoder/config.json's model_type (Qwen3Model, Qwen3ForCausalLM)
# The variants' own settings (docs/contract.md §5.3); neither has fixed sigmas or a size rule.
SAMPLING = {
    "turbo": {"steps": 8, "cfg": 1.0, "shift": 3.0},
    "base": {"steps": 50, "cfg": 5.0, "shift": 6.0},
}

# The pipeline folder's model_index.json (its components' classes) and a variant's scheduler
# config, as diffusers writes them for Z-Image.
MODEL_INDEX = {
    "_class_name": PIPELINE_CLASS,
    **pipeline_components(
        "ZImageTransformer2DModel", "AutoencoderKL", "Qwen3ForCausalLM", "Qwen2Tokenizer"
    ),
}


def scheduler_config(variant: str) -> dict:
    """scheduler_config.json: the pipeline's flow-matching Euler at the variant's static shift."""
    return {
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "num_train_timesteps": 1000,
        "shift": SAMPLING[variant]["shift"],
        "use_dynamic_shifting": False,
    }


def identify(model_dir: Path) -> tuple[str, str] | None:
    """(family, variant) of a ZImagePipeline folder whose text encoder is Qwen3, else None.
    The variant is the one whose shift is nearest the scheduler's (turbo when the folder has
    no scheduler shift)."""
    model_dir = Path(model_dir)
    if model_index(model_dir).get("_class_name") != PIPELINE_CLASS:
        return None
    if read_config(model_dir / "text_encoder").get("model_type") != TEXT_ENCODER_TYPE:
        return None
    scheduler = model_dir / "scheduler" / "scheduler_config.json"
    shift = read_json(scheduler).get("shift")
    if shift is None:
        return FAMILY, "turbo"
    return FAMILY, min(SAMPLING, key=lambda name: abs(SAMPLING[name]["shift"] - float(shift)))


SPEC = FamilySpec(
    name=FAMILY,
    title="Z-Image",
    identify=identify,
    comfy={"model_class": "ZImage", "image_model": "lumina2"},
    # No references; an empty prompt is encoded as it is (the chat template's tokens remain).
    # ZImageInpaintPipeline brings the mask to the latent grid by nearest neighbour.
    conditioning=Conditioning(inpaint_mask="nearest"),
    latent_stride=8,
    latent_patch=2,
    # The VAE tiles images past its sample_size as diffusers' tiling does, which is not the
    # untiled pass: docs/contract.md §8 says so.
    features=("noise_mask", "tiled_vae"),
    sampling=SAMPLING,
    files=("dit", "text_encoder"),
    shards=True,
    published=(Published("z-image-turbo", "Tongyi-MAI/Z-Image-Turbo"),),
    package=__package__,
)
SPECS = (SPEC,)
