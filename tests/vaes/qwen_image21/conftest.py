"""Tiny VAE folders built once per session, with the torch reference model beside each."""

from __future__ import annotations

import pytest

from tests.families.qwen_image21.tiny.vae import build_vae

# name -> builder overrides: the real RGBA layout, and an RGB one with another block layout.
CONFIGS = {
    "rgba": {},
    "rgb": {
        "in_channels": 3,
        "out_channels": 3,
        "num_res_blocks": 2,
        "temperal_downsample": [True, False, True, False],
    },
}


@pytest.fixture(scope="session")
def torch_threads():
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session", params=sorted(CONFIGS))
def tiny_vae(request, tmp_path_factory, torch_threads):
    """(folder, torch model) for each tiny config."""
    directory = tmp_path_factory.mktemp(f"vae_{request.param}")
    model = build_vae(directory, seed=3, **CONFIGS[request.param])
    return directory, model


@pytest.fixture(scope="session")
def rgba_vae(tmp_path_factory, torch_threads):
    directory = tmp_path_factory.mktemp("vae_rgba_only")
    return directory, build_vae(directory, seed=5)
