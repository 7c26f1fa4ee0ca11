"""The text encoder and the VAE in bfloat16 against float32 on this machine's MLX backend.

Times, median of `--repeats` after one warm-up, the same work at both dtypes:

  encoder tiny    the embedded default model's prompt encoder (Qwen3-VL, width 128, 2 layers)
                  on a 60-word prompt
  encoder layer   one Qwen3 decoder layer at the 8B encoder's width (4096, MLP 12288, 32 heads,
                  8 KV heads) on `--tokens` tokens, random weights
  vae tiny        the embedded default model's VAE: a decode of a 256x256 image, an encode of it
  vae layer       one VAE residual block at the full decoder's full-resolution width (144
                  channels at 256x256) and one at the encoder's deepest width (768 channels at
                  32x32), random weights

and the relative L2 of each bf16 output against the float32 one. The decision it informs is
`nn.dtypes.encoder_vae_dtype`'s default for the backend (docs/benchmarks.md, "Encoder and VAE
dtypes").

    .venv/bin/python bench/lean_dtypes.py [--repeats 3] [--tokens 256] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.timing import median_ms  # noqa: E402 - after the path insert

PROMPT = " ".join(["a red fox jumps over the lazy brown dog in a quiet winter forest"] * 5)
ENCODER_WIDTH = {
    "vocab_size": 1024,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 1,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
VAE_LAYERS = {"decoder full resolution": (144, 256), "encoder deepest": (768, 32)}


def rel_l2(got, want) -> float:
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _as_dtype(module, dtype):
    """A copy of the module's parameters at `dtype`, put back into the module."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    module.load_weights([(k, v.astype(dtype)) for k, v in tree_flatten(module.parameters())])
    mx.eval(module.parameters())


def time_pair(name: str, run, repeats: int) -> dict:
    """run(dtype) -> output (float32 array); the two timings and the bf16 error."""
    import mlx.core as mx
    import numpy as np

    outputs, times = {}, {}
    for dtype in (mx.float32, mx.bfloat16):
        outputs[dtype] = np.array(run(dtype).astype(mx.float32))
        times[dtype] = median_ms(lambda dtype=dtype: mx.eval(run(dtype)), repeats)
    row = {
        "what": name,
        "f32_ms": round(times[mx.float32], 1),
        "bf16_ms": round(times[mx.bfloat16], 1),
        "bf16_rel_l2": rel_l2(outputs[mx.bfloat16], outputs[mx.float32]),
    }
    print(json.dumps(row), flush=True)
    return row


def encoder_rows(folder: Path, repeats: int, tokens: int) -> list[dict]:
    import mlx.core as mx
    import numpy as np
    from gmlx_server.engine.encoders.qwen3.text import TextConfig, TextDecoderLayer
    from gmlx_server.engine.families.qwen_image21.prompt import QwenImage21PromptEncoder
    from gmlx_server.engine.nn.rope import cos_sin, inverse_frequencies

    encoders = {d: QwenImage21PromptEncoder.load(folder, d) for d in (mx.float32, mx.bfloat16)}
    rows = [
        time_pair("encoder tiny", lambda d: mx.array(encoders[d].encode(PROMPT, []).cond), repeats)
    ]
    config = TextConfig.from_dict({**ENCODER_WIDTH, "rope_theta": 5000000.0})
    layer = TextDecoderLayer(config)
    mx.eval(layer.parameters())
    x = mx.array(np.random.default_rng(0).standard_normal((1, tokens, config.hidden_size)))
    angles = np.arange(tokens, dtype=np.float32)[:, None] * inverse_frequencies(
        config.rope_theta, config.head_dim
    )

    def run(dtype):
        _as_dtype(layer, dtype)
        cos, sin = cos_sin(angles, dtype)
        return layer(x.astype(dtype), cos, sin)

    rows.append(time_pair(f"encoder layer, width 4096, {tokens} tokens", run, repeats))
    return rows


def vae_rows(folder: Path, repeats: int) -> list[dict]:
    import mlx.core as mx
    import numpy as np
    from gmlx_server.engine.vaes.qwen_image21 import QwenImage21VAE, ResidualBlock

    vaes = {d: QwenImage21VAE.load(folder / "vae", d) for d in (mx.float32, mx.bfloat16)}
    rng = np.random.default_rng(1)
    latents = mx.array(rng.standard_normal((1, vaes[mx.float32].z_dim, 16, 16)), mx.float32)
    image = mx.array(rng.random((1, 256, 256, 4)), mx.float32)
    rows = [
        time_pair("vae tiny decode 256x256", lambda d: vaes[d].decode(latents), repeats),
        time_pair("vae tiny encode 256x256", lambda d: vaes[d].encode(image), repeats),
    ]
    for name, (width, side) in VAE_LAYERS.items():
        block = ResidualBlock(width, width)
        mx.eval(block.parameters())
        x = mx.array(rng.standard_normal((1, side, side, width)), mx.float32)

        def run(dtype, block=block, x=x):
            _as_dtype(block, dtype)
            return block(x.astype(dtype))

        rows.append(time_pair(f"vae block {name}, {width} ch at {side}x{side}", run, repeats))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    args = parser.parse_args()
    from gmlx_server.engine.blas import ensure_fast_blas

    ensure_fast_blas()
    import mlx.core as mx
    from gmlx_server.engine.families.qwen_image21.embedded import ensure_embedded_model

    folder = ensure_embedded_model()
    print(f"# {platform.machine()} MLX {mx.__version__} on {mx.default_device()}", flush=True)
    rows = encoder_rows(folder, args.repeats, args.tokens) + vae_rows(folder, args.repeats)
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
