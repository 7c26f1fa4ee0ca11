"""A VAE whose tiles are not its whole pass (the FLUX.1 AutoencoderKL of Z-Image) decodes and
encodes whole wherever the memory plan fits the whole pass, at any size past its `sample_size`,
and in tiles only where the whole pass does not fit and the tiled one does (ComfyUI's fallback on
out-of-memory); the VAE routes say which (`X-Gmlx-Vae-Tiled`). The passes themselves are
diffusers' untiled and tiled ones (tests/vaes/autoencoder_kl/test_tiling.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from gmlx_contract import wire
from gmlx_server.config import ImageConfig, ServerConfig
from gmlx_server.engine.base import MemoryPlanError
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.memory import MemoryPlanner

from tests.families.z_image.tiny.folder import build_tiny_folder
from tests.server.conftest import serve

TILE = 32  # pixels: the folder's VAE sample_size, so a 96-pixel image spans 3 x 3 tiles
SIDE = 96


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vae_tiles") / "z-image-tiny"
    build_tiny_folder(folder)
    config_file = folder / "vae" / "config.json"
    vae_config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**vae_config, "sample_size": TILE}))
    registry = ModelRegistry([], folder.name, extra_models=[folder])
    server = serve(ServerConfig(host="127.0.0.1", port=0, image=ImageConfig()), registry)
    server.model_id = folder.name
    yield server
    server.close()


def planner_with_room(served, free: int) -> tuple[MemoryPlanner, object]:
    """A planner over the served registry whose machine leaves `free` bytes beside what is held."""
    registry = served.ctx.registry
    loaded = registry.loaded(served.model_id)
    config = replace(ImageConfig(), memory_budget_mb=0, memory_headroom_mb=0)
    planner = MemoryPlanner(registry, [], config, machine=lambda: 0)
    held = planner.held()
    planner.budget = lambda: held + free
    return planner, loaded


def test_the_routes_pass_whole_where_it_fits_and_say_so(served):
    rng = np.random.default_rng(1)
    latents = rng.standard_normal((1, 16, SIDE // 8, SIDE // 8)).astype(np.float32)
    r = served.post_container("vae/decode", {"latents": latents}, {})
    assert r.status_code == 200, r.text
    assert r.headers["X-Gmlx-Vae-Tiled"] == "false"
    loaded = served.ctx.registry.loaded(served.model_id)
    assert loaded.model.vae_tileable(SIDE, SIDE, True)  # it could have tiled
    whole = loaded.model.vae_decode(latents[0], False, False)
    tiled = loaded.model.vae_decode(latents[0], False, True)
    image = wire.read_container(r.content).tensors["image"][0]
    np.testing.assert_array_equal(image, whole)
    assert np.linalg.norm(image - tiled) / np.linalg.norm(whole) > 1e-3
    pixels = rng.random((1, SIDE, SIDE, 3), dtype=np.float32)
    r = served.post_container("vae/encode", {"image": pixels}, {})
    assert r.status_code == 200 and r.headers["X-Gmlx-Vae-Tiled"] == "false", r.text


@pytest.mark.parametrize("decode", [True, False])
def test_the_plan_tiles_only_where_the_whole_pass_does_not_fit(served, decode):
    """Whole where it fits, the text encoder released first where that makes it fit; then
    tiles where they fit; else the refusal."""
    model = served.ctx.registry.loaded(served.model_id).model
    whole = model.vae_peak_bytes(SIDE, SIDE, decode)
    tiles = model.vae_peak_bytes(SIDE, SIDE, decode, tiled=True)
    assert tiles < whole
    planner, loaded = planner_with_room(served, whole)
    assert planner.check_vae(loaded, SIDE, SIDE, decode) is False
    model.prompt_encoder()  # resident, so releasing it would make room
    planner, loaded = planner_with_room(served, whole - 1)
    assert planner.check_vae(loaded, SIDE, SIDE, decode) is False
    assert not model.encoder_resident  # released for the whole pass, not tiled
    for free in (whole - 1, tiles):
        planner, loaded = planner_with_room(served, free)
        assert planner.check_vae(loaded, SIDE, SIDE, decode) is True, free
    planner, loaded = planner_with_room(served, tiles - 1)
    with pytest.raises(MemoryPlanError, match="fit"):
        planner.check_vae(loaded, SIDE, SIDE, decode)


def test_an_image_of_one_tile_never_tiles(served):
    model = served.ctx.registry.loaded(served.model_id).model
    assert not model.vae_tileable(TILE, TILE, True)
    planner, loaded = planner_with_room(served, model.vae_peak_bytes(TILE, TILE, True) - 1)
    with pytest.raises(MemoryPlanError):
        planner.check_vae(loaded, TILE, TILE, True)
