"""Qwen-Image 2.1's facts, as data and without MLX (engine/spec.py).

The folder is in diffusers layout (model_index.json's `_class_name` "QwenImage21Pipeline");
the variant is `turbo` when model_index.json carries `sample_sigmas` (a fixed schedule), else
`base`.
"""

from __future__ import annotations

from ...base import ReferenceSizes
from ...spec import ByClass, Conditioning, FamilySpec, Published

FAMILY = "qwen_image21"
PIPELINE_CLASS = "QwenImage21Pipeline"
# What an empty prompt is encoded as: Qwen has no BOS token, so an empty prompt would leave the
# encoder nothing to read (its pipeline's rule).
EMPTY_PROMPT = " "
# Its reference images (docs/contract.md §2.6): any sides, from 256x256 to 1024x1024 pixels of
# area, each resized at its own area to sides in 32s by the encoder (images.py); the server's
# own sampler brings a picture outside that to the pipeline's size, 1024x1024 pixels at its
# aspect (engine/reference_images.py).
REFERENCE_SIZES = ReferenceSizes(
    min_side=1, min_area=256 * 256, max_area=1024 * 1024, side_multiple=32
)


SPEC = FamilySpec(
    name=FAMILY,
    title="Qwen-Image 2.1",
    identify=ByClass(FAMILY, PIPELINE_CLASS, flag="sample_sigmas", variants=("turbo", "base")),
    comfy={"model_class": "QwenImage21", "image_model": "qwen_image21"},
    # The DiT places references by index (ComfyUI's `ref_latents_method`).
    conditioning=Conditioning(ref_method="index", empty_prompt=EMPTY_PROMPT),
    latent_stride=16,
    max_refs=10,
    reference_sizes=REFERENCE_SIZES,
    features=("prefix_cache", "noise_mask", "rgba_vae", "tiled_vae"),
    in_parts=("comfy", "reference"),  # its time rule is the reference one under both
    sampling={
        "base": {"steps": 40, "cfg": 1.0, "shift": 1.0},
        "turbo": {"cfg": 1.0, "shift": 1.0},  # its steps: its fixed sigmas'
    },
    files=("dit", "text_encoder", "mmproj"),
    shards=True,
    published=(Published("qwen-image-2.1", "Qwen/Qwen-Image-2.1"),),
    package=__package__,
)
SPECS = (SPEC,)
