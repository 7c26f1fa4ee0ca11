"""GGUF types as MLX weights: what each way of holding them costs in bits, error and time.

For every quantized GGUF type the server reads, a (`--rows`, `--cols`) tensor of random valid
blocks (as tests/engine/gguf_files.py writes them: float16 scales of 0.002..0.02, any levels;
Q8_0..Q5_1 quantized from Gaussian weights by `gguf.quants.quantize`), against
`gguf.quants.dequantize` of the same bytes (relative L2, and the largest difference relative
to the largest weight), held two ways:
- as the file's blocks (engine/ggml_blocks.py, the default), decoded by `ggml_blocks.decode`;
- in MLX's affine form (engine/gguf_affine.py, `GMLX_GGUF_WEIGHTS=affine`), dequantized by
  `mx.dequantize`: exact for seven types at their width, Q6_K/Q3_K/Q2_K at NEAREST's.
Bits per weight: the file's, and the affine form's (levels plus float32 scale and bias per 32).

With `--speed`, the time of one linear (`--tokens` rows through a `--rows` x `--cols` weight)
held as float32, affine (quantize.quantized_matmul) and blocks (ggml_blocks.matmul), median
of `--repeats`, for the types given by `--types`; where `mlx-kquant` is importable, its
quantized matmul on the same blocks beside them.

With `--networks`, what the affine form adds at the output of whole networks, as the tests
build them (K-quant blocks at the float weights' RMS): Qwen-Image 2.1's step on the tiny GGUF
DiT of tests/families/qwen_image21/test_gguf.py (every block linear of the type) and Qwen3's
hidden states on the tiny GGUF encoder of tests/encoders/qwen3/test_gguf.py (every matrix, the
token embedding included), each against the same network on gguf's dequantized weights.

    .venv/bin/python bench/gguf_types.py [--rows 1024] [--cols 4096] [--json]
    .venv/bin/python bench/gguf_types.py --speed [--tokens 1024] [--types Q4_K Q6_K]
    .venv/bin/python bench/gguf_types.py --networks
    .venv/bin/python bench/gguf_types.py --kquant   (where mlx-kquant is importable)

With `--kquant`, the loss of mlx-kquant's encoder (Q4_K, Q5_K, Q6_K, Q8_0, as `gmlx model
quantize --kquant` writes them) on a Gaussian float16 tensor against MLX's affine quantization
at the same bits a weight (groups of 64, float16 scales and biases).

Results go to docs/benchmarks.md ("GGUF types").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gmlx_server.engine.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()  # before mlx is imported, or it has no effect

import mlx.core as mx  # noqa: E402
from gmlx_server.engine.ggml_blocks import (  # noqa: E402
    BlockLayout,
    decode,
    kquant,
    kquant_matmul,
    matmul,
)
from gmlx_server.engine.gguf import HELD_SETTING, QUANTIZED_TYPES  # noqa: E402
from gmlx_server.engine.gguf_affine import GROUP_SIZE, NEAREST, affine  # noqa: E402
from gmlx_server.engine.quantize import quantized_matmul  # noqa: E402

from bench.timing import median_ms  # noqa: E402
from tests.engine.gguf_files import random_blocks  # noqa: E402


def errors(got: np.ndarray, expected: np.ndarray) -> dict:
    return {
        "rel_l2": float(np.linalg.norm(got - expected) / np.linalg.norm(expected)),
        "max_rel": float(np.abs(got - expected).max() / np.abs(expected).max()),
    }


def file_bpw(kind) -> float:
    """Bits a weight of a GGUF type, as the file (and the blocks) hold it."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    return 8 * type_size / block_size


def report(rows: list[dict], as_json: bool, columns: tuple[str, ...], line) -> None:
    """The rows as JSON, or as a markdown table of `columns`, one `line(row)` each."""
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(line(row)) + " |")


def evaluated_ms(run, repeats: int) -> float:
    """median_ms of evaluating what `run` builds."""
    return median_ms(lambda: mx.eval(run()), repeats)


def held_forms(kind, shape):
    """(gguf's weights, blocks (data, layout), affine (packed, scales, biases, bits))."""
    data = random_blocks(kind, shape, np.random.default_rng(int(kind)))
    expected = gguf.quants.dequantize(data, kind)
    layout = BlockLayout(shape[1], ((kind, shape[0]),))
    item = affine(kind, data, *shape)
    return expected, (mx.array(data.reshape(-1)), layout), (*item.packed(), item.bits)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--networks", action="store_true")
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--types", nargs="+", default=["Q8_0", "Q4_K", "Q6_K"])
    parser.add_argument("--kquant", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.kquant:
        report_kquant(args)
        return
    if args.networks:
        report_networks(args.json)
        return
    if args.speed:
        report_speed(args)
        return
    shape = (args.rows, args.cols)
    rows = []
    for kind in QUANTIZED_TYPES:
        expected, (data, layout), (packed, scales, biases, bits) = held_forms(kind, shape)
        blocks = np.array(decode(data, layout))
        dequantized = mx.dequantize(packed, scales, biases, group_size=GROUP_SIZE, bits=bits)
        rows.append(
            {
                "type": kind.name,
                "gguf_bpw": file_bpw(kind),
                "blocks": errors(blocks, expected),
                "affine_bits": bits,
                "affine_bpw": bits + 2 * 32 / GROUP_SIZE,
                "affine": errors(np.array(dequantized), expected),
            }
        )
    columns = ("type", "file bpw", "blocks rel-L2", "affine bits", "affine bpw", "affine rel-L2")
    report(
        rows,
        args.json,
        (*columns, "affine max / max weight"),
        lambda row: (
            row["type"],
            f"{row['gguf_bpw']:.4g}",
            f"{row['blocks']['rel_l2']:.2g}",
            str(row["affine_bits"]),
            f"{row['affine_bpw']:g}",
            f"{row['affine']['rel_l2']:.2g}",
            f"{row['affine']['max_rel']:.2g}",
        ),
    )


def speeds(kind, shape, x: mx.array, repeats: int) -> dict:
    """Median ms of one linear with the weight held as float32, affine and blocks."""
    expected, (data, layout), (packed, scales, biases, bits) = held_forms(kind, shape)
    weight = mx.array(expected)
    mx.eval(x, weight, data, packed, scales, biases)
    return {
        "type": kind.name,
        "float32_ms": evaluated_ms(lambda: x @ weight.T, repeats),
        "affine_ms": evaluated_ms(
            lambda: quantized_matmul(x, packed, scales, biases, bits, GROUP_SIZE), repeats
        ),
        "blocks_ms": evaluated_ms(lambda: matmul(x, data, layout), repeats),
        "decode_ms": evaluated_ms(lambda: decode(data, layout), repeats),
        **kquant_speed(x, data, layout, repeats),
    }


def kquant_speed(x: mx.array, data: mx.array, layout, repeats: int) -> dict:
    """mlx-kquant's quantized matmul on the same blocks, where the extra is importable: its
    time and its distance from the blocks' product."""
    if kquant() is None:
        return {}
    ours = np.array(matmul(x, data, layout), np.float64)
    theirs = np.array(kquant_matmul(x, data, layout), np.float64)
    return {
        "kquant_ms": evaluated_ms(lambda: kquant_matmul(x, data, layout), repeats),
        "kquant_rel_l2": float(np.linalg.norm(theirs - ours) / np.linalg.norm(ours)),
    }


def report_speed(args) -> None:
    shape = (args.rows, args.cols)
    x = mx.random.normal((args.tokens, args.cols))
    kinds = [gguf.GGMLQuantizationType[name] for name in args.types]
    out = [speeds(kind, shape, x, args.repeats) for kind in kinds]
    if not args.json:
        print(
            f"{args.tokens} rows through a {shape[0]} x {shape[1]} weight, median of {args.repeats}"
        )
    extra = "kquant_ms" in out[0]
    columns = ("type", "float32 ms", "affine ms", "blocks ms", "blocks / affine", "decode alone ms")

    def line(row: dict) -> tuple[str, ...]:
        cells = (
            row["type"],
            f"{row['float32_ms']:.1f}",
            f"{row['affine_ms']:.1f}",
            f"{row['blocks_ms']:.1f}",
            f"{row['blocks_ms'] / row['affine_ms']:.2f}",
            f"{row['decode_ms']:.1f}",
        )
        if extra:
            cells += (f"{row['kquant_ms']:.0f}", f"{row['kquant_rel_l2']:.2g}")
        return cells

    report(out, args.json, columns + (("mlx-kquant ms", "its rel-L2") if extra else ()), line)


# K-quant encodings (mlx-kquant's) against MLX affine at the same bits a weight: groups of 64
# with float16 scales and biases add 0.5 bit, as the K-quants' own scales do.
KQUANT_VS_AFFINE = (("Q4_K", 4), ("Q5_K", 5), ("Q6_K", 6), ("Q8_0", 8))


def report_kquant(args) -> None:
    """The loss of encoding Gaussian weights (float16) by mlx-kquant's K-quant encoder and by
    MLX's affine quantization at the same bits a weight, against the weights."""
    extra = kquant()
    if extra is None:
        raise SystemExit("--kquant needs mlx-kquant importable")
    shape = (args.rows, args.cols)
    weights = mx.array(np.random.default_rng(0).standard_normal(shape).astype(np.float16))
    reference = np.array(weights, np.float64)
    out = []
    for name, bits in KQUANT_VS_AFFINE:
        kind = gguf.GGMLQuantizationType[name]
        encoded, _ = extra.quantize(weights.astype(mx.float32), name.lower())
        layout = BlockLayout(shape[1], ((kind, shape[0]),))
        kq_values = np.array(decode(encoded.reshape(-1), layout), np.float64)
        packed, scales, biases = mx.quantize(weights, 64, bits)
        affine_values = np.array(mx.dequantize(packed, scales, biases, group_size=64, bits=bits))
        out.append(
            {
                "type": name,
                "bpw": file_bpw(kind),
                "kquant_rel_l2": errors(kq_values, reference)["rel_l2"],
                "affine_bits": bits,
                "affine_bpw": bits + 2 * 16 / 64,
                "affine_rel_l2": errors(affine_values.astype(np.float64), reference)["rel_l2"],
            }
        )
    columns = ("K-quant", "bpw", "rel-L2", "affine bits (g64, f16)", "bpw", "rel-L2")
    report(
        out,
        args.json,
        (*columns, "K-quant / affine"),
        lambda row: (
            row["type"],
            f"{row['bpw']:.4g}",
            f"{row['kquant_rel_l2']:.3g}",
            str(row["affine_bits"]),
            f"{row['affine_bpw']:g}",
            f"{row['affine_rel_l2']:.3g}",
            f"{row['kquant_rel_l2'] / row['affine_rel_l2']:.2f}",
        ),
    )


def report_networks(as_json: bool) -> None:
    import tempfile

    from gmlx_server.engine.encoders.qwen3.text import Qwen3TextEncoder
    from gmlx_server.engine.families.qwen_image21 import family

    from tests.encoders.qwen3 import test_gguf as encoder_test
    from tests.families.qwen_image21 import test_gguf as dit_test

    root = Path(tempfile.mkdtemp())
    base = dit_test.ensure_embedded_model(root / "embedded")
    rows = dit_test.rows_of(
        family.QWEN_IMAGE21.load(base, "encoder").encode("a red boat", [], refs=False)
    )
    text_dir = encoder_test.tiny_qwen3(root / "qwen3")
    os.environ[HELD_SETTING] = "affine"
    out = []
    for kind in NEAREST:
        folder, reference = dit_test.gguf_model(base, root, kind)
        got = dit_test.step(family.QWEN_IMAGE21.load(folder, "gguf"), rows)
        expected = dit_test.step(family.QWEN_IMAGE21.load(reference, "reference"), rows)
        work = root / f"encoder-{kind.name}"
        work.mkdir()
        held = encoder_test.write_encoder_gguf(
            work / "e.gguf", text_dir, kind, np.random.default_rng(int(kind))
        )
        encoded = encoder_test.hidden(Qwen3TextEncoder.load(text_dir, gguf=work / "e.gguf"))
        plain = Qwen3TextEncoder.load(encoder_test.reference_folder(text_dir, work / "ref", held))
        out.append(
            {
                "type": kind.name,
                "mlx_bits": NEAREST[kind],
                "step_rel_l2": dit_test.rel_l2(got, expected),
                "encode_rel_l2": encoder_test.rel_l2(encoded, encoder_test.hidden(plain)),
            }
        )
    report(
        out,
        as_json,
        ("type", "MLX bits", "Qwen-Image 2.1 step rel-L2", "Qwen3 hidden states rel-L2"),
        lambda row: (
            row["type"],
            str(row["mlx_bits"]),
            f"{row['step_rel_l2']:.2g}",
            f"{row['encode_rel_l2']:.2g}",
        ),
    )


if __name__ == "__main__":
    main()
