"""`gmlx image sample` in process under the memory plan the routes use (server/memory.py):
work that cannot fit is refused before the prompt is encoded, naming what would fit."""

from __future__ import annotations

from gmlx_server import image_cli

BUDGET_MB = 64


def test_an_image_that_cannot_fit_is_refused_before_it_is_encoded(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = tmp_path / "config.toml"
    config.write_text(f"[server.image]\nmemory_budget_mb = {BUDGET_MB}\n")

    def no_generate(*args, **kwargs):
        raise AssertionError("the image was sampled before its plan")

    monkeypatch.setattr(image_cli, "generate", no_generate)
    out = tmp_path / "x.png"
    argv = ["--prompt", "a red fox", "--width", "1536", "--height", "1536"]
    assert image_cli.sample_main([*argv, "--config", str(config), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "step's memory plan does not fit" in err and f"{BUDGET_MB} MiB" in err, err
    assert "server.image.memory_budget_mb" in err and "fit at up to" in err
    assert not out.exists()


def test_a_fitting_image_samples_under_the_plan(tmp_path, monkeypatch):
    """The plan bounds each step's allocations (memory.allocation_bound) and checks the decode."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    planned = []
    real = image_cli.MemoryPlanner.run_step

    def counted(self, *args, **kwargs):
        planned.append("step")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(image_cli.MemoryPlanner, "run_step", counted)
    out = tmp_path / "x.png"
    argv = ["--prompt", "a red fox", "--width", "64", "--height", "64", "--out", str(out)]
    assert image_cli.sample_main(argv) == 0
    assert out.is_file() and len(planned) == 8  # the embedded default's fixed 8 steps
