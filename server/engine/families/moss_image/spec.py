"""MOSS-Image's facts, as data and without MLX (engine/spec.py).

The folder is the layout of upstream's diffusers custom pipeline (`MOSSImagePipeline`):
transformer/ (`MOSSImageTransformer`), text_encoder/ (Qwen3.5, whose language model alone is
read), tokenizer/, vae/ (FLUX.2's `AutoencoderKLFlux2` with a narrower decoder). The SFT and
base checkpoints share everything but the DiT's weights and sample alike; nothing in the files
tells them apart, so the variant is `base` where the folder's name says so, else `sft`.

The pipeline samples 50 steps at guidance 3 (`uncond + g (cond - uncond)`, ComfyUI's cfg as it
is), the negative pass leaving out block 22; its schedule is a static shift of 5 whose sigmas
snap to the 1000-step training grid (the `moss_image` rule of gmlx_contract.schedules). The DiT
embeds 1000 sigma, which is what a step's timestep carries (timestep_scale 0.001).
"""

from __future__ import annotations

from pathlib import Path

from gmlx_contract.schedules import moss_image_rule

from ...spec import FamilySpec, model_index, read_config

FAMILY = "moss_image"
PIPELINE_CLASS = "MOSSImagePipeline"
TRANSFORMER_CLASS = "MOSSImageTransformer"
SHIFT = 5.0
NEG_SKIP = (22,)  # the blocks the pipeline's negative pass leaves out
SAMPLING = {
    variant: {"steps": 50, "cfg": 3.0, "shift": SHIFT, "neg_skip": list(NEG_SKIP)}
    for variant in ("sft", "base")
}
# The pipeline's text layout: the prompt as one user turn of Qwen3.5's chat template with the
# generation prompt and thinking on, cut at MAX_SEQUENCE_LENGTH tokens; the final hidden states.
CHAT_TEXT = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n"
MAX_SEQUENCE_LENGTH = 4096


# A folder's model_index.json (engine/embedded.py's format).
MODEL_INDEX = {
    "_class_name": PIPELINE_CLASS,
    "_diffusers_version": "0.42.1",
    "text_encoder": ["transformers", "Qwen3_5ForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2TokenizerFast"],
    "transformer": ["pipeline_moss_image", TRANSFORMER_CLASS],
    "vae": ["diffusers", "AutoencoderKLFlux2"],
}


def pipeline_class(index: dict) -> str | None:
    """model_index.json's `_class_name`: a name, or a custom pipeline's [module, name]."""
    name = index.get("_class_name")
    if isinstance(name, list) and name:
        name = name[-1]
    return name if isinstance(name, str) else None


def identify(model_dir: Path) -> tuple[str, str] | None:
    """(family, variant) of a MOSS-Image folder (its model_index.json names the pipeline, or
    its transformer/ config the DiT), else None."""
    model_dir = Path(model_dir)
    try:
        found = pipeline_class(model_index(model_dir)) == PIPELINE_CLASS
    except (FileNotFoundError, ValueError):
        found = False
    if not found:
        try:
            config = read_config(model_dir / "transformer")
        except (FileNotFoundError, ValueError):
            return None
        if config.get("_class_name") != TRANSFORMER_CLASS:
            return None
    return FAMILY, "base" if "base" in model_dir.name.lower() else "sft"


SPEC = FamilySpec(
    name=FAMILY,
    title="MOSS-Image",
    identify=identify,
    comfy={"model_class": "MOSSImage", "image_model": "moss_image"},
    # No references (the default conditioning); an empty prompt is encoded as it is (the
    # template's tokens remain).
    features=("noise_mask", "skip_blocks"),
    timestep_scale=0.001,
    sampling=SAMPLING,
    schedule=moss_image_rule(SHIFT),
    files=("dit", "text_encoder"),
    shards=True,
    package=__package__,
)
SPECS = (SPEC,)
