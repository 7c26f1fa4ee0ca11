"""A tiny FLUX.3 klein folder in diffusers' layout, from the references themselves: the tiny DiT
of reference.py (a flow map for the distilled variant), FLUX.2's tiny AutoencoderKLFlux2, a tiny
Qwen3VLModel text encoder with the tests' Qwen tokenizer, the pipelines' scheduler config.
Nothing is downloaded; torch, diffusers and transformers are development dependencies."""

from __future__ import annotations

import json
from pathlib import Path

from gmlx_server.engine.families.flux3_klein.spec import PIPELINE_CLASSES, model_index_of

from tests.families.flux2_klein.tiny.vae import build_vae
from tests.families.flux3_klein.reference import build_transformer
from tests.families.qwen_image21.tiny.text_encoder import build_language_model

TEXT_LAYERS = 4  # the tiny encoder's decoder layers; the taps below read three of them
OUT_LAYERS = (1, 2, 3)
TEXT_WIDTH = 64
SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 6.93,
    "use_dynamic_shifting": False,
}


def build_tiny_folder(
    root: Path,
    seed: int = 0,
    variant: str = "distilled",
    text_layers: int = TEXT_LAYERS,
    out_layers: tuple[int, ...] = OUT_LAYERS,
    **transformer,
):
    """Write a tiny FLUX.3 klein folder at `root` (`text_layers`: the encoder's depth, tapped
    after `out_layers`; `transformer`: overrides of the tiny DiT's config); returns it."""
    root = Path(root)
    build_transformer(
        root / "transformer",
        seed,
        **{
            "joint_attention_dim": len(out_layers) * TEXT_WIDTH,
            "flow_map": variant == "distilled",
            **transformer,
        },
    )
    build_vae(root / "vae", seed + 1)
    build_language_model(root, seed + 2, text_layers)
    (root / "scheduler").mkdir(parents=True, exist_ok=True)
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER))
    index = model_index_of(variant, out_layers)
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
    return root


def processor(root: Path):
    """The folder's tokenizer as the pipeline's processor (chat template and tokenizer)."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from tests.encoders.qwen3.reference import ImageOnlyQwen3VLProcessor

    tokenizer = AutoTokenizer.from_pretrained(str(Path(root) / "tokenizer"))
    return ImageOnlyQwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )


def reference_pipeline(root: Path):
    """The folder as diffusers' FLUX.3 modular pipeline of its variant (float32, CPU), without
    the prompt upsampler."""
    import torch
    from diffusers import AutoencoderKLFlux2, Flux3Transformer2DModel
    from diffusers.modular_pipelines import Flux3AutoBlocks, Flux3DistilledAutoBlocks
    from diffusers.schedulers import FlowMatchEulerDiscreteScheduler
    from transformers import Qwen3VLModel

    root = Path(root)
    distilled = (
        json.loads((root / "model_index.json").read_text())["_class_name"]
        == PIPELINE_CLASSES["distilled"]
    )
    blocks = Flux3DistilledAutoBlocks() if distilled else Flux3AutoBlocks()
    blocks.sub_blocks.pop(
        "prompt_upsampler"
    )  # the prompt as typed (its upsampler is a model apart)
    pipe = blocks.init_pipeline()
    pipe.update_components(
        transformer=Flux3Transformer2DModel.from_pretrained(str(root / "transformer")).eval(),
        vae=AutoencoderKLFlux2.from_pretrained(str(root / "vae")).eval(),
        text_encoder=Qwen3VLModel.from_pretrained(
            str(root / "text_encoder"), dtype=torch.float32
        ).eval(),
        tokenizer=processor(root),
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER),
    )
    return pipe
