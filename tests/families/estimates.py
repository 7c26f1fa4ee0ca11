"""What the step-estimate tests share: MLX's measured peak of a piece of work, and the check of
a reference-taking family's estimate (the FLUX klein families') against it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from gmlx_contract.hashing import tensor_hash
from gmlx_server.engine.base import StepRow


def peak_of(work) -> int:
    """MLX's peak allocation during `work`, above what was held before it."""
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    work()
    mx.synchronize()
    return mx.get_peak_memory() - base


def check_estimate_with_refs(model, width, side, lengths, ref_sides, label, **step) -> None:
    """Rows of `lengths` text tokens `width` wide, each with references of `ref_sides`, over
    128-channel latents `side` square: the step's estimate bounds the measured peak (at 1.05 to
    3 times), and the quick estimate (no rows) is at most it. `step`: the call's keywords."""
    rng = np.random.default_rng(side)
    refs = tuple(rng.standard_normal((128, s, s), dtype=np.float32) for s in ref_sides)
    rows = [
        StepRow(
            rng.standard_normal((n, width), dtype=np.float32),
            f"c{i}",
            ref_latents=refs,
            ref_keys=tuple(tensor_hash(r) for r in refs),
        )
        for i, n in enumerate(lengths)
    ]
    x = rng.standard_normal((len(rows), 128, side, side), dtype=np.float32)
    t = np.full((len(rows),), 0.7, np.float32)
    estimate = model.step_peak_bytes(x.shape, rows)
    quick = model.step_peak_bytes(x.shape, None)
    measured = peak_of(lambda: model.denoise_step(x, t, rows, **step))
    print(
        f"{label} {len(rows)}x{side}^2 texts {lengths} refs {ref_sides}: measured"
        f" {measured / 2**20:.1f} MiB, estimate {estimate / 2**20:.1f} MiB,"
        f" quick {quick / 2**20:.1f} MiB"
    )
    assert quick <= estimate
    assert 1.05 * measured <= estimate <= 3 * measured
