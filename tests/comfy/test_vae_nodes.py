"""The remote VAE against a stand-in server client: RGB for ComfyUI's IMAGE, alpha as a MASK,
one request per image with ComfyUI's interrupt checked between and during them; and the empty
latent node's sizes."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gmlx_comfy.errors import GmlxError
from gmlx_comfy.nodes import GmlxEmptyLatent, GmlxVAEDecode, latent_size
from gmlx_comfy.vae import GmlxVAE

from tests.comfy.interrupt_flag import Flag, Interrupted

STATUS = {"vae": {"stride": 16, "channels_out": 4}, "latent": {"channels": 64, "stride": 16}}


class Client:
    """vae/decode as the server answers it: (B, H, W, 4) with alpha, else 3 channels."""

    def __init__(self, seconds=0.0):
        self.seconds = seconds
        self.calls: list[tuple[int, bool]] = []
        self.started = threading.Event()

    def vae_decode(self, latents, model=None, alpha=False):
        self.calls.append((latents.shape[0], alpha))
        self.started.set()
        time.sleep(self.seconds)
        b, _, h, w = latents.shape
        image = np.full((b, h * 16, w * 16, 4), 0.25, np.float32)
        image[..., 3] = 0.75
        return image if alpha else image[..., :3]

    def vae_encode(self, image, model=None):
        self.calls.append((image.shape[0], image.shape[-1] == 4))
        return np.zeros((image.shape[0], 64, image.shape[1] // 16, image.shape[2] // 16))


def _vae(client, status=STATUS, flag=None):
    conn = SimpleNamespace(client=client, lock=threading.RLock(), ensure_reachable=lambda: None)
    vae = GmlxVAE(conn, "tiny", status)
    vae.interrupt = flag or Flag()
    return vae


def test_decode_gives_rgb_one_request_per_image():
    client = Client()
    images = _vae(client).decode(torch.zeros(3, 64, 2, 2))
    assert images.shape == (3, 32, 32, 3)
    assert client.calls == [(1, False)] * 3


def test_the_decode_node_gives_rgb_and_one_minus_alpha():
    client = Client()
    images, mask = GmlxVAEDecode().decode({"samples": torch.zeros(2, 64, 2, 2)}, _vae(client))
    assert images.shape == (2, 32, 32, 3) and torch.all(images == 0.25)
    assert mask.shape == (2, 32, 32) and torch.allclose(mask, torch.tensor(0.25))
    assert client.calls == [(1, True)] * 2


def test_the_decode_node_without_alpha_gives_an_opaque_mask():
    rgb_only = {**STATUS, "vae": {"stride": 16, "channels_out": 3}}
    client = Client()
    images, mask = GmlxVAEDecode().decode(
        {"samples": torch.zeros(1, 64, 2, 2)}, _vae(client, rgb_only)
    )
    assert images.shape == (1, 32, 32, 3) and mask.shape == (1, 32, 32)
    assert torch.all(mask == 0.0) and client.calls == [(1, False)]


def test_the_decode_node_refuses_another_vae():
    with pytest.raises(GmlxError, match="gmlx VAE Loader"):
        GmlxVAEDecode().decode({"samples": torch.zeros(1, 64, 2, 2)}, object())


@pytest.mark.parametrize(
    "shape, said",
    [
        ((1, 16, 2, 2), "'tiny'.* 64 channels.*another model"),
        ((1, 64, 2, 2, 2), r"\(batch, channels, height, width\).*\(1, 64, 2, 2, 2\)"),
        ((64, 2, 2), r"\(batch, channels, height, width\).*\(64, 2, 2\)"),
    ],
)
def test_a_latent_the_vae_cannot_decode_is_refused_before_any_request(shape, said):
    client = Client()
    with pytest.raises(GmlxError, match=said):
        _vae(client).decode(torch.zeros(shape))
    assert client.calls == []


def test_a_status_without_the_latent_channels_checks_none():
    client = Client()
    status = {**STATUS, "latent": {"stride": 16}}
    assert _vae(client, status).decode(torch.zeros(1, 16, 2, 2)).shape == (1, 32, 32, 3)
    assert _vae(client).decode(torch.zeros(1, 64, 1, 2, 2)).shape == (1, 32, 32, 3)  # one frame


@pytest.mark.parametrize("tiled", [False, True])
def test_an_interrupt_during_a_batch_stops_it_at_once(tiled):
    """Interrupted in the second image of four: raised within a poll, the rest never sent."""
    client, flag = Client(seconds=0.6), Flag()
    vae = _vae(client, flag=flag)
    decode = vae.decode_tiled if tiled else vae.decode

    def interrupt_in_the_second_image():
        while len(client.calls) < 2:
            time.sleep(0.01)
        flag.raised = True

    threading.Thread(target=interrupt_in_the_second_image, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(Interrupted):
        decode(torch.zeros(4, 64, 2, 2))
    assert time.monotonic() - start < 0.6 + 0.6 / 2  # not the rest of the second image
    time.sleep(0.7)
    assert len(client.calls) == 2


def test_an_interrupt_before_a_pass_sends_nothing():
    client, flag = Client(), Flag()
    flag.raised = True
    with pytest.raises(Interrupted):
        _vae(client, flag=flag).encode(torch.zeros(2, 32, 32, 3))
    assert client.calls == []


def test_encode_sends_one_image_per_request_with_alpha_padded():
    client = Client()
    latents = _vae(client).encode(torch.zeros(2, 32, 32, 3))
    assert latents.shape == (2, 64, 2, 2) and client.calls == [(1, True)] * 2


def test_latent_size_floors_and_says_so():
    assert latent_size(1024, 768, 16) == (1024, 768, None)
    w, h, note = latent_size(500, 300, 16)
    assert (w, h) == (496, 288) and "500×300 rounded down to 496×288" in note
    with pytest.raises(GmlxError):
        latent_size(8, 300, 16)


def test_empty_latent_node_reports_the_rounding(caplog):
    vae = _vae(Client())
    (plain,) = GmlxEmptyLatent().empty(vae, 256, 256, 2)
    assert plain["samples"].shape == (2, 64, 16, 16) and plain["downscale_ratio_spacial"] == 16
    with caplog.at_level(logging.WARNING, "gmlx_comfy"):
        out = GmlxEmptyLatent().empty(vae, 500, 300, 1)
    (latent,) = out["result"]
    assert latent["samples"].shape == (1, 64, 18, 31)
    assert out["ui"]["text"] == [caplog.records[0].getMessage()]
    assert "496×288" in out["ui"]["text"][0]


def test_empty_latent_node_floors_to_the_patch_of_a_patched_dit():
    """Z-Image: stride 8, patch 2, so sides of 16 pixels; 200x152 is refused by the DiT, so the
    node gives 192x144 (latents 24x18, each even) and says so."""
    status = {"vae": {"stride": 8}, "latent": {"channels": 16, "stride": 8, "patch": 2}}
    vae = _vae(Client(), status)
    out = GmlxEmptyLatent().empty(vae, 200, 152, 1)
    (latent,) = out["result"]
    assert latent["samples"].shape == (1, 16, 18, 24) and latent["downscale_ratio_spacial"] == 8
    assert (
        "200×152 rounded down to 192×144 (the model's sides are multiples of 16)"
        in (out["ui"]["text"][0])
    )


def test_empty_latent_node_refuses_a_stock_vae_naming_the_loader():
    with pytest.raises(GmlxError, match="gmlx Empty Latent needs a VAE from the gmlx VAE Loader"):
        GmlxEmptyLatent().empty(object(), 256, 256, 1)


def test_the_status_node_runs_at_every_prompt():
    """ComfyUI replays a node whose IS_CHANGED answers as before; NaN never equals itself."""
    from gmlx_comfy.nodes import GmlxServerStatus

    answer = GmlxServerStatus.IS_CHANGED(model_name="tiny", server_url="", start_server=True)
    assert answer != answer
