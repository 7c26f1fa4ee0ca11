"""The MLX Z-Image DiT against diffusers' ZImageTransformer2DModel (float32, tiny random
weights)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.families.z_image.dit import ZImageDiT

from tests.compare import rel_l2
from tests.compiled_dits import compiled_dits
from tests.families.z_image.reference import reference_dit
from tests.families.z_image.tiny.transformer import TINY_CONFIG, build_transformer

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The reference and our DiT, compiled: the parity here is the compiled pass's."""
    folder = tmp_path_factory.mktemp("z_image_dit")
    model = build_transformer(folder, seed=0)
    with compiled_dits():
        return model, ZImageDiT.load(folder, mx.float32)


def inputs(seed: int, cap_lens, hw=(6, 10)):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((len(cap_lens), TINY_CONFIG["in_channels"], *hw)).astype(np.float32)
    caps = [
        rng.standard_normal((n, TINY_CONFIG["cap_feat_dim"])).astype(np.float32) for n in cap_lens
    ]
    return x, caps


def ours(dit, x, t, caps) -> np.ndarray:
    out = dit.forward(mx.array(x), mx.array(np.asarray(t, np.float32)), [mx.array(c) for c in caps])
    return np.array(out)


@pytest.mark.parametrize("t", [0.0, 0.41, 1.0])
def test_text_only(tiny, t):
    model, dit = tiny
    x, caps = inputs(1, [9])
    expected = reference_dit(model, x, [t], caps)
    assert rel_l2(ours(dit, x, [t], caps), expected) <= TOLERANCE


@pytest.mark.parametrize("hw", [(2, 2), (6, 10), (10, 6), (16, 16)])
def test_sizes(tiny, hw):
    """Sizes whose patch grids are odd (3x5) and whose token counts are and are not multiples
    of the padding multiple (1, 15, 64)."""
    model, dit = tiny
    x, caps = inputs(2, [13], hw)
    expected = reference_dit(model, x, [0.7], caps)
    assert rel_l2(ours(dit, x, [0.7], caps), expected) <= TOLERANCE


@pytest.mark.parametrize("cap_lens", [[5, 40], [32, 7, 33], [12, 12]])
def test_rows_of_different_lengths(tiny, cap_lens):
    """A batch of captions of their own lengths (the pipeline's cond and uncond rows), at times
    of their own: each row equals the reference's batched answer."""
    model, dit = tiny
    x, caps = inputs(3, cap_lens)
    t = np.linspace(0.2, 0.9, len(cap_lens))
    expected = reference_dit(model, x, t, caps)
    assert rel_l2(ours(dit, x, t, caps), expected) <= TOLERANCE


def test_caption_moves_the_output(tiny):
    """The tiny weights let the caption matter, so the parity above covers the text path."""
    _, dit = tiny
    x, caps = inputs(4, [9])
    _, other = inputs(5, [9])
    a, b = ours(dit, x, [0.5], caps), ours(dit, x, [0.5], other)
    assert rel_l2(a, b) > 0.05


def test_bf16_weights_run_near_float32(tiny, tmp_path):
    """The GPU backends' compute dtype: the same DiT in bf16 (norm scales kept float32) stays
    within bf16's rounding of the float32 answer, rows of different lengths included."""
    model, dit = tiny
    model.save_pretrained(str(tmp_path))
    half = ZImageDiT.load(tmp_path, mx.bfloat16)
    x, caps = inputs(6, [5, 40])
    t = np.array([0.3, 0.8], np.float32)
    out = half.forward(mx.array(x), mx.array(t), [mx.array(c) for c in caps])
    assert out.dtype == mx.bfloat16
    assert rel_l2(np.array(out.astype(mx.float32)), ours(dit, x, t, caps)) <= 0.05


@pytest.mark.parametrize(("cap_lens", "hw"), [([9], (6, 10)), ([5, 40], (4, 4))])
def test_compiled_equals_eager(tiny, cap_lens, hw):
    """The forward runs under mx.compile (fused elementwise work); eager, the same arrays give
    the same answer up to float rounding (measured 0.0 on the CPU backend), and the parity
    above is the compiled one's."""
    _, dit = tiny
    x, caps = inputs(6, cap_lens, hw)
    t = np.linspace(0.3, 0.8, len(cap_lens))
    assert dit.compiled_pass.enabled
    compiled = ours(dit, x, t, caps)
    assert dit.compiled_pass.enabled, "mx.compile fell back to eager on this machine"
    assert (id(dit.weights), x.shape, tuple(cap_lens)) in dit.compiled_pass.signatures
    dit.compiled_pass.enabled = False
    try:
        eager = ours(dit, x, t, caps)
    finally:
        dit.compiled_pass.enabled = True
    assert rel_l2(compiled, eager) <= 1e-6
