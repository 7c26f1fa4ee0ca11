"""Pure parts of the remote CLIP and VAE and of the edit node (docs/contract.md §7.4, §2.6)."""

import numpy as np
import pytest
import torch
from gmlx_comfy.clip import image_to_u8, prompt_text
from gmlx_comfy.families import latent_normalisation
from gmlx_comfy.nodes import reference_size
from gmlx_comfy.vae import crop_to_stride, match_channels


def test_images_become_rgb_uint8_by_clamp_scale_round():
    image = torch.tensor([[[[0.0, 0.5, 1.2, 0.3], [-0.1, 0.998, 0.502, 1.0]]]])
    (u8,) = image_to_u8(image)
    assert u8.dtype == np.uint8 and u8.shape == (1, 2, 3)
    assert u8.tolist() == [[[0, 128, 255], [0, 254, 128]]]


def test_empty_prompt_becomes_a_space_for_qwen():
    assert prompt_text("", "qwen_image21") == " "
    assert prompt_text("", "z_image") == ""
    assert prompt_text("a cat", "qwen_image21") == "a cat"


def test_crop_to_stride_centres():
    pixels = torch.arange(1 * 35 * 18 * 3, dtype=torch.float32).reshape(1, 35, 18, 3)
    out = crop_to_stride(pixels, 16)
    assert out.shape == (1, 32, 16, 3)
    assert torch.equal(out, pixels[:, 1:33, 1:17])


def test_match_channels_pads_alpha_with_one():
    rgb = torch.rand(2, 4, 4, 3)
    rgba = match_channels(rgb, 4)
    assert rgba.shape[-1] == 4 and torch.all(rgba[..., 3] == 1.0)
    assert torch.equal(match_channels(rgba, 3), rgb)


@pytest.mark.parametrize(
    "w, h",
    [(1024, 1024), (100, 100), (4000, 3000), (640, 480), (2000, 40), (1025, 1023), (257, 255)],
)
def test_reference_size_is_what_the_server_encodes_unchanged(w, h):
    nw, nh = reference_size(w, h)
    assert nw % 32 == 0 and nh % 32 == 0
    assert 65_536 <= nw * nh <= 1_048_576
    if 65_536 <= w * h <= 1_048_576 and w % 32 == 0 and h % 32 == 0:
        assert (nw, nh) == (w, h)


def test_server_sampler_starts_from_comfy_noise():
    """The stock RandomNoise / KSampler noise (comfy.sample.prepare_noise: manual_seed, then a
    CPU randn of the LATENT's shape) is the server sampler's initial noise."""
    sampling = pytest.importorskip("gmlx_server.engine.sampling")
    latent = torch.zeros(1, 64, 4, 6)
    generator = torch.manual_seed(7)
    noise = torch.randn(latent.size(), dtype=latent.dtype, generator=generator, device="cpu")
    np.testing.assert_array_equal(noise.numpy(), sampling.initial_noise(7, 64, 4, 6))


def test_latent_normalisation_choices():
    status = {
        "family": "qwen_image21",
        "latent": {"channels": 2},
        "vae": {"latents_mean": [0.5, 1], "latents_std": [2, 3]},
    }
    assert latent_normalisation(status) == ([0.5, 1.0], [2.0, 3.0])
    assert latent_normalisation({"latent": {"channels": 2}, "vae": {"space": "model"}}) is None
    published = latent_normalisation(
        {"family": "qwen_image21", "latent": {"channels": 64}, "vae": {}}
    )
    assert len(published[0]) == 64 and published[1][0] == pytest.approx(3.2001)
    with pytest.raises(ValueError, match="normalisation"):
        latent_normalisation({"family": "krea2", "latent": {"channels": 16}, "vae": {}})
    with pytest.raises(ValueError, match="3 latent channels"):
        latent_normalisation({**status, "latent": {"channels": 3}})


def test_the_edit_node_refuses_images_without_the_vae():
    """Images with no VAE would reach the text encoder alone, which the contract refuses: the
    node says so before any request."""
    from gmlx_comfy.errors import GmlxError
    from gmlx_comfy.nodes import GmlxTextEncodeEdit

    with pytest.raises(GmlxError, match="the images need the vae input"):
        GmlxTextEncodeEdit().encode(None, "make it blue", vae=None, image2=torch.zeros(1, 8, 8, 3))
