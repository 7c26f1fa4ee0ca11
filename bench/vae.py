"""Time the Qwen-Image 2.1 VAE decode and encode in MLX against diffusers' PyTorch model.

One random VAE (diffusers' own class, built by tests/families/qwen_image21/tiny/vae.py, saved and loaded by both sides)
of the `--preset` configuration; for each image size it times, median of `--repeats` after one
warm-up, with the same latents / image on both sides:

  decode   raw latents (1, z, h, w) -> image, diffusers' model.decode vs QwenImage21VAE.decode
  encode   image -> raw latents (distribution mean), model.encode(...).mode() vs .encode

and prints the ratios torch / mlx (above 1: MLX is faster) and the relative L2 between the two
outputs. MLX time is taken after mx.eval; neither side tiles unless `--tile-cells` makes MLX tile.

    .venv/bin/python bench/vae.py [--preset tiny|small|medium] [--sizes 256x256,512x512]
        [--repeats 3] [--tile-cells N] [--reference-blas] [--json]

The optimised BLAS for MLX's CPU backend (gmlx_server.engine.blas) is loaded first unless
--reference-blas is given. Results go to docs/benchmarks.md ("VAE decode and encode").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import median_ms  # noqa: E402 - after the path insert

# Builder overrides per preset; "full" would be diffusers' defaults (base 96, decoder 144,
# z 64, dim_mult 1,2,4,8,8, two res blocks), too slow for a shared two-core machine.
PRESETS = {
    "tiny": {},
    "small": {"base_dim": 16, "decoder_base_dim": 24, "num_res_blocks": 2, "z_dim": 64},
    "medium": {
        "base_dim": 32,
        "decoder_base_dim": 48,
        "dim_mult": [1, 2, 4, 8, 8],
        "num_res_blocks": 2,
        "z_dim": 64,
    },
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument(
        "--sizes", default="256x256,512x512", help="image sizes HxW, comma-separated"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tile-cells", type=int, default=None, help="MLX tile side in latents")
    parser.add_argument("--reference-blas", action="store_true", help="keep MLX's netlib BLAS")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def rel_l2(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def time_size(model, vae, height: int, width: int, repeats: int) -> dict:
    import mlx.core as mx
    import numpy as np
    import torch

    from tests.vaes.qwen_image21.reference import reference_decode, reference_encode

    rng = np.random.default_rng(0)
    latents = rng.standard_normal((1, vae.z_dim, height // 16, width // 16)).astype(np.float32)
    image = rng.random((1, height, width, vae.in_channels), dtype=np.float32)
    latents_mx, image_mx = mx.array(latents), mx.array(image)

    with torch.inference_mode():
        torch_decode = median_ms(lambda: reference_decode(model, latents), repeats)
        torch_encode = median_ms(lambda: reference_encode(model, image), repeats)
        decode_error = rel_l2(vae.decode(latents_mx), reference_decode(model, latents))
        encode_error = rel_l2(vae.encode(image_mx), reference_encode(model, image))
    mx.reset_peak_memory()
    mlx_decode = median_ms(lambda: vae.decode(latents_mx), repeats)  # decode evaluates its output
    decode_peak = mx.get_peak_memory()
    mx.reset_peak_memory()
    mlx_encode = median_ms(lambda: vae.encode(image_mx), repeats)
    encode_peak = mx.get_peak_memory()
    return {
        "size": f"{height}x{width}",
        "torch_decode_ms": torch_decode,
        "mlx_decode_ms": mlx_decode,
        "ratio_decode": torch_decode / mlx_decode,
        "torch_encode_ms": torch_encode,
        "mlx_encode_ms": mlx_encode,
        "ratio_encode": torch_encode / mlx_encode,
        "rel_l2_decode": decode_error,
        "rel_l2_encode": encode_error,
        "mlx_decode_peak_bytes": decode_peak,
        "mlx_encode_peak_bytes": encode_peak,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.reference_blas:
        os.environ["GMLX_BLAS"] = "off"
    from gmlx_server.engine.blas import ensure_fast_blas

    blas = ensure_fast_blas()  # before mlx is imported, or it has no effect

    import mlx.core as mx
    import torch
    from gmlx_server.engine.vaes.qwen_image21 import QwenImage21VAE

    from tests.families.qwen_image21.tiny.vae import build_vae, tiny_config

    folder = Path(tempfile.mkdtemp(prefix="vae_bench_"))
    model = build_vae(folder, seed=0, **PRESETS[args.preset])
    vae = QwenImage21VAE.load(folder)
    if args.tile_cells:
        vae.tile_cells = args.tile_cells
    sizes = [tuple(int(v) for v in size.lower().split("x")) for size in args.sizes.split(",")]
    results = [time_size(model, vae, h, w, args.repeats) for h, w in sizes]

    config = {k: v for k, v in tiny_config(**PRESETS[args.preset]).items()}
    report = {
        "preset": args.preset,
        "config": config,
        "blas": blas.message,
        "torch_threads": torch.get_num_threads(),
        "mlx_device": str(mx.default_device()),
        "tile_cells": vae.tile_cells,
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"preset {args.preset}: {config}")
    print(f"{report['blas']}; torch threads {report['torch_threads']}; mlx {report['mlx_device']}")
    print(
        f"{'size':>10} {'torch dec':>10} {'mlx dec':>9} {'ratio':>6}   "
        f"{'torch enc':>10} {'mlx enc':>9} {'ratio':>6}   {'rel L2 dec/enc':>16}"
    )
    for r in results:
        print(
            f"{r['size']:>10} {r['torch_decode_ms']:>10.1f} {r['mlx_decode_ms']:>9.1f} "
            f"{r['ratio_decode']:>6.2f}   {r['torch_encode_ms']:>10.1f} "
            f"{r['mlx_encode_ms']:>9.1f} {r['ratio_encode']:>6.2f}   "
            f"{r['rel_l2_decode']:.1e}/{r['rel_l2_encode']:.1e}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
