"""A tiny family folder served on loopback as `gmlx serve` serves it, and a whole sampling
through its step routes: what each family's pipeline parity compares with its reference."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from gmlx_contract.client import StepClient
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.engine.sampling import ImageRequest, generate
from gmlx_server.model_choice import ModelChoice
from gmlx_server.step_server import StepServer, ViaStepsTransport


def loaded_folder(folder: Path):
    """The folder's model loaded by a registry of its own (what `--model FOLDER` loads): the
    registry's LoadedModel, what a LoRA file's table is built for."""
    return ModelRegistry(extra_models=[folder]).acquire(folder.name)


@contextmanager
def served_folder(folder) -> Iterator[StepServer]:
    """The folder's model, loaded, behind the step routes of a server of its own."""
    registry = ModelRegistry(extra_models=[folder], default_model=folder.name)
    with StepServer(ModelChoice(registry, folder.name, 0.0)) as server:
        server.load()
        yield server


def variant_folder(
    root: Path, variant: str, build_tiny_folder: Callable, write_embedded_model: Callable
) -> Path:
    """`root` written as the tests' tiny folder of `variant` (`build_tiny_folder`), or, for
    "embedded", as the family's embedded model (its product recipe, `write_embedded_model`)."""
    if variant == "embedded":
        write_embedded_model(root)
        return root
    return build_tiny_folder(root, variant=variant)


def through_routes(server: StepServer, request: ImageRequest) -> np.ndarray:
    """`generate` over the step routes: the status's schedule, ComfyUI's noise for the seed;
    the final latents."""
    status = server.loaded.model.status()
    with StepClient(server.base_url) as client:
        via = ViaStepsTransport(client, server.direct(), server.choice.model_id)
        latents, _ = generate(via, status, request)
    return latents


def through_openai_edit(server: StepServer, request: ImageRequest) -> np.ndarray:
    """The same image to image (or inpainting) as an OpenAI edit of the server: multipart, the
    init image and the mask (white where to paint) as PNG files; the answer's pixels."""
    import base64
    import io

    import requests
    from PIL import Image

    def png(pixels: np.ndarray) -> bytes:
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        return buffer.getvalue()

    fields = {
        "prompt": request.prompt,
        "size": f"{request.width}x{request.height}",
        "seed": str(request.seed),
        "strength": str(request.strength),
        **({"steps": str(request.steps)} if request.steps else {}),
        **({"cfg": str(request.cfg)} if request.cfg is not None else {}),
        **({"negative_prompt": request.negative} if request.negative else {}),
    }
    files = {"image": ("init.png", png(request.init_image), "image/png")}
    if request.mask is not None:
        files["mask"] = ("mask.png", png(request.mask), "image/png")
    answer = requests.post(
        server.base_url + "/v1/images/edits", data=fields, files=files, timeout=120
    )
    assert answer.status_code == 200, answer.text
    data = base64.b64decode(answer.json()["data"][0]["b64_json"])
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


def decoded(server: StepServer, latents: np.ndarray) -> np.ndarray:
    """Final latents as the routes' PNG pixels."""
    from gmlx_server.engine.sampling import to_uint8

    return to_uint8(server.direct().decode(latents))
