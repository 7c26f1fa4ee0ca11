"""`gmlx comfyui install --comfy DIR` (comfy_nodes/install.py)."""

import json
import os
import subprocess

import pytest
from gmlx_comfy import install
from gmlx_comfy.errors import GmlxError


def _comfy(tmp_path):
    root = tmp_path / "ComfyUI"
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
    recorded = json.loads((tmp_path / "s.json").read_text())["installed"]
    assert recorded["link"] == str(link)
    # running it again keeps the link
    assert not install.install(root, run=run, environ=env).replaced_link


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


def test_pip_target_without_a_source_tree(tmp_path):
    assert install.pip_target(tmp_path / "pack", "0.1.0") == "gmlx-steps==0.1.0"
