"""The gmlx Server Status node's text: a line for the server, the model and its weights, the
sampling settings, the references and the features, readable without the contract at hand."""

from types import SimpleNamespace

from gmlx_comfy.nodes import sampling_text, status_text

CAPABILITIES = {"gmlx_version": "0.1.0", "contract": {"major": 1, "minor": 0}, "features": []}
# Qwen-Image 2.1 turbo's sampling as docs/contract.md §2.3 gives it.
TURBO_SIGMAS = [1.0, 0.978453, 0.95418, 0.926626, 0.89508, 0.845148, 0.704534, 0.414568, 0.0]


def test_a_resident_model_says_what_it_holds_and_how_it_samples():
    conn = SimpleNamespace(
        url="http://127.0.0.1:8080", capabilities={**CAPABILITIES, "features": ["lora", "mask"]}
    )
    status = {
        "model": "qwen-image21-turbo",
        "family": "qwen_image21",
        "variant": "turbo",
        "resident": True,
        "edit_capable": True,
        "sampling": {"steps": 8, "cfg": 1.0, "shift": 1.0, "sigmas": TURBO_SIGMAS},
        "memory": {
            "dit_bytes": 10_200_000_000,
            "encoder_bytes": 8_300_000_000,
            "vae_bytes": 250_000_000,
            "resident_bytes": 20_100_000_000,
        },
    }
    assert status_text(conn, status).splitlines() == [
        "server http://127.0.0.1:8080: gmlx 0.1.0, contract 1.0",
        "model qwen-image21-turbo: qwen_image21 turbo, resident, holding 20.10 GB (weights:"
        " DiT 10.20 GB, text encoder 8.30 GB, VAE 250.0 MB)",
        "sampling: 8 steps, cfg 1.0, shift 1.0, fixed sigmas of 8 steps (gmlx Sigmas gives them)",
        "reference images: taken",
        "features: lora, mask",
    ]


def test_a_model_not_loaded_and_the_schedule_kinds():
    conn = SimpleNamespace(url="http://box:9000", capabilities=CAPABILITIES)
    status = {"model": "m", "family": "z_image", "variant": "base", "resident": False}
    lines = status_text(conn, status).splitlines()
    assert lines[1:] == [
        "model m: z_image base, not loaded",
        "sampling: none of its own (ComfyUI's simple schedule)",
        "reference images: not taken",
        "features: none",
    ]
    rule = {"steps": 50, "cfg": 4.0, "shift": None, "sigmas": None, "schedule": {"kind": "x"}}
    assert sampling_text({**rule, "neg_skip": [7, 8]}) == (
        "50 steps, cfg 4.0, a schedule by image size (gmlx Sigmas, given the width and height),"
        " the negative pass skips blocks 7, 8"
    )
