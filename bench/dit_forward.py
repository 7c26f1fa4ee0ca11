"""Time the Qwen-Image 2.1 DiT forward in MLX against diffusers' PyTorch forward.

One random transformer of a small-to-medium configuration (diffusers' own class, saved and loaded
by both sides), one prompt of `--text` rows (and `--refs` 16x16-latent references), one row. For
each latent size it times, median of `--repeats` after one warm-up:

  torch full     diffusers forward over the whole joint sequence (no KV cache)
  torch cached   diffusers decode step against its prefix KV cache (kv_cache_mode="cached")
  mlx full       prefix state + target pass, what a step with a prefix-cache miss runs
  mlx cached     target pass on a held prefix state, what a step with a prefix-cache hit runs

and prints the ratios torch / mlx (above 1: MLX is faster). MLX time is taken after mx.eval.
With --variants it also times the cached step of the same weights on
  mlx-ops       MLX's own ops on the CPU (mx.fast SDPA, mx.sigmoid): engine/nn/cpu_ops.py turned off
  mlx-eager     the target pass without mx.compile
so before/after figures come from one run on one machine state. `first_call_ms` is the first
cached call of the default model (mx.compile traces and g++ builds any kernel not yet in
$TMPDIR/mlx), `load` the 1-minute load average when the run ended.

    .venv/bin/python bench/dit_forward.py [--sizes 32x32,64x64] [--layers 4] [--heads 4]
        [--head-dim 64] [--text 128] [--refs 0] [--repeats 3] [--reference-blas]
        [--variants] [--json]

The optimised BLAS for MLX's CPU backend (gmlx_server.engine.blas) is loaded first unless
--reference-blas is given. Results go to docs/benchmarks.md ("DiT forward").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import median_ms  # noqa: E402 - after the path insert


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="32x32,64x64", help="latent sizes HxW, comma-separated")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--context", type=int, default=256, help="text encoder width")
    parser.add_argument("--text", type=int, default=128, help="text rows of the prompt")
    parser.add_argument("--refs", type=int, default=0, help="16x16-latent references")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reference-blas", action="store_true", help="keep MLX's netlib BLAS")
    parser.add_argument("--variants", action="store_true", help="also time mlx-ops, mlx-eager")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """Even axes summing to head_dim in the 16:56:56 proportion of the full-size model."""
    frame = max(2, (head_dim // 8) // 2 * 2)
    side = (head_dim - frame) // 2 // 2 * 2
    return frame, side, head_dim - frame - side


@contextlib.contextmanager
def mlx_own_ops():
    """Turn engine/nn/cpu_ops.py off while a model is loaded, traced and timed: MLX's own SDPA and
    sigmoid, as the DiT ran before it (a compiled pass keeps the ops it was traced with)."""
    from gmlx_server.engine.nn import cpu_ops

    use_cpu_ops = cpu_ops.use_cpu_ops
    cpu_ops.use_cpu_ops = lambda dtype: False
    try:
        yield
    finally:
        cpu_ops.use_cpu_ops = use_cpu_ops


class Bench:
    """One model pair and prompt; `time_size` times the four forwards at one latent size."""

    def __init__(self, model, dit, variants, cond, ref_tokens, layout, args):
        self.model, self.dit, self.layout, self.args = model, dit, layout, args
        self.variants = variants  # name -> another QwenImage21DiT of the same weights
        self.cond, self.ref_tokens = cond, ref_tokens

    def torch_inputs(self, x, sigma, h, w) -> dict:
        """hidden_states, encoder_hidden_states with the references' pad rows (one per 2x2
        latent tokens, at the middle text row), img_mask and img_shapes, as the pipeline does."""
        import numpy as np
        import torch

        text, refs, context = self.args.text, self.ref_tokens, self.cond.shape[1]
        half = text // 2
        pad_rows = np.zeros((sum(len(r) for r in refs) // 4, context), np.float32)
        encoder_hidden = np.concatenate([self.cond[:half], pad_rows, self.cond[half:]])
        mask = [False] * half + [True] * len(pad_rows) + [False] * (text - half)
        mask += [True] * (h * w // 4)
        return {
            "hidden_states": torch.from_numpy(np.concatenate([*refs, x[0]])[None].copy()),
            "encoder_hidden_states": torch.from_numpy(encoder_hidden[None].copy()),
            "timestep": torch.from_numpy(sigma),
            "img_shapes": [[*[(1, 16, 16) for _ in refs], (1, h, w)]],
            "img_mask": torch.tensor([mask]),
            "return_dict": False,
        }

    def time_size(self, h: int, w: int) -> dict:
        import mlx.core as mx
        import numpy as np
        import torch
        from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

        args, dit, model, layout = self.args, self.dit, self.model, self.layout
        rng = np.random.default_rng(h * 1000 + w)
        x = rng.standard_normal((1, h * w, args.channels)).astype(np.float32)
        sigma = np.array([0.7], np.float32)
        kwargs = self.torch_inputs(x, sigma, h, w)
        cache = QwenImage21KVCache(args.layers)
        with torch.no_grad():
            model(**kwargs, kv_cache=cache, kv_cache_mode="extract")
            t_full = median_ms(lambda: model(**kwargs), args.repeats)
            t_cached = median_ms(
                lambda: model(**kwargs, kv_cache=cache, kv_cache_mode="cached"), args.repeats
            )

        text = mx.array(self.cond)
        refs = [mx.array(t) for t in self.ref_tokens]
        tokens, mx_sigma = mx.array(x), mx.array(sigma)

        def mlx_full():
            state = dit.prefix_state(layout, text, refs)
            mx.eval(dit.target_forward(tokens, mx_sigma, [state], h, w))

        state = dit.prefix_state(layout, text, refs)
        mx.eval(state.keys, state.values)
        started = time.perf_counter()
        mx.eval(dit.target_forward(tokens, mx_sigma, [state], h, w))
        first_call = (time.perf_counter() - started) * 1000.0
        m_full = median_ms(mlx_full, args.repeats)
        m_cached = median_ms(
            lambda: mx.eval(dit.target_forward(tokens, mx_sigma, [state], h, w)), args.repeats
        )
        variants = {}
        for name, other in self.variants.items():
            with mlx_own_ops() if name == "mlx-ops" else contextlib.nullcontext():
                other_state = other.prefix_state(layout, text, refs)
                mx.eval(other_state.keys, other_state.values)
                ms = median_ms(
                    lambda o=other, s=other_state: mx.eval(
                        o.target_forward(tokens, mx_sigma, [s], h, w)
                    ),
                    args.repeats,
                )
            variants[f"{name}_cached_ms"] = round(ms, 2)
            variants[f"ratio_cached_{name}"] = round(t_cached / ms, 3)
        return {
            "latent": f"{h}x{w}",
            "tokens": {"prefix": layout.length, "target": h * w},
            "torch_full_ms": round(t_full, 2),
            "torch_cached_ms": round(t_cached, 2),
            "mlx_full_ms": round(m_full, 2),
            "mlx_cached_ms": round(m_cached, 2),
            "ratio_full": round(t_full / m_full, 3),
            "ratio_cached": round(t_cached / m_cached, 3),
            "first_call_ms": round(first_call, 1),
            **variants,
        }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.reference_blas:
        os.environ["GMLX_BLAS"] = "off"
    from gmlx_server.engine.blas import ensure_fast_blas

    blas = ensure_fast_blas()  # before mlx is imported, or it has no effect

    import mlx.core as mx
    import numpy as np
    import torch
    from gmlx_server.engine.families.qwen_image21.dit import PrefixLayout, QwenImage21DiT

    from tests.families.qwen_image21.tiny.transformer import build_transformer

    config = {
        "in_channels": args.channels,
        "out_channels": args.channels,
        "num_layers": args.layers,
        "attention_head_dim": args.head_dim,
        "num_attention_heads": args.heads,
        "context_in_dim": args.context,
        "axes_dims_rope": rope_axes(args.head_dim),
    }
    folder = Path(tempfile.mkdtemp(prefix="dit_bench_"))
    model = build_transformer(folder, seed=0, **config)
    dit = QwenImage21DiT.load(folder)
    dit.compiled = True  # as a DiT of a real width runs (nn/compiled.py: a narrow one is eager)
    variants = {}
    if args.variants:
        variants["mlx-eager"] = QwenImage21DiT.load(folder)
        variants["mlx-eager"].compiled = False
        with mlx_own_ops():
            variants["mlx-ops"] = QwenImage21DiT.load(folder)
        variants["mlx-ops"].compiled = True
    rng = np.random.default_rng(0)
    cond = rng.standard_normal((args.text, args.context)).astype(np.float32)
    refs = [
        rng.standard_normal((args.channels, 16, 16)).astype(np.float32) for _ in range(args.refs)
    ]
    ref_tokens = [r.reshape(args.channels, -1).T.copy() for r in refs]
    slots = [args.text // 2] * args.refs
    layout = PrefixLayout(args.text, tuple((16, 16) for _ in refs), tuple(slots))

    bench = Bench(model, dit, variants, cond, ref_tokens, layout, args)
    results = [
        bench.time_size(*(int(v) for v in size.lower().split("x")))
        for size in args.sizes.split(",")
    ]

    report = {
        "config": config,
        "text_rows": args.text,
        "refs": args.refs,
        "blas": blas.message,
        "torch_threads": torch.get_num_threads(),
        "mlx_device": str(mx.default_device()),
        "compiled": dit.compiled,
        "load": round(os.getloadavg()[0], 2),
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"config {config}, text {args.text} rows, refs {args.refs}")
    print(
        f"{report['blas']}; torch threads {report['torch_threads']}; mlx {report['mlx_device']};"
        f" compiled {report['compiled']}; load {report['load']}"
    )
    print(
        f"{'latent':>8} {'torch full':>11} {'mlx full':>9} {'ratio':>6}   "
        f"{'torch cached':>12} {'mlx cached':>10} {'ratio':>6}"
    )
    for r in results:
        print(
            f"{r['latent']:>8} {r['torch_full_ms']:>11.1f} {r['mlx_full_ms']:>9.1f} "
            f"{r['ratio_full']:>6.2f}   {r['torch_cached_ms']:>12.1f} "
            f"{r['mlx_cached_ms']:>10.1f} {r['ratio_cached']:>6.2f}"
            + "".join(f"   {k} {v}" for k, v in r.items() if k.startswith("ratio_cached_"))
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
