"""MOSS-Image's DiT (families/moss_image/dit.py) against upstream's MLX port of
`MOSSImageTransformer` (tests/families/moss_image/tiny.py says why that is the reference) on
the same tiny files of two shapes, float32: one step with and without `skip`, relative L2 <=
1e-4, at sizes with odd and even sides (RoPE's centred coordinates) and texts of two lengths."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.families.moss_image.dit import MOSSImageDiT

from tests.compare import rel_l2
from tests.families.moss_image.tiny import SHAPES, build_tiny_folder, reference_dit

TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request, tmp_path_factory):
    folder = build_tiny_folder(tmp_path_factory.mktemp("moss_dit") / request.param, request.param)
    ours = MOSSImageDiT.load(folder / "transformer", dtype=mx.float32)
    return ours, reference_dit(folder)


@pytest.mark.parametrize(
    ("height", "width", "text", "timestep", "skip"),
    [
        (4, 6, 7, 975.0, ()),
        (5, 3, 12, 321.0, ()),
        (4, 6, 7, 975.0, (22,)),
        (3, 3, 5, 40.0, (0, 5, 22)),
    ],
)
def test_one_step_equals_the_port(pair, height, width, text, timestep, skip):
    ours, reference = pair
    rng = np.random.default_rng(height * 100 + text)
    latents = rng.standard_normal((1, 128, height, width)).astype(np.float32)
    cond = rng.standard_normal((1, text, ours.config.text_dim)).astype(np.float32)
    expected = reference(mx.array(latents), timestep, mx.array(cond), skip)
    got = ours.forward(
        mx.array(latents), np.array([timestep], np.float32), [mx.array(cond[0])], skip=skip
    )
    assert rel_l2(np.array(got), np.array(expected)) <= TOLERANCE
    if skip:  # skipping changes the answer: the blocks are really left out
        plain = reference(mx.array(latents), timestep, mx.array(cond))
        assert rel_l2(np.array(got), np.array(plain)) > 100 * TOLERANCE


def test_rows_of_different_lengths_are_each_their_own_sample(pair):
    """A batch of rows of different text lengths (a guided step's two prompts) answers each row
    as the port answers it alone."""
    ours, reference = pair
    rng = np.random.default_rng(7)
    latents = rng.standard_normal((3, 128, 4, 4)).astype(np.float32)
    conds = [rng.standard_normal((n, ours.config.text_dim)).astype(np.float32) for n in (9, 4, 9)]
    times = np.array([600.0, 600.0, 17.0], np.float32)
    got = np.array(ours.forward(mx.array(latents), times, [mx.array(c) for c in conds]))
    for row in range(3):
        expected = reference(
            mx.array(latents[row : row + 1]), float(times[row]), mx.array(conds[row][None])
        )
        assert rel_l2(got[row : row + 1], np.array(expected)) <= TOLERANCE, row


def test_compiled_equals_eager(pair, monkeypatch):
    """Under mx.compile (GMLX_DIT_COMPILE=1, as on a GPU backend or at a real width) the forward,
    with and without `skip`, is the eager one's up to float rounding: each skip set is a trace
    of its own."""
    monkeypatch.setenv("GMLX_DIT_COMPILE", "1")
    ours, _ = pair
    dit = MOSSImageDiT(ours.config, ours.weights, ours.dtype)
    assert dit.compiled_pass.enabled
    rng = np.random.default_rng(5)
    latents = mx.array(rng.standard_normal((2, 128, 3, 4)).astype(np.float32))
    conds = [
        mx.array(rng.standard_normal((n, ours.config.text_dim)).astype(np.float32)) for n in (6, 6)
    ]
    times = np.float32([700.0, 300.0])
    for skip in ((), (22,)):
        compiled = np.array(dit.forward(latents, times, conds, skip=skip))
        assert dit.compiled_pass.enabled, "mx.compile fell back to eager on this machine"
        assert (id(dit.weights), (2, 128, 3, 4), 6, skip) in dit.compiled_pass.signatures
        eager = np.array(ours.forward(latents, times, conds, skip=skip))
        assert rel_l2(compiled, eager) <= 1e-6
