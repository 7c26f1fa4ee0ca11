"""Calling diffusers' FLUX.2 klein references the way Flux2KleinPipeline and
Flux2KleinKVPipeline do, for parity tests."""

from __future__ import annotations

import numpy as np
import torch


def _ids(time: int, h: int, w: int) -> torch.Tensor:
    return torch.cartesian_prod(
        torch.tensor([time]), torch.arange(h), torch.arange(w), torch.arange(1)
    )


def _tokens(latents: np.ndarray) -> torch.Tensor:
    """(B, C, h, w) -> (B, h*w, C), the pipeline's `_pack_latents`."""
    batch, channels = latents.shape[:2]
    return (
        torch.from_numpy(np.ascontiguousarray(latents))
        .reshape(batch, channels, -1)
        .permute(0, 2, 1)
    )


def reference_dit(
    model, x: np.ndarray, t, cap: np.ndarray, refs=(), kv: bool = False
) -> np.ndarray:
    """The transformer's output (B, C, h, w) for latents x (B, C, h, w) at times t (B,) under
    one caption (B, L, D) and references (each (C, h_k, w_k), shared by the rows): the plain
    forward with the references after the image tokens, or (`kv`) the KV pipeline's extract
    step with the references first."""
    batch, _, height, width = x.shape
    txt_ids = torch.cartesian_prod(
        torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(cap.shape[1])
    )
    img = _tokens(x)
    img_ids = _ids(0, height, width)
    ref_tokens = [_tokens(r[None]).expand(batch, -1, -1) for r in refs]
    ref_ids = [_ids(10 + 10 * k, r.shape[1], r.shape[2]) for k, r in enumerate(refs)]
    kwargs = {}
    if kv:
        use_kv_processors(model)
    if refs and kv:
        img = torch.cat([*ref_tokens, img], dim=1)
        img_ids = torch.cat([*ref_ids, img_ids], dim=0)
        kwargs = {"kv_cache_mode": "extract", "num_ref_tokens": sum(r.shape[1] for r in ref_tokens)}
    elif refs:
        img = torch.cat([img, *ref_tokens], dim=1)
        img_ids = torch.cat([img_ids, *ref_ids], dim=0)
    with torch.no_grad():
        out = model(
            hidden_states=img,
            encoder_hidden_states=torch.from_numpy(np.array(cap, np.float32)),
            timestep=torch.from_numpy(np.asarray(t, np.float32)),
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=None,
            return_dict=False,
            **kwargs,
        )[0]
    out = out[:, -height * width :] if (refs and kv) else out[:, : height * width]
    return out.permute(0, 2, 1).reshape(x.shape).numpy()


def use_kv_processors(model) -> None:
    """The KV pipeline's attention processors (they act as the plain ones without KV
    arguments)."""
    from diffusers.models.transformers.transformer_flux2 import (
        Flux2KVAttnProcessor,
        Flux2KVParallelSelfAttnProcessor,
    )

    for block in model.transformer_blocks:
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in model.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())
