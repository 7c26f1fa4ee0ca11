"""Peak memory while a component loads, against what it holds once loaded (MLX's
`get_peak_memory` over the load): at most LOAD_PEAK_RATIO x the resident bytes for the DiT, the
text encoder and the VAE, float and quantized, on a folder stored in bfloat16 that is wide and
deep enough (tiny/wide.py) for one tensor in flight to be a small part of the whole. A bf16
file loaded at bf16 is never cast: beside the loaded weights at most one fused weight's parts
are in flight, where a pass through float32 would hold them at twice that."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from gmlx_server.engine.families.qwen_image21.dit import QwenImage21DiT
from gmlx_server.engine.families.qwen_image21.prompt import QwenImage21PromptEncoder
from gmlx_server.engine.nn.dtypes import tree_leaves
from gmlx_server.engine.precision import Quantization
from gmlx_server.engine.vaes.qwen_image21 import QwenImage21VAE

from tests.families.qwen_image21.tiny.wide import write_wide_folder

LOAD_PEAK_RATIO = 1.15
PRECISIONS = [None, Quantization(4), Quantization(8)]
DTYPES = [mx.bfloat16, mx.float32]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_wide_folder(tmp_path_factory.mktemp("wide") / "model")


def load_peak(load) -> tuple[object, int]:
    """(what `load()` made, the peak of active memory above the start while it ran)."""
    gc.collect()  # a DiT of an earlier test is freed now, not during this load
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    loaded = load()
    return loaded, mx.get_peak_memory() - before


@pytest.mark.parametrize("quantization", PRECISIONS, ids=["float", "4bit", "8bit"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
def test_the_dit_loads_within_the_ratio(folder, dtype, quantization):
    dit, peak = load_peak(lambda: QwenImage21DiT.load(folder / "transformer", dtype, quantization))
    assert dit.weight_bytes > 4 << 20  # not trivial: many megabytes in many tensors
    assert peak <= LOAD_PEAK_RATIO * dit.weight_bytes, (peak, dit.weight_bytes)


def test_a_bf16_dit_loads_at_bf16_without_a_float32_pass(folder):
    dit, peak = load_peak(lambda: QwenImage21DiT.load(folder / "transformer", mx.bfloat16))
    leaves = [leaf for leaf in tree_leaves(dit.weights) if isinstance(leaf, mx.array)]
    floats = [leaf for leaf in leaves if leaf.dtype == mx.float32]
    assert all(leaf.ndim == 1 for leaf in floats)  # only the norm scales, by choice
    assert sum(leaf.nbytes for leaf in floats) < dit.weight_bytes // 100
    largest = max(leaf.nbytes for leaf in leaves)  # a fused weight, whose parts are in flight
    assert peak - dit.weight_bytes <= largest, (peak, dit.weight_bytes, largest)


@pytest.mark.parametrize("quantization", PRECISIONS, ids=["float", "4bit", "8bit"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
def test_the_text_encoder_loads_within_the_ratio(folder, dtype, quantization):
    encoder, peak = load_peak(lambda: QwenImage21PromptEncoder.load(folder, dtype, quantization))
    assert encoder.weight_bytes > 4 << 20
    assert peak <= LOAD_PEAK_RATIO * encoder.weight_bytes, (peak, encoder.weight_bytes)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
def test_the_vae_loads_within_the_ratio(folder, dtype):
    vae, peak = load_peak(lambda: QwenImage21VAE.load(folder / "vae", dtype))
    assert vae.weight_bytes > 4 << 20
    assert peak <= LOAD_PEAK_RATIO * vae.weight_bytes, (peak, vae.weight_bytes)
