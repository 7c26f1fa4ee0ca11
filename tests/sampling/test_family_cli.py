"""`gmlx image sample` and `gmlx image bench` on tiny folders of the families with no model of
their own here (the embedded models' are tests/sampling/test_sample_cli.py's), as a user runs
them: the step routes (--via-steps) give the in-process image bit for bit."""

from __future__ import annotations

import pytest

from tests.families.flux3_klein import tiny as flux3_tiny
from tests.families.krea2 import tiny as krea2_tiny
from tests.families.z_image.tiny import folder as z_image_tiny
from tests.sampling.image_cli import assert_routed_png_is_direct, routed_bench_record

# Each family's tiny folder of its few-step variant, and that variant's steps.
BUILDERS = {
    "z_image": (z_image_tiny.build_tiny_folder, "turbo", 8),
    "krea2": (krea2_tiny.build_tiny_folder, "turbo", 8),
    "flux3_klein": (flux3_tiny.build_tiny_folder, "distilled", 16),  # a flow map
}


# Z-Image's repeats Krea 2's through the same command paths (its sampling through the routes is
# tests/families/z_image/test_pipeline_parity.py's); it runs with -m heavy.
@pytest.fixture(
    scope="module",
    params=[pytest.param("z_image", marks=pytest.mark.heavy), "krea2", "flux3_klein"],
)
def folder(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"{request.param}_cli") / f"{request.param}-tiny"
    build, variant, _ = BUILDERS[request.param]
    build(root, variant=variant)
    return root


def test_sample_via_the_step_routes_writes_the_direct_png(tmp_path, folder):
    steps = BUILDERS[folder.name.removesuffix("-tiny")][2]
    assert_routed_png_is_direct(tmp_path, folder, steps)


def test_guided_bench_via_steps_is_equal_to_direct(tmp_path, folder):
    extra = ["--cfg", "2.5", "--negative", "blurry", "--steps", "3"]
    record = routed_bench_record(tmp_path, folder, *extra)
    assert record["model"]["family"] == folder.name.removesuffix("-tiny")
