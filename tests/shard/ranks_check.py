"""Run as every rank of a group (mlx.launch): rank 0 loads the tiny folder over the group and
in one process, runs the same steps on both and prints, as one JSON line, each case's relative
L2 distance and prefix-cache answers. The other ranks follow (server/distributed.py).

    mlx.launch -n N --backend ring -- python -m tests.shard.ranks_check FOLDER MODE
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from tests.compare import rel_l2


def lora_doc(model_id: str, rng) -> tuple[dict, dict[str, np.ndarray]]:
    """A table over a fused part with a band, a column-split and a row-split weight, and a
    layer outside the blocks."""
    from gmlx_contract.hashing import table_id, tensor_hash  # noqa: F401

    keys = {
        "transformer_blocks.1.attn.to_k.weight": (192, 192, [0, 32, 64]),
        "transformer_blocks.4.attn.to_out.0.weight": (192, 192, None),
        "transformer_blocks.2.img_mlp.proj.weight": (576, 192, None),
        "transformer_blocks.5.img_mlp.out.weight": (192, 576, [1, 96, 288]),
        "img_in.weight": (192, 64, None),
    }
    entries, adapters = [], {}
    for key, (out_dim, in_dim, band) in keys.items():
        rows = band[2] if band and band[0] == 0 else out_dim
        cols = band[2] if band and band[0] == 1 else in_dim
        up = (0.5 * rng.standard_normal((rows, 4))).astype(np.float32)
        down = (0.5 * rng.standard_normal((4, cols))).astype(np.float32)
        names = []
        for matrix in (up, down):
            digest = tensor_hash(matrix)
            adapters[digest] = matrix
            names.append(digest)
        entries.append(
            {
                "key": key,
                "band": band,
                "patches": [{"up": names[0], "down": names[1], "alpha": 2.0}],
            }
        )
    return {"model": model_id, "entries": entries}, adapters


def via_steps(registry, folder: Path, group) -> dict:
    """A guided sampling through the step routes served over the group, against the same
    sampling in one process: the final latents' relative L2."""
    from gmlx_contract.client import StepClient
    from gmlx_server.engine.families.qwen_image21 import family
    from gmlx_server.engine.sampling import DirectTransport, ImageRequest, generate
    from gmlx_server.model_choice import ModelChoice
    from gmlx_server.step_server import StepServer, ViaStepsTransport

    request = ImageRequest(
        prompt="a red fox", negative="blur", width=64, height=64, steps=3, cfg=2.5, seed=11
    )
    with StepServer(ModelChoice(registry, folder.name, 0.0, group=group)) as server:
        status = server.load().model.status()
        with StepClient(server.base_url) as client:
            via = ViaStepsTransport(client, server.direct(), folder.name)
            latents, _ = generate(via, status, request)
    single = family.QWEN_IMAGE21.load(folder, folder.name)
    alone, _ = generate(DirectTransport(single), single.status(), request)
    return {"rel_l2": rel_l2(latents, alone), "distributed": status["distributed"]}


def gguf_model(folder: Path) -> tuple[Path, Path]:
    """A copy of the folder without DiT weights, and a GGUF file of its DiT beside it (the
    block linears Q8_0, Q4_0 in the second half: their 192 and 576 input columns whole groups
    of 32), named by the model's settings."""
    from gguf import GGMLQuantizationType as T
    from gmlx_server.engine.embedded import DIFFUSERS_WEIGHTS
    from safetensors.numpy import load_file

    from tests.engine.gguf_files import write_dit

    target = folder.parent / (folder.name + "-gguf")
    dit = folder.parent / (folder.name + "-dit-Q8_0.gguf")
    if not target.exists():
        shutil.copytree(folder, target)
        (target / "transformer" / DIFFUSERS_WEIGHTS).unlink()
        weights = load_file(str(folder / "transformer" / DIFFUSERS_WEIGHTS))
        types = {
            name: T.Q4_0 if int(name.split(".")[1]) >= 3 else T.Q8_0
            for name, value in weights.items()
            if name.startswith("transformer_blocks.") and value.ndim == 2
        }
        write_dit(dit, weights, types, np.random.default_rng(3))
    return target, dit


def missing_on_rank_1(registry, folder: Path, dit: Path) -> dict:
    """A load whose DiT file rank 0 reaches and rank 1 does not (a `.gguf` link to a file
    descriptor only rank 0 holds open, /dev/fd on Linux and macOS): refused, naming the rank
    and the file."""
    import os

    from gmlx_contract.errors import ContractError
    from gmlx_server.engine.load_settings import LoadSettings

    registry.unload(folder.name)
    descriptor = os.open(dit, os.O_RDONLY)
    held = os.dup2(descriptor, 900)
    os.close(descriptor)
    path = dit.with_name("held-by-rank-0.gguf")
    path.unlink(missing_ok=True)
    path.symlink_to(f"/dev/fd/{held}")
    settings, registry.settings = registry.settings, lambda model_id: LoadSettings(dit=path)
    try:
        registry.acquire(folder.name)
    except ContractError as exc:
        return {"status": exc.status, "message": exc.message, "file": str(path)}
    finally:
        registry.settings = settings
        os.close(held)
        path.unlink()
    return {"status": 200, "message": "", "file": str(path)}


def main(folder: str, mode: str) -> None:
    from gmlx_server import distributed

    group = distributed.join(mode)  # the other ranks follow here, then end
    from gmlx_server.engine.families.qwen_image21 import family
    from gmlx_server.engine.load_settings import LoadSettings
    from gmlx_server.engine.precision import Quantization
    from gmlx_server.engine.registry import ModelRegistry
    from gmlx_server.engine.weights import quantize_folder

    from tests.lora.reference import make_table, row
    from tests.shard.folder import GROUP_SIZE

    folder = Path(folder)
    quantized_folder = folder.parent / (folder.name + "-q8")
    if not quantized_folder.exists():
        shutil.copytree(folder, quantized_folder)
    quantization = Quantization(8, GROUP_SIZE)
    stored_folder = folder.parent / (folder.name + "-stored8")  # `gmlx model quantize`'s
    if not stored_folder.exists():
        quantize_folder(
            folder, stored_folder, quantization, family.QWEN_IMAGE21.quantized_files(folder)
        )
    gguf_folder, dit = gguf_model(folder)
    settings = {
        quantized_folder.name: LoadSettings(quantization),
        gguf_folder.name: LoadSettings(dit=dit, encoder_vae_dtype="f16"),
    }
    registry = ModelRegistry(
        extra_models=[folder, quantized_folder, stored_folder, gguf_folder],
        settings=lambda model_id: settings.get(model_id, LoadSettings()),
    )
    distributed.attach(group, registry)
    rng = np.random.default_rng(1)
    conds = [rng.standard_normal((n, 128)).astype(np.float32) for n in (5, 3)]
    ref = rng.standard_normal((64, 2, 2)).astype(np.float32)
    rows = [row(conds[0], refs=(ref,), slots=(2,)), row(conds[1])]
    x = rng.standard_normal((2, 64, 4, 4)).astype(np.float32)
    timestep = np.array([0.7, 0.7], np.float32)
    results = {}
    models = (folder.name, quantized_folder.name, stored_folder.name, gguf_folder.name)
    for model_id in models:
        loaded = registry.acquire(model_id)
        sharded = loaded.model
        options = registry.settings(model_id).options()
        single = family.QWEN_IMAGE21.load(registry.resolve(model_id).path, model_id, **options)
        doc, adapters = lora_doc(model_id, rng)
        tables = [make_table(engine, doc, adapters) for engine in (sharded, single)]
        uncached = [dataclasses.replace(r, prefix_cache=False) for r in rows]
        cases = [
            ("miss", None, "r1", rows),
            ("hit", None, "r1", rows),
            ("lora", 0, "r1", rows),
            ("lora hit", 0, "r1", rows),
            ("no run", None, None, rows),
            ("off", None, "r1", uncached),  # held states, yet built afresh
        ]
        for name, table, run, step_rows in cases:
            answers = [
                engine.denoise_step(
                    x, timestep, step_rows, run=run, table=None if table is None else tables[index]
                )
                for index, engine in enumerate((sharded, single))
            ]
            results[f"{model_id} {name}"] = {
                "rel_l2": rel_l2(answers[0].out, answers[1].out),
                "prefix": [answer.prefix_cache for answer in answers],
            }
        sharded.end_run("r1")
        single.end_run("r1")
        results[f"{model_id} weights"] = {
            "ranks": sharded.rank_weight_bytes,
            "single": single.weight_bytes,
        }
        residency = sharded.status()["residency"]
        results[f"{model_id} dtypes"] = {part: residency[part]["dtype"] for part in residency}
        registry.release(loaded)
    results["missing on rank 1"] = missing_on_rank_1(registry, gguf_folder, dit)
    results["via steps"] = via_steps(registry, folder, group)
    registry.unload_all()
    distributed.stop_group(group)
    print("RESULTS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
