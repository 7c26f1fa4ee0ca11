"""The MLX FLUX.3 DiT against diffusers' Flux3Transformer2DModel (float32, tiny random weights):
the flow map's step (target times) and the base checkpoint's, with and without references, rows
of different layouts in one batch."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.families.flux3_klein.dit import Flux3DiT

from tests.compare import rel_l2
from tests.families.flux3_klein.reference import build_transformer, reference_dit

TOLERANCE = 1e-4
# Two shapes: the tiny flow map, and a base checkpoint of three 8-wide heads with two per-mode
# blocks and three joint ones.
CONFIGS = {
    "flow_map": {},
    "base": {
        "flow_map": False,
        "attention_head_dim": 8,
        "num_attention_heads": 3,
        "num_layers": 2,
        "num_single_layers": 3,
        "axes_dims_rope": [2, 2, 2, 2],
    },
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"flux3_dit_{request.param}")
    model = build_transformer(folder, seed=0, **CONFIGS[request.param])
    return model, Flux3DiT.load(folder, mx.float32)


def draw(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def ours(dit, x, t, texts, refs=None, targets=None) -> np.ndarray:
    out = dit.forward(
        mx.array(x),
        mx.array(np.asarray(t, np.float32)),
        [mx.array(c) for c in texts],
        None if refs is None else [[mx.array(r) for r in row] for row in refs],
        None if targets is None else mx.array(np.asarray(targets, np.float32)),
    )
    return np.array(out)


def targets_of(dit, t):
    return [max(0.0, s - 0.2) for s in t] if dit.config.flow_map else None


@pytest.mark.parametrize("hw", [(3, 5), (4, 4)])
def test_a_text_to_image_step_is_the_references(tiny, hw):
    model, dit = tiny
    rng = np.random.default_rng(1)
    x, text = draw(rng, 2, 128, *hw), draw(rng, 2, 7, 96)
    t = [0.9, 0.35]
    want = reference_dit(model, x, t, text, targets=targets_of(dit, t))
    got = ours(dit, x, t, list(text), targets=targets_of(dit, t))
    assert rel_l2(got, want) <= TOLERANCE


def test_a_step_with_two_references_is_the_references(tiny):
    model, dit = tiny
    rng = np.random.default_rng(2)
    x, text = draw(rng, 1, 128, 3, 4), draw(rng, 1, 5, 96)
    refs = [draw(rng, 1, 128, 2, 3), draw(rng, 1, 128, 4, 2)]
    t = [0.6]
    want = reference_dit(model, x, t, text, refs, targets_of(dit, t))
    got = ours(dit, x, t, list(text), [[r[0] for r in refs]], targets_of(dit, t))
    assert rel_l2(got, want) <= TOLERANCE


def test_rows_of_different_layouts_answer_as_alone(tiny):
    """A batch of a row with references and one with a longer text and none: each row is the
    reference's answer for it alone."""
    model, dit = tiny
    rng = np.random.default_rng(3)
    x = draw(rng, 2, 128, 3, 3)
    texts = [draw(rng, 4, 96), draw(rng, 9, 96)]
    ref = draw(rng, 1, 128, 2, 2)
    t = [0.8, 0.8]
    targets = targets_of(dit, t)
    got = ours(dit, x, t, texts, [[ref[0]], []], targets)
    first = reference_dit(model, x[:1], t[:1], texts[0][None], [ref], targets and targets[:1])
    second = reference_dit(model, x[1:], t[1:], texts[1][None], (), targets and targets[1:])
    assert rel_l2(got[:1], first) <= TOLERANCE
    assert rel_l2(got[1:], second) <= TOLERANCE


def test_the_target_time_moves_a_flow_maps_answer(tiny):
    _, dit = tiny
    if not dit.config.flow_map:
        pytest.skip("a base checkpoint has no target time")
    rng = np.random.default_rng(4)
    x, text = draw(rng, 1, 128, 2, 2), [draw(rng, 3, 96)]
    near, far = ours(dit, x, [0.7], text, targets=[0.6]), ours(dit, x, [0.7], text, targets=[0.0])
    assert rel_l2(near, far) > 1e-3
