"""`gmlx image sample` and `gmlx image bench` on tiny folders of the families with no model of
their own here (the embedded models' are tests/sampling/test_sample_cli.py's), as a user runs
them: the step routes (--via-steps) give the in-process image bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from PIL import Image

from tests.families.flux3_klein import tiny as flux3_tiny
from tests.families.krea2 import tiny as krea2_tiny
from tests.families.z_image.tiny import folder as z_image_tiny

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


def image_command(tmp_path, folder, command: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    line = [sys.executable, "-m", "gmlx_server", "image", command, "--model", str(folder)]
    line += ["--prompt", "a red fox", "--width", "64", "--height", "48", "--seed", "5"]
    return subprocess.run(line + list(extra), capture_output=True, text=True, env=env)


def test_sample_via_the_step_routes_writes_the_direct_png(tmp_path, folder):
    direct = image_command(tmp_path, folder, "sample", "--out", str(tmp_path / "direct.png"))
    assert direct.returncode == 0, direct.stderr[-2000:]
    routed = image_command(
        tmp_path, folder, "sample", "--out", str(tmp_path / "routed.png"), "--via-steps"
    )
    assert routed.returncode == 0, routed.stderr[-2000:]
    steps = BUILDERS[folder.name.removesuffix("-tiny")][2]
    assert f"{steps} steps" in routed.stdout and "via the step routes" in routed.stdout
    with Image.open(tmp_path / "direct.png") as image:
        assert image.size == (64, 48) and image.mode == "RGB"
    assert (tmp_path / "direct.png").read_bytes() == (tmp_path / "routed.png").read_bytes()


def test_guided_bench_via_steps_is_equal_to_direct(tmp_path, folder):
    out = tmp_path / "bench.json"
    extra = ["--cfg", "2.5", "--negative", "blurry", "--steps", "3", "--runs", "1"]
    bench = image_command(
        tmp_path, folder, "bench", *extra, "--warmup", "0", "--via-steps", "--json-out", str(out)
    )
    assert bench.returncode == 0, bench.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["transport"]["mode"] == "steps"
    assert record["transport"]["equal_to_direct"] is True
    assert record["model"]["family"] == folder.name.removesuffix("-tiny")
