"""`gmlx image sample` as a user runs it: in process, and through the step routes (--via-steps)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from PIL import Image

from tests.catalog import EMBEDDED_MODELS


def sample(tmp_path, name: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "gmlx_server", "image", "sample", "--prompt", "a red fox"]
    command += ["--width", "128", "--height", "96", "--seed", "5", "--out", str(tmp_path / name)]
    return subprocess.run(command + list(extra), capture_output=True, text=True, env=env)


def test_sample_writes_the_same_png_in_process_and_via_the_step_routes(tmp_path):
    """The routed run's configuration switches the step routes off for `gmlx serve`; the
    command's own loopback server serves them all the same."""
    direct = sample(tmp_path, "direct.png")
    assert direct.returncode == 0, direct.stderr[-2000:]
    config = tmp_path / "no-steps.toml"
    config.write_text("[server.image]\nsteps_api = false\n")
    routed = sample(tmp_path, "routed.png", "--via-steps", "--config", str(config))
    assert routed.returncode == 0, routed.stderr[-2000:]
    assert "via the step routes" in routed.stdout
    with Image.open(tmp_path / "direct.png") as image:
        assert image.size == (128, 96) and image.mode in ("RGB", "RGBA")
    assert (tmp_path / "direct.png").read_bytes() == (tmp_path / "routed.png").read_bytes()


def test_sample_refuses_a_missing_reference_file(tmp_path):
    missing = tmp_path / "nowhere.png"
    result = sample(tmp_path, "x.png", "--ref", str(missing))
    assert result.returncode == 2
    assert f"gmlx image sample: --ref {missing}: cannot be read: " in result.stderr, result.stderr


def test_bench_names_the_reference_file_it_cannot_decode(tmp_path):
    garbage = tmp_path / "notes.png"
    garbage.write_text("not an image")
    command = [sys.executable, "-m", "gmlx_server", "image", "bench", "--ref", str(garbage)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"gmlx image bench: --ref {garbage}: an image could not be decoded" in result.stderr
    assert "Traceback" not in result.stderr


def test_sample_names_the_flag_a_refused_setting_came_from(tmp_path):
    """The embedded default samples its fixed 8 steps: --steps 4 is refused by its flag's name;
    so is a side that is no multiple of the latent stride."""
    steps = sample(tmp_path, "x.png", "--steps", "4")
    assert steps.returncode == 1
    assert "leave --steps out or set it to 8" in steps.stderr, steps.stderr[-2000:]
    width = sample(tmp_path, "x.png", "--width", "100")
    assert width.returncode == 1
    assert "--width must be a positive multiple of 16, not 100" in width.stderr, width.stderr
    assert not (tmp_path / "x.png").exists()


def test_a_model_that_is_not_there_is_explained(tmp_path):
    """--model naming a folder that is no model folder, or an id nobody has, says what is
    missing rather than only that the model is unknown."""
    from gmlx_server.model_choice import choose_model

    from . import toy_family

    models = tmp_path / "models"
    toy_family.make_folder(models, "toy-a")
    config = tmp_path / "config.toml"
    config.write_text(f'[server]\nmodel_dirs = ["{models}"]\n')
    plain = tmp_path / "downloads"
    plain.mkdir()
    (plain / "checkpoint.safetensors").write_bytes(b"")
    cases = {
        str(plain): "exists but is not a diffusers model folder: it has no model_index.json",
        str(models): "holds model folders (toy-a), not a model",
        str(plain / "checkpoint.safetensors"): "is a file, not a model folder",
        # with no default_model configured, the embedded models are known too
        "no-such-id": "no model of that id (model ids known here: "
        + ", ".join(sorted([*EMBEDDED_MODELS, "toy-a"]))
        + ")",
    }
    (models / "toy-a" / "transformer").mkdir()
    cases[str(models / "toy-a" / "transformer")] = "part of the model folder"
    cases["toy-b"] = "(model ids known here: " + ", ".join(sorted([*EMBEDDED_MODELS, "toy-a"]))
    cases["toy-b"] += "); did you mean 'toy-a'?"
    for model, words in cases.items():
        with pytest.raises(ValueError) as refused:
            choose_model(model, config)
        assert words in str(refused.value), (model, str(refused.value))
    assert choose_model("toy-a", config).model_id == "toy-a"
    # with a default_model configured, --model may still name an embedded model
    config.write_text(f'[server]\nmodel_dirs = ["{models}"]\ndefault_model = "toy-a"\n')
    assert choose_model("z-image-random-tiny", config).model_id == "z-image-random-tiny"


@pytest.mark.parametrize(
    ("size", "message"),
    [
        (["--width", "500"], "--width must be a positive multiple of 16, not 500"),
        (["--width", "8192", "--height", "512"], "--width 8192 is over the limit of 4096"),
        (["--width", "16", "--height", "4112"], "--height 4112 is over the limit of 4096"),
        (["--width", "4096", "--height", "4096"], "over the limit of 4194304 pixels"),
        (["--steps", "3"], "leave --steps out or set it to 8"),
        # the routes' bounds: a NaN guidance painted a black image, --steps 0 meant the default
        (["--cfg", "nan"], "--cfg must be a number from 0 to 100"),
        (["--cfg", "-5"], "--cfg must be a number from 0 to 100"),
        (["--steps", "0"], "--steps must be from 1 to 1000, or left out"),
        (["--seed", "-1"], "--seed must be an integer from 0 to 9223372036854775807"),
        (["--seed", str(2**64)], "--seed must be an integer from 0 to"),
    ],
)
@pytest.mark.parametrize("command", ["sample", "bench"])
def test_settings_are_refused_before_the_model_loads(monkeypatch, capsys, command, size, message):
    """The step routes' limits (413 over HTTP) and the model's own, read from its files."""
    from gmlx_server import image_cli
    from gmlx_server.engine.registry import ModelRegistry

    def no_load(self, model_id):
        raise AssertionError(f"{model_id} was loaded before its settings were checked")

    monkeypatch.setattr(ModelRegistry, "acquire", no_load)
    argv = ["--prompt", "a red fox", *size]
    argv += ["--out", "unwritten.png"] if command == "sample" else ["--runs", "1"]
    main = image_cli.sample_main if command == "sample" else image_cli.bench_main
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "was loaded" not in err


def write_init_and_mask(tmp_path) -> tuple[str, str]:
    import numpy as np

    rows, cols = np.mgrid[0:96, 0:128]
    picture = np.stack([rows * 2, cols * 2, 255 - rows * 2], axis=-1).astype(np.uint8)
    Image.fromarray(picture).save(tmp_path / "init.png")
    mask = np.zeros((96, 128, 4), np.uint8)
    mask[..., 3] = 255
    mask[32:64, 32:96, 3] = 0  # transparent where to paint, as OpenAI's edit masks
    Image.fromarray(mask, "RGBA").save(tmp_path / "mask.png")
    return str(tmp_path / "init.png"), str(tmp_path / "mask.png")


def test_inpainting_with_a_preview_is_the_same_in_process_and_via_the_step_routes(tmp_path):
    """--init-image, --strength, --mask and --mask-blur reach the sampler on both paths; the
    preview file is a whole PNG of the image's size."""

    init, mask = write_init_and_mask(tmp_path)
    flags = ["--init-image", init, "--strength", "0.75", "--mask", mask, "--mask-blur", "2"]
    direct = sample(tmp_path, "direct.png", *flags, "--preview", str(tmp_path / "preview.png"))
    assert direct.returncode == 0, direct.stderr[-2000:]
    routed = sample(tmp_path, "routed.png", *flags, "--via-steps")
    assert routed.returncode == 0, routed.stderr[-2000:]
    assert (tmp_path / "direct.png").read_bytes() == (tmp_path / "routed.png").read_bytes()
    with Image.open(tmp_path / "preview.png") as preview:
        assert preview.size == (128, 96)
    assert not list(tmp_path.glob(".*partial"))
    plain = sample(tmp_path, "plain.png")
    assert plain.returncode == 0, plain.stderr[-2000:]
    # the tiny VAE's random weights reconstruct no picture, so the kept region's latents are
    # checked in the parity tests (tests/families/z_image/test_img2img_parity.py), not here
    assert (tmp_path / "plain.png").read_bytes() != (tmp_path / "direct.png").read_bytes()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--strength", "0.5"], "--strength needs an init image to start from"),
        (["--strength", "0"], "--strength must be a number above 0 and at most 1"),
        (["--mask", "MASK"], "a --mask needs an init image to paint into"),
        (["--init-image", "INIT", "--mask-blur", "-1"], "--mask-blur must be from 0 to 256"),
        (["--init-image", "nowhere.png"], "--init-image nowhere.png: cannot be read"),
        # a mask made for another picture is refused, as the OpenAI edits refuse it
        (["--init-image", "INIT", "--mask", "SMALL"], "the --mask is 64x48 but the init image"),
    ],
)
def test_image_to_image_settings_are_refused_by_their_flags(tmp_path, flags, message):
    init, mask = write_init_and_mask(tmp_path)
    with Image.open(mask) as whole:
        whole.resize((64, 48)).save(tmp_path / "small.png")
    named = {"INIT": init, "MASK": mask, "SMALL": str(tmp_path / "small.png")}
    flags = [named.get(f, f) for f in flags]
    result = sample(tmp_path, "x.png", *flags)
    assert result.returncode == 2  # the arguments' fault, whatever the model
    assert message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "x.png").exists()


def test_pictures_are_written_in_the_format_their_suffix_names(tmp_path, capsys):
    """--out photo.jpg is a JPEG file, not PNG bytes under that name; a suffix no format has is
    refused before any work; a preview's partial file keeps its target's format."""
    import numpy as np
    from gmlx_server import image_cli

    pixels = np.linspace(0, 1, 16 * 24 * 3, dtype=np.float32).reshape(16, 24, 3)
    for name, kind in (("a.jpg", "JPEG"), ("b.JPEG", "JPEG"), ("c.webp", "WEBP"), ("d", "PNG")):
        image_cli.write_picture(pixels, tmp_path / name)
        with Image.open(tmp_path / name) as written:
            assert (written.format, written.size) == (kind, (24, 16)), name
    image_cli.write_picture(pixels, tmp_path / ".e.webp.partial", "webp")
    with Image.open(tmp_path / ".e.webp.partial") as written:
        assert written.format == "WEBP"
    for flag in ("--out", "--preview"):
        argv = ["--prompt", "x", "--out", str(tmp_path / "ok.png"), flag, str(tmp_path / "x.bmp")]
        assert image_cli.sample_main(argv) == 2
        assert (
            f"{flag} {tmp_path / 'x.bmp'}: name a .png, .jpg or .webp file"
            in capsys.readouterr().err
        )


@pytest.mark.parametrize(
    ("model", "size", "message"),
    [
        ("z-image-random-tiny", (64, 64), "the model takes no reference images"),
        ("flux2-klein-random-tiny", (40, 100), "ref.png: reference image 1 is 100x40: the model"),
    ],
)
def test_references_are_refused_before_the_model_loads(
    monkeypatch, capsys, tmp_path, model, size, message
):
    import numpy as np
    from gmlx_server import image_cli
    from gmlx_server.engine.registry import ModelRegistry

    def no_load(self, model_id):
        raise AssertionError(f"{model_id} was loaded before its references were checked")

    monkeypatch.setattr(ModelRegistry, "acquire", no_load)
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(tmp_path / "fine.png")
    Image.fromarray(np.zeros((*size, 3), np.uint8)).save(tmp_path / "ref.png")
    argv = ["--model", model, "--prompt", "x", "--ref", str(tmp_path / "fine.png")]
    argv += ["--ref", str(tmp_path / "ref.png"), "--out", str(tmp_path / "out.png")]
    assert image_cli.sample_main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "was loaded" not in err


def test_a_dit_file_alone_that_the_default_model_refuses_says_what_the_flag_did(tmp_path, capsys):
    import numpy as np
    from gmlx_server import image_cli
    from safetensors.numpy import save_file

    save_file({"w": np.zeros((2, 2), np.float32)}, str(tmp_path / "dit.safetensors"))
    argv = ["--prompt", "x", "--dit", str(tmp_path / "dit.safetensors")]
    assert image_cli.sample_main([*argv, "--out", str(tmp_path / "out.png")]) == 1
    err = capsys.readouterr().err
    assert err.strip().endswith(
        "(--dit and --text-encoder without --vae replace the default model's own files; a model"
        " from component files takes --dit, --text-encoder and --vae)"
    ), err
