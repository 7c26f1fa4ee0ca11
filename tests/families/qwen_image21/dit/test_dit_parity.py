"""The MLX DiT against diffusers' QwenImage21Transformer2DModel (float32, tiny random weights)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.families.qwen_image21.dit import PrefixLayout, QwenImage21DiT

from tests.compare import rel_l2
from tests.compiled_dits import compiled_dits
from tests.families.qwen_image21.dit.conftest import CONFIGS
from tests.families.qwen_image21.dit.reference import pack, reference_row

TOLERANCE = 1e-4


def mlx_row(dit, cond, x, sigma, refs=(), slots=()):
    layout = PrefixLayout(cond.shape[0], tuple(r.shape[1:] for r in refs), tuple(slots))
    state = dit.prefix_state(layout, mx.array(cond), [mx.array(pack(r)) for r in refs])
    channels, h, w = x.shape
    out = dit.target_forward(mx.array(pack(x))[None], mx.array([sigma]), [state], h, w)
    return np.array(out[0]).T.reshape(-1, h, w)


def inputs(model, seed, text_len=9, hw=(4, 6)):
    rng = np.random.default_rng(seed)
    cfg = model.config
    cond = rng.standard_normal((text_len, cfg.context_in_dim)).astype(np.float32)
    x = rng.standard_normal((cfg.in_channels, *hw)).astype(np.float32)
    refs = [
        rng.standard_normal((cfg.in_channels, 4, 4)).astype(np.float32),
        rng.standard_normal((cfg.in_channels, 2, 6)).astype(np.float32),
    ]
    return cond, x, refs


@pytest.fixture(scope="module")
def dits(tiny_transformers):
    return {name: QwenImage21DiT.load(folder) for name, (folder, _, _) in tiny_transformers.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("sigma", [1.0, 0.37, 0.0])
def test_text_only(tiny_transformers, dits, name, sigma):
    model = tiny_transformers[name][1]
    cond, x, _ = inputs(model, seed=3)
    expected = reference_row(model, cond, x, sigma)
    assert rel_l2(mlx_row(dits[name], cond, x, sigma), expected) <= TOLERANCE


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("slots", [(2, 5), (0, 9), (4, 4), (9, 9)])
def test_two_references_in_slots(tiny_transformers, dits, name, slots):
    model = tiny_transformers[name][1]
    cond, x, refs = inputs(model, seed=4)
    expected = reference_row(model, cond, x, 0.6, refs, slots)
    assert rel_l2(mlx_row(dits[name], cond, x, 0.6, refs, slots), expected) <= TOLERANCE


@pytest.mark.parametrize("hw", [(2, 2), (5, 4), (8, 8)])
def test_target_sizes(tiny_transformers, dits, hw):
    model = tiny_transformers["default"][1]
    cond, x, refs = inputs(model, seed=5, text_len=4, hw=hw)
    expected = reference_row(model, cond, x, 0.8, refs[:1], [1])
    assert rel_l2(mlx_row(dits["default"], cond, x, 0.8, refs[:1], [1]), expected) <= TOLERANCE


def test_conditioning_moves_the_output_well_beyond_the_tolerance(tiny_transformers):
    """The tiny weights must make text, references and slots matter, or parity proves little."""
    model = tiny_transformers["default"][1]
    cond, x, refs = inputs(model, seed=6)
    base = reference_row(model, cond, x, 0.5, refs, (2, 5))
    variants = [
        reference_row(model, cond[::-1].copy(), x, 0.5, refs, (2, 5)),
        reference_row(model, cond, x, 0.5, refs[::-1], (2, 5)),
        reference_row(model, cond, x, 0.5, refs, (3, 5)),
    ]
    for variant in variants:
        assert rel_l2(variant, base) > 100 * TOLERANCE


def test_pad_rows_are_overwritten(tiny_transformers):
    """The reference's pad-row values never reach the output, so dropping them is exact."""
    model = tiny_transformers["default"][1]
    cond, x, refs = inputs(model, seed=7)
    one = reference_row(model, cond, x, 0.5, refs, (2, 5), pad_seed=1)
    two = reference_row(model, cond, x, 0.5, refs, (2, 5), pad_seed=2)
    assert np.array_equal(one, two)


def test_layout_positions_follow_the_reference_rope():
    layout = PrefixLayout(text_len=3, ref_shapes=((2, 4),), slots=(1,))
    table, target_frame = layout.positions
    assert table[:1].tolist() == [[0, 0, 0]]
    assert table[1:9, 0].tolist() == [1] * 8  # the block's frame is frozen
    assert table[1:9, 1].tolist() == [-1, -1, -1, -1, 0, 0, 0, 0]
    assert table[1:9, 2].tolist() == [-2, -1, 0, 1] * 2
    assert table[9:].tolist() == [[5, 5, 5], [6, 6, 6]]  # 1 + max(2, 4)
    assert target_frame == 7


@pytest.fixture(autouse=True)
def compiled_pass():
    """The parity here is the compiled pass's."""
    with compiled_dits():
        yield


def test_the_compiled_pass_is_made_anew_after_its_signatures(tiny_transformers, monkeypatch):
    """mx.compile keeps a trace per signature while the compiled function lives: after
    SIGNATURES_KEPT of them (prompt lengths here) the DiT makes a new one, which drops them,
    and its answers stay those of the reference."""
    from gmlx_server.engine.nn import compiled

    monkeypatch.setattr(compiled, "SIGNATURES_KEPT", 2)
    name = next(iter(CONFIGS))
    folder, torch_model, _ = tiny_transformers[name]
    model = QwenImage21DiT.load(folder)
    assert model.compiled
    seen = []
    for text_len in (5, 6, 5, 7, 8):
        cond, x, _ = inputs(model, seed=text_len, text_len=text_len)
        ours = mlx_row(model, cond, x, 0.5)
        assert rel_l2(ours, reference_row(torch_model, cond, x, 0.5)) <= TOLERANCE
        seen.append((model.target_pass.compiled_function, set(model.target_pass.signatures)))
    assert model.compiled, "mx.compile fell back to eager on this machine"
    first, after_6, again_5, after_7, after_8 = seen
    assert after_6[0] is first[0] and again_5[0] is first[0]  # 5 and 6 traced: kept
    assert after_7[0] is not first[0] and len(after_7[1]) == 1  # a third: made anew
    assert after_8[0] is after_7[0] and len(after_8[1]) == 2
