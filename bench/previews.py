"""Time a step preview (`engine/previews.LatentPreview.picture`) at the latent shapes of a
1024 x 1024 image of each family, against nothing: a preview runs no network.

For each family's model-space latents (channels at the latent grid) it times, median of
`--repeats` after one warm-up, the affine map to colours and the upscale to the image size.
The map's fit is one VAE encode of a 256 x 256 probe (bench/vae.py times that encode).

    .venv/bin/python bench/previews.py [--size 1024] [--repeats 20]

Results go to docs/benchmarks.md ("Step previews").
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gmlx_server.engine.previews import LatentPreview  # noqa: E402

from bench.timing import median_ms  # noqa: E402 - after the path insert

# (family, latent channels, latent stride) of the model space the sampler works in.
LATENTS = [
    ("Z-Image (FLUX.1 VAE)", 16, 8),
    ("FLUX.2 klein, FLUX.3 klein", 128, 16),
    ("Qwen-Image 2.1", 64, 16),
    ("Krea 2 (Qwen-Image VAE)", 16, 8),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    print("| family | latents | preview ms |")
    print("|---|---|---|")
    for name, channels, stride in LATENTS:
        side = args.size // stride
        preview = LatentPreview(rng.normal(size=(channels + 1, 3)).astype(np.float32) * 0.1)
        latents = rng.normal(size=(1, channels, side, side)).astype(np.float32)
        ms = median_ms(partial(preview.picture, latents, args.size, args.size), args.repeats)
        print(f"| {name} | {channels} × {side}² | {ms:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
