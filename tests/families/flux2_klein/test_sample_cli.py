"""`gmlx image sample` and `gmlx image bench` on tiny FLUX.2 klein folders, as a user runs
them: the step routes (--via-steps) give the in-process image bit for bit, references
included."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from tests.families.flux2_klein.tiny.folder import build_tiny_folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux2_cli")
    build_tiny_folder(root / "klein-tiny", family="flux2_klein", distilled=True)
    build_tiny_folder(root / "klein-base-tiny", family="flux2_klein", distilled=False)
    refs = []
    rng = np.random.default_rng(3)
    for i, (h, w) in enumerate([(64, 64), (96, 64)]):
        path = root / f"ref{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        refs.append(str(path))
    return root, refs


def image_command(tmp_path, folder, command: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    line = [sys.executable, "-m", "gmlx_server", "image", command, "--model", str(folder)]
    line += ["--prompt", "a red fox", "--width", "64", "--height", "48", "--seed", "5"]
    return subprocess.run(line + list(extra), capture_output=True, text=True, env=env)


def test_sample_with_references_via_the_step_routes_writes_the_direct_png(tmp_path, folders):
    root, refs = folders
    folder = root / "klein-tiny"
    ref_args = [arg for path in refs for arg in ("--ref", path)]
    direct = image_command(
        tmp_path, folder, "sample", *ref_args, "--out", str(tmp_path / "direct.png")
    )
    assert direct.returncode == 0, direct.stderr[-2000:]
    routed = image_command(
        tmp_path, folder, "sample", *ref_args, "--out", str(tmp_path / "routed.png"), "--via-steps"
    )
    assert routed.returncode == 0, routed.stderr[-2000:]
    assert "4 steps" in routed.stdout and "via the step routes" in routed.stdout
    with Image.open(tmp_path / "direct.png") as image:
        assert image.size == (64, 48) and image.mode == "RGB"
    assert (tmp_path / "direct.png").read_bytes() == (tmp_path / "routed.png").read_bytes()
    plain = image_command(tmp_path, folder, "sample", "--out", str(tmp_path / "plain.png"))
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert (tmp_path / "plain.png").read_bytes() != (tmp_path / "direct.png").read_bytes()


def test_guided_base_bench_via_steps_is_equal_to_direct(tmp_path, folders):
    root, _ = folders
    out = tmp_path / "bench.json"
    extra = ["--steps", "3", "--runs", "1", "--warmup", "0", "--via-steps", "--json-out", str(out)]
    bench = image_command(tmp_path, root / "klein-base-tiny", "bench", *extra)
    assert bench.returncode == 0, bench.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["transport"]["mode"] == "steps"
    assert record["transport"]["equal_to_direct"] is True
    assert record["model"]["family"] == "flux2_klein"
