"""Qwen3.5's language model (encoders/qwen35/text.py) against Qwen3's (encoders/qwen3/text.py)
of the same width, depth, attention heads and MLP, in MLX: the time to encode a prompt and
the memory it peaks at, and the weights' bytes. Random weights (MLX's own init), float32, the optimised BLAS under MLX's CPU backend.

Qwen3.5 keeps a full attention layer in four; the other three are Gated DeltaNet, whose
state is (key heads x key dim x value dim) a head whatever the prompt's length. The
"small" preset is Qwen3.5-9B's proportions at a quarter of its width and depth (width 1024,
8 layers; Gated DeltaNet key 8 x 64, value 16 x 64), Qwen3's the same width and attention.

    .venv/bin/python bench/qwen35.py [--lengths 128,512] [--repeats 5]

Results go to docs/benchmarks.md ("Prompt encoding").
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gmlx_server.engine.blas import ensure_fast_blas  # noqa: E402 - after the path insert

BLAS = ensure_fast_blas()  # before MLX loads: its CPU backend's GEMMs

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from gmlx_server.engine.encoders.qwen3.text import Qwen3TextEncoder  # noqa: E402
from gmlx_server.engine.encoders.qwen3.text import TextConfig as Qwen3Config  # noqa: E402
from gmlx_server.engine.encoders.qwen3.text import TextModel as Qwen3Model  # noqa: E402
from gmlx_server.engine.encoders.qwen35.text import TextConfig, TextModel  # noqa: E402
from gmlx_server.engine.nn.dtypes import tree_bytes  # noqa: E402

from bench.timing import median_ms  # noqa: E402

SHARED = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
}
QWEN35 = {
    **SHARED,
    "linear_num_key_heads": 8,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
}


def peak_and_ms(encode, repeats: int) -> tuple[float, float]:
    mx.reset_peak_memory()
    ms = median_ms(lambda: mx.eval(encode()), repeats)
    return mx.get_peak_memory() / 2**20, ms


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="128,512")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    qwen35 = TextModel(TextConfig.from_dict(QWEN35))
    qwen3 = Qwen3TextEncoder(Qwen3Model(Qwen3Config.from_dict({**SHARED, "rope_theta": 1e6})), 0)
    mx.eval(qwen35.parameters(), qwen3.model.parameters())
    print(f"MLX BLAS: {BLAS}")
    print(f"weights MiB: Qwen3.5 {tree_bytes(qwen35.parameters()) / 2**20:.0f},"
          f" Qwen3 {tree_bytes(qwen3.model.parameters()) / 2**20:.0f}")  # fmt: skip
    print("| tokens | Qwen3.5 ms | Qwen3 ms | ratio | Qwen3.5 peak MiB | Qwen3 peak MiB |")
    print("|---|---|---|---|---|---|")
    for length in (int(n) for n in args.lengths.split(",")):
        ids = np.random.default_rng(length).integers(0, SHARED["vocab_size"], length)
        new = partial(qwen35.hidden_states, ids, (SHARED["num_hidden_layers"],))
        old = partial(qwen3.hidden_states, ids, (-1,))
        new_peak, new_ms = peak_and_ms(new, args.repeats)
        old_peak, old_ms = peak_and_ms(old, args.repeats)
        print(f"| {length} | {new_ms:.0f} | {old_ms:.0f} | {new_ms / old_ms:.2f} |"
              f" {new_peak:.0f} | {old_peak:.0f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
