"""The DiT with the CPU rewrites (blocked exp2 attention, exp2 SiLU) against the same DiT on
MLX's own ops, and its fallback when mx.compile cannot build kernels on the CPU backend."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.families.qwen_image21.dit import PrefixLayout, QwenImage21DiT
from gmlx_server.engine.nn import cpu_ops

from tests.families.qwen_image21.tiny.transformer import build_transformer

ROOT = Path(__file__).resolve().parents[2]
H, W = 6, 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("dit_cpu_ops")
    build_transformer(
        path,
        seed=3,
        num_attention_heads=3,
        attention_head_dim=8,
        axes_dims_rope=(2, 2, 4),
        in_channels=8,
        out_channels=8,
    )
    return path


def forward(dit: QwenImage21DiT) -> np.ndarray:
    rng = np.random.default_rng(4)
    text = mx.array(rng.standard_normal((7, dit.config.context_in_dim)).astype(np.float32))
    ref = mx.array(rng.standard_normal((4 * 4, dit.config.in_channels)).astype(np.float32))
    layout = PrefixLayout(7, ((4, 4),), (3,))
    state = dit.prefix_state(layout, text, [ref])
    x = mx.array(rng.standard_normal((1, H * W, dit.config.in_channels)).astype(np.float32))
    return np.array(dit.target_forward(x, mx.array([0.6]), [state], H, W))


def test_cpu_paths_match_mlx_ops_across_score_blocks(folder, monkeypatch):
    monkeypatch.setattr(cpu_ops, "SCORE_BLOCK_BYTES", 4 * 40 * 8)  # forces several row blocks
    dit = QwenImage21DiT.load(folder)
    assert dit.cpu_ops, "the test suite runs on the CPU backend in float32"
    rewritten = forward(dit)
    # A fresh model: a compiled target pass keeps the ops it was traced with.
    monkeypatch.setattr(cpu_ops, "use_cpu_ops", lambda dtype: False)
    plain_dit = QwenImage21DiT.load(folder)
    assert not plain_dit.cpu_ops
    plain = forward(plain_dit)
    assert np.linalg.norm(rewritten - plain) / np.linalg.norm(plain) < 1e-5


# Runs in a fresh process: MLX decides once per process whether g++ works.
FALLBACK_SCRIPT = textwrap.dedent(
    """
    import logging, sys
    import numpy as np
    logging.basicConfig(level=logging.INFO, format="LOG %(levelname)s %(message)s")
    sys.path.insert(0, {root!r})
    from gmlx_server.engine.families.qwen_image21.dit import QwenImage21DiT
    from tests.nn.test_dit_cpu_paths import forward
    dit = QwenImage21DiT.load({folder!r})
    first = forward(dit)
    second = forward(dit)
    np.save({out!r}, np.stack([first, second]))
    print("compiled", dit.compiled)
    """
)


def run_forward(folder, tmp_path, env_changes) -> tuple[str, np.ndarray]:
    out = tmp_path / "out.npy"
    script = FALLBACK_SCRIPT.format(root=str(ROOT), folder=str(folder), out=str(out))
    env = {**os.environ, "GMLX_DIT_COMPILE": "1", **env_changes}  # compiled, unless changed
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr, np.load(out)


@pytest.fixture(scope="module")
def eager_output(folder, tmp_path_factory):
    _, outputs = run_forward(folder, tmp_path_factory.mktemp("eager"), {"GMLX_DIT_COMPILE": "0"})
    return outputs[0]


def broken_compiler(tmp_path) -> Path:
    """A g++ that answers --version (so MLX tries to use it) and fails every build."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gxx = bin_dir / "g++"
    gxx.write_text('#!/bin/sh\n[ "$1" = --version ] && exit 0\necho "broken" >&2\nexit 1\n')
    gxx.chmod(0o755)
    return bin_dir


def test_no_compiler_on_path_runs_eagerly(folder, tmp_path, eager_output):
    log, outputs = run_forward(folder, tmp_path, {"PATH": str(Path(sys.executable).parent)})
    assert "no g++ on PATH" in log
    np.testing.assert_array_equal(outputs[0], eager_output)


def test_failing_compiler_falls_back_once(folder, tmp_path, eager_output):
    kernels = tmp_path / "tmp"  # empty: no kernel built by an earlier run can be reused
    kernels.mkdir()
    path = f"{broken_compiler(tmp_path)}:{os.environ['PATH']}"
    log, outputs = run_forward(folder, tmp_path, {"PATH": path, "TMPDIR": str(kernels)})
    assert log.count("mx.compile failed") == 1
    assert "compiled False" in log
    np.testing.assert_array_equal(outputs[0], eager_output)
    np.testing.assert_array_equal(outputs[1], eager_output)


def test_missing_temporary_directory_falls_back(folder, tmp_path, eager_output):
    log, outputs = run_forward(folder, tmp_path, {"TMPDIR": str(tmp_path / "missing")})
    assert log.count("mx.compile failed") == 1
    np.testing.assert_array_equal(outputs[0], eager_output)


def test_a_narrow_dit_runs_eagerly_on_the_cpu_backend_unless_told(monkeypatch):
    """Where compiling pays (nn/compiled.py): on the CPU backend from 1024 wide; the setting
    overrides it either way."""
    import mlx.core as mx
    from gmlx_server.engine.nn import compiled

    assert mx.default_device().type == mx.DeviceType.cpu
    monkeypatch.delenv(compiled.SETTING, raising=False)
    assert not compiled.compile_enabled(256) and compiled.compile_enabled(3072)
    assert not compiled.CompiledPass(lambda x: x, 256).enabled
    monkeypatch.setenv(compiled.SETTING, "1")
    assert compiled.compile_enabled(256) and compiled.CompiledPass(lambda x: x, 256).enabled
    monkeypatch.setenv(compiled.SETTING, "0")
    assert not compiled.compile_enabled(3072)
