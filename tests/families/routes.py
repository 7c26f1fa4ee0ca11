"""A tiny family folder served on loopback as `gmlx serve` serves it, and a whole sampling
through its step routes: what each family's pipeline parity compares with its reference."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from gmlx_contract.client import StepClient
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.engine.sampling import ImageRequest, generate
from gmlx_server.image_cli import ModelChoice, StepServer, ViaStepsTransport


@contextmanager
def served_folder(folder) -> Iterator[StepServer]:
    """The folder's model, loaded, behind the step routes of a server of its own."""
    registry = ModelRegistry(extra_models=[folder], default_model=folder.name)
    with StepServer(ModelChoice(registry, folder.name, 0.0)) as server:
        server.load()
        yield server


def through_routes(server: StepServer, request: ImageRequest) -> np.ndarray:
    """`generate` over the step routes: the status's schedule, ComfyUI's noise for the seed;
    the final latents."""
    status = server.loaded.model.status()
    with StepClient(server.base_url) as client:
        via = ViaStepsTransport(client, server.direct(), server.choice.model_id)
        latents, _ = generate(via, status, request)
    return latents
