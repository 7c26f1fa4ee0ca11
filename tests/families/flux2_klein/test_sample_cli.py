"""`gmlx image sample` and `gmlx image bench` on tiny FLUX.2 klein folders, as a user runs
them: the step routes (--via-steps) give the in-process image bit for bit, references
included."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from tests.families.flux2_klein.tiny.folder import build_tiny_folder
from tests.sampling.image_cli import assert_routed_png_is_direct, image_command, routed_bench_record


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


def test_sample_with_references_via_the_step_routes_writes_the_direct_png(tmp_path, folders):
    root, refs = folders
    folder = root / "klein-tiny"
    ref_args = [arg for path in refs for arg in ("--ref", path)]
    direct = assert_routed_png_is_direct(tmp_path, folder, 4, *ref_args)
    plain = image_command(tmp_path, folder, "sample", "--out", str(tmp_path / "plain.png"))
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert (tmp_path / "plain.png").read_bytes() != direct.read_bytes()


# A guided bench through the routes is every family's (tests/sampling/test_family_cli.py);
# klein's base variant repeats it with -m heavy.
@pytest.mark.heavy
def test_guided_base_bench_via_steps_is_equal_to_direct(tmp_path, folders):
    root, _ = folders
    record = routed_bench_record(tmp_path, root / "klein-base-tiny", "--steps", "3")
    assert record["model"]["family"] == "flux2_klein"
