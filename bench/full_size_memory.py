"""Memory of the full-size Qwen-Image 2.1 (7.1 B DiT, 8.8 B Qwen3-VL encoder, 0.34 B VAE),
quantized and not, through the server's own loaders and step, with random weights.

write   a full-size component folder under `--root`: the checkpoint's own tensor names and
        shapes (diffusers' transformer and VAE, transformers' Qwen3-VL-8B, instantiated on
        torch's meta device, which allocates nothing), random weights generated one tensor at
        a time and written one shard (a block, a layer) at a time. At `--bits` 3-8 the weights
        the family quantizes (family.quantized_files) are written as `gmlx model quantize`
        writes them, generated directly in packed form: random uint32 words, float32 scales
        and biases per group that span about +-sqrt(3/fan_in); everything else in bf16. At 16
        bits every tensor is bf16. No float model exists at any point. `--layers N`: only N
        DiT blocks or decoder layers (a per-layer figure when the whole does not fit).
load    one component loaded by the server's own loader (QwenImage21DiT.load,
        Qwen3VLEncoder.load, QwenImage21VAE.load) at `--dtype`: the bytes of its arrays, MLX's
        active and peak memory, the process's RSS after the load and its peak (VmHWM), all
        less the process before the load.
step    the DiT and the VAE resident (the text encoder released, never loaded), one guided
        step at `--size` as the server runs it (family denoise_step: two rows, conditioned
        and unconditioned, one prefix each of `--text` and `--negative` tokens, built on the
        first step, held for the second), through the first `--blocks` of the resident
        blocks (a view of the same arrays); MLX's and the process's peaks, the prefix states
        held and ms per block.
        The step runs with MLX's allocations bounded by the server's plan of it
        (memory.allocation_bound; `--bound 0` without), `--steps 1` the first step alone.
phases  the live set of each phase of the first block's target pass (q/k/v, attention,
        gate/up, activation, ...) at `--size`, each evaluated alone with nothing queued
        ahead: what the step estimate (qwen_image21/family.py, step_peak_bytes) counts.
all     the measurements of docs/benchmarks.md ("Full-size memory"), each in its own process
        after checking MemAvailable (the run's need + 3 GB; a run that does not fit is
        reported skipped), folders written just before they are measured and deleted after,
        16 bits last and one component at a time; JSON lines to `--out`.

    .venv/bin/python bench/full_size_memory.py all --root /tmp/qwen-image21-full --out results.jsonl
    .venv/bin/python bench/full_size_memory.py write --component transformer --bits 4 --root R
    .venv/bin/python bench/full_size_memory.py load --component transformer --root R --bits 4
    .venv/bin/python bench/full_size_memory.py step --root R --bits 4 --blocks 2 --size 1024
    .venv/bin/python bench/full_size_memory.py phases --root R --bits 4
    .venv/bin/python bench/full_size_memory.py write --gguf Q4_K --root R
    .venv/bin/python bench/full_size_memory.py load --gguf Q4_K --root R --dtype float32

`--gguf TYPE` (write, load): the DiT as one GGUF file in root/gguf-TYPE/transformer, written
with the `gguf` package one tensor at a time, the blocks' linear weights random valid blocks
of TYPE (tests/engine/gguf_files.py), the rest float16 and the norm scales float32, loaded
through the server's loader (the family's dit_file) as `GMLX_GGUF_WEIGHTS` says. `Q4_K_M`
mixes as llama.cpp's preset of that name does: the value and MLP-down matrices Q6_K in the
first and last eighth of the blocks and every third block between (llama.cpp's
`use_more_bits`), every other block linear Q4_K. The load reports the file's tensor bytes
beside what the DiT holds.

Results go to docs/benchmarks.md ("Full-size memory").
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GB = 10**9
HEADROOM = 3 * GB  # left free beside a run (other jobs share the machine)
FILES = {
    "transformer": "diffusion_pytorch_model",
    "text_encoder": "model",
    "vae": "diffusion_pytorch_model",
}
# Qwen3-VL-8B (transformers' Qwen3VLConfig): the prompt encoder of Qwen-Image 2.1.
TEXT_CONFIG = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_section": [24, 20, 20],
        "mrope_interleaved": True,
    },
}
VISION_CONFIG = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "out_hidden_size": 4096,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
    "hidden_act": "gelu_pytorch_tanh",
    "in_channels": 3,
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("write", "load", "step", "phases", "all"))
    parser.add_argument("--root", type=Path, default=Path("/tmp/qwen-image21-full"))
    parser.add_argument("--component", choices=tuple(FILES), default="transformer")
    parser.add_argument("--bits", type=int, default=4, choices=(3, 4, 5, 6, 8, 16))
    parser.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--size", type=int, default=1024, help="image side in pixels")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--text", type=int, default=256, help="conditioned prefix tokens")
    parser.add_argument("--negative", type=int, default=32, help="unconditioned prefix tokens")
    parser.add_argument(
        "--steps", type=int, default=2, choices=(1, 2), help="step: 1, the prefixes built only"
    )
    parser.add_argument(
        "--bound",
        type=int,
        default=1,
        choices=(0, 1),
        help="step: 0 runs without the plan's bound on MLX's allocations (the server has it)",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--layers", type=int, default=None, help="write: only this many blocks or layers"
    )
    parser.add_argument(
        "--gguf",
        default=None,
        metavar="TYPE",
        help="write, load, step: the DiT as one GGUF file, its blocks' linears of this type"
        " (Q4_K, or Q4_K_M's mix)",
    )
    return parser.parse_args(argv)


def folder(root: Path, bits: int, group_size: int, gguf_type: str | None = None) -> Path:
    if gguf_type is not None:
        return root / f"gguf-{gguf_type}"
    return root / (f"bits{bits}-g{group_size}" if bits < 16 else "bf16")


# ------------------------------------------------------------------------------- the folders


def checkpoint_shapes(
    component: str, layers: int | None = None
) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """(config.json, tensor name -> shape) of a full-size component, from the reference
    implementation built on torch's meta device; `layers`: only that many DiT blocks or
    decoder layers (for a per-layer figure where the whole component cannot be loaded)."""
    import torch

    with torch.device("meta"):
        if component == "text_encoder":
            from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

            text = dict(TEXT_CONFIG)
            if layers is not None:
                text["num_hidden_layers"] = layers
            config = Qwen3VLConfig(
                text_config=text, vision_config=VISION_CONFIG, tie_word_embeddings=False
            )
            module = Qwen3VLForConditionalGeneration(config)
            config_json = config.to_dict()
        else:
            from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel

            if component == "transformer":
                extra = {} if layers is None else {"num_layers": layers}
                module = QwenImage21Transformer2DModel(**extra)
            else:
                module = AutoencoderKLQwenImage21()
            config_json = {"_class_name": type(module).__name__, **module.config}
            config_json.pop("_use_default_values", None)
    shapes = {name: tuple(value.shape) for name, value in module.state_dict().items()}
    return json.loads(json.dumps(config_json, default=list)), shapes


def shard_of(name: str) -> str:
    """Shards of one block or layer each (so a shard is written, then dropped)."""
    parts = name.split(".")
    for marker in ("transformer_blocks", "layers", "blocks", "down_blocks", "up_blocks"):
        if marker in parts:
            index = parts.index(marker)
            return ".".join(parts[: index + 2])
    return "rest"


def write_component(
    root: Path, component: str, bits: int, group_size: int, layers: int | None = None
) -> dict:
    """Write root/<component> (see the module's docstring); returns its bytes and time."""
    import mlx.core as mx
    import numpy as np
    from gmlx_server.engine.families.qwen_image21.family import QWEN_IMAGE21
    from gmlx_server.engine.precision import Quantization

    started = time.perf_counter()
    config, shapes = checkpoint_shapes(component, layers)
    target = root / component
    target.mkdir(parents=True, exist_ok=False)
    quantization = Quantization(bits, group_size) if bits < 16 else None
    if quantization is not None:
        config["quantization"] = quantization.status()
    (target / "config.json").write_text(json.dumps(config, indent=2))
    # the family's choice by file name (it reads transformer/config.json: written first)
    never = lambda name: False  # noqa: E731
    pick = (
        never if quantization is None else QWEN_IMAGE21.quantized_files(root).get(component, never)
    )
    rng = np.random.default_rng(0)
    shards: dict[str, list[str]] = {}
    for name in shapes:
        shards.setdefault(shard_of(name), []).append(name)
    stem, weight_map, total = FILES[component], {}, 0
    for number, (_, names) in enumerate(shards.items(), start=1):
        file = f"{stem}-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            shape = shapes[name]
            packed = (
                quantization is not None
                and len(shape) == 2
                and shape[1] % group_size == 0
                and name.endswith(".weight")
                and pick(name)
            )
            if packed:
                base = name[: -len(".weight")]
                made = packed_tensors(rng, shape, quantization)
                tensors[name], tensors[base + ".scales"], tensors[base + ".biases"] = made
            else:
                tensors[name] = float_tensor(rng, name, shape)
        mx.eval(tensors)
        total += sum(value.nbytes for value in tensors.values())
        mx.save_safetensors(str(target / file), tensors, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (target / f"{stem}.safetensors.index.json").write_text(json.dumps(index))
    return {"bytes": total, "write_s": round(time.perf_counter() - started, 1)}


def write_gguf_dit(root: Path, type_name: str) -> dict:
    """Write root/transformer as a full-size GGUF DiT (config.json and one .gguf file, written
    with the `gguf` package tensor by tensor): the blocks' linear weights of `type_name`
    (random valid blocks), everything else float16 (norm scales float32), by diffusers name."""
    import gguf
    import numpy as np

    from tests.engine.gguf_files import random_blocks

    started = time.perf_counter()
    config, shapes = checkpoint_shapes("transformer")
    kinds = block_linear_types(type_name, config["num_layers"])
    target = root / "transformer"
    target.mkdir(parents=True, exist_ok=False)
    (target / "config.json").write_text(json.dumps(config, indent=2))

    def stored(name: str, shape: tuple[int, ...]):
        """(type, numpy dtype, stored shape, bytes) of a tensor as the file holds it."""
        if len(shape) == 2 and name.startswith("transformer_blocks.") and name.endswith(".weight"):
            rows, cols = shape
            kind = kinds(name, shape)
            block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
            return (
                kind,
                np.uint8,
                (rows, cols // block_size * type_size),
                rows * cols // block_size * type_size,
            )
        dtype = np.float32 if len(shape) == 1 else np.float16
        return None, dtype, shape, math.prod(shape) * np.dtype(dtype).itemsize

    writer = gguf.GGUFWriter(
        str(target / f"diffusion_pytorch_model-{type_name}.gguf"), "qwen_image"
    )
    layout = {name: stored(name, shape) for name, shape in shapes.items()}
    for name, (raw, dtype, shape, nbytes) in layout.items():
        writer.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    total = 0
    for name, (raw, dtype, _, nbytes) in layout.items():
        shape = shapes[name]
        if raw is not None:
            data = random_blocks(raw, shape, rng)
        else:
            data = float_values(rng, name, shape).astype(dtype)
        writer.write_tensor_data(data)
        total += nbytes
    writer.close()
    return {"bytes": total, "write_s": round(time.perf_counter() - started, 1)}


def block_linear_types(type_name: str, blocks: int):
    """(name, shape) -> the GGUF type of a block linear: `type_name`'s, or (Q4_K_M) the mix
    `gmlx model quantize --kquant q4_k_m` writes (engine/kquant_folder.py)."""
    import gguf
    from gmlx_server.engine.kquant_folder import preset_types

    if type_name == "Q4_K_M":
        return preset_types("q4_k_m", blocks)
    return lambda name, shape: gguf.GGMLQuantizationType[type_name]


def packed_tensors(rng, shape, quantization):
    """(packed, scales, biases) of a random (out, in) weight at `quantization`, made directly:
    uniform codes, so each weight is uniform in +-a, a = sqrt(3/in) times a per-group factor."""
    import mlx.core as mx
    import numpy as np

    rows, cols = shape
    bits, group_size = quantization.bits, quantization.group_size
    words = rng.integers(0, 2**32, size=(rows, cols * bits // 32), dtype=np.uint32)
    span = math.sqrt(3.0 / cols) * rng.uniform(0.5, 1.5, (rows, cols // group_size))
    scales = (2 * span / (2**bits - 1)).astype(np.float32)
    biases = (-span).astype(np.float32)
    return mx.array(words), mx.array(scales), mx.array(biases)


def float_tensor(rng, name: str, shape):
    """A bf16 tensor of `float_values`."""
    import mlx.core as mx

    return mx.array(float_values(rng, name, shape)).astype(mx.bfloat16)


def float_values(rng, name: str, shape):
    """float32 values: ones for norm scales, zeros for 1-D biases, else N(0, 1/fan_in)."""
    import numpy as np

    if len(shape) == 1 or name.endswith("gamma"):
        scale = ("norm" in name or name.endswith("gamma")) and not name.endswith("bias")
        return np.full(shape, 1.0 if scale else 0.0, np.float32)
    fan_in = int(np.prod(shape[1:]))
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(fan_in**-0.5)


# ---------------------------------------------------------------------------- measurements


def proc_status() -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of this process, in bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def reset_peaks() -> dict[str, int]:
    """Reset MLX's peak and the process's peak RSS; the state before what follows."""
    import mlx.core as mx

    mx.synchronize()
    mx.clear_cache()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    mx.reset_peak_memory()
    return {"rss": proc_status()["VmRSS"], "active": mx.get_active_memory()}


def since(before: dict[str, int]) -> dict[str, int]:
    """MLX's and the process's memory now and at peak, less `before`."""
    import mlx.core as mx

    mx.synchronize()
    status = proc_status()
    return {
        "mlx_active": mx.get_active_memory() - before["active"],
        "mlx_peak": mx.get_peak_memory() - before["active"],
        "mlx_cache": mx.get_cache_memory(),  # freed buffers MLX keeps for reuse (in the RSS)
        "rss": status["VmRSS"] - before["rss"],
        "rss_peak": status["VmHWM"] - before["rss"],
    }


def load_component(root: Path, component: str, dtype):
    """The component through the server's own loader; (object, bytes of its arrays). The
    modules are imported before a measurement starts (main)."""
    from gmlx_server.engine.encoders.qwen3.vl import Qwen3VLEncoder
    from gmlx_server.engine.families.qwen_image21.dit import QwenImage21DiT
    from gmlx_server.engine.families.qwen_image21.prompt import quantized
    from gmlx_server.engine.vaes.qwen_image21 import QwenImage21VAE

    if component == "transformer":
        dit = QwenImage21DiT.load(root / "transformer", dtype)
        return dit, dit.weight_bytes
    if component == "vae":
        vae = QwenImage21VAE.load(root / "vae", dtype)
        return vae, vae.weight_bytes
    return Qwen3VLEncoder.load(root / "text_encoder", dtype, None, quantized)


def measure_load(args) -> dict:
    import mlx.core as mx

    before = reset_peaks()
    started = time.perf_counter()
    _, weight_bytes = load_component(
        folder(args.root, args.bits, args.group_size, args.gguf),
        args.component,
        getattr(mx, args.dtype),
    )
    seconds = time.perf_counter() - started
    row = {"weights": weight_bytes, **since(before), "load_s": round(seconds, 1)}
    if args.gguf:
        from gmlx_server.engine.families.qwen_image21.dit import dit_file

        transformer = folder(args.root, args.bits, args.group_size, args.gguf) / "transformer"
        row["file_tensor_bytes"] = dit_file(transformer).stored_bytes()
    return row


def measure_step(args) -> dict:
    """One guided step twice (prefixes built, then held) through the first `--blocks` blocks of
    the resident DiT, the VAE resident beside it."""
    import mlx.core as mx
    import numpy as np
    from gmlx_server.engine.base import StepCall, StepRow
    from gmlx_server.engine.families.qwen_image21.dit import QwenImage21DiT
    from gmlx_server.engine.families.qwen_image21.family import step_peak_bytes
    from gmlx_server.engine.families.qwen_image21.step import denoise_step
    from gmlx_server.engine.prefix_cache import PrefixCache
    from gmlx_server.engine.quantize import float_weight_bytes
    from gmlx_server.memory import allocation_bound

    model_dir = folder(args.root, args.bits, args.group_size, args.gguf)
    dtype = getattr(mx, args.dtype)
    start = reset_peaks()
    dit, dit_bytes = load_component(model_dir, "transformer", dtype)
    vae_bytes = 0
    if (model_dir / "vae").is_dir():  # a GGUF DiT's folder holds the DiT alone
        _, vae_bytes = load_component(model_dir, "vae", mx.float32)
    resident = since(start)
    view = QwenImage21DiT(
        dit.config, {**dit.weights, "blocks": dit.weights["blocks"][: args.blocks]}, dtype
    )
    rng = np.random.default_rng(0)
    cells = args.size // 16
    rows = [
        StepRow(rng.standard_normal((length, 4096), dtype=np.float32), f"c{i}", (), (), ())
        for i, length in enumerate((args.text, args.negative))
    ]
    x = rng.standard_normal((2, 64, cells, cells), dtype=np.float32)
    cache = PrefixCache(4 << 30)
    weight_element_bytes = float_weight_bytes(dit.weights, dtype.size)
    steps = []
    for label, built in (("prefix built", True), ("prefix held", False))[: args.steps]:
        # the server's plan of the whole step (all the blocks), which bounds MLX's allocations
        planned = step_peak_bytes(
            dit.config,
            dtype.size,
            cells * cells,
            [(row.cond.shape[0], built) for row in rows],
            view.cpu_ops,
            weight_element_bytes,
        )
        before = reset_peaks()
        started = time.perf_counter()
        with allocation_bound(planned if args.bound else 1 << 62):
            denoise_step(
                view, cache, x, np.array([0.7, 0.7], np.float32), rows, StepCall(run="bench")
            )
        seconds = time.perf_counter() - started
        steps.append(
            {
                "step": label,
                **since(before),
                "planned": planned,
                "states": cache.total_bytes,
                "ms_per_block": round(1000 * seconds / args.blocks),
            }
        )
    return {
        "dit_weights": dit_bytes,
        "vae_weights": vae_bytes,
        "resident": resident,
        "blocks": args.blocks,
        "of_blocks": dit.config.num_layers,
        "steps": steps,
    }


def measure_phases(args) -> dict:
    """The live set of each phase of the first block's target pass at `--size` (two rows, held
    prefixes of `--text` and `--negative` tokens), eager, each phase evaluated alone with MLX's
    limit at nothing (so nothing is queued ahead): its peak above what it was handed, and the
    bytes of what it hands on. The phases step_peak_bytes counts."""
    import mlx.core as mx
    import numpy as np
    from gmlx_server.engine.families.qwen_image21.dit import PrefixLayout
    from gmlx_server.engine.lora import project
    from gmlx_server.engine.nn.activations import layer_norm, silu
    from gmlx_server.memory import allocation_bound

    dtype = getattr(mx, args.dtype)
    dit, _ = load_component(folder(args.root, args.bits, args.group_size), "transformer", dtype)
    w, block, eps = dit.weights, dit.weights["blocks"][0], dit.config.eps
    rng = np.random.default_rng(0)
    cells = args.size // 16
    states = [
        dit.prefix_state(
            PrefixLayout(n), mx.array(rng.standard_normal((n, 4096), dtype=np.float32)), []
        )
        for n in (args.text, args.negative)
    ]
    mx.eval([state.keys + state.values for state in states])
    x = mx.array(rng.standard_normal((2, cells * cells, 64), dtype=np.float32)).astype(dtype)
    cos, sin = dit._target_rope(states, cells, cells)
    scale1, gate1, scale2, gate2 = dit.modulation(w, dit.time_embedding(w, mx.array([0.7, 0.7])))
    mx.eval(cos, sin, scale1, gate1, scale2, gate2)
    prefix = [(state.keys[0], state.values[0]) for state in states]
    phases = {}

    def phase(name, work, *inputs):
        before = reset_peaks()
        with allocation_bound(0):
            out = work(*inputs)
            mx.eval(out)
        measured = since(before)
        phases[name] = {"peak": measured["mlx_peak"], "out": measured["mlx_active"]}
        return out

    def activation(gate_up):
        gate, up = mx.split(gate_up, 2, axis=-1)
        return silu(gate) * up

    hidden = phase("img_in", lambda: project(w, "img_in", x))
    normed = phase("norm1", lambda h: layer_norm(h, eps) * (1 + scale1), hidden)
    qkv = phase("qkv", lambda n: list(dit.qkv(block, n, cos, sin)), normed)
    del normed
    attended = phase("attention", lambda t: dit._target_attention(prefix, *t), qkv)
    del qkv
    hidden = phase(
        "attn_out", lambda h, a: h + gate1 * dit.attention_out(block, a), hidden, attended
    )
    del attended
    normed = phase("norm2", lambda h: layer_norm(h, eps) * (1 + scale2), hidden)
    gate_up = phase("gate_up", lambda n: project(block, "gate_up", n), normed)
    del normed
    product = phase("activation", activation, gate_up)
    del gate_up
    phase("down", lambda h, p: h + gate2 * project(block, "down", p), hidden, product)
    return {"tokens": 2 * cells * cells, "phases": phases}


# ---------------------------------------------------------------------------- the whole plan


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def plan() -> list[tuple[int, list[tuple]]]:
    """Per precision: the components to write, then the measurements (what, component,
    dtype, blocks, need in bytes). 16 bits last, one component at a time."""
    quantized = []
    for bits in (4, 8):
        scale = bits / 4
        quantized.append(
            (
                bits,
                [
                    ("load", "transformer", "float32", 0, int(6 * scale * GB)),
                    ("load", "transformer", "bfloat16", 0, int(5 * scale * GB)),
                    ("load", "text_encoder", "float32", 0, int((5 * scale + 4) * GB)),
                    ("load", "text_encoder", "bfloat16", 0, int((5 * scale + 2) * GB)),
                ]
                + (
                    [
                        ("load", "vae", "float32", 0, 2 * GB),
                        ("load", "vae", "bfloat16", 0, 1 * GB),
                        ("step", "transformer", "float32", 1, int(12 * GB)),
                        ("step", "transformer", "float32", 2, int(12 * GB)),
                        ("step", "transformer", "float32", 4, int(12 * GB)),
                    ]
                    if bits == 4
                    else []
                ),
            )
        )
    return [
        *quantized,
        (16, [("load", "transformer", "bfloat16", 0, 16 * GB)]),
        (16, [("load", "text_encoder", "bfloat16", 0, 19 * GB)]),
    ]


def run_all(args) -> None:
    out = args.out.open("a") if args.out else sys.stdout
    for bits, runs in plan():
        model_dir = folder(args.root, bits, args.group_size)
        needed = {component for _, component, *_ in runs}
        components = [c for c in ("transformer", "text_encoder", "vae") if c in needed]
        if any(what == "step" for what, *_ in runs):
            components.append("vae")
        for component in dict.fromkeys(components):
            if not (model_dir / component).exists():
                written = subprocess_json(["write", "--component", component], bits, args)
                emit(out, {"what": "write", "bits": bits, "component": component, **written})
        for what, component, dtype, blocks, need in runs:
            free = mem_available()
            row = {"what": what, "bits": bits, "component": component, "dtype": dtype}
            if blocks:
                row["blocks"] = blocks
            if free < need + HEADROOM:
                emit(out, {**row, "skipped": f"needs {need + HEADROOM}, MemAvailable {free}"})
                continue
            extra = ["--component", component, "--dtype", dtype, "--blocks", str(blocks or 1)]
            extra += ["--size", str(args.size), "--text", str(args.text)]
            extra += ["--negative", str(args.negative)]
            emit(out, {**row, "mem_available": free, **subprocess_json([what, *extra], bits, args)})
        for component in components:
            shutil.rmtree(model_dir / component, ignore_errors=True)


def subprocess_json(command: list[str], bits: int, args) -> dict:
    """Run this script once in a fresh process; its last stdout line as JSON."""
    full = [sys.executable, __file__, *command, "--bits", str(bits), "--root", str(args.root)]
    full += ["--group-size", str(args.group_size)]
    done = subprocess.run(full, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def emit(out, row: dict) -> None:
    out.write(json.dumps(row) + "\n")
    out.flush()


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.what == "all":
        run_all(args)
        return
    from gmlx_server.engine.blas import ensure_fast_blas

    ensure_fast_blas()  # before mlx is imported
    import gmlx_server.engine.encoders.qwen3.vl  # noqa: F401  (imported before any measurement)
    import gmlx_server.engine.families.qwen_image21.step  # noqa: F401
    import gmlx_server.engine.vaes.qwen_image21  # noqa: F401

    if args.what == "write" and args.gguf:
        result = write_gguf_dit(folder(args.root, args.bits, args.group_size, args.gguf), args.gguf)
    elif args.what == "write":
        result = write_component(
            folder(args.root, args.bits, args.group_size),
            args.component,
            args.bits,
            args.group_size,
            args.layers,
        )
    elif args.what == "load":
        result = measure_load(args)
    elif args.what == "phases":
        result = measure_phases(args)
    else:
        result = measure_step(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
