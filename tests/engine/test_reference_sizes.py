"""The reference image sizes a family's pipeline takes as they are (base.ReferenceSizes), as
FLUX.2 klein's and FLUX.3 klein's specs declare them: each bound taken at its edge and refused
past it, with the message naming the sizes (the encode route answers it as a 400), the
loaded model's check reading them from its capabilities, and encode refusing an image before
any encoder runs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from gmlx_server.engine.base import EngineInputError
from gmlx_server.engine.families.flux2_klein.spec import SPECS as FLUX2_SPECS
from gmlx_server.engine.families.flux3_klein.spec import SPEC as FLUX3_SPEC
from gmlx_server.engine.families.qwen_image21.spec import SPEC as QWEN_IMAGE21_SPEC

STRIDE = 16
FLUX2 = FLUX2_SPECS[0].reference_sizes
FLUX3 = FLUX3_SPEC.reference_sizes


def refusal(sizes, height: int, width: int, count: int = 1) -> str | None:
    try:
        sizes.check(2, height, width, count, STRIDE, "Model")
    except EngineInputError as refused:
        return str(refused)
    return None


@pytest.mark.parametrize(
    ("height", "width", "taken"),
    [
        (64, 64, True),
        (48, 64, False),  # a side under 64
        (64, 72, False),  # not a multiple of the stride
        (64, 512, True),  # aspect 8
        (64, 528, False),  # aspect past 8
        (1024, 1024, True),
        (1024, 1040, False),  # past 1024x1024 pixels
    ],
)
def test_flux2_kleins_bounds(height, width, taken):
    assert (refusal(FLUX2, height, width) is None) == taken
    assert (refusal(FLUX2, height, width, count=3) is None) == taken  # the same for several


def test_flux2_kleins_refusal_names_every_bound():
    assert refusal(FLUX2, 48, 64) == (
        "image 2 is 64x48: Model references must have sides that are multiples of 16, at least"
        " 64, within an aspect ratio of 8 and at most 1048576 pixels (the pipeline's sizes,"
        " which it would resize to), or be sent as latents from vae/encode"
    )


@pytest.mark.parametrize(
    ("height", "width", "count", "taken"),
    [
        (64, 4096, 1, True),  # no aspect bound: the longest side alone
        (64, 4112, 1, False),  # a side past 4096
        (48, 64, 1, False),
        (2048, 2048, 1, True),  # a lone reference: up to 4 megapixels
        (2048, 2064, 1, False),
        (1024, 1024, 2, True),  # each of several: up to 1 megapixel
        (1024, 1040, 2, False),
    ],
)
def test_flux3_kleins_bounds(height, width, count, taken):
    assert (refusal(FLUX3, height, width, count) is None) == taken


def test_flux3_kleins_refusal_says_which_area_applies():
    lone, several = refusal(FLUX3, 2048, 2064), refusal(FLUX3, 1024, 1040, count=2)
    assert lone == (
        "image 2 is 2064x2048: Model references must have sides that are multiples of 16 from 64"
        " to 4096 and at most 4194304 pixels (one reference: the pipeline's sizes, which it would"
        " resize to), or be sent as latents from vae/encode"
    )
    assert "at most 1048576 pixels (each of several: the pipeline's sizes" in several


def test_the_three_flux2_klein_families_and_their_capabilities_carry_the_sizes():
    assert {spec.reference_sizes for spec in FLUX2_SPECS} == {FLUX2}
    assert FLUX2_SPECS[2].capabilities().reference_sizes == FLUX2


def test_a_loaded_model_checks_the_sizes_its_capabilities_carry():
    from gmlx_server.engine.family import FamilyModel

    def model(spec):
        vae = SimpleNamespace(stride=STRIDE)
        return SimpleNamespace(capabilities=spec.capabilities(), vae=vae, title=spec.title)

    flux3 = model(FLUX3_SPEC)
    with pytest.raises(EngineInputError, match="image 1 is 64x48: FLUX.3 klein references"):
        FamilyModel.check_reference(flux3, 1, 48, 64, 2)
    FamilyModel.check_reference(flux3, 1, 2048, 2048, 1)
    # Qwen-Image 2.1 takes references of any sides within its area (its encoder resizes them)
    qwen = model(QWEN_IMAGE21_SPEC)
    FamilyModel.check_reference(qwen, 0, 260, 300, 1)
    with pytest.raises(EngineInputError, match="must have from 65536 to 1048576 pixels"):
        FamilyModel.check_reference(qwen, 0, 48, 72, 1)


def test_encode_refuses_a_reference_before_any_encoder_runs():
    from gmlx_server.engine.family import FamilyModel

    model = object.__new__(FamilyModel)
    spec = FLUX2_SPECS[0]
    model.capabilities, model.title = spec.capabilities(), spec.title
    model.vae = SimpleNamespace(stride=STRIDE)  # no encode: a VAE encode would fail the test
    model.prompt_encoder = lambda: pytest.fail("the prompt was encoded")
    images = [np.zeros((64, 64, 3), np.uint8), np.zeros((48, 64, 3), np.uint8)]
    with pytest.raises(EngineInputError, match="image 1 is 64x48: FLUX.2 klein"):
        model.encode("a cat", images, refs=True)
