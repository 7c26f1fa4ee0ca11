"""Micro-benchmarks of MLX's CPU backend at DiT-like shapes: why its softmax is slow, and what
server/engine/nn/cpu_ops.py does about it.

Sections (float32, best of --repeats after one warm-up; `cpu/wall` is process CPU time over wall
time, so 1.0 means one thread did the work):

  elementwise   mx.exp, mx.sigmoid, mx.tanh, add, cpu_ops.exp2_nonpositive and cpu_ops.sigmoid,
                eager and mx.compile'd, against numpy, on --elements floats
  reductions    max and sum over the last axis; softmax
  matmul        the two attention matmuls of one head-batch, through the preloaded BLAS
  attention     mx.fast.scaled_dot_product_attention (MLX's CPU fallback: matmul, softmax,
                matmul), the same with mx.compile, cpu_ops.attention eager and compiled, and
                torch's scaled_dot_product_attention when torch is installed
  jit           (--jit) the kernels mx.compile built with g++ for exp vs cpu_ops' exp2: how many
                packed (vectorised) and scalar float instructions each holds (needs objdump)

    .venv/bin/python bench/mlx_ops.py [--elements 4718592] [--attention 4x1024x64,4x4096x64]
        [--prefix 128] [--repeats 3] [--jit] [--json]

Attention shapes are HEADSxTOKENSxHEAD_DIM with B=1 and --prefix extra keys (text rows), as in
the DiT's target pass. Results go to docs/benchmarks.md ("MLX's slow CPU kernels").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=4 * 1152 * 1024)
    parser.add_argument("--attention", default="4x1024x64,4x4096x64,8x1024x128")
    parser.add_argument("--prefix", type=int, default=128, help="extra keys per attention")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jit", action="store_true", help="inspect the g++-built kernels")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def best_ms(fn, repeats: int) -> tuple[float, float]:
    """(best wall ms, CPU time / wall time of that call) after one warm-up."""
    fn()
    best, ratio = float("inf"), 0.0
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if wall < best:
            best, ratio = wall, cpu / wall
    return best * 1e3, ratio


def row(section: str, name: str, ms: float, ratio: float, **extra) -> dict:
    return {
        "section": section,
        "op": name,
        "ms": round(ms, 2),
        "cpu_wall": round(ratio, 2),
        **extra,
    }


def elementwise(args) -> list[dict]:
    import mlx.core as mx
    import numpy as np
    from gmlx_server.engine.nn import cpu_ops

    rng = np.random.default_rng(0)
    x_np = (-np.abs(rng.standard_normal(args.elements)) * 8).astype(np.float32)  # softmax-like
    x = mx.array(x_np)
    mx.eval(x)
    ops = {
        "mx.exp": mx.exp,
        "mx.sigmoid": mx.sigmoid,
        "mx.tanh": mx.tanh,
        "add (x + 1)": lambda a: a + 1.0,
        "cpu_ops.exp2_nonpositive": cpu_ops.exp2_nonpositive,
        "cpu_ops.sigmoid": cpu_ops.sigmoid,
    }
    rows = []
    for name, op in ops.items():
        compiled = mx.compile(op)
        eager_ms, eager_ratio = best_ms(lambda: mx.eval(op(x)), args.repeats)  # noqa: B023
        comp_ms, comp_ratio = best_ms(lambda: mx.eval(compiled(x)), args.repeats)  # noqa: B023
        rows.append(row("elementwise", name, eager_ms, eager_ratio, compiled_ms=round(comp_ms, 2)))
    numpy_ops = {"numpy exp": np.exp, "numpy exp2": np.exp2, "numpy add": lambda a: a + 1.0}
    for name, op in numpy_ops.items():
        rows.append(row("elementwise", name, *best_ms(lambda: op(x_np), args.repeats)))  # noqa: B023
    for r in rows:
        r["ns_per_element"] = round(r["ms"] * 1e6 / args.elements, 2)
    return rows


def reductions(args) -> list[dict]:
    import mlx.core as mx

    x = mx.random.normal((args.elements // 4096, 4096))
    mx.eval(x)
    ops = {
        "max(-1)": lambda: x.max(axis=-1),
        "sum(-1)": lambda: x.sum(axis=-1),
        "softmax(-1)": lambda: mx.softmax(x, axis=-1),
        "softmax(-1, precise)": lambda: mx.softmax(x, axis=-1, precise=True),
    }
    return [
        row("reductions", n, *best_ms(lambda: mx.eval(f()), args.repeats))  # noqa: B023
        for n, f in ops.items()
    ]


def attention_shapes(args) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in s.split("x")) for s in args.attention.split(",")]


def attention(args) -> list[dict]:
    import mlx.core as mx
    import numpy as np
    from gmlx_server.engine.nn import cpu_ops

    rows = []
    for heads, tokens, dim in attention_shapes(args):
        keys = tokens + args.prefix
        rng = np.random.default_rng(1)
        q_np, k_np, v_np = (
            rng.standard_normal((1, heads, n, dim), dtype=np.float32) for n in (tokens, keys, keys)
        )
        q, k, v = mx.array(q_np), mx.array(k_np), mx.array(v_np)
        scale = dim**-0.5
        shape = f"{heads}x{tokens}x{dim}+{args.prefix}"
        scores = heads * tokens * keys

        def sdpa(q, k, v):
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)  # noqa: B023

        def blocked(q, k, v):
            return cpu_ops.attention(q, k, v, scale)  # noqa: B023

        reference = sdpa(q, k, v)
        candidates = {
            "matmul q@k^T": lambda q, k, v: q @ k.swapaxes(-1, -2),
            "mx.fast.sdpa": sdpa,
            "mx.fast.sdpa compiled": mx.compile(sdpa),
            "cpu_ops.attention": blocked,
            "cpu_ops.attention compiled": mx.compile(blocked),
        }
        for name, fn in candidates.items():
            ms, ratio = best_ms(lambda: mx.eval(fn(q, k, v)), args.repeats)  # noqa: B023
            extra = {"shape": shape, "ns_per_score": round(ms * 1e6 / scores, 2)}
            if name != "matmul q@k^T":
                out = fn(q, k, v)
                extra["rel_l2_vs_sdpa"] = float(
                    (mx.linalg.norm(out - reference) / mx.linalg.norm(reference)).item()
                )
            rows.append(row("attention", name, ms, ratio, **extra))
        rows.extend(torch_attention(args, shape, scores, q_np, k_np, v_np))
    return rows


def torch_attention(args, shape, scores, q_np, k_np, v_np) -> list[dict]:
    try:
        import torch
    except ImportError:
        return []
    q, k, v = (torch.from_numpy(a) for a in (q_np, k_np, v_np))
    with torch.no_grad():
        ms, ratio = best_ms(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), args.repeats
        )
    return [
        row(
            "attention",
            f"torch sdpa ({torch.get_num_threads()} threads)",
            ms,
            ratio,
            shape=shape,
            ns_per_score=round(ms * 1e6 / scores, 2),
        )
    ]


def jit_kernels(kernel_dir: Path) -> list[dict]:
    """Count packed vs scalar float arithmetic in each kernel library g++ built."""
    packed = ("mulps", "addps", "subps", "divps", "cvttps2dq", "cvtdq2ps", "pslld", "paddd")
    scalar = ("mulss", "addss", "subss", "divss", "cvttss2si", "call")
    rows = []
    for library in sorted(kernel_dir.rglob("lib*.so")):
        try:
            listing = subprocess.run(
                ["objdump", "-d", str(library)], capture_output=True, text=True, check=True
            ).stdout
        except (OSError, subprocess.CalledProcessError):
            return []
        words = [
            line.split("\t")[-1].split(" ")[0] for line in listing.splitlines() if "\t" in line
        ]
        mnemonics = [w.lstrip("v") for w in words]
        rows.append(
            {
                "section": "jit",
                "kernel": library.name[3:60],
                "packed": sum(m in packed for m in mnemonics),
                "scalar_or_call": sum(m in scalar for m in mnemonics),
            }
        )
    return rows


def jit(args, kernel_dir: Path) -> list[dict]:
    import mlx.core as mx
    from gmlx_server.engine.nn import cpu_ops

    x = mx.random.normal((4096,)) - 4.0
    mx.eval(mx.compile(lambda a: mx.exp(a * 0.5))(x))
    mx.eval(mx.compile(lambda a: cpu_ops.exp2_nonpositive(a * 0.5))(x))
    return jit_kernels(kernel_dir)


def main(argv=None) -> int:
    args = parse_args(argv)
    kernel_dir = None
    if args.jit:
        # MLX writes its kernels under $TMPDIR/mlx/<version>/cpu: a fresh folder holds only ours.
        kernel_dir = Path(tempfile.mkdtemp(prefix="mlx_jit_"))
        os.environ["TMPDIR"] = str(kernel_dir)
    from gmlx_server.engine.blas import ensure_fast_blas

    blas = ensure_fast_blas()
    import mlx.core as mx

    rows = elementwise(args) + reductions(args) + attention(args)
    if kernel_dir is not None:
        rows += jit(args, kernel_dir)
    report = {
        "cpu_cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "mlx": mx.__version__,
        "blas": blas.message,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"mlx {report['mlx']}; {report['blas']}; cores {report['cpu_cores']};"
        f" load {report['load_average'][0]:.1f}"
    )
    for r in rows:
        rest = {k: v for k, v in r.items() if k not in ("section", "op", "kernel")}
        print(f"{r['section']:12s} {r.get('op', r.get('kernel')):32s} {rest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
