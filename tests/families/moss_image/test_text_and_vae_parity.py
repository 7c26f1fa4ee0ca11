"""MOSS-Image's prompt encoder and VAE on the tests' tiny folders of two shapes, float32:

- the encoding (families/moss_image/prompt.py) is transformers' Qwen3.5 last hidden state of
  the templated prompt's tokens, relative L2 <= 1e-4, the template as the pipeline renders it
  (a user turn, the generation prompt, thinking on);
- the decode (FLUX.2's AutoencoderKLFlux2 with MOSS-Image's narrower decoder) is diffusers'
  in model space (batch-norm statistics, 2x2 unpatchify), and the MLX port's decoder agrees.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from gmlx_server.engine.families.moss_image.prompt import MOSSImagePromptEncoder
from gmlx_server.engine.vaes.autoencoder_kl_flux2 import AutoencoderKLFlux2
from safetensors.numpy import load_file

from tests.compare import rel_l2
from tests.families.moss_image.tiny import SHAPES, build_tiny_folder
from tests.vaes.autoencoder_kl.reference import flux2_reference_decode

TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=sorted(SHAPES))
def folder(request, tmp_path_factory):
    return build_tiny_folder(tmp_path_factory.mktemp("moss_parts") / request.param, request.param)


def transformers_text_model(folder):
    import json

    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    config = json.loads((folder / "text_encoder" / "config.json").read_text())["text_config"]
    model = Qwen3_5TextModel(Qwen3_5TextConfig(**config)).eval()
    files = load_file(str(folder / "text_encoder" / "model.safetensors"))
    weights = {
        k.removeprefix("model.language_model."): torch.from_numpy(v) for k, v in files.items()
    }
    model.load_state_dict(weights, strict=True)
    return model


@pytest.mark.parametrize("prompt", ["a lighthouse at dusk", "", "signs that read OPEN LATE " * 6])
def test_the_encoding_is_transformers_last_hidden_state(folder, prompt):
    encoder = MOSSImagePromptEncoder.load(folder)
    ids = encoder.token_ids(prompt)
    rendered = encoder.tokenizer.decode(ids.tolist(), skip_special_tokens=False)
    assert rendered == f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n"
    with torch.no_grad():
        expected = transformers_text_model(folder)(torch.from_numpy(ids.astype(np.int64))[None])
    got = encoder.encode(prompt)
    assert got.shape == (1, len(ids), encoder.hidden_size)
    assert rel_l2(got, expected.last_hidden_state.numpy()) <= TOLERANCE


@pytest.mark.parametrize("hw", [(2, 2), (3, 5)])
def test_decode_matches_diffusers_and_the_port(folder, hw):
    from diffusers import AutoencoderKLFlux2 as Reference
    from moss_image_mlx.vae import load_vae_decoder

    reference = Reference.from_pretrained(str(folder / "vae")).eval()
    assert list(reference.config.decoder_block_out_channels) != list(
        reference.config.block_out_channels
    )
    latents = np.random.default_rng(2).standard_normal((1, 128, *hw)).astype(np.float32)
    expected = flux2_reference_decode(reference, latents)
    ours = np.array(AutoencoderKLFlux2.load(folder / "vae").decode(mx.array(latents)))
    assert ours.shape == expected.shape == (1, hw[0] * 16, hw[1] * 16, 3)
    assert rel_l2(ours, expected) <= TOLERANCE
    port = np.array(load_vae_decoder(folder / "vae").decode_packed(mx.array(latents)))
    port = np.clip(port / 2 + 0.5, 0, 1)  # (1, H, W, 3) in [-1, 1]
    assert rel_l2(ours, port) <= TOLERANCE
