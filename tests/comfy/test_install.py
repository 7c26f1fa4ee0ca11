"""`gmlx comfyui install|uninstall|status` (comfy_nodes/install.py)."""

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from gmlx_comfy import install
from gmlx_comfy.errors import GmlxError


def _comfy(tmp_path, name="ComfyUI"):
    root = tmp_path / name
    (root / "comfy").mkdir(parents=True)
    (root / "main.py").write_text("")
    return root


class Recorder:
    def __init__(self, rc=0):
        self.calls, self.rc = [], rc

    def __call__(self, command, check=False):
        self.calls.append(command)
        return subprocess.CompletedProcess(command, self.rc)


def test_links_the_pack_and_pip_installs_into_comfy_python(tmp_path):
    root = _comfy(tmp_path)
    venv_python = root / "venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text("")
    run = Recorder()
    env = {"GMLX_COMFY_SETTINGS": str(tmp_path / "s.json")}
    result = install.install(root, run=run, environ=env)
    link = root / "custom_nodes" / "gmlx_steps"
    assert link.is_symlink() and os.readlink(link) == str(install.PACK_DIR)
    assert (link / "nodes.py").is_file()
    assert run.calls == [
        [str(venv_python), "-m", "pip", "install", "-e", str(install.PACK_DIR.parent)]
    ]
    assert result.python == venv_python and not result.replaced_link
    (recorded,) = json.loads((tmp_path / "s.json").read_text())["installs"]
    assert recorded == {"comfy_dir": str(root), "link": str(link), "python": str(venv_python)}
    # running it again keeps the link and the one record
    assert not install.install(root, run=run, environ=env).replaced_link
    assert len(install.recorded_installs(env)) == 1


def test_replaces_a_stale_link_but_never_a_folder(tmp_path):
    root = _comfy(tmp_path)
    nodes = root / "custom_nodes"
    nodes.mkdir()
    (nodes / "gmlx_steps").symlink_to(tmp_path)
    env = {"GMLX_COMFY_SETTINGS": str(tmp_path / "s.json")}
    assert install.install(root, python=tmp_path / "py", run=Recorder(), environ=env).replaced_link
    (nodes / "gmlx_steps").unlink()
    (nodes / "gmlx_steps").mkdir()
    with pytest.raises(GmlxError, match="not a link"):
        install.install(root, python=tmp_path / "py", run=Recorder(), environ=env)


def test_refuses_a_folder_that_is_not_comfyui_and_a_failed_pip(tmp_path):
    with pytest.raises(GmlxError, match="not a ComfyUI folder"):
        install.install(tmp_path, run=Recorder())
    root = _comfy(tmp_path)
    with pytest.raises(GmlxError, match="pip failed"):
        install.install(
            root,
            python=tmp_path / "py",
            run=Recorder(rc=1),
            environ={"GMLX_COMFY_SETTINGS": str(tmp_path / "s.json")},
        )
    assert not (root / "custom_nodes" / "gmlx_steps").exists()


def test_a_python_that_does_not_run_is_one_line_and_nothing_is_linked(tmp_path):
    root = _comfy(tmp_path)
    env = {"GMLX_COMFY_SETTINGS": str(tmp_path / "s.json")}
    for python in (tmp_path / "missing" / "python", tmp_path):  # no file; a folder
        with pytest.raises(GmlxError) as refused:
            install.install(root, python=python, environ=env)  # subprocess.run itself
        assert str(refused.value).startswith(f"gmlx: cannot run {python} (")
        assert str(refused.value).endswith("name ComfyUI's Python with --python")
    assert not (root / "custom_nodes" / "gmlx_steps").exists()


def test_pip_target_without_a_source_tree(tmp_path):
    assert install.pip_target(tmp_path / "pack", "0.1.0") == "gmlx-steps==0.1.0"


def _env(tmp_path):
    return {"GMLX_COMFY_SETTINGS": str(tmp_path / "s.json")}


def _two_installs(tmp_path):
    env = _env(tmp_path)
    first, second = _comfy(tmp_path, "first"), _comfy(tmp_path, "second")
    install.install(first, python=tmp_path / "py1", run=Recorder(), environ=env)
    install.install(second, python=tmp_path / "py2", run=Recorder(), environ=env)
    return env, first, second


def test_every_install_is_kept(tmp_path):
    env, first, second = _two_installs(tmp_path)
    assert [i.comfy_dir for i in install.recorded_installs(env)] == [first, second]
    install.install(first, python=tmp_path / "py3", run=Recorder(), environ=env)  # again
    assert [(i.comfy_dir, i.python.name) for i in install.recorded_installs(env)] == [
        (second, "py2"),
        (first, "py3"),
    ]


def test_an_older_single_record_counts_as_one_install(tmp_path):
    env = _env(tmp_path)
    old = {"comfy_dir": "/c", "link": "/c/custom_nodes/gmlx_steps", "python": "/c/venv/bin/python"}
    (tmp_path / "s.json").write_text(json.dumps({"installed": old, "base_url": "http://a:1"}))
    (found,) = install.recorded_installs(env)
    assert found.comfy_dir.as_posix() == "/c"
    install.install(_comfy(tmp_path), python=tmp_path / "py", run=Recorder(), environ=env)
    doc = json.loads((tmp_path / "s.json").read_text())
    assert "installed" not in doc and len(doc["installs"]) == 2
    assert doc["base_url"] == "http://a:1"


def test_uninstall_removes_one_link_and_its_record_and_leaves_the_pip_install(tmp_path):
    env, first, second = _two_installs(tmp_path)
    run = Recorder()
    result = install.uninstall(first, run=run, environ=env)
    assert result.removed_link and result.pip_command is None and run.calls == []
    assert not os.path.lexists(first / "custom_nodes" / "gmlx_steps")
    assert (second / "custom_nodes" / "gmlx_steps").is_symlink()
    assert [i.comfy_dir for i in install.recorded_installs(env)] == [second]
    with pytest.raises(GmlxError, match=f"no install into {first} is recorded"):
        install.uninstall(first, run=run, environ=env)


def test_uninstall_with_pip_removes_the_distribution_where_that_is_safe(tmp_path):
    env, first, second = _two_installs(tmp_path)
    run = Recorder()
    result = install.uninstall(first, pip=True, run=run, environ=env)
    assert run.calls == [[str(tmp_path / "py1"), "-m", "pip", "uninstall", "--yes", "gmlx-steps"]]
    assert result.pip_command == run.calls[0]
    shared = _comfy(tmp_path, "shared")
    install.install(shared, python=tmp_path / "py2", run=Recorder(), environ=env)
    with pytest.raises(GmlxError, match="also serves the install in"):
        install.uninstall(shared, pip=True, run=run, environ=env)
    mine = _comfy(tmp_path, "mine")
    install.install(mine, python=Path(sys.executable), run=Recorder(), environ=env)
    with pytest.raises(GmlxError, match="the Python running this command"):
        install.uninstall(mine, pip=True, run=run, environ=env)
    assert (mine / "custom_nodes" / "gmlx_steps").is_symlink()  # a refusal changes nothing


def test_uninstall_never_removes_a_real_folder(tmp_path):
    env, first, _ = _two_installs(tmp_path)
    link = first / "custom_nodes" / "gmlx_steps"
    link.unlink()
    link.mkdir()
    with pytest.raises(GmlxError, match="is not a link"):
        install.uninstall(first, environ=env)
    assert link.is_dir()


def test_status_reports_link_python_and_whether_the_pack_imports(tmp_path):
    env = _env(tmp_path)
    here, bare, gone = _comfy(tmp_path, "here"), _comfy(tmp_path, "bare"), _comfy(tmp_path, "gone")
    venv.create(tmp_path / "bare-venv", with_pip=False)
    bare_python = tmp_path / "bare-venv" / "bin" / "python"
    install.install(here, python=Path(sys.executable), run=Recorder(), environ=env)
    install.install(bare, python=bare_python, run=Recorder(), environ=env)
    install.install(gone, python=tmp_path / "no-python", run=Recorder(), environ=env)
    (gone / "custom_nodes" / "gmlx_steps").unlink()
    lines = install.install_status(env)
    link = "custom_nodes/gmlx_steps"
    assert lines == [
        f"{here}: link {here / link} linked; Python {sys.executable}: imports from "
        f"{install.PACK_DIR}",
        f"{bare}: link {bare / link} linked; Python {bare_python}: does not import "
        "(ModuleNotFoundError: No module named 'gmlx_comfy')",
        f"{gone}: link {gone / link} missing; Python {tmp_path / 'no-python'}: Python not found",
    ]


def test_the_gmlx_commands_uninstall_and_status(tmp_path, monkeypatch, capsys):
    from gmlx_server import cli

    monkeypatch.setenv("GMLX_COMFY_SETTINGS", str(tmp_path / "s.json"))
    assert cli.main(["comfyui", "status"]) == 0
    assert capsys.readouterr().out == f"no install recorded in {tmp_path / 's.json'}\n"
    root = _comfy(tmp_path)
    install.install(root, python=tmp_path / "py", run=Recorder())
    assert cli.main(["comfyui", "status"]) == 0
    assert capsys.readouterr().out.startswith(f"{root}: link ")
    assert cli.main(["comfyui", "uninstall", "--comfy", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"removed {root / 'custom_nodes' / 'gmlx_steps'}" in out
    assert f"gmlx-steps stays installed in {tmp_path / 'py'}" in out and "--pip" in out
    assert cli.main(["comfyui", "uninstall", "--comfy", str(root)]) == 2
    assert capsys.readouterr().err.startswith("gmlx comfyui uninstall: no install into")
    assert cli.main(["comfyui", "install", "--comfy", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith("gmlx comfyui install: ")


def test_install_records_the_gmlx_that_serves_unless_one_is_set(tmp_path):
    """ComfyUI's Python gets the pack's needs alone, so its `gmlx` cannot serve: the install
    records the serving `gmlx` of the Python it runs in (which has the server) for the pack to
    start; a command the user set stays."""
    root = _comfy(tmp_path)
    env = {"GMLX_COMFY_SETTINGS": str(tmp_path / "s.json")}
    install.install(root, python=Path(sys.executable), run=Recorder(), environ=env)
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["gmlx_command"] == [sys.executable, "-m", "gmlx_server"]
    from gmlx_comfy.settings import load_settings

    assert load_settings(env).gmlx_command(serve=True) == [sys.executable, "-m", "gmlx_server"]
    doc["gmlx_command"] = ["/opt/mine/gmlx"]
    (tmp_path / "s.json").write_text(json.dumps(doc))
    install.install(root, python=Path(sys.executable), run=Recorder(), environ=env)
    assert json.loads((tmp_path / "s.json").read_text())["gmlx_command"] == ["/opt/mine/gmlx"]


def test_an_install_into_gmlxs_own_python_says_so(tmp_path, monkeypatch, capsys):
    """With no --python and no Python in the ComfyUI folder, the fallback (the Python running
    gmlx) is said, with how to name another."""
    root = _comfy(tmp_path)
    made = install.InstallResult(
        link=root / "custom_nodes" / "gmlx_steps",
        python=Path(sys.executable),
        pip_command=[],
        replaced_link=False,
    )
    monkeypatch.setattr(install, "install", lambda comfy_dir, python=None: made)
    assert install.main(["--comfy", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"note: {root} holds no Python of its own" in out and "--python" in out
    assert install.main(["--comfy", str(root), "--python", sys.executable]) == 0
    assert "note:" not in capsys.readouterr().out


def test_two_virtual_environments_of_one_base_python_are_two(tmp_path, monkeypatch):
    """ComfyUI's venv and gmlx's, both made from one python3 (their pythons link to it), are
    two environments: ComfyUI's is not taken for gmlx's own, so its install needs no note and
    its uninstall --pip goes ahead."""
    for name in ("comfy-venv", "gmlx-venv"):
        venv.create(tmp_path / name, with_pip=False, symlinks=True)
    comfy_python = tmp_path / "comfy-venv" / "bin" / "python"
    gmlx_python = tmp_path / "gmlx-venv" / "bin" / "python"
    assert comfy_python.resolve() == gmlx_python.resolve()  # the one base interpreter
    monkeypatch.setattr(sys, "executable", str(gmlx_python))
    assert not install._same_environment(comfy_python, Path(sys.executable))
    assert install._same_environment(gmlx_python, tmp_path / "gmlx-venv" / "bin" / "python3")
    assert install._pip_uninstall_command(
        install.Install(tmp_path, tmp_path / "link", comfy_python), []
    ) == [str(comfy_python), "-m", "pip", "uninstall", "--yes", "gmlx-steps"]
