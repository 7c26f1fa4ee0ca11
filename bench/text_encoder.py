"""Qwen-Image 2.1 prompt encoding: the MLX encoder against diffusers/transformers on one config.

Builds a random Qwen3-VL folder (tests/families/qwen_image21/tiny/text_encoder.py) at the chosen preset, then times
`QwenImage21PromptEncoder.encode` and the pipeline's `encode_prompt` on the same prompt and
references (float32, after warm-up), and reports the medians and their relative L2 difference.

    .venv/bin/python bench/text_encoder.py [--preset tiny|small] [--images 0] [--size 512]
                                           [--words 60] [--repeats 5] [--json]

Results go to docs/benchmarks.md ("Prompt encoding").
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.timing import median_ms  # noqa: E402 - after the path insert

PRESETS = {
    "tiny": {},
    "small": {
        "text": {
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 64,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [12, 10, 10],
                "mrope_interleaved": True,
            },
        },
        "vision": {
            "depth": 6,
            "hidden_size": 256,
            "intermediate_size": 1024,
            "num_heads": 4,
            "out_hidden_size": 512,
            "num_position_embeddings": 256,
            "deepstack_visual_indexes": [1, 3, 5],
        },
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--images", type=int, default=0, help="reference images per prompt")
    parser.add_argument("--size", type=int, default=512, help="side of each square reference")
    parser.add_argument("--words", type=int, default=60, help="prompt length in words")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    # As `gmlx serve` does: an optimised BLAS for MLX's Linux CPU backend, before mlx loads.
    from gmlx_server.engine.blas import ensure_fast_blas

    blas = ensure_fast_blas()
    import mlx.core as mx
    import torch
    from gmlx_server.engine.families.qwen_image21.prompt import QwenImage21PromptEncoder

    from tests.compare import rel_l2
    from tests.encoders.qwen3.reference import (
        load_pipeline,
        reference_encode,
        resize_like_pipeline,
    )
    from tests.families.qwen_image21.tiny.text_encoder import build_text_encoder

    words = "a red fox in the snow photograph golden hour light oil painting".split()
    prompt = " ".join(words[i % len(words)] for i in range(args.words))
    rng = np.random.default_rng(0)
    images = [
        rng.integers(0, 256, (args.size, args.size, 3), dtype=np.uint8) for _ in range(args.images)
    ]

    with tempfile.TemporaryDirectory() as folder:
        build_text_encoder(Path(folder), seed=0, **PRESETS[args.preset])
        encoder = QwenImage21PromptEncoder.load(Path(folder))
        pipe = load_pipeline(Path(folder))

        @torch.no_grad()
        def transformers_encode():
            # The pipeline's own work: its resize of the references, then encode_prompt.
            resized = [resize_like_pipeline(pipe, image)[0] for image in images]
            pipe.encode_prompt(prompt, image=resized or None, device=torch.device("cpu"))

        ours = encoder.encode(prompt, images)
        cond, *_ = reference_encode(pipe, prompt, images)
        result = {
            "preset": args.preset,
            "images": args.images,
            "image_size": args.size,
            "tokens": int(ours.token_ids.shape[0]),
            "mlx_ms": median_ms(lambda: encoder.encode(prompt, images), args.repeats),
            "transformers_ms": median_ms(transformers_encode, args.repeats),
            "rel_l2": rel_l2(ours.cond[0], cond),
            "mlx_device": str(mx.default_device()),
            "mlx_blas": str(blas),
            "torch_threads": torch.get_num_threads(),
            "machine": f"{platform.system()} {platform.machine()}",
        }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>16}: {value:.2f}" if isinstance(value, float) else f"{key:>16}: {value}")


if __name__ == "__main__":
    main()
