"""`gmlx image sample` and `gmlx image bench` on a model folder as a user runs them, and the two
checks every family's run makes: the step routes (--via-steps) give the in-process image bit for
bit, and a bench through them records it equal to direct."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from PIL import Image


def image_command(tmp_path, folder, command: str, *extra: str) -> subprocess.CompletedProcess:
    """`gmlx image COMMAND --model FOLDER` of a 64x48 red fox at seed 5 (`extra`: more flags),
    its cache under tmp_path."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    line = [sys.executable, "-m", "gmlx_server", "image", command, "--model", str(folder)]
    line += ["--prompt", "a red fox", "--width", "64", "--height", "48", "--seed", "5"]
    return subprocess.run(line + list(extra), capture_output=True, text=True, env=env)


def assert_routed_png_is_direct(tmp_path, folder, steps: int, *extra: str) -> Path:
    """`gmlx image sample` in process and via the step routes (`extra`: more flags of both):
    the routed run says it took `steps` steps through the routes, and both write the same
    64x48 RGB PNG; returns the direct one's path."""
    direct, routed = tmp_path / "direct.png", tmp_path / "routed.png"
    done = image_command(tmp_path, folder, "sample", *extra, "--out", str(direct))
    assert done.returncode == 0, done.stderr[-2000:]
    done = image_command(tmp_path, folder, "sample", *extra, "--out", str(routed), "--via-steps")
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{steps} steps" in done.stdout and "via the step routes" in done.stdout
    with Image.open(direct) as image:
        assert image.size == (64, 48) and image.mode == "RGB"
    assert direct.read_bytes() == routed.read_bytes()
    return direct


def routed_bench_record(tmp_path, folder, *extra: str) -> dict:
    """`gmlx image bench --via-steps` of one run after no warm-up (`extra`: more flags): its
    JSON record, which says the routes ran and gave the direct image."""
    out = tmp_path / "bench.json"
    flags = ["--runs", "1", "--warmup", "0", "--via-steps", "--json-out", str(out)]
    bench = image_command(tmp_path, folder, "bench", *extra, *flags)
    assert bench.returncode == 0, bench.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["transport"]["mode"] == "steps"
    assert record["transport"]["equal_to_direct"] is True
    return record
