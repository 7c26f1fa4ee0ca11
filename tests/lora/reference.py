"""The reference side of the LoRA tests: diffusers' transformer with peft adapters, or with a
weight patched by hand (bands), and the engine side's small helpers."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from gmlx_contract.hashing import table_id, tensor_hash
from gmlx_server.engine.base import StepRow
from gmlx_server.service import CachedTensor, build_table

from tests.lora.forms import Lora


def plain_model(folder):
    from diffusers import QwenImage21Transformer2DModel

    return QwenImage21Transformer2DModel.from_pretrained(str(folder / "transformer")).eval()


def layer_shapes(model) -> dict[str, tuple[int, int]]:
    """(out, in) of every linear layer of the torch model, by module name."""
    return {
        name: (module.out_features, module.in_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }


def peft_model(folder, loras: list[tuple[Lora, float]], model=None):
    """The transformer with each LoRA added as a peft adapter, active together at its strength
    (peft scales each by strength * lora_alpha / r); `model`: another family's diffusers
    transformer (default: the folder's Qwen-Image 2.1 one)."""
    from peft import LoraConfig

    model = plain_model(folder) if model is None else model
    names = []
    for index, (lora, _) in enumerate(loras):
        name = f"lora{index}"
        alpha = lora.rank if lora.alpha is None else lora.alpha
        config = LoraConfig(
            r=lora.rank, lora_alpha=alpha, target_modules=list(lora.pairs), init_lora_weights=False
        )
        model.add_adapter(config, adapter_name=name)
        with torch.no_grad():
            for layer, (a, b) in lora.pairs.items():
                module = model.get_submodule(layer)
                module.lora_A[name].weight.copy_(torch.from_numpy(a))
                module.lora_B[name].weight.copy_(torch.from_numpy(b))
        names.append(name)
    model.set_adapters(names, weights=[strength for _, strength in loras])
    return model


def patched_by_hand(folder, changes: list[tuple[str, tuple | None, np.ndarray]]):
    """The transformer with `delta` added to each named weight, on the band's slice (ComfyUI's
    `weight.narrow(dim, start, length)`) or on the whole weight."""
    model = plain_model(folder)
    with torch.no_grad():
        for layer, band, delta in changes:
            weight = model.get_submodule(layer).weight
            target = weight if band is None else weight.narrow(*band)
            target += torch.from_numpy(delta)
    return model


# ---------------------------------------------------------------- the engine side


def make_table(engine, doc: dict, adapters: dict[str, np.ndarray]):
    """The service's table builder on the engine (what PUT patch-tables runs on the worker)."""
    loaded = SimpleNamespace(model_id=engine.model_id, model=engine)
    cached = {digest: CachedTensor(array, "F32") for digest, array in adapters.items()}
    return build_table(loaded, table_id(doc), doc, cached)


def row(cond: np.ndarray, refs=(), slots=()) -> StepRow:
    return StepRow(
        cond=cond,
        cond_key="wire:" + tensor_hash(cond),
        ref_latents=tuple(refs),
        ref_keys=tuple(tensor_hash(r) for r in refs),
        image_slots=tuple(slots),
    )


def engine_step(engine, cond, x, sigma, table=None, refs=(), slots=(), run=None) -> np.ndarray:
    """One row's output (C, h, w) from the family's denoise_step."""
    timestep = np.array([sigma], np.float32)
    result = engine.denoise_step(x[None], timestep, [row(cond, refs, slots)], table=table, run=run)
    return result.out[0]
