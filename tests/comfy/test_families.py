"""The pack reads a family's facts from the server's status; its tables serve older servers."""

import pytest
from gmlx_comfy.clip import prompt_text
from gmlx_comfy.families import empty_prompt, ref_method


def test_the_reference_method_is_the_status_s_else_the_table_s():
    published = {"family": "qwen_image21", "conditioning": {"ref_method": "offset"}}
    assert ref_method(published) == "offset"
    assert ref_method({"family": "qwen_image21"}) == "index"  # an older server
    assert ref_method({"family": "someone_new"}) is None


def test_the_empty_prompt_is_the_status_s_else_the_table_s():
    assert empty_prompt("someone_new", "<empty>") == "<empty>"
    assert empty_prompt("qwen_image21", "") == ""  # the server's word wins
    assert empty_prompt("qwen_image21") == " " and empty_prompt("z_image") == ""
    assert prompt_text("", "someone_new", "<empty>") == "<empty>"
    assert prompt_text("a cat", "someone_new", "<empty>") == "a cat"


def test_the_server_publishes_what_the_tables_hold_for_its_family():
    family = pytest.importorskip("gmlx_server.engine.families.qwen_image21.family")
    embedded = pytest.importorskip("gmlx_server.engine.families.qwen_image21.embedded")
    status = {"family": "qwen_image21", **family.describe(embedded.ensure_embedded_model())}
    assert ref_method(status) == ref_method({"family": "qwen_image21"})
    assert empty_prompt("qwen_image21", status["conditioning"]["empty_prompt"]) == (
        empty_prompt("qwen_image21")
    )
