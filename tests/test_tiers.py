"""The suite's two tiers: the tests marked `heavy` exist, the default run collects every one of
them and skips it saying how to run it, and `pytest -m heavy` (the heavy tier's command,
README.md) selects exactly those tests. CI (.ci/run) runs the README's test command."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY_MARK = re.compile(r"mark\.heavy\b")
SKIP_REASON = "heavy run: select it with pytest -m heavy"
# The heavy tier holds at least this many tests (72 when this was written): fuzz and load runs,
# the three-rank groups, the schemathesis runs with many examples, the larger memory checks and
# klein's encoder on every GGUF type and bit width.
AT_LEAST = 65


def heavy_files() -> list[str]:
    """The test files that mark tests heavy, relative to the repository."""
    return sorted(
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "tests").rglob("test_*.py")
        if HEAVY_MARK.search(path.read_text())
    )


def session_heavy(request) -> list[pytest.Item]:
    return [item for item in request.session.items if item.get_closest_marker("heavy")]


def collected_whole_files(request, files: list[str]) -> bool:
    """Whether this session collected the files whole (not a subset run, not -k)."""
    seen = {item.path.relative_to(ROOT).as_posix() for item in request.session.items}
    return set(files) <= seen and not request.config.getoption("keyword")


def test_the_default_run_collects_and_skips_every_heavy_test(request):
    files = heavy_files()
    if not collected_whole_files(request, files):
        pytest.skip("a run of part of the suite: the tier check needs the whole suite collected")
    heavy = session_heavy(request)
    assert len(heavy) >= AT_LEAST, [item.nodeid for item in heavy]
    for item in heavy:
        reasons = [mark.kwargs.get("reason") for mark in item.iter_markers("skip")]
        assert SKIP_REASON in reasons, item.nodeid


# A second collection of every heavy file (about nine seconds) is the heavy tier's own check.
@pytest.mark.heavy
def test_pytest_m_heavy_selects_exactly_the_heavy_tests(request):
    files = heavy_files()
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "heavy", *files]
    listed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stdout[-3000:] + listed.stderr[-3000:]
    selected = {line for line in listed.stdout.splitlines() if "::" in line}
    assert len(selected) >= AT_LEAST, listed.stdout[-3000:]
    if collected_whole_files(request, files):
        assert selected == {item.nodeid for item in session_heavy(request)}


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("Run the tests:", 1)[1].split("```sh\n", 1)[1].split("\n```", 1)[0]
    readme_command = block.strip().split(" && ")[-1]
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    ci_command = [line for line in ci_lines if line.strip() and not line.startswith("#")][-1]
    assert ci_command == readme_command


def test_the_default_run_draws_the_same_hypothesis_examples():
    """The default run's property tests draw the same examples on every machine
    (tests/conftest.py); the heavy tier draws new ones."""
    from hypothesis import settings

    assert settings.default.derandomize
