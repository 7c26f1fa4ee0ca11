"""FLUX.3 klein's facts, as data and without MLX (engine/spec.py).

The folder is diffusers' layout of the FLUX.3 modular pipelines (`Flux3ModularPipeline`, the
base checkpoint, and `Flux3DistilledModularPipeline`, the step-distilled one): transformer/
(Flux3Transformer2DModel), vae/ (AutoencoderKLFlux2), text_encoder/ (Qwen3-VL), tokenizer/ (its
processor's tokenizer), scheduler/. The DiT's config says which checkpoint it is: `flow_map`
(the distilled one, which embeds the time each step jumps to) is the `distilled` variant, else
`base`.

The pipelines' schedule is a linspace from 1 to 1/steps under the static shift 6.93
(FlowMatchEulerDiscreteScheduler's `shift`), then 0: 16 unguided steps for the distilled
checkpoint, each jumping to the next sigma; 50 steps at guidance 3.5
(`uncond + g (cond - uncond)`, ComfyUI's cfg as it is) for the base one.
"""

from __future__ import annotations

from ...base import ReferenceSizes
from ...spec import ByClass, Conditioning, FamilySpec, pipeline_components

FAMILY = "flux3_klein"
TRANSFORMER_CLASS = "Flux3Transformer2DModel"
SHIFT = 6.93  # the pipelines' scheduler shift
MAX_REFS = 10
SAMPLING = {
    "distilled": {"steps": 16, "cfg": 1.0, "shift": SHIFT, "flow_map": True},
    "base": {"steps": 50, "cfg": 3.5, "shift": SHIFT, "flow_map": False},
}
# The pipeline's text layout: the prompt as one user turn of Qwen3-VL's chat template with the
# generation prompt, cut at MAX_SEQUENCE_LENGTH tokens and right-padded to a multiple of
# PAD_MULTIPLE; the hidden states after these entries of the encoder's `hidden_states` (0 is
# the embedding output), stacked per token.
CHAT_TEXT = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
MAX_SEQUENCE_LENGTH = 8192
PAD_MULTIPLE = 80
OUT_LAYERS = (4, 8, 12, 16, 20, 24, 28, 32)


# The pipelines' scheduler, and a folder's model_index.json (engine/embedded.py's format).
SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": "0.42.1",
    "num_train_timesteps": 1000,
    "shift": SHIFT,
    "use_dynamic_shifting": False,
}
PIPELINE_CLASSES = {"distilled": "Flux3DistilledModularPipeline", "base": "Flux3ModularPipeline"}


def model_index_of(variant: str, out_layers) -> dict:
    """model_index.json of a FLUX.3 klein folder of this variant, tapping `out_layers`."""
    return {
        "_class_name": PIPELINE_CLASSES[variant],
        "_diffusers_version": "0.42.1",
        "text_encoder_out_layers": list(out_layers),
        **pipeline_components(
            TRANSFORMER_CLASS, "AutoencoderKLFlux2", "Qwen3VLModel", "Qwen3VLProcessor"
        ),
    }


SPEC = FamilySpec(
    name=FAMILY,
    title="FLUX.3 klein",
    identify=ByClass(
        FAMILY,
        TRANSFORMER_CLASS,
        flag="flow_map",
        variants=("distilled", "base"),
        document="transformer/config.json",
    ),
    comfy={"model_class": "Flux3", "image_model": "flux3"},
    # References are told apart by their index (their own RoPE layer); an empty prompt is
    # encoded as it is (the template's tokens remain).
    conditioning=Conditioning(ref_method="index"),
    max_refs=MAX_REFS,
    # The pipeline's reference images: sides multiples of the stride from 64 to 4096; one of
    # at most 4 megapixels, kept whole (downscaled and padded), or several of at most 1
    # megapixel each (downscaled and cropped).
    reference_sizes=ReferenceSizes(
        min_side=64,
        max_side=4096,
        max_area=1024 * 1024,
        lone_max_area=4 * 1024 * 1024,
        lone_fit="pad",
    ),
    features=("noise_mask", "flow_map"),
    sampling=SAMPLING,
    files=("dit", "text_encoder", "mmproj"),
    shards=True,
    package=__package__,
)
SPECS = (SPEC,)
