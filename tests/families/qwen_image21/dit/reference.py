"""Calling diffusers' QwenImage21Transformer2DModel the way its pipeline does, for parity tests.

One row at a time: the wire-form conditioning (text rows only) gets h*w/4 pad rows per reference
inserted before its slot (filled with noise here, since the model must overwrite them), the
reference and target latents are packed (refs first, target last), and `img_mask` / `img_shapes`
are built as `QwenImage21Pipeline.__call__` builds them.
"""

from __future__ import annotations

import numpy as np
import torch


def pack(latent: np.ndarray) -> np.ndarray:
    """(C, h, w) -> (h*w, C), the pipeline's plain spatial flatten."""
    channels = latent.shape[0]
    return latent.reshape(channels, -1).T


def reference_row(
    model,
    cond: np.ndarray,
    x: np.ndarray,
    sigma: float,
    refs: list[np.ndarray] = (),
    slots: list[int] = (),
    pad_seed: int = 123,
) -> np.ndarray:
    """Model output (C, h, w) for one row; `cond` (L, D) text rows, `slots` one per reference."""
    text_len, dim = cond.shape
    rng = np.random.default_rng(pad_seed)
    pieces, mask, row = [], [], 0
    for slot, ref in zip(slots, refs, strict=True):
        pieces.append(cond[row:slot])
        mask += [False] * (slot - row)
        pad_rows = ref.shape[1] * ref.shape[2] // 4
        pieces.append(rng.standard_normal((pad_rows, dim)).astype(np.float32))
        mask += [True] * pad_rows
        row = slot
    pieces.append(cond[row:])
    mask += [False] * (text_len - row)
    channels, height, width = x.shape
    mask += [True] * (height * width // 4)

    encoder_hidden = torch.from_numpy(np.concatenate(pieces)[None].copy())
    latents = [pack(ref) for ref in refs] + [pack(x)]
    hidden = torch.from_numpy(np.concatenate(latents)[None].copy())
    img_shapes = [[*[(1, r.shape[1], r.shape[2]) for r in refs], (1, height, width)]]
    with torch.no_grad():
        out = model(
            hidden_states=hidden,
            encoder_hidden_states=encoder_hidden,
            timestep=torch.tensor([sigma], dtype=torch.float32),
            img_shapes=img_shapes,
            img_mask=torch.tensor([mask]),
            return_dict=False,
        )[0]
    target = out[0, -height * width :].numpy()
    return target.T.reshape(-1, height, width)
