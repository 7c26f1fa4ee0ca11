"""FLUX.2 klein's DiT quantized at load (`dit.quantized`: the blocks' linears): its forward
equals the same network run in float32 with the dequantized weights, references and the KV
way included, at each bit width; the embedders and modulations stay float."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.families.flux2_klein.dit import Flux2DiT
from gmlx_server.engine.precision import BITS, Quantization
from gmlx_server.engine.quantize import SPEC

from tests.compare import rel_l2
from tests.engine.quantized import dequantized_tree
from tests.families.flux2_klein.tiny.transformer import build_transformer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux2_quantized")
    build_transformer(folder, seed=0)
    return folder


@pytest.mark.parametrize("bits", BITS)
def test_a_quantized_forward_equals_the_dequantized_network(folder, bits):
    dit = Flux2DiT.load(folder, mx.float32, Quantization(bits=bits, group_size=32))
    assert "img_qkv" + SPEC in dit.weights["double"][0]  # a block linear, quantized
    assert "x_in" + SPEC not in dit.weights and "mod_img" + SPEC not in dit.weights
    plain = Flux2DiT(dit.config, dequantized_tree(dit.weights), mx.float32)
    rng = np.random.default_rng(bits)
    x = mx.array(rng.standard_normal((1, 128, 3, 4)).astype(np.float32))
    caps = [mx.array(rng.standard_normal((6, 96)).astype(np.float32))]
    refs = [mx.array(rng.standard_normal((128, 2, 3)).astype(np.float32))]
    t = mx.array([0.4], mx.float32)
    for model_refs, mode in ((None, "joint"), ([refs], "joint"), (None, "kv")):
        outs = []
        for model in (dit, plain):
            states = [model.reference_states(refs)] if mode == "kv" else None
            out = model.forward(x, t, caps, model_refs, ref_mode=mode, ref_states=states)
            outs.append(np.array(out))
        assert rel_l2(*outs) <= 1e-4
    assert dit.weight_bytes < plain.weight_bytes
