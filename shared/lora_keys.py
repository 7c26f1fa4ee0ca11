"""How a LoRA file's keys name a layer of the DiT: the one naming rule of the server's `--adapter`
loader and of the ComfyUI pack's LoRA key map (docs/lora.md).

A layer is a linear weight of the model's manifest, less `.weight` (diffusers module names). A
LoRA key is a stem naming the layer followed by a suffix naming the part. The stems of the forms
found in the wild:

    ComfyUI           diffusion_model.<layer>          (also model.diffusion_model.<layer>)
    diffusers         transformer.<layer>              (also the bare <layer>)
    PEFT              base_model.model.<layer>         (PEFT's save_pretrained)
    kohya             lora_unet_<layer, dots as underscores>

Pure: plain strings and dictionaries.
"""

from __future__ import annotations

from typing import Any

# Suffix -> the part of the pair it holds (down = A (rank, in), up = B (out, rank)).
SUFFIXES = {
    ".lora_A.weight": "down",
    ".lora_B.weight": "up",
    ".lora_down.weight": "down",
    ".lora_up.weight": "up",
    ".alpha": "alpha",
}
PEFT_PREFIX = "base_model.model."
# Prefixes before a layer's name, longest first where one ends another.
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.", PEFT_PREFIX)
KOHYA_PREFIX = "lora_unet_"


def linear_layers(manifest: dict[str, Any]) -> list[str]:
    """The manifest's linear weights (2-D `.weight` tensors), less `.weight`."""
    return [
        tensor["name"].removesuffix(".weight")
        for tensor in manifest["tensors"]
        if tensor["name"].endswith(".weight") and len(tensor["shape"]) == 2
    ]


def stems_of(layer: str) -> list[str]:
    """Every stem a LoRA file may name `layer` by, one per form (the bare name included)."""
    return [prefix + layer for prefix in PREFIXES] + [layer, kohya_stem(layer)]


def kohya_stem(layer: str) -> str:
    return KOHYA_PREFIX + layer.replace(".", "_")


class LayerNames:
    """The layers of a model, to read LoRA stems against."""

    def __init__(self, layers: list[str]) -> None:
        self.layers = frozenset(layers)
        self._kohya = {kohya_stem(layer): layer for layer in layers}

    def layer_of(self, stem: str) -> str | None:
        """The layer a stem names (its form's prefix dropped; a kohya name matched with dots
        written as underscores), None when it names no layer of the model."""
        if stem in self._kohya:
            return self._kohya[stem]
        for prefix in PREFIXES:
            if stem.startswith(prefix):
                stem = stem[len(prefix) :]
                break
        return stem if stem in self.layers else None
