"""Reference images of any size brought to the sizes a family takes (engine/reference_images.py),
pixel for pixel as the families' diffusers pipelines bring them: FLUX.2 klein's
(`Flux2KleinPipeline`: downscaled to a megapixel, center-cropped to the stride, refused under
64 pixels a side or beyond an aspect of 8) and FLUX.3 klein's (`Flux3ImageProcessor`: a lone
reference downscaled and padded by reflection to its canvas, several downscaled and cropped);
an image the bounds take stays as it is; the bounds reach the sampler through the status."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor
from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions
from gmlx_server.engine.families.flux2_klein.spec import SPECS as FLUX2_SPECS
from gmlx_server.engine.families.flux3_klein.spec import SPEC as FLUX3_SPEC
from gmlx_server.engine.families.qwen_image21.spec import SPEC as QWEN_IMAGE21_SPEC
from gmlx_server.engine.reference_images import (
    check_references,
    fitted_references,
    lone_canvas,
)
from gmlx_server.engine.sampling import SettingError
from PIL import Image

STRIDE = 16
FLUX2_STATUS = {
    "vae": {"stride": STRIDE},
    "conditioning": FLUX2_SPECS[0].conditioning_status(),
}
FLUX3_STATUS = {"vae": {"stride": STRIDE}, "conditioning": FLUX3_SPEC.conditioning_status()}
QWEN_STATUS = {"vae": {"stride": 8}, "conditioning": QWEN_IMAGE21_SPEC.conditioning_status()}


def picture(height: int, width: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    """A smooth image with detail (so a resampling's rounding shows) of uint8 pixels."""
    rng = np.random.default_rng(seed)
    rows = np.arange(height, dtype=np.uint16)[:, None] * 200 // height
    cols = np.arange(width, dtype=np.uint16)[None, :] * 200 // width
    base = np.stack(np.broadcast_arrays(rows, cols, (rows + cols) // 2), axis=-1)
    image = (base + rng.integers(0, 56, base.shape, dtype=np.uint16)).astype(np.uint8)
    if channels == 4:
        image = np.concatenate([image, np.full((height, width, 1), 255, np.uint8)], axis=-1)
    return image


def as_pipeline_input(image: np.ndarray) -> torch.Tensor:
    """What a VAE encodes of a uint8 image, as diffusers' image processors normalize it."""
    array = np.ascontiguousarray(image[..., :3]).astype(np.float32) / 255.0
    return torch.from_numpy(array).permute(2, 0, 1)[None] * 2.0 - 1.0


def flux2_pipeline(image: np.ndarray) -> torch.Tensor:
    """Flux2KleinPipeline's processing of one reference image (its __call__, step 4)."""
    processor = Flux2ImageProcessor(vae_scale_factor=STRIDE)
    img = Image.fromarray(image)
    processor.check_image_input(img)
    image_width, image_height = img.size
    if image_width * image_height > 1024 * 1024:
        img = processor._resize_to_target_area(img, 1024 * 1024)
        image_width, image_height = img.size
    image_width = (image_width // STRIDE) * STRIDE
    image_height = (image_height // STRIDE) * STRIDE
    return processor.preprocess(img, height=image_height, width=image_width, resize_mode="crop")


def flux3_pipeline(image: np.ndarray, count: int) -> torch.Tensor:
    """FLUX.3 klein's modular blocks' processing of one of `count` references."""
    mode = "fill" if count == 1 else "crop"
    return Flux3ImageProcessor().preprocess(Image.fromarray(image), resize_mode=mode)[0]


@pytest.mark.parametrize(
    ("height", "width", "channels"),
    [
        (70, 100, 3),  # cropped to the stride
        (1500, 900, 3),  # downscaled to a megapixel, then cropped
        (1200, 1200, 4),  # with alpha, resized as Pillow resizes RGBA, then dropped
        (64, 512, 3),  # taken as it is
    ],
)
def test_flux2_klein_references_are_its_pipelines(height, width, channels):
    image = picture(height, width, channels)
    (got,) = fitted_references(FLUX2_STATUS, [image])
    expected = flux2_pipeline(image)
    assert as_pipeline_input(got).shape == expected.shape
    torch.testing.assert_close(as_pipeline_input(got), expected, rtol=0, atol=1e-6)
    if (height, width) == (64, 512):
        assert got is image


@pytest.mark.parametrize(
    ("height", "width", "count"),
    [
        (70, 100, 1),  # padded by reflection to 80x112
        (40, 30, 1),  # under a token: mirrored to the 64x64 canvas
        (3000, 2000, 1),  # downscaled until the canvas fits 4 megapixels
        (5000, 600, 1),  # its long side brought to 4096
        (1500, 900, 3),  # one of several: downscaled to a megapixel and cropped
        (70, 100, 2),
    ],
)
def test_flux3_klein_references_are_its_pipelines(height, width, count):
    image = picture(height, width)
    others = [picture(64, 64, seed=i) for i in range(1, count)]
    got = fitted_references(FLUX3_STATUS, [image, *others])[0]
    expected = flux3_pipeline(image, count)
    assert as_pipeline_input(got).shape == expected.shape
    torch.testing.assert_close(as_pipeline_input(got), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("height", "width"), [(70, 100), (40, 30), (3000, 2000), (5000, 600), (64, 80)]
)
def test_a_lone_flux3_klein_reference_gives_its_pipelines_canvas_and_crop_back(height, width):
    """The size the modular blocks generate at when none is given (the padded reference's
    canvas) and the box they crop their output back to (`reference_crop`)."""
    image = picture(height, width)
    canvas, box = lone_canvas(FLUX3_STATUS, [image])
    padded, kwargs = Flux3ImageProcessor().preprocess(Image.fromarray(image), resize_mode="fill")
    assert canvas == tuple(padded.shape[-2:])
    assert box == tuple(kwargs["reference_crop"])


def test_only_a_lone_reference_that_is_padded_has_a_canvas():
    image = picture(70, 100)
    assert lone_canvas(FLUX3_STATUS, [image, image]) is None
    assert lone_canvas(FLUX2_STATUS, [image]) is None
    assert lone_canvas({"vae": {"stride": STRIDE}}, [image]) is None


@pytest.mark.parametrize(("height", "width"), [(40, 100), (64, 600)])
def test_what_flux2_kleins_pipeline_refuses_is_refused_before_any_work(height, width):
    image = picture(height, width)
    with pytest.raises(ValueError):
        flux2_pipeline(image)
    with pytest.raises(SettingError, match=f"reference image 1 is {width}x{height}: the model"):
        check_references(FLUX2_STATUS, [picture(64, 64), image])


def test_a_model_without_bounds_takes_references_as_they_are():
    image = picture(70, 100)
    status = {"vae": {"stride": 8}, "conditioning": {"ref_method": "index"}}
    check_references(status, [image])
    assert fitted_references(status, [image])[0] is image


def test_references_on_a_model_that_takes_none_are_refused_before_any_work():
    status = {"vae": {"stride": 8}, "edit_capable": False, "conditioning": {"ref_method": None}}
    check_references(status, [])
    with pytest.raises(SettingError, match="the model takes no reference images"):
        check_references(status, [picture(64, 64)])


@pytest.mark.parametrize(
    ("height", "width", "channels", "size"),
    [
        (1000, 3000, 3, (576, 1760)),  # over 1024x1024 pixels: the pipeline's size
        (40, 40, 3, (1024, 1024)),  # under 256x256 pixels: brought up to the pipeline's
        # the pipeline's 768x1376 and 896x1184 hold more than 1024x1024 pixels, which the
        # encoder refuses: the sides floored to 32s
        (1080, 1920, 3, (768, 1344)),
        (1200, 1600, 4, (864, 1152)),
        (600, 700, 3, (600, 700)),  # within the area: as it is (the encoder resizes it)
    ],
)
def test_qwen_image21_references_are_its_pipelines_size(height, width, channels, size):
    """Outside the encoder's area, QwenImage21Pipeline's size for the picture (1024x1024
    pixels at its aspect, sides in 32s: `calculate_dimensions`), resized as its image
    processor resizes (Lanczos)."""
    image = picture(height, width, channels)
    (got,) = fitted_references(QWEN_STATUS, [image])
    if (height, width) == size:
        assert got is image
        return
    pipeline_width, pipeline_height, _ = calculate_dimensions(1024 * 1024, width / height)
    rounded = pipeline_width * pipeline_height <= 1024 * 1024
    assert rounded == (size == (pipeline_height, pipeline_width))
    assert got.shape == (*size, channels)
    mode = "RGBA" if channels == 4 else "RGB"
    expected = VaeImageProcessor().resize(
        Image.fromarray(image, mode), height=size[0], width=size[1]
    )
    np.testing.assert_array_equal(got, np.asarray(expected))
