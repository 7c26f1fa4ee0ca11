"""Calling diffusers' Z-Image references the way ZImagePipeline does, for parity tests."""

from __future__ import annotations

import numpy as np
import torch


def reference_dit(model, x: np.ndarray, t: np.ndarray, caps: list[np.ndarray]) -> np.ndarray:
    """The transformer's raw output (B, C, H, W) for latents x (B, C, H, W) at the pipeline's
    time t (B,) = 1 - sigma, row b under caption features caps[b] (L_b, D): a list of rows of
    their own lengths, as the pipeline passes them."""
    latents = [torch.from_numpy(row[:, None].copy()) for row in x]  # (C, 1, H, W) each
    features = [torch.from_numpy(np.array(cap, np.float32)) for cap in caps]
    with torch.no_grad():
        out = model(
            latents, torch.from_numpy(np.asarray(t, np.float32)), features, return_dict=False
        )
    return np.stack([row[:, 0].numpy() for row in out[0]])


def load_encode_pipeline(model_dir):
    """ZImagePipeline with only its text encoder and tokenizer (the encode path needs no more)."""
    from diffusers import ZImagePipeline
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    text_encoder = Qwen3ForCausalLM.from_pretrained(
        f"{model_dir}/text_encoder", dtype=torch.float32
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(f"{model_dir}/tokenizer")
    return ZImagePipeline(
        scheduler=None, vae=None, text_encoder=text_encoder, tokenizer=tokenizer, transformer=None
    )


def reference_encode(pipe, prompts: list[str]) -> list[np.ndarray]:
    """The pipeline's caption features of each prompt (batched, padded and unpadded as it does)."""
    with torch.no_grad():
        embeds = pipe._encode_prompt(list(prompts), device=torch.device("cpu"))
    return [row.numpy() for row in embeds]
