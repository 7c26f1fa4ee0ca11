"""Run as every rank of a group (mlx.launch): rank 0 loads a tiny family folder over the group
and in one process, runs the same steps on both (rows of two conditioning lengths; with a LoRA
table over its block stacks) and prints each case's relative L2 as one JSON line. The other
ranks follow (server/distributed.py). CASES says, per family, the rows' width and latents and
the layers the LoRA patches.

    mlx.launch -n N --backend ring -- python -m tests.shard.family_check FOLDER MODE
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from tests.compare import rel_l2

# family -> (conditioning width, latent channels, {LoRA'd weight: (out, in)}), for the folders
# of tests.shard.folder.
CASES = {
    # Z_IMAGE_TRANSFORMER: 6 heads x 16, MLP int(96 / 3 * 8); caption width 32
    "z_image": (
        32,
        16,
        {
            "noise_refiner.0.attention.to_out.0.weight": (96, 96),
            "context_refiner.0.feed_forward.w3.weight": (256, 96),
            "layers.0.attention.to_k.weight": (96, 96),
            "layers.1.feed_forward.w2.weight": (96, 256),
        },
    ),
    # KREA2_TRANSFORMER: 4 heads x 16 over 2 key/value heads, MLP 96; three text layers of 64
    "krea2": (
        192,
        16,
        {
            "text_fusion.refiner_blocks.0.attn.to_out.0.weight": (64, 64),
            "transformer_blocks.0.attn.to_k.weight": (32, 64),
            "transformer_blocks.0.attn.to_gate.weight": (64, 64),
            "transformer_blocks.1.ff.down.weight": (64, 96),
        },
    ),
    # tests/families/flux3_klein: 4 heads x 16, MLP 192; three text layers of 64
    "flux3_klein": (
        192,
        128,
        {
            "mode_blocks.image.0.attn.to_q.weight": (64, 64),
            "single_transformer_blocks.0.attn.to_k.weight": (64, 64),
            "single_transformer_blocks.1.ff.linear_out.weight": (64, 192),
        },
    ),
    # moss-image-random-tiny: 2 heads x 16, feed-forward 64; Qwen3.5 32 wide
    "moss_image": (
        32,
        128,
        {
            "text_embedder.blocks.0.qkv.weight": (96, 32),
            "layers.0.proj.k.weight": (32, 32),
            "layers.1.proj.ffn_up_gate.weight": (128, 32),
            "layers.23.proj.ffn_down.weight": (32, 64),
        },
    ),
}
# A flow map's steps (FLUX.3 klein's) follow this schedule.
SCHEDULE = np.array([1.0, 0.7, 0.4, 0.0], np.float32)


def lora_doc(model_id: str, keys: dict, rng) -> tuple[dict, dict[str, np.ndarray]]:
    from gmlx_contract.hashing import tensor_hash

    entries, adapters = [], {}
    for key, (out_dim, in_dim) in keys.items():
        up = (0.5 * rng.standard_normal((out_dim, 4))).astype(np.float32)
        down = (0.5 * rng.standard_normal((4, in_dim))).astype(np.float32)
        adapters[tensor_hash(up)], adapters[tensor_hash(down)] = up, down
        patch = {"up": tensor_hash(up), "down": tensor_hash(down), "alpha": 2.0}
        entries.append({"key": key, "band": None, "patches": [patch]})
    return {"model": model_id, "entries": entries}, adapters


def main(folder: str, mode: str) -> None:
    from gmlx_server import distributed

    group = distributed.join(mode)  # the other ranks follow here, then end
    from gmlx_server.engine.base import StepRow
    from gmlx_server.engine.registry import ModelRegistry

    from tests.lora.reference import make_table

    folder = Path(folder)
    registry = ModelRegistry(extra_models=[folder])
    alone = ModelRegistry(extra_models=[folder])  # the same folder in this process alone
    distributed.attach(group, registry)
    results = {}
    try:
        loaded = registry.acquire(folder.name)
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        results["load"] = {"refused": getattr(exc, "message", str(exc))}
    else:
        sharded, single = loaded.model, alone.acquire(folder.name).model
        width, channels, keys = CASES[sharded.family]
        rng = np.random.default_rng(3)
        rows = [
            StepRow(rng.standard_normal((n, width)).astype(np.float32), f"wire:c{n}")
            for n in (7, 40)
        ]
        x = rng.standard_normal((2, channels, 8, 8)).astype(np.float32)
        timestep = np.array([0.7, 0.4], np.float32)
        doc, adapters = lora_doc(folder.name, keys, rng)
        tables = [make_table(engine, doc, adapters) for engine in (sharded, single)]
        for name, table in (("step", None), ("lora", tables)):
            schedule = SCHEDULE if single.capabilities.flow_map else None
            answers = [
                engine.denoise_step(
                    x,
                    timestep,
                    rows,
                    table=None if table is None else table[i],
                    sample_sigmas=schedule,
                )
                for i, engine in enumerate((sharded, single))
            ]
            results[name] = {"rel_l2": rel_l2(answers[0].out, answers[1].out)}
        results["weights"] = {"ranks": sharded.rank_weight_bytes, "single": single.weight_bytes}
        registry.release(loaded)
        alone.unload_all()
    registry.unload_all()
    distributed.stop_group(group)
    print("RESULTS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
