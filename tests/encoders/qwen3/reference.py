"""diffusers' QwenImage21Pipeline encode path on a tiny folder, for parity tests.

transformers 5.24 builds `Qwen3VLProcessor` only with a video processor, which is gated on
torchvision (it does not load beside the local torch wheel). The encode path never touches video,
so the tests build the processor from its image processor (the PIL implementation) and tokenizer
alone, through a subclass that declares just those two parts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from diffusers import QwenImage21Pipeline
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions
from PIL import Image
from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil


class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
    """Qwen3VLProcessor without its video processor (torchvision-gated here)."""

    @classmethod
    def get_attributes(cls):
        return ["image_processor", "tokenizer"]


def load_processor(model_dir: Path) -> ImageOnlyQwen3VLProcessor:
    processor_dir = Path(model_dir) / "processor"
    return ImageOnlyQwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(processor_dir),
        tokenizer=AutoTokenizer.from_pretrained(processor_dir),
        chat_template=(processor_dir / "chat_template.jinja").read_text(),
    )


def load_pipeline(model_dir: Path) -> QwenImage21Pipeline:
    """The pipeline with only its text encoder and processor (the encode path needs no more)."""
    text_encoder = Qwen3VLForConditionalGeneration.from_pretrained(
        Path(model_dir) / "text_encoder", dtype=torch.float32
    ).eval()
    return QwenImage21Pipeline(
        scheduler=None,
        vae=None,
        text_encoder=text_encoder,
        processor=load_processor(model_dir),
        transformer=None,
    )


def resize_like_pipeline(pipe: QwenImage21Pipeline, array: np.ndarray):
    """Step 1 of the pipeline's __call__ at the image's own area (docs/contract.md §2.6): the resized RGBA
    image for the encoder and the VAE's input, returned in [0, 1] as (H, W, 4)."""
    image = Image.fromarray(array)
    if image.mode != "RGBA":
        image = image.convert("RGBA")
    width, height, _ = calculate_dimensions(image.width * image.height, image.width / image.height)
    resized = pipe.image_processor.resize(image, width=width, height=height)
    vae = pipe.image_processor.preprocess(
        image, width=width, height=height
    )  # (1, 4, H, W) in [-1, 1]
    vae = ((vae[0].permute(1, 2, 0) + 1) / 2).numpy()
    return resized, vae


@torch.no_grad()
def reference_encode(pipe: QwenImage21Pipeline, text: str, images: list[np.ndarray]):
    """(cond (L, D) text rows, slots, vae images, all ids after the drop, pad mask) via diffusers."""
    resized, vae_images = [], []
    for array in images:
        encoder_image, vae_image = resize_like_pipeline(pipe, array)
        resized.append(encoder_image)
        vae_images.append(vae_image)
    embeds, _, pad_mask = pipe.encode_prompt(
        text, image=resized or None, device=torch.device("cpu")
    )
    embeds, pad_mask = embeds[0].numpy(), pad_mask[0].numpy().astype(bool)
    starts = [i for i in range(len(pad_mask)) if pad_mask[i] and (i == 0 or not pad_mask[i - 1])]
    slots = [int(np.count_nonzero(~pad_mask[:start])) for start in starts]
    ids = _prompt_ids(pipe, text, resized)
    return embeds[~pad_mask], slots, vae_images, ids, pad_mask


def _prompt_ids(pipe: QwenImage21Pipeline, text: str, images: list) -> np.ndarray:
    """The processor's input ids for the pipeline's templated prompt, after the dropped rows."""
    text = text or " "
    if images:
        replace = " ".join(
            f"<image{i}><|vision_start|><|image_pad|><|vision_end|>"
            for i in range(1, len(images) + 1)
        )
        template = pipe.prompt_template_ti2i.replace(
            "<image1><|vision_start|><|image_pad|><|vision_end|>", replace
        )
        flattened = []
        for image in images:
            white = Image.new("RGB", image.size, (255, 255, 255))
            white.paste(image, mask=image.getchannel("A"))
            flattened.append(white)
        inputs = pipe.processor(text=[template.format(text)], images=flattened, return_tensors="np")
    else:
        inputs = pipe.processor(text=[pipe.prompt_template_t2i.format(text)], return_tensors="np")
    return inputs["input_ids"][0][pipe._drop_idx :]
