"""The MLX Krea 2 DiT against diffusers' Krea2Transformer2DModel (float32, tiny random weights)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.families.krea2.dit import Krea2DiT

from tests.compare import rel_l2
from tests.compiled_dits import compiled_dits
from tests.families.krea2.reference import build_transformer, reference_dit

TOLERANCE = 1e-4


# Two shapes: the tiny config (grouped-query attention, three tapped layers), and one with as
# many key/value heads as query heads, two tapped layers and two layerwise fusion blocks.
CONFIGS = {
    "gqa": {},
    "mha": {
        "num_key_value_heads": 4,
        "text_num_key_value_heads": 4,
        "num_text_layers": 2,
        "num_layerwise_text_blocks": 2,
        "num_refiner_text_blocks": 1,
    },
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    """The reference and our DiT, compiled: the parity here is the compiled pass's."""
    folder = tmp_path_factory.mktemp(f"krea2_dit_{request.param}")
    model = build_transformer(folder, seed=0, **CONFIGS[request.param])
    with compiled_dits():
        return model, Krea2DiT.load(folder, mx.float32)


def inputs(dit, seed: int, lengths, hw=(6, 10)):
    rng = np.random.default_rng(seed)
    config = dit.config
    x = rng.standard_normal((len(lengths), config.latent_channels, *hw)).astype(np.float32)
    shape = (config.num_text_layers, config.text_dim)
    conds = [rng.standard_normal((n, *shape)).astype(np.float32) for n in lengths]
    return x, conds


def ours(dit, x, t, conds) -> np.ndarray:
    t = mx.array(np.asarray(t, np.float32))
    return np.array(dit.forward(mx.array(x), t, [mx.array(c) for c in conds]))


@pytest.mark.parametrize("t", [0.0, 0.37, 1.0])
def test_one_row(tiny, t):
    model, dit = tiny
    x, conds = inputs(dit, 1, [9])
    assert rel_l2(ours(dit, x, [t], conds), reference_dit(model, x, [t], conds)) <= TOLERANCE


@pytest.mark.parametrize("hw", [(2, 2), (6, 10), (10, 6), (14, 18)])
def test_sizes_and_odd_patch_grids(tiny, hw):
    model, dit = tiny
    x, conds = inputs(dit, 2, [5], hw)
    want = reference_dit(model, x, [0.6], conds)
    assert rel_l2(ours(dit, x, [0.6], conds), want) <= TOLERANCE


def test_rows_of_different_lengths_batch_as_the_masked_reference(tiny):
    """Two rows, prompts of 3 and 11 tokens: the reference pads and masks, ours left-pads and
    attends over each row's own keys; each row also equals itself alone."""
    model, dit = tiny
    x, conds = inputs(dit, 3, [3, 11])
    t = [0.8, 0.25]
    got = ours(dit, x, t, conds)
    assert rel_l2(got, reference_dit(model, x, t, conds)) <= TOLERANCE
    alone = ours(dit, x[1:], t[1:], conds[1:])
    assert rel_l2(got[1:], alone) <= TOLERANCE


def test_the_prompt_and_the_time_move_the_output(tiny):
    _, dit = tiny
    x, conds = inputs(dit, 4, [7])
    _, other = inputs(dit, 5, [7])
    base = ours(dit, x, [0.5], conds)
    assert rel_l2(ours(dit, x, [0.5], other), base) > 1e-2
    assert rel_l2(ours(dit, x, [0.9], conds), base) > 1e-2
