"""The remote CLIP (docs/contract.md §7.4, §2.6): prompts are encoded on the server.

Behaves like the parts of ComfyUI's `comfy.sd.CLIP` that stock text-encode nodes use:
`tokenize` only records the text (and images), `encode_from_tokens_scheduled` sends one
`encode` request. Needs torch, not ComfyUI.
"""

from __future__ import annotations

import copy
import logging
import re
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from gmlx_contract.errors import StepError

from .connection import Connection, RemotePart
from .errors import GmlxError
from .families import empty_prompt

log = logging.getLogger("gmlx_comfy")

# ComfyUI's "(words:1.2)" emphasis; the server encodes text as typed.
WEIGHTED = re.compile(r"\([^()]*:\s*[-+]?[0-9]*\.?[0-9]+\s*\)")


@dataclass
class GmlxTokens:
    """What `tokenize` hands back: the prompt and its reference images, encoded later."""

    text: str
    images: list[np.ndarray] = field(default_factory=list)


def image_to_u8(image: torch.Tensor) -> list[np.ndarray]:
    """A ComfyUI IMAGE (B, H, W, C) in [0, 1] -> RGB uint8 (H, W, 3) arrays, one per entry:
    clamp, x255, round (docs/contract.md §7.4)."""
    if image.ndim == 3:
        image = image[None]
    rgb = image[..., :3].detach().to("cpu", torch.float32).clamp(0.0, 1.0)
    u8 = torch.round(rgb * 255.0).to(torch.uint8).numpy()
    return [np.ascontiguousarray(entry) for entry in u8]


def prompt_text(text: str, family: str | None, published: str | None = None) -> str:
    """The text sent: an empty prompt becomes what the server's status says (`published`,
    its `conditioning.empty_prompt`), else one space for families whose encoder needs text
    (docs/contract.md §7.4)."""
    return text if text != "" else empty_prompt(family, published)


class GmlxCLIP(RemotePart):
    """A CLIP whose encoder runs on the server."""

    def __init__(self, conn: Connection, model_id: str, status: dict) -> None:
        super().__init__(conn, model_id)
        self.family = status.get("family")
        self.empty_prompt = (status.get("conditioning") or {}).get("empty_prompt")
        self.layer_idx = None
        self.use_clip_schedule = False
        self.patcher = SimpleNamespace(forced_hooks=None, model=None)
        self.cond_stage_model = torch.nn.Module()  # no weights: CLIP LoRA keys map to nothing

    def clone(self) -> GmlxCLIP:
        twin = copy.copy(self)
        twin.patcher = SimpleNamespace(forced_hooks=None, model=None)
        return twin

    def add_patches(
        self, patches: dict, strength_patch: float = 1.0, strength_model: float = 1.0
    ) -> list:
        """No CLIP weight takes a patch: the text encoder runs on the server. The patches a
        LoRA loader hands here are the model's (a LoRA's text-encoder keys map to nothing, and
        ComfyUI logs them as "lora key not loaded")."""
        return []

    def clip_layer(self, layer_idx: int) -> None:
        raise GmlxError("gmlx: choosing a text-encoder layer is not supported by the server")

    def set_tokenizer_option(self, name: str, value: Any) -> None:
        log.warning("gmlx: tokenizer option %r ignored: the server tokenizes", name)

    def load_model(self) -> None:
        return None

    def get_sd(self) -> dict:
        return {}

    def tokenize(self, text: str, return_word_ids: bool = False, **kwargs: Any) -> dict:
        if return_word_ids:
            raise GmlxError("gmlx: word ids are not available: the server tokenizes")
        for template in ("llama_template", "template"):
            if kwargs.get(template):
                raise GmlxError("gmlx: custom prompt templates are not supported by the server")
        if WEIGHTED.search(text):
            log.warning("gmlx: weighted prompt syntax is sent as typed (no emphasis)")
        images: list[np.ndarray] = []
        for image in list(kwargs.get("images") or []) + [kwargs.get("image")]:
            if image is not None:
                images += image_to_u8(image)
        return {"gmlx": GmlxTokens(text=text, images=images)}

    def encode_from_tokens_scheduled(
        self,
        tokens: dict,
        unprojected: bool = False,
        add_dict: dict | None = None,
        show_pbar: bool = True,
    ) -> list:
        if self.patcher.forced_hooks is not None:
            raise GmlxError("gmlx: scheduled CLIP hooks are not supported by the server")
        out = self.encode_from_tokens(tokens, return_dict=True)
        cond = out.pop("cond")
        out.update(add_dict or {})
        return [[cond, out]]

    def encode_from_tokens(
        self, tokens: dict, return_pooled: bool = False, return_dict: bool = False
    ) -> Any:
        item = tokens.get("gmlx") if isinstance(tokens, dict) else None
        if not isinstance(item, GmlxTokens):
            raise GmlxError("gmlx: these tokens were not made by a gmlx CLIP")
        tensors, fields = self._encode(item)
        cond = torch.from_numpy(np.array(tensors["cond"], dtype=np.float32))
        extra: dict[str, Any] = {"pooled_output": None}
        if item.images:
            extra["image_slots"] = [int(s) for s in fields.get("image_slots") or []]
        if "cond_typed" in tensors:
            extra["gmlx_cond_typed"] = torch.from_numpy(np.array(tensors["cond_typed"]))
            extra["gmlx_revised_prompt"] = fields.get("revised_prompt")
        if return_dict:
            return {"cond": cond, **extra}
        if return_pooled:
            return cond, None
        return cond

    def encode(self, text: str) -> torch.Tensor:
        return self.encode_from_tokens(self.tokenize(text))

    def _encode(self, item: GmlxTokens) -> tuple[dict, dict]:
        text = prompt_text(item.text, self.family, self.empty_prompt)
        self.conn.ensure_reachable()

        def work() -> tuple[dict, dict]:
            # With images the reference latents come from the gmlx VAE node instead.
            return self.conn.client.encode(
                text, model=self.model_id, images=item.images or None, refs=False
            )

        try:
            return self.call(work)
        except StepError as err:
            raise GmlxError(f"{err} (encoding a prompt for {self.model_id!r})") from err
