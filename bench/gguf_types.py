"""GGUF types as MLX weights: the error each conversion adds (engine/gguf.py).

For every quantized GGUF type the server reads, a (`--rows`, `--cols`) tensor of random valid
blocks (as tests/engine/gguf_files.py writes them: float16 scales of 0.002..0.02, any levels;
Q8_0..Q5_1 quantized from Gaussian weights by `gguf.quants.quantize`) is converted to MLX's
affine form and dequantized by `mx.dequantize`; against `gguf.quants.dequantize` of the same
bytes: the relative L2, the largest difference relative to the largest weight, and the bits
per weight each form holds (MLX: packed levels plus float32 scale and bias per 32). For the
types with no exact form, the same at every MLX width from the source's up, to show the choice
(engine/gguf.NEAREST).

With `--networks`, what those types add at the output of whole networks, as the tests build
them (K-quant blocks at the float weights' RMS): Qwen-Image 2.1's step on the tiny GGUF DiT of
tests/families/qwen_image21/test_gguf.py (every block linear of the type) and Qwen3's hidden
states on the tiny GGUF encoder of tests/encoders/qwen3/test_gguf.py (every matrix, the token
embedding included), each against the same network on gguf's dequantized weights.

    .venv/bin/python bench/gguf_types.py [--rows 1024] [--cols 4096] [--networks] [--json]

Results go to docs/benchmarks.md ("GGUF types").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gmlx_server.engine.gguf import EXACT, GROUP_SIZE, NEAREST, affine  # noqa: E402

from tests.engine.gguf_files import random_blocks  # noqa: E402

SOURCE_BITS = {
    gguf.GGMLQuantizationType.Q6_K: 6,
    gguf.GGMLQuantizationType.Q3_K: 3,
    gguf.GGMLQuantizationType.Q2_K: 2,
}
MLX_BITS = (2, 3, 4, 5, 6, 8)


def errors(got: np.ndarray, expected: np.ndarray) -> dict:
    return {
        "rel_l2": float(np.linalg.norm(got - expected) / np.linalg.norm(expected)),
        "max_rel": float(np.abs(got - expected).max() / np.abs(expected).max()),
    }


def mlx_bpw(bits: int) -> float:
    return bits + 2 * 32 / GROUP_SIZE


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--networks", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.networks:
        report_networks(args.json)
        return
    shape = (args.rows, args.cols)
    rows = []
    for kind in (*EXACT, *NEAREST):
        data = random_blocks(kind, shape, np.random.default_rng(int(kind)))
        expected = gguf.quants.dequantize(data, kind)
        block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
        widths = [EXACT[kind]] if kind in EXACT else [b for b in MLX_BITS if b >= SOURCE_BITS[kind]]
        for bits in widths:
            if kind in EXACT:
                item = affine(kind, data, *shape)
                packed, scales, biases = item.packed()
            else:
                packed, scales, biases = mx.quantize(mx.array(expected), GROUP_SIZE, bits)
            got = np.array(mx.dequantize(packed, scales, biases, group_size=GROUP_SIZE, bits=bits))
            rows.append(
                {
                    "type": kind.name,
                    "gguf_bpw": 8 * type_size / block_size,
                    "mlx_bits": bits,
                    "mlx_bpw": mlx_bpw(bits),
                    "chosen": kind in EXACT or NEAREST[kind] == bits,
                    **errors(got, expected),
                }
            )
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| type | GGUF bpw | MLX bits | MLX bpw | rel-L2 | max / max weight |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        mark = " (kept)" if row["chosen"] and row["type"] in {k.name for k in NEAREST} else ""
        print(
            f"| {row['type']} | {row['gguf_bpw']:.4g} | {row['mlx_bits']}{mark} |"
            f" {row['mlx_bpw']:g} | {row['rel_l2']:.2g} | {row['max_rel']:.2g} |"
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
    if as_json:
        print(json.dumps(out, indent=2))
        return
    print("| type | MLX bits | Qwen-Image 2.1 step rel-L2 | Qwen3 hidden states rel-L2 |")
    print("|---|---|---|---|")
    for row in out:
        print(
            f"| {row['type']} | {row['mlx_bits']} | {row['step_rel_l2']:.2g} |"
            f" {row['encode_rel_l2']:.2g} |"
        )


if __name__ == "__main__":
    main()
