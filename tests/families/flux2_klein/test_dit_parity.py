"""The MLX FLUX.2 klein DiT against diffusers' Flux2Transformer2DModel (float32, tiny random
weights): text only, with one and with several references of different sizes, in the plain
forward and in the KV model's reference mode, and batch rows of different layouts."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.families.flux2_klein.dit import Flux2DiT

from tests.compare import rel_l2
from tests.families.flux2_klein.reference import reference_dit
from tests.families.flux2_klein.tiny.transformer import TINY_CONFIG, build_transformer

TOLERANCE = 1e-4
CHANNELS = TINY_CONFIG["in_channels"]
WIDTH = TINY_CONFIG["joint_attention_dim"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux2_dit")
    model = build_transformer(folder, seed=0)
    return model, Flux2DiT.load(folder, mx.float32)


def draw(seed: int, batch: int, cap_len: int, hw=(4, 6), ref_shapes=()):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, CHANNELS, *hw)).astype(np.float32)
    cap = rng.standard_normal((batch, cap_len, WIDTH)).astype(np.float32)
    refs = [rng.standard_normal((CHANNELS, *s)).astype(np.float32) for s in ref_shapes]
    return x, cap, refs


def ours(dit, x, t, caps, refs_per_row=None, kv=False) -> np.ndarray:
    caps = [mx.array(c) for c in caps]
    rows = [[mx.array(r) for r in refs] for refs in (refs_per_row or [[]] * len(caps))]
    t = mx.array(np.asarray(t, np.float32))
    if kv:
        states = [dit.reference_states(refs) if refs else None for refs in rows]
        out = dit.forward(mx.array(x), t, caps, ref_mode="kv", ref_states=states)
    else:
        out = dit.forward(mx.array(x), t, caps, rows)
    return np.array(out)


@pytest.mark.parametrize("t", [0.0, 0.37, 1.0])
def test_text_only(tiny, t):
    model, dit = tiny
    x, cap, _ = draw(1, 1, 9)
    expected = reference_dit(model, x, [t], cap)
    assert rel_l2(ours(dit, x, [t], list(cap)), expected) <= TOLERANCE


@pytest.mark.parametrize("kv", [False, True])
@pytest.mark.parametrize("ref_shapes", [[(4, 6)], [(2, 4), (6, 2), (3, 3)]])
def test_references(tiny, ref_shapes, kv):
    """One reference and several of different sizes, in the plain forward (references after
    the image, at the step's time) and the KV model's extract step (references first, at time
    0, attending to themselves)."""
    model, dit = tiny
    x, cap, refs = draw(2, 2, 7, ref_shapes=ref_shapes)
    t = [0.8, 0.3]
    expected = reference_dit(model, x, t, cap, refs, kv=kv)
    got = ours(dit, x, t, list(cap), [refs, refs], kv=kv)
    assert rel_l2(got, expected) <= TOLERANCE
    plain = reference_dit(model, x, t, cap)
    assert rel_l2(expected, plain) > 0.05  # the references move the output


def test_rows_of_different_layouts(tiny):
    """Rows of their own caption lengths and references in one batch: each row equals the
    reference's answer for that row alone."""
    model, dit = tiny
    x, _, refs = draw(3, 3, 1, ref_shapes=[(2, 2), (4, 2)])
    rng = np.random.default_rng(4)
    caps = [rng.standard_normal((n, WIDTH)).astype(np.float32) for n in (5, 12, 5)]
    rows = [refs, [], refs[:1]]
    t = np.array([0.2, 0.6, 0.9], np.float32)
    got = ours(dit, x, t, caps, rows)
    for b in range(3):
        expected = reference_dit(model, x[b : b + 1], t[b : b + 1], caps[b][None], rows[b])
        assert rel_l2(got[b : b + 1], expected) <= TOLERANCE


def test_caption_moves_the_output(tiny):
    _, dit = tiny
    x, cap, _ = draw(5, 1, 9)
    _, other, _ = draw(6, 1, 9)
    assert rel_l2(ours(dit, x, [0.5], list(cap)), ours(dit, x, [0.5], list(other))) > 0.05


def test_bf16_runs_near_float32(tiny, tmp_path):
    model, dit = tiny
    model.save_pretrained(str(tmp_path))
    half = Flux2DiT.load(tmp_path, mx.bfloat16)
    x, cap, refs = draw(7, 1, 6, ref_shapes=[(2, 2)])
    out = half.forward(mx.array(x), mx.array([0.4]), [mx.array(cap[0])], [[mx.array(refs[0])]])
    assert out.dtype == mx.bfloat16
    assert rel_l2(np.array(out.astype(mx.float32)), ours(dit, x, [0.4], list(cap), [refs])) <= 0.05


def test_the_comfy_time_rule_embeds_the_float32_time(tiny, tmp_path):
    """docs/contract.md §5.2: `comfy` embeds the float32 time where the reference rule embeds
    it as the compute dtype holds it (diffusers casts the timestep to the DiT's dtype): the same
    in float32, apart in bf16 for a time bf16 cannot hold."""
    model, dit = tiny
    t = mx.array([0.3337], mx.float32)
    same = [np.array(dit.time_embedding(dit.weights, t, rule)) for rule in (True, False)]
    np.testing.assert_array_equal(*same)
    model.save_pretrained(str(tmp_path))
    half = Flux2DiT.load(tmp_path, mx.bfloat16)
    comfy, reference = (
        np.array(half.time_embedding(half.weights, t, rule).astype(mx.float32))
        for rule in (True, False)
    )
    assert not np.array_equal(comfy, reference)
    rounded = mx.array([float(np.float32(mx.array(0.3337).astype(mx.bfloat16).item()))])
    as_held = np.array(half.time_embedding(half.weights, rounded, True).astype(mx.float32))
    assert rel_l2(reference, as_held) < rel_l2(reference, comfy)
