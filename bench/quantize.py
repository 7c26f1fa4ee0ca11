"""Quantized weights: what each bit width loses, and what a quantized step costs on this machine.

loss    the embedded default model (tiny, random weights; `--family flux2_klein`: the tests'
        tiny FLUX.2 klein) loaded as its files store it and at each bit width (groups of
        `--group-size`): the step's relative L2 against the float model's step (one row: a
        prompt and a reference image, at sigma 0.7), the encode's relative L2, and the DiT's
        and text encoder's resident bytes.
time    the target pass (what a step with a prefix hit runs) of a random DiT at full width
        (32 heads x 128 = 4096, SwiGLU x3, `--layers` blocks, a held prefix of `--text` rows),
        in float32 (and bf16 with `--bf16`) and with its blocks quantized at `--bits`, each
        on both quantized paths: dequantize + GEMM (quantize.linear on the CPU backend) and
        MLX's quantized kernel (`mx.quantized_matmul`, the GPU backends' path), in
        interleaved rounds after one warm-up, all after mx.eval: the same run, the same
        shapes. Best and median ms.
matmul  one 4096 x 4096 linear at `--rows` input rows: float32 (x W^T), mx.quantized_matmul
        at each of `--bits`, mx.dequantize followed by the float32 matmul, and
        quantize.linear.

    .venv/bin/python bench/quantize.py [--group-size 64] [--size 8x8] [--layers 1]
        [--text 16] [--bits 4 8] [--rows 1 64 256] [--repeats 3] [--bf16] [--no-kernel]
        [--family qwen_image21|flux2_klein] [--loss-only] [--json]

Results go to docs/benchmarks.md ("Quantized weights").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lora import CONTEXT, interleaved_ms, random_dit  # noqa: E402

ALL_BITS = (3, 4, 5, 6, 8)
SIGMA = [0.7]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    parser.add_argument("--size", default="8x8", help="latent HxW (8x8 = a 128x128 image)")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--text", type=int, default=16)
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 8], choices=ALL_BITS)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bf16", action="store_true", help="time the bf16 target pass too")
    parser.add_argument(
        "--no-kernel",
        dest="kernel",
        action="store_false",
        help="leave out MLX's quantized kernel (slow at many tokens on the CPU backend)",
    )
    parser.add_argument(
        "--family",
        default="qwen_image21",
        choices=("qwen_image21", "flux2_klein"),
        help="the tiny model of the loss table (the embedded default, or the tests' klein)",
    )
    parser.add_argument("--loss-only", action="store_true", help="leave out the time tables")
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def rel_l2(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def loss_per_bits(group_size: int, family_name: str) -> dict:
    """Step and encode relative L2 against the float model, and resident bytes, per bit width."""
    from gmlx_server.engine.precision import Quantization

    measure = MEASURES[family_name]()
    cond, out, (dit_bytes, encoder_bytes) = measure(None)
    rows = {
        "float32": {
            "step_rel_l2": 0.0,
            "encode_rel_l2": 0.0,
            "dit_bytes": dit_bytes,
            "encoder_bytes": encoder_bytes,
        }
    }
    for bits in ALL_BITS:
        q_cond, q_out, (q_dit, q_encoder) = measure(Quantization(bits, group_size))
        rows[f"{bits}-bit"] = {
            "step_rel_l2": round(rel_l2(q_out, out), 5),
            "encode_rel_l2": round(rel_l2(q_cond, cond), 5),
            "dit_bytes": q_dit,
            "encoder_bytes": q_encoder,
        }
    return rows


def qwen_image21_measure():
    """quantization -> (conditioning, step, (DiT bytes, encoder bytes)) on the embedded
    default: a prompt with a reference image, a 64x96 latent at sigma 0.7."""
    from gmlx_server.engine.families.qwen_image21 import family
    from gmlx_server.engine.families.qwen_image21.embedded import ensure_embedded_model

    folder = ensure_embedded_model(Path(tempfile.mkdtemp()))
    return loss_measure(family.QWEN_IMAGE21, folder, (256, 384), (1, 64, 4, 6))


def flux2_klein_measure():
    """The same on the tests' tiny FLUX.2 klein folder (width 64, 2 + 2 blocks, a 32-wide
    28-layer Qwen3): a prompt with a 64x96 reference image, a 4x6 latent at sigma 0.7."""
    from gmlx_server.engine.families.flux2_klein import family

    from tests.families.flux2_klein.tiny.folder import build_tiny_folder

    folder = Path(tempfile.mkdtemp()) / "klein-tiny"
    build_tiny_folder(folder)
    return loss_measure(family.FLUX2_KLEIN, folder, (64, 96), (1, 128, 4, 6))


def loss_measure(family, folder: Path, image_hw: tuple[int, int], latents: tuple):
    """quantization -> (conditioning, step, (DiT bytes, encoder bytes)) of the folder's model
    loaded at it (None: as its files store it): the prompt with a reference image of
    `image_hw` pixels, one step of latents of shape `latents` at sigma 0.7."""
    import numpy as np

    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (*image_hw, 3), dtype=np.uint8)
    x = rng.standard_normal(latents).astype(np.float32)

    def measure(quantization):
        model = family.load(folder, "bench", quantization)
        encoding = model.encode("a lighthouse on a cliff at dusk", [image], refs=True)
        out = model.denoise_step(x, SIGMA, [row_of(encoding)]).out
        return encoding.cond, out, (model.dit.weight_bytes, model.encoder.weight_bytes)

    return measure


def row_of(encoding):
    """The step row of an encode's conditioning and reference latents."""
    from gmlx_contract.hashing import tensor_hash
    from gmlx_server.engine.base import StepRow

    refs = tuple(latents[0] for latents in encoding.ref_latents)
    return StepRow(
        cond=encoding.cond,
        cond_key="wire:" + tensor_hash(encoding.cond),
        ref_latents=refs,
        ref_keys=tuple(tensor_hash(r) for r in refs),
        image_slots=tuple(encoding.image_slots),
    )


MEASURES = {"qwen_image21": qwen_image21_measure, "flux2_klein": flux2_klein_measure}


def quantized_copy(dit, quantization):
    """The DiT with its blocks quantized as a quantized load does (dit.quantized)."""
    from gmlx_server.engine.families.qwen_image21.dit import QwenImage21DiT, quantized
    from gmlx_server.engine.quantize import quantize_tree

    weights = {**dit.weights, "blocks": [dict(block) for block in dit.weights["blocks"]]}
    quantize_tree(weights, quantization, quantized)
    return QwenImage21DiT(dit.config, weights, dit.dtype)


def step_times(args) -> dict:
    """The target pass in float32 (and bf16 with `--bf16`) and at each of `--bits` on both
    quantized paths (the CPU backend's dequantize-then-GEMM, MLX's quantized kernel),
    interleaved."""
    import mlx.core as mx
    import numpy as np
    from gmlx_server.engine.families.qwen_image21.dit import PrefixLayout, QwenImage21DiT
    from gmlx_server.engine.nn.dtypes import tree_bytes
    from gmlx_server.engine.precision import Quantization
    from mlx.utils import tree_map

    h, w = (int(v) for v in args.size.split("x"))
    float_dit, _ = random_dit(args.layers, mx.float32)
    dits = {"float32": (float_dit, True)}
    if args.bf16:
        # the same weights in bf16, the norm scales (vectors) kept float32 as a load keeps them
        weights = tree_map(lambda a: a.astype(mx.bfloat16) if a.ndim == 2 else a, float_dit.weights)
        dits["bf16"] = (QwenImage21DiT(float_dit.config, weights, mx.bfloat16), True)
    for bits in args.bits:
        quantized_dit = quantized_copy(float_dit, Quantization(bits, args.group_size))
        dits[f"{bits}-bit, dequantize + GEMM"] = (quantized_dit, True)
        if not args.kernel:
            continue
        # the same arrays in a DiT of its own, so its compiled trace takes the kernel path
        twin = QwenImage21DiT(quantized_dit.config, quantized_dit.weights, mx.float32)
        dits[f"{bits}-bit, mx.quantized_matmul"] = (twin, False)
    rng = np.random.default_rng(2)
    text = mx.array(rng.standard_normal((args.text, CONTEXT), np.float32))
    x = mx.array(rng.standard_normal((1, h * w, 64), np.float32))
    sigma = mx.array(np.array([0.7], np.float32))
    passes, outs, states = {}, {}, {}
    for name, (dit, dequantizing) in dits.items():
        if id(dit) not in states:
            states[id(dit)] = dit.prefix_state(PrefixLayout(args.text), text, [])
            mx.eval(states[id(dit)].keys, states[id(dit)].values)
        passes[name] = partial(
            target, dit, states[id(dit)], dequantizing, x, sigma, (h, w), outs, name
        )
    times, _ = interleaved_ms(passes, args.repeats)
    return {
        name: {
            "target_ms_best": round(min(times[name]), 1),
            "target_ms_median": round(statistics.median(times[name]), 1),
            "block_bytes": tree_bytes(dit.weights["blocks"]),
            "rel_l2_vs_float32": round(rel_l2(outs[name].astype(mx.float32), outs["float32"]), 5),
        }
        for name, (dit, _) in dits.items()
    }


def target(dit, state, dequantizing: bool, x, sigma, hw, outs: dict, name: str) -> None:
    """One target pass of `dit`, its quantized linears on the chosen path (the DiT's compiled
    trace is made under that choice on its first call, then reused)."""
    import mlx.core as mx
    from gmlx_server.engine import quantize

    chosen = quantize.dequantize_first
    quantize.dequantize_first = lambda rows: dequantizing
    try:
        outs[name] = dit.target_forward(x.astype(dit.dtype), sigma, [state], *hw)
        mx.eval(outs[name])
    finally:
        quantize.dequantize_first = chosen


def matmul_times(args) -> dict:
    """One 4096 x 4096 linear per row count: float32, MLX's quantized kernel, mx.dequantize
    then float32, and quantize.linear (the CPU backend's path: the same, ordered after x)."""
    import mlx.core as mx
    from gmlx_server.engine.quantize import SCALES, SPEC, linear

    mx.random.seed(3)
    weight = mx.random.normal((4096, 4096)) * 4096**-0.5
    packed = {bits: mx.quantize(weight, args.group_size, bits) for bits in args.bits}
    mx.eval(weight, packed)
    report = {}
    for rows in args.rows:
        x = mx.random.normal((rows, 4096))
        mx.eval(x)
        fns = {"float32": lambda x=x: mx.eval(x @ weight.T)}
        for bits, (w, scales, biases) in packed.items():
            kw = {"group_size": args.group_size, "bits": bits}
            node = {
                "w": w,
                "w" + SCALES: scales,
                "w.biases": biases,
                "w" + SPEC: (bits, kw["group_size"]),
            }
            fns[f"{bits}-bit"] = lambda x=x, w=w, s=scales, b=biases, kw=kw: mx.eval(
                mx.quantized_matmul(x, w, s, b, transpose=True, **kw)
            )
            fns[f"{bits}-bit dequantized"] = lambda x=x, w=w, s=scales, b=biases, kw=kw: mx.eval(
                x @ mx.dequantize(w, s, b, **kw).T
            )
            fns[f"{bits}-bit quantize.linear"] = lambda x=x, node=node: mx.eval(
                linear(node, "w", x)
            )
        times, _ = interleaved_ms(fns, args.repeats)
        report[rows] = {name: round(min(t), 1) for name, t in times.items()}
    return report


def main(argv=None) -> dict:
    args = parse_args(argv)
    from gmlx_server.engine.blas import ensure_fast_blas

    blas = ensure_fast_blas()  # before mlx is imported
    h, w = (int(v) for v in args.size.split("x"))
    report = {
        "blas": blas.message,
        "group_size": args.group_size,
        "family": args.family,
        "loss": loss_per_bits(args.group_size, args.family),
    }
    if not args.loss_only:
        report["time"] = {
            "tokens": h * w,
            "layers": args.layers,
            "text": args.text,
            "passes": step_times(args),
        }
        report["matmul_ms_best"] = matmul_times(args)
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
