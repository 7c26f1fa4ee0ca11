"""Krea 2's facts, as data and without MLX (engine/spec.py).

The folder is diffusers' `Krea2Pipeline` layout: transformer/ (Krea2Transformer2DModel), vae/
(Qwen-Image's AutoencoderKLQwenImage), text_encoder/ (Qwen3-VL), tokenizer/, scheduler/. The
variant is `turbo` when model_index.json says `is_distilled` (the few-step checkpoint), else
`raw` (the base one).

The pipeline's schedule is a linspace from 1 to 1/steps under an exponential time shift of
`mu`: the distilled checkpoint's fixed mu = 1.15, which is a static shift of e^1.15; the base
checkpoint's mu follows the image's token count (the `krea2` size rule of
gmlx_contract.schedules). Its guidance is `cond + g (cond - uncond)`: the pipeline's default
g = 4.5 is ComfyUI's cfg 5.5.
"""

from __future__ import annotations

import math

from gmlx_contract.schedules import krea2_rule

from ...spec import ByClass, FamilySpec, pipeline_components

FAMILY = "krea2"
PIPELINE_CLASS = "Krea2Pipeline"
TURBO_MU = 1.15  # the distilled checkpoint's fixed time-shift exponent (Krea2Pipeline)
SAMPLING = {
    "turbo": {"steps": 8, "cfg": 1.0, "shift": math.exp(TURBO_MU), "schedule": None},
    "raw": {"steps": 28, "cfg": 5.5, "shift": 1.0},
}
# The pipeline's text layout: the template's system prefix (its first PREFIX_ROWS tokens are
# dropped from the encoding), the prompt, then the assistant suffix; hidden states tapped after
# these entries of the encoder's `hidden_states` (0 is the embedding output), stacked per token.
PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n"
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
PREFIX_ROWS = 34
SUFFIX_TOKENS = 5
MAX_SEQUENCE_LENGTH = 512  # the pipeline's default: prefix and prompt keep 512 + 34 - 5 tokens
SELECT_LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)


# The pipeline's scheduler, and its model_index.json (engine/embedded.py's format).
SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": "0.42.1",
    "num_train_timesteps": 1000,
    "use_dynamic_shifting": True,
    "time_shift_type": "exponential",
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 6400,
}


def model_index_of(variant: str, select_layers) -> dict:
    """model_index.json of a Krea 2 folder of this variant, tapping `select_layers`."""
    return {
        "_class_name": PIPELINE_CLASS,
        "_diffusers_version": "0.42.1",
        "is_distilled": variant == "turbo",
        "patch_size": 2,
        "text_encoder_select_layers": list(select_layers),
        **pipeline_components(
            "Krea2Transformer2DModel",
            "AutoencoderKLQwenImage",
            "Qwen3VLModel",
            "Qwen2TokenizerFast",
        ),
    }


SPEC = FamilySpec(
    name=FAMILY,
    title="Krea 2",
    identify=ByClass(FAMILY, PIPELINE_CLASS, flag="is_distilled", variants=("turbo", "raw")),
    comfy={"model_class": "Krea2", "image_model": "krea2"},
    # No references (the default conditioning); an empty prompt is encoded as it is (the
    # template's tokens remain).
    latent_stride=8,
    latent_patch=2,
    sampling=SAMPLING,
    schedule=krea2_rule(),
    files=("dit", "text_encoder", "mmproj"),
    shards=True,
    package=__package__,
)
SPECS = (SPEC,)
