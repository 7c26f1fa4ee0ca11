"""The twin-blocks family's facts, as data (gmlx_server.engine.spec), as a product family
declares them."""

from __future__ import annotations

from pathlib import Path

from gmlx_server.engine.spec import FamilySpec, model_index

FAMILY = "twin_blocks"
PIPELINE_CLASS = "GmlxTwinBlocksPipeline"


def identify(model_dir: Path) -> tuple[str, str] | None:
    if model_index(model_dir).get("_class_name") != PIPELINE_CLASS:
        return None
    return FAMILY, "base"


SPEC = FamilySpec(
    name=FAMILY,
    title="twin-blocks",
    identify=identify,
    comfy={"model_class": "TwinBlocks", "image_model": FAMILY},
    latent_stride=8,
    features=("noise_mask",),
    sampling={"base": {"steps": 4, "cfg": 1.0, "shift": 1.0}},
    schedule={"rule": "flux2"},
    files=("dit", "text_encoder"),
    package=__package__,
)
SPECS = (SPEC,)
