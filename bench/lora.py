"""LoRA on the Qwen-Image 2.1 DiT: low-rank pairs per step against weights merged per table.

A random DiT at full width (32 heads x 128 = 4096, SwiGLU x3) with `--layers` blocks, a random
LoRA of rank `--rank` on every linear of every block (q, k, v, out, gate, proj, down: the usual
targets), one row with a held prefix state of `--text` rows. `--repeats` rounds after one
warm-up (the warm-up also compiles), all times after mx.eval. The three passes are timed in
interleaved rounds; the overheads compare best times (on a shared machine the best of several
is the figure least disturbed by other jobs; medians and the process's CPU time are printed
too):

  plain      the target pass (what a step with a prefix hit runs) without a table
  low-rank   the same pass with the table's pairs: x W^T + (x A^T) B^T per patched weight
             (what the server runs: server/engine/lora.py)
  merged     the same pass on W + B A, merged per table beforehand
  prepare    building the table's low-rank pairs (once per table, at PUT time)
  merge      building the merged weights (once per table, again whenever tables alternate
             past a cache of merged copies)

plus the bytes each form holds per table, and the relative L2 between low-rank and merged.

    .venv/bin/python bench/lora.py [--size 32x32] [--layers 2] [--rank 16] [--text 200]
        [--repeats 5] [--dtype f32|bf16] [--json]

Results go to docs/benchmarks.md ("LoRA").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HEADS, HEAD_DIM, MLP_RATIO, CHANNELS, CONTEXT = 32, 128, 3, 64, 4096
BLOCK_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "img_mlp.gate_layer",
    "img_mlp.proj",
    "img_mlp.out",
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="32x32", help="latent HxW (32x32 = a 512x512 image)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--text", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="f32", choices=("f32", "bf16"))
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def interleaved_ms(fns: dict, repeats: int) -> tuple[dict, dict]:
    """Wall and process CPU times (ms) of each function, run in rounds that call each once in
    turn, after one warm-up round: a drift in the machine's load then falls on all alike."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            times[name].append((time.perf_counter() - start) * 1000.0)
            cpu[name].append((time.process_time() - start_cpu) * 1000.0)
    return times, cpu


def random_dit(layers: int, dtype):
    """A QwenImage21DiT at full width with random weights (linear weights ~ N(0, 1/fan_in))."""
    import mlx.core as mx
    from gmlx_server.engine.families.qwen_image21.dit import (
        DiTConfig,
        QwenImage21DiT,
        linear_slots,
        sanitize,
    )

    config = DiTConfig(
        in_channels=CHANNELS,
        out_channels=CHANNELS,
        num_layers=layers,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        context_in_dim=CONTEXT,
        mlp_ratio=MLP_RATIO,
        axes_dims_rope=(16, 56, 56),
        eps=1e-6,
    )
    inner, mlp = config.inner_dim, config.inner_dim * MLP_RATIO
    shapes = {
        "time_text_embed.timestep_embedder.linear_1": (inner, 256),
        "time_text_embed.timestep_embedder.linear_2": (inner, inner),
        "txt_in.in_layer": (inner, CONTEXT),
        "txt_in.out_layer": (inner, inner),
        "img_in": (inner, CHANNELS),
        "modulation.1": (4 * inner, inner),
        "norm_out.linear": (inner, inner),
        "proj_out": (CHANNELS, inner),
    }
    for i in range(layers):
        p = f"transformer_blocks.{i}."
        shapes.update({p + n: (inner, inner) for n in BLOCK_TARGETS[:4]})
        shapes.update({p + "img_mlp.gate_layer": (mlp, inner), p + "img_mlp.proj": (mlp, inner)})
        shapes[p + "img_mlp.out"] = (inner, mlp)
    assert set(shapes) == set(linear_slots(config))
    mx.random.seed(0)
    files = {}
    for name, (out_dim, in_dim) in shapes.items():
        files[name + ".weight"] = mx.random.normal((out_dim, in_dim)) * (in_dim**-0.5)
        mx.eval(files[name + ".weight"])
    for i in range(layers):
        for norm in ("norm_q", "norm_k"):
            files[f"transformer_blocks.{i}.attn.{norm}.weight"] = mx.ones((HEAD_DIM,))
    files["txt_in.text_norm.weight"] = mx.zeros((CONTEXT,))
    weights = sanitize(files, config)
    del files
    weights = {
        k: ([{n: a.astype(dtype) for n, a in b.items()} for b in v] if k == "blocks" else v)
        for k, v in weights.items()
    }
    for block in weights["blocks"]:
        block["norm_q"] = block["norm_q"].astype(mx.float32)
        block["norm_k"] = block["norm_k"].astype(mx.float32)
    weights = {k: v if k == "blocks" else v.astype(dtype) for k, v in weights.items()}
    weights["text_norm"] = weights["text_norm"].astype(mx.float32)
    mx.eval(weights)
    return QwenImage21DiT(config, weights, dtype), shapes


def random_table(shapes: dict, layers: int, rank: int):
    """A PatchTable (the service's type) with one rank-`rank` patch on every block linear."""
    import numpy as np
    from gmlx_server.service import LoraPatch, PatchEntry, PatchTable

    rng = np.random.default_rng(1)
    entries = []
    for i in range(layers):
        for target in BLOCK_TARGETS:
            layer = f"transformer_blocks.{i}.{target}"
            out_dim, in_dim = shapes[layer]
            up = rng.standard_normal((out_dim, rank), np.float32) * 0.1
            down = rng.standard_normal((rank, in_dim), np.float32) / np.sqrt(in_dim)
            patch = LoraPatch(up=up, down=down, scale=1.0, strength=1.0)
            entries.append(PatchEntry(f"diffusion_model.{layer}.weight", layer, None, (patch,)))
    return PatchTable("bench", "bench", tuple(entries))


def merged_tree(tree: dict, grouped: dict, dtype):
    """The comparison form: every patched weight replaced by W + B A (a copy per table)."""
    import mlx.core as mx
    import numpy as np
    from gmlx_server.engine.lora import copy_along

    merged = copy_along(tree, {slot.path for slot in grouped})
    for slot, pairs in grouped.items():
        node = slot.node(merged)
        down = mx.array(np.concatenate([p.down for p in pairs])).astype(dtype)
        up = mx.array(np.concatenate([p.up for p in pairs], 1)).astype(dtype)
        node[slot.key] = node[slot.key] + up @ down
    return merged


def main(argv=None) -> dict:
    args = parse_args(argv)
    from gmlx_server.engine.blas import ensure_fast_blas

    blas = ensure_fast_blas()  # before mlx is imported
    import mlx.core as mx
    import numpy as np
    from gmlx_server.engine.families.qwen_image21.dit import PrefixLayout, linear_slots
    from gmlx_server.engine.lora import TableWeights, pair_bytes, table_pairs

    dtype = {"f32": mx.float32, "bf16": mx.bfloat16}[args.dtype]
    h, w = (int(v) for v in args.size.split("x"))
    dit, shapes = random_dit(args.layers, dtype)
    table = random_table(shapes, args.layers, args.rank)
    slots = linear_slots(dit.config)

    rng = np.random.default_rng(2)
    text = mx.array(rng.standard_normal((args.text, CONTEXT), np.float32))
    x = mx.array(rng.standard_normal((1, h * w, CHANNELS), np.float32))
    sigma = mx.array(np.array([0.7], np.float32))

    tables = TableWeights(dit.weights, slots, dtype)
    start = time.perf_counter()
    lowrank = tables.weights_for(table)
    prepare_ms = (time.perf_counter() - start) * 1000.0

    grouped = table_pairs(table, slots, dit.weights)
    start = time.perf_counter()
    merged = merged_tree(dit.weights, grouped, dtype)
    mx.eval(merged)
    merge_ms = (time.perf_counter() - start) * 1000.0
    merged_bytes = sum(slot.node(merged)[slot.key].nbytes for slot in grouped)

    layout = PrefixLayout(args.text)
    passes, outs = {}, {}
    for name, tree in (("plain", None), ("low-rank", lowrank), ("merged", merged)):
        state = dit.prefix_state(layout, text, [], tree)
        mx.eval(state.keys, state.values)

        def target(tree=tree, state=state, name=name):
            outs[name] = dit.target_forward(x, sigma, [state], h, w, tree)
            mx.eval(outs[name])

        passes[name] = target
    times, cpu = interleaved_ms(passes, args.repeats)
    best = {name: min(t) for name, t in times.items()}
    best_cpu = {name: min(t) for name, t in cpu.items()}
    low, mer = np.array(outs["low-rank"], np.float64), np.array(outs["merged"], np.float64)
    report = {
        "blas": blas.message,
        "dtype": args.dtype,
        "layers": args.layers,
        "width": HEADS * HEAD_DIM,
        "tokens": h * w,
        "text": args.text,
        "rank": args.rank,
        "target_ms_best": {k: round(v, 1) for k, v in best.items()},
        "target_ms_median": {k: round(statistics.median(v), 1) for k, v in times.items()},
        "lowrank_overhead_pct": round(100 * (best["low-rank"] / best["plain"] - 1), 2),
        "merged_overhead_pct": round(100 * (best["merged"] / best["plain"] - 1), 2),
        "target_cpu_ms_best": {k: round(v, 1) for k, v in best_cpu.items()},
        "lowrank_cpu_overhead_pct": round(100 * (best_cpu["low-rank"] / best_cpu["plain"] - 1), 2),
        "prepare_ms": round(prepare_ms, 1),
        "merge_ms": round(merge_ms, 1),
        "lowrank_bytes": pair_bytes(lowrank),
        "merged_bytes": merged_bytes,
        "lowrank_vs_merged_rel_l2": float(np.linalg.norm(low - mer) / np.linalg.norm(mer)),
    }
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    return report


if __name__ == "__main__":
    main()
