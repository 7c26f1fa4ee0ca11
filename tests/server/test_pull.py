"""`gmlx pull` against a loopback hub (tests/server/loopback_hub.py, `HF_ENDPOINT`) serving a
tiny Z-Image folder: the files land in the first model_dirs folder byte for byte and serve;
a download cut halfway resumes with a range request; a file whose bytes do not match the
Hub's hash is refused and removed; `--quantize 4` writes what `gmlx model quantize` writes,
shard by shard, its disk and memory peaking within 1.15x of the quantized folder; a published
name resolves through the families' catalog; `--gguf TYPE` picks the files of a type."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.families.z_image import embedded
from safetensors.numpy import save_file

from tests.server.conftest import listed_models
from tests.server.loopback_hub import LoopbackHub

SHARDS = 16
REPO = "tiny-org/Z-Image-Tiny"
BIG_FILE = "big.safetensors"


def shard_transformer(folder: Path, shards: int) -> None:
    """The transformer's one file as `shards` shards with an index, as large folders hold it."""
    source = folder / "diffusion_pytorch_model.safetensors"
    tensors = {n: np.array(v) for n, v in mx.load(str(source)).items()}
    source.unlink()
    names = sorted(tensors, key=lambda n: -tensors[n].nbytes)
    groups = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for index, group in enumerate(groups, start=1):
        file = f"diffusion_pytorch_model-{index:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(folder / file))
        weight_map.update(dict.fromkeys(group, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub") / "Z-Image-Tiny"
    embedded.write_embedded_model(root)
    shard_transformer(root / "transformer", SHARDS)
    (root / "README.md").write_text("a tiny random Z-Image\n")
    return root


@pytest.fixture
def hub(repo, tmp_path):
    ggufs = tmp_path / "ggufs"
    ggufs.mkdir()
    for kind in ("Q4_K_M", "Q8_0"):
        (ggufs / f"z-image-tiny-{kind}.gguf").write_bytes(b"GGUF" + kind.encode() * 8)
    big = tmp_path / "big"
    big.mkdir()
    # past huggingface_hub's 10 MB download chunk, the unit a cut download resumes in
    save_file({"w": np.arange(6 << 20, dtype=np.float32)}, str(big / BIG_FILE))
    served = LoopbackHub(
        {REPO: repo, "Tongyi-MAI/Z-Image-Turbo": repo, "tiny-org/gguf": ggufs, "tiny-org/big": big}
    )
    yield served
    served.close()


def run_pull(hub, tmp_path, *args, driver: str | None = None) -> subprocess.CompletedProcess:
    models = tmp_path / "models"
    models.mkdir(exist_ok=True)
    config = tmp_path / "config.toml"
    config.write_text(f'[server]\nmodel_dirs = ["{models}"]\n')
    env = {
        **os.environ,
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }
    env.pop("HF_HUB_OFFLINE", None)
    line = [sys.executable, "-m", "gmlx_server", "pull", *args, "--config", str(config)]
    if driver is not None:
        line = [sys.executable, "-c", driver, *line[3:]]
    return subprocess.run(line, capture_output=True, text=True, env=env, timeout=300)


def tree(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and ".cache" not in p.parts
    }


def test_a_pull_lands_the_repository_in_the_model_dirs_and_serves(hub, repo, tmp_path):
    done = run_pull(hub, tmp_path, REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    target = tmp_path / "models" / "Z-Image-Tiny"
    assert tree(target) == tree(repo)
    assert "model Z-Image-Tiny:" in done.stdout and "disk: about" in done.stdout
    assert "Z-Image-Tiny" in listed_models(tmp_path / "config.toml")


def test_a_cut_download_resumes_where_it_stopped(hub, tmp_path):
    hub.cut.add(BIG_FILE)
    done = run_pull(hub, tmp_path, "tiny-org/big")
    assert done.returncode == 0, done.stderr[-3000:]
    ranges = [r for method, path, r in hub.requests if method == "GET" and path.endswith(BIG_FILE)]
    assert len(ranges) == 2 and ranges[0] is None and ranges[1].startswith("bytes=")
    assert int(ranges[1].removeprefix("bytes=").rstrip("-")) > 0
    pulled = tmp_path / "models" / "big" / BIG_FILE
    assert pulled.read_bytes() == (hub.repos["tiny-org/big"] / BIG_FILE).read_bytes()


def test_a_file_that_does_not_match_its_hash_is_refused_and_removed(hub, tmp_path):
    hub.corrupt.add("vae/diffusion_pytorch_model.safetensors")
    done = run_pull(hub, tmp_path, REPO)
    assert done.returncode == 1
    assert "vae/diffusion_pytorch_model.safetensors is refused: its hash" in done.stderr
    assert not (
        tmp_path / "models" / "Z-Image-Tiny" / "vae" / "diffusion_pytorch_model.safetensors"
    ).exists()


# Runs `gmlx pull` with the disk and MLX memory measured after every file fetched (the peak of
# a quantized pull is just after a float shard arrives, before it is quantized and removed).
PEAK_DRIVER = """
import json, sys
from pathlib import Path
import mlx.core as mx
from gmlx_server import pull
from gmlx_server.cli import main
peaks = {"disk": 0}
fetch = pull.fetch
def measured(plan, file, folder):
    path = fetch(plan, file, folder)
    used = sum(p.stat().st_size for p in plan.target.rglob("*") if p.is_file() and ".cache" not in p.parts)
    peaks["disk"] = max(peaks["disk"], used)
    return path
pull.fetch = measured
mx.reset_peak_memory()
try:
    code = main(sys.argv[1:])
finally:
    peaks["memory"] = mx.get_peak_memory()
    print("PEAKS " + json.dumps(peaks))
sys.exit(code)
"""


def test_a_quantized_pull_writes_what_model_quantize_writes_shard_by_shard(hub, repo, tmp_path):
    done = run_pull(hub, tmp_path, REPO, "--quantize", "4", driver=PEAK_DRIVER)
    assert done.returncode == 0, done.stderr[-3000:]
    target = tmp_path / "models" / "Z-Image-Tiny-4bit"
    expected = tmp_path / "expected"
    quantized = subprocess.run(
        [
            sys.executable,
            "-m",
            "gmlx_server",
            "model",
            "quantize",
            str(repo),
            str(expected),
            "--bits",
            "4",
        ],
        capture_output=True,
        text=True,
    )
    assert quantized.returncode == 0, quantized.stderr[-3000:]
    got, want = tree(target), tree(expected)
    assert set(got) == set(want)
    for name in want:
        if name.endswith(".safetensors"):
            a, b = mx.load(str(target / name)), mx.load(str(expected / name))
            assert set(a) == set(b), name
            for key in a:
                assert mx.array_equal(a[key], b[key]).item(), (name, key)
        elif name.endswith(".json"):
            assert json.loads(got[name]) == json.loads(want[name]), name
    assert not (target / ".pull-float").exists()
    peaks = json.loads(done.stdout.split("PEAKS ", 1)[1])
    size = sum(len(v) for v in got.values())
    print(
        f"quantized pull: disk peak {peaks['disk'] / size:.3f}x, MLX memory peak"
        f" {peaks['memory'] / size:.3f}x of the {size} B quantized folder"
    )
    assert peaks["disk"] <= 1.15 * size, (peaks, size)
    assert peaks["memory"] <= 1.15 * size, (peaks, size)


def test_published_names_and_gguf_types(hub, tmp_path):
    listed = run_pull(hub, tmp_path, "--list")
    assert "z-image-turbo: Tongyi-MAI/Z-Image-Turbo (Z-Image" in listed.stdout
    done = run_pull(hub, tmp_path, "z-image-turbo", "--include", "scheduler/*")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "models" / "z-image-turbo" / "scheduler" / "scheduler_config.json").is_file()
    done = run_pull(hub, tmp_path, "tiny-org/gguf", "--gguf", "Q8_0")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "models" / "gguf").glob("*.gguf")) == [
        "z-image-tiny-Q8_0.gguf"
    ]
    refused = run_pull(hub, tmp_path, "tiny-org/gguf", "--gguf", "Q2_K")
    assert refused.returncode == 1 and "no .gguf file of type Q2_K" in refused.stderr
    unknown = run_pull(hub, tmp_path, "nothing-like-this")
    assert unknown.returncode == 1 and "published model name" in unknown.stderr


def test_no_model_dirs_and_no_hub_are_said_plainly(tmp_path):
    """Before any download: where the files would go, then whether the Hub answers."""
    config = tmp_path / "none.toml"
    config.write_text("")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9"}
    line = [sys.executable, "-m", "gmlx_server", "pull", REPO, "--config", str(config)]
    done = subprocess.run(line, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1 and "no model_dirs folder to pull into" in done.stderr
    assert "Traceback" not in done.stderr
    to = [*line, "--to", str(tmp_path / "x")]
    done = subprocess.run(to, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "cannot reach the Hub at http://127.0.0.1:9" in done.stderr
    assert "HF_ENDPOINT" in done.stderr


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--quantize", "7"], "invalid choice: 7"),
        (["--quantize", "4", "--gguf", "Q8_0"], "--quantize and --gguf exclude each other"),
        (["--group-size", "64"], "--group-size needs --quantize"),
        (["--to", "FILE/model"], "--to FILE/model: FILE is a file, not a folder"),
    ],
)
def test_arguments_that_cannot_go_together_exit_2_before_any_download(
    tmp_path, capsys, flags, said
):
    from gmlx_server import cli

    config = tmp_path / "c.toml"
    config.write_text("")
    flags = [flag.replace("FILE", str(config)) for flag in ["--to", str(tmp_path), *flags]]
    said = said.replace("FILE", str(config))
    try:
        code = cli.main(["pull", REPO, *flags, "--config", str(config)])
    except SystemExit as exited:  # argparse's refusal
        code = exited.code
    assert code == 2 and said in capsys.readouterr().err


def test_a_hub_that_takes_the_connection_and_never_answers_is_said_plainly(monkeypatch):
    """A login page or a dropping firewall: the listing gives up after HUB_TIMEOUT_S."""
    import socket
    import time

    import huggingface_hub.constants
    from gmlx_server import pull

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", url)
        monkeypatch.setattr(pull, "HUB_TIMEOUT_S", 0.25)
        started = time.monotonic()
        with pytest.raises(pull.PullError, match=f"cannot reach the Hub at {url}"):
            pull.repo_files(REPO, None)
        assert time.monotonic() - started < 20


def test_the_pull_a_set_without_tokenizer_is_told_fetches_it_where_the_set_finds_it(hub, tmp_path):
    """A text encoder file with no tokenizer beside it (and no ComfyUI checkout): the refusal's
    `gmlx pull` command, run as it is written, puts the tokenizer where the set reads it."""
    import re
    import shlex
    import shutil

    from gmlx_server.engine.components import ComponentError, ComponentFiles, set_folder
    from gmlx_server.engine.spec import family_specs

    from tests.families.z_image.tiny.comfy import SET, write_comfy_models

    _, models = write_comfy_models(tmp_path / "comfy")
    loose = tmp_path / "loose"
    for part in ("dit", "text_encoder", "vae"):
        (loose / part).mkdir(parents=True)
        shutil.copy(SET.path(models, part), loose / part)
    files = ComponentFiles(
        *(next((loose / part).iterdir()) for part in ("dit", "text_encoder", "vae"))
    )
    with pytest.raises(ComponentError) as refused:
        set_folder(files, family_specs(), tmp_path / "sets")
    command = re.search(r"`gmlx pull (.*?)`", str(refused.value)).group(1)
    done = run_pull(hub, tmp_path, *shlex.split(command))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (loose / "text_encoder" / "tokenizer" / "tokenizer.json").is_file()
    assert (set_folder(files, family_specs(), tmp_path / "sets") / "tokenizer").is_dir()
