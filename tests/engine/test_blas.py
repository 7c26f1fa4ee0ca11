"""The optimised BLAS under MLX: chosen before mlx loads, same results as the reference BLAS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gmlx_server.engine import blas

from tests.compare import rel_l2

# Runs in a fresh interpreter, because the choice only works before mlx is imported.
_CHILD = textwrap.dedent(
    """
    import json, sys
    from gmlx_server.engine.blas import ensure_fast_blas, _provider_path
    choice = ensure_fast_blas()
    import mlx.core as mx
    import numpy as np
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 96, 200), dtype=np.float32)
    b = rng.standard_normal((3, 120, 200), dtype=np.float32)
    c = rng.standard_normal((200, 64), dtype=np.float32)
    batched = mx.matmul(mx.array(a), mx.array(b).transpose(0, 2, 1))  # a transposed operand
    plain = mx.array(a[0]) @ mx.array(c)
    np.savez(sys.argv[1], batched=np.array(batched), plain=np.array(plain))
    print(json.dumps({"action": choice.action, "provider": _provider_path("cblas_sgemm")}))
    """
)


def _run_child(tmp_path, setting: str) -> tuple[dict, dict]:
    out = tmp_path / f"result-{setting.replace('/', '_')}.npz"
    env = {**os.environ, blas.ENV_VAR: setting}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    with np.load(out) as arrays:
        return report, {name: arrays[name] for name in arrays.files}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="only Linux swaps the BLAS")
def test_optimised_blas_matches_reference_blas(tmp_path):
    fast_report, fast = _run_child(tmp_path, "auto")
    if fast_report["action"] == "none-found":
        pytest.skip("no optimised BLAS installed (pip install mkl, or the system's libopenblas0)")
    reference_report, reference = _run_child(tmp_path, "off")

    assert fast_report["action"] == "loaded"
    assert reference_report["action"] == "off"
    # The global scope, which libmlx.so searches first, serves cblas_sgemm from the chosen library;
    # left alone, only MLX's private reference BLAS (loaded locally, not global) has it.
    assert fast_report["provider"] and "mlx_cpu.libs" not in fast_report["provider"]
    assert reference_report["provider"] is None
    for name in ("batched", "plain"):
        assert fast[name].shape == reference[name].shape
        assert rel_l2(fast[name], reference[name]) <= 1e-5


def test_off_switch_leaves_mlx_alone(monkeypatch):
    monkeypatch.setenv(blas.ENV_VAR, "off")
    assert blas._choose() == blas.BlasChoice("off")


def test_macos_is_left_alone(monkeypatch):
    monkeypatch.delenv(blas.ENV_VAR, raising=False)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert blas._choose().action == "not-linux"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="only Linux swaps the BLAS")
def test_too_late_once_mlx_is_imported(monkeypatch):
    import mlx.core  # noqa: F401  (the point: mlx is already loaded)

    monkeypatch.delenv(blas.ENV_VAR, raising=False)
    choice = blas._choose()
    assert choice.action == "too-late"
    assert "reference BLAS" in choice.message


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="only Linux swaps the BLAS")
def test_explicit_library_that_cannot_serve_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv(blas.ENV_VAR, str(tmp_path / "libmissing.so"))
    monkeypatch.delitem(sys.modules, "mlx.core", raising=False)  # as if mlx were not loaded yet
    with pytest.raises(RuntimeError, match="cannot load it"):
        blas._choose()


def test_library_without_cblas_is_not_loaded():
    # libm is always there and has no cblas_sgemm: it must not qualify.
    assert blas._load_global("libm.so.6") is None


def test_messages_name_the_library_and_the_switch():
    message = blas.BlasChoice("loaded", "/x/libopenblas.so.0", 4).message
    assert "/x/libopenblas.so.0" in message and "4 threads" in message
    assert blas.ENV_VAR in message


def test_idle_blas_threads_sleep_unless_the_user_chose(monkeypatch):
    # Set before the library loads (it reads them then); a value the user set is kept.
    monkeypatch.setattr(os, "environ", {"OPENBLAS_THREAD_TIMEOUT": "10"})
    assert blas.quiet_idle_threads() == {"KMP_BLOCKTIME": "0"}
    assert os.environ == {"OPENBLAS_THREAD_TIMEOUT": "10", "KMP_BLOCKTIME": "0"}
    assert blas.quiet_idle_threads() == {}
