"""Run as every rank of a group (mlx.launch): rank 0 loads a tiny Z-Image folder over the group
and in one process, runs the same steps on both (rows of two caption lengths; with a LoRA table
over the three block stacks) and prints each case's relative L2 as one JSON line. The other
ranks follow (server/distributed.py).

    mlx.launch -n N --backend ring -- python -m tests.shard.z_image_check FOLDER MODE
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from tests.shard.ranks_check import rel_l2

DIM, HIDDEN = 96, 256  # tests.shard.folder.Z_IMAGE_TRANSFORMER: 6 heads x 16, int(96 / 3 * 8)
LORA_KEYS = {
    "noise_refiner.0.attention.to_out.0.weight": (DIM, DIM),
    "context_refiner.0.feed_forward.w3.weight": (HIDDEN, DIM),
    "layers.0.attention.to_k.weight": (DIM, DIM),
    "layers.1.feed_forward.w2.weight": (DIM, HIDDEN),
}


def lora_doc(model_id: str, rng) -> tuple[dict, dict[str, np.ndarray]]:
    from gmlx_contract.hashing import tensor_hash

    entries, adapters = [], {}
    for key, (out_dim, in_dim) in LORA_KEYS.items():
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
    from gmlx_server.engine.families.z_image import family
    from gmlx_server.engine.registry import ModelRegistry

    from tests.lora.reference import make_table

    folder = Path(folder)
    registry = ModelRegistry(extra_models=[folder])
    distributed.attach(group, registry)
    results = {}
    try:
        loaded = registry.acquire(folder.name)
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        results["load"] = {"refused": getattr(exc, "message", str(exc))}
    else:
        sharded = loaded.model
        single = family.Z_IMAGE.load(folder, folder.name)
        rng = np.random.default_rng(3)
        rows = [
            StepRow(rng.standard_normal((n, 32)).astype(np.float32), f"wire:z{n}") for n in (7, 40)
        ]
        x = rng.standard_normal((2, 16, 8, 8)).astype(np.float32)
        timestep = np.array([0.7, 0.4], np.float32)
        doc, adapters = lora_doc(folder.name, rng)
        tables = [make_table(engine, doc, adapters) for engine in (sharded, single)]
        for name, table in (("step", None), ("lora", tables)):
            answers = [
                engine.denoise_step(x, timestep, rows, table=None if table is None else table[i])
                for i, engine in enumerate((sharded, single))
            ]
            results[name] = {"rel_l2": rel_l2(answers[0].out, answers[1].out)}
        results["weights"] = {"ranks": sharded.rank_weight_bytes, "single": single.weight_bytes}
        registry.release(loaded)
    registry.unload_all()
    distributed.stop_group(group)
    print("RESULTS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
