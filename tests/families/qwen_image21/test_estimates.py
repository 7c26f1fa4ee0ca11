"""The family's memory estimates bound the measured MLX peaks of the tiny model's work."""

from __future__ import annotations

import numpy as np
import pytest
from gmlx_server.engine.base import StepRow
from gmlx_server.engine.families.qwen_image21 import embedded, family
from gmlx_server.memory import LIMIT_FRACTION, allocation_bound

from tests.compiled_dits import compiled_dits
from tests.families.estimates import peak_of


@pytest.fixture(scope="module")
def model():
    """The embedded model, compiled: the plan must cover the compiled pass's peaks."""
    folder = embedded.ensure_embedded_model()
    with compiled_dits():
        loaded = family.QWEN_IMAGE21.load(folder, folder.name)
    yield loaded
    loaded.close()


def rows(count: int, length: int, refs: int = 0, seed: int = 0) -> list[StepRow]:
    rng = np.random.default_rng(seed)
    made = []
    for i in range(count):
        cond = rng.standard_normal((length, 128), dtype=np.float32)
        latents = tuple(rng.standard_normal((64, 8, 8), dtype=np.float32) for _ in range(refs))
        made.append(StepRow(cond, f"c{seed}:{i}", latents, tuple(f"r{j}" for j in range(refs)), ()))
    return made


# (2, 48, 300, 0) repeats at three times the cost what (2, 32, 64, 1) shows, two rows over a
# prefix (and a reference besides); it runs with -m heavy.
@pytest.mark.parametrize(
    ("batch", "side", "length", "refs"),
    [(1, 16, 32, 0), (2, 32, 64, 1), pytest.param(2, 48, 300, 0, marks=pytest.mark.heavy)],
)
def test_step_estimate_bounds_the_measured_peak(model, batch, side, length, refs):
    step_rows = rows(batch, length, refs, seed=side)
    x = np.random.default_rng(1).standard_normal((batch, 64, side, side), dtype=np.float32)
    t = np.full((batch,), 0.7, np.float32)
    estimate = model.step_peak_bytes(x.shape, step_rows)
    quick = model.step_peak_bytes(x.shape, None)

    def step(bound: int):  # the server bounds MLX's allocations by the plan (memory.py)
        model.prefix_cache.clear()  # the prefixes built by each
        with allocation_bound(bound):
            model.denoise_step(x, t, step_rows)

    # bounded at nothing, MLX queues an operation only when the ones before it have finished:
    # the step's own live set, which the plan must cover
    live = peak_of(lambda: step(0))
    bounded = peak_of(lambda: step(estimate))
    print(
        f"step {batch}x{side}^2 prefix {length}+{refs} refs: live {live / 2**20:.1f} MiB, "
        f"bounded {bounded / 2**20:.1f} MiB, estimate {estimate / 2**20:.1f} MiB, "
        f"quick {quick / 2**20:.1f} MiB"
    )
    assert quick <= estimate
    # the live set fits under the limit the plan sets (else MLX would wait at every operation)
    assert 1.05 * live <= LIMIT_FRACTION * estimate
    assert estimate <= 8 * live + (8 << 20)
    # over its limit MLX waits, past it by the operations queued between two waits
    assert bounded <= estimate
    # held now: a second plan counts no new states, so it needs less
    assert model.step_peak_bytes(x.shape, step_rows) < estimate
    model.prefix_cache.clear()


# Tiled, (16, 32) cells in tiles of 8 (eight tiles) bound the plan as (32, 48) (24 tiles, three
# times the cost, run with -m heavy) do; untiled, (32, 32) repeats the bound (16, 16) shows at
# four times the cost, and runs with -m heavy too.
@pytest.mark.parametrize(
    ("cells", "tile"),
    [
        ((16, 16), None),
        pytest.param((32, 32), None, marks=pytest.mark.heavy),
        ((16, 32), 8),
        pytest.param((32, 48), 8, marks=pytest.mark.heavy),
    ],
)
def test_vae_estimate_bounds_the_measured_peak(model, cells, tile):
    vae = model.vae
    saved = vae.tile_cells
    vae.tile_cells = tile or saved
    try:
        height, width = cells[0] * 16, cells[1] * 16
        rng = np.random.default_rng(2)
        z = rng.standard_normal((64, *cells), dtype=np.float32)
        image = rng.random((height, width, 4), dtype=np.float32)
        for decode, work in (
            (True, lambda: model.vae_decode(z, True)),
            (False, lambda: model.vae_encode(image)),
        ):
            estimate = model.vae_peak_bytes(height, width, decode)
            measured = peak_of(work)
            print(
                f"vae {'decode' if decode else 'encode'} {width}x{height} tile {vae.tile_cells}:"
                f" measured {measured / 2**20:.1f} MiB, estimate {estimate / 2**20:.1f} MiB"
            )
            assert measured <= estimate <= 3 * measured
    finally:
        vae.tile_cells = saved
