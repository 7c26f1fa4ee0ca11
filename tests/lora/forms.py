"""Tiny random LoRAs, written in the three key forms found in the wild, and the mapping a client
does from those keys onto the manifest's names to build a patch table (docs/contract.md §2.9, 7.7).

A LoRA here is its ground truth: layer name (diffusers module name) -> (A (rank, in), B (out,
rank)), with one alpha for the whole LoRA (None: scale 1.0). The reference applies the ground
truth with peft; the server gets the table a client builds from the written form.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gmlx_contract.hashing import tensor_hash

# Diffusers/PEFT files: `transformer.<module>.lora_A.weight` / `.lora_B.weight`, no alpha.
# Kohya (sd-scripts) files: `lora_unet_<module with dots as underscores>.lora_down.weight` /
#   `.lora_up.weight` / `.alpha` (a scalar).
# ComfyUI's own saved LoRAs: `diffusion_model.<module>.lora_down.weight` / `.lora_up.weight` /
#   `.alpha`.
FORMS = ("diffusers", "kohya", "comfy")

# Layers the test LoRAs touch: every fused part of a block, the other block linears, and the
# linears outside the blocks (time MLP, modulation, text and image input, output).
LAYERS = (
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.attn.to_k",
    "transformer_blocks.0.attn.to_v",
    "transformer_blocks.0.attn.to_out.0",
    "transformer_blocks.1.attn.to_k",
    "transformer_blocks.1.img_mlp.gate_layer",
    "transformer_blocks.1.img_mlp.proj",
    "transformer_blocks.1.img_mlp.out",
    "txt_in.in_layer",
    "txt_in.out_layer",
    "img_in",
    "modulation.1",
    "time_text_embed.timestep_embedder.linear_1",
    "norm_out.linear",
    "proj_out",
)


@dataclass
class Lora:
    pairs: dict[str, tuple[np.ndarray, np.ndarray]]  # layer -> (A (r, in), B (out, r))
    alpha: float | None
    rank: int

    @property
    def scale(self) -> float:
        return 1.0 if self.alpha is None else self.alpha / self.rank


def random_lora(
    shapes: dict[str, tuple[int, int]],
    seed: int,
    rank: int = 4,
    alpha: float | None = 8.0,
    layers=LAYERS,
    gain: float = 0.5,
) -> Lora:
    """Random A, B on `layers` (shapes: layer -> (out, in)), large enough to move the output."""
    rng = np.random.default_rng(seed)
    pairs = {}
    for layer in layers:
        out_dim, in_dim = shapes[layer]
        a = rng.standard_normal((rank, in_dim)) / np.sqrt(in_dim)
        b = rng.standard_normal((out_dim, rank)) * gain / np.sqrt(rank)
        pairs[layer] = (a.astype(np.float32), b.astype(np.float32))
    return Lora(pairs, alpha, rank)


def write_form(lora: Lora, form: str) -> dict[str, np.ndarray]:
    """The LoRA as a state dict of that form's file."""
    out: dict[str, np.ndarray] = {}
    for layer, (a, b) in lora.pairs.items():
        if form == "diffusers":
            assert lora.alpha is None, "diffusers files carry no alpha"
            out[f"transformer.{layer}.lora_A.weight"] = a
            out[f"transformer.{layer}.lora_B.weight"] = b
            continue
        stem = (
            "lora_unet_" + layer.replace(".", "_")
            if form == "kohya"
            else f"diffusion_model.{layer}"
        )
        out[f"{stem}.lora_down.weight"] = a
        out[f"{stem}.lora_up.weight"] = b
        if lora.alpha is not None:
            out[f"{stem}.alpha"] = np.array(lora.alpha, np.float32)
    return out


def write_lora_file(folder: Path, lora: Lora, form: str) -> Path:
    """The LoRA as a file of `form` in `folder`: FORMS' as `<form>.safetensors`, or "peft" as
    PEFT's save_pretrained writes it (adapter_model.safetensors, the diffusers form's keys
    under `base_model.model.`, and its adapter_config.json beside it, at scale 1); returns the
    file's path."""
    from gmlx_contract import wire

    folder.mkdir(parents=True, exist_ok=True)
    if form == "peft":
        state = {
            key.replace("transformer.", "base_model.model.", 1): value
            for key, value in write_form(lora, "diffusers").items()
        }
        config = {"r": lora.rank, "lora_alpha": lora.rank, "target_modules": sorted(lora.pairs)}
        (folder / "adapter_config.json").write_text(json.dumps(config))
        path = folder / "adapter_model.safetensors"
    else:
        state, path = write_form(lora, form), folder / f"{form}.safetensors"
    path.write_bytes(wire.write_container(state))
    return path


# ---------------------------------------------------------------- the client's side

KEY_SUFFIXES = {
    ".lora_A.weight": "down",
    ".lora_B.weight": "up",
    ".lora_down.weight": "down",
    ".lora_up.weight": "up",
    ".alpha": "alpha",
}


def map_keys(state: dict[str, np.ndarray], layers: list[str]) -> dict[str, dict]:
    """A LoRA file's keys onto manifest layers: layer -> {"up", "down", "alpha"}, as a client
    does it: strip the form's suffix, then its prefix; kohya names are matched against the
    manifest's names with dots written as underscores."""
    kohya_names = {layer.replace(".", "_"): layer for layer in layers}
    found: dict[str, dict] = {}
    for key, value in state.items():
        suffix = next((s for s in KEY_SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise KeyError(f"not a LoRA key: {key}")
        side, stem = KEY_SUFFIXES[suffix], key[: -len(suffix)]
        if stem.startswith("lora_unet_"):
            layer = kohya_names[stem.removeprefix("lora_unet_")]
        else:
            layer = stem.removeprefix("transformer.").removeprefix("diffusion_model.")
        if layer not in layers:
            raise KeyError(f"{key} names no layer of the manifest")
        found.setdefault(layer, {"alpha": None})[side] = float(value) if side == "alpha" else value
    return found


def client_table(
    model_id: str,
    loras: list[tuple[dict[str, np.ndarray], float]],
    layers: list[str],
    key_of=lambda layer: f"diffusion_model.{layer}.weight",
) -> tuple[dict, dict[str, np.ndarray]]:
    """A table document (and the matrices by hash) for LoRA files stacked at strengths, entries
    grouped by key and sorted as the pack does (docs/contract.md §7.7)."""
    adapters: dict[str, np.ndarray] = {}
    grouped: dict[str, list[dict]] = {}
    for state, strength in loras:
        for layer, parts in map_keys(state, layers).items():
            up, down = parts["up"], parts["down"]
            adapters[tensor_hash(up)] = up
            adapters[tensor_hash(down)] = down
            grouped.setdefault(key_of(layer), []).append(
                {
                    "up": tensor_hash(up),
                    "down": tensor_hash(down),
                    "alpha": parts["alpha"],
                    "strength": float(strength),
                    "strength_model": 1.0,
                }
            )
    entries = [{"key": key, "band": None, "patches": grouped[key]} for key in sorted(grouped)]
    return {"model": model_id, "entries": entries}, adapters
