"""The pack's example workflows: the UI-format files that ComfyUI's template browser opens
(`comfy_nodes/example_workflows/`, each with a `.jpg` thumbnail) and their API-format copies
(`comfy_nodes/api_workflows/`, what the frontend queues for them), with the frontend's UI → API
conversion for what the examples use."""

from __future__ import annotations

import json
from pathlib import Path

PACK_DIR = Path(__file__).resolve().parents[2] / "comfy_nodes"
UI_DIR = PACK_DIR / "example_workflows"
API_DIR = PACK_DIR / "api_workflows"
# The frontend finds a template by its name among ComfyUI's own first (a pack's "lora" opens
# ComfyUI's lora template): the pack's names carry its prefix.
NAME_PREFIX = "gmlx_"
# The examples on an embedded model (the default, or the family's of EMBEDDED_FAMILY), and those
# whose loaders name a family's embedded model and carry a note saying how to use a real one
# (NOTED_FAMILY: by name, the family).
DEFAULT_MODEL_NAMES = (
    "gmlx_text_to_image",
    "gmlx_lora",
    "gmlx_edit_two_references",
    "gmlx_z_image_text_to_image",
    "gmlx_krea2_text_to_image",
    "gmlx_moss_image_text_to_image",
)
EMBEDDED_FAMILY = {
    "gmlx_z_image_text_to_image": "z_image",
    "gmlx_krea2_text_to_image": "krea2",
    "gmlx_moss_image_text_to_image": "moss_image",
}
NOTED_FAMILY = {
    "gmlx_flux2_klein_text_to_image": "flux2_klein",
    "gmlx_flux2_klein_edit_two_references": "flux2_klein",
    "gmlx_flux3_klein_text_to_image": "flux3_klein",
    "gmlx_flux3_klein_edit_two_references": "flux3_klein",
}
FLUX2_KLEIN_NAMES = tuple(name for name, family in NOTED_FAMILY.items() if family == "flux2_klein")
NAMES = DEFAULT_MODEL_NAMES + tuple(NOTED_FAMILY)
FLUX2_KLEIN_MODEL = "flux2-klein-random-tiny"  # server/engine/families/flux2_klein/embedded.py
FLUX3_KLEIN_MODEL = "flux3-klein-random-tiny"  # server/engine/families/flux3_klein/embedded.py

# The stock ComfyUI node types the examples use (the e2e suite checks them against a real
# ComfyUI's /object_info).
STOCK_NODES = frozenset(
    {
        "CFGGuider",
        "CLIPTextEncode",
        "KSampler",
        "KSamplerSelect",
        "LoadImage",
        "LoraLoaderModelOnly",
        "RandomNoise",
        "ReferenceLatent",
        "SamplerCustomAdvanced",
        "SaveImage",
        "SkipLayerGuidanceDiTSimple",
        "VAEDecode",
        "VAEEncode",
    }
)
# Nodes of the frontend alone: drawn on the canvas, never queued.
FRONTEND_NODES = frozenset({"Note", "MarkdownNote"})
# Widgets the frontend shows but never sends. A seed's "control after generate" has no input
# slot: its value follows the seed's in widgets_values. The image upload button is a slot.
CONTROL_AFTER_GENERATE = {"KSampler": "seed", "RandomNoise": "noise_seed"}
UPLOAD_BUTTONS = {"LoadImage": "upload"}
MODE_ALWAYS, MODE_BYPASS = 0, 4


def ui_workflow(name: str) -> dict:
    return json.loads((UI_DIR / f"{name}.json").read_text(encoding="utf-8"))


def api_workflow(name: str) -> dict:
    return json.loads((API_DIR / f"{name}.json").read_text(encoding="utf-8"))


def ui_to_api(ui: dict) -> dict:
    """The prompt the frontend queues for a UI workflow: frontend-only and bypassed nodes left
    out (a link through a bypassed node goes to its input of the same type), widget values by
    widget name, links as [origin id, origin slot]."""
    nodes = {node["id"]: node for node in ui["nodes"]}
    links = {link[0]: link for link in ui["links"]}
    prompt = {}
    for node in ui["nodes"]:
        if node["type"] in FRONTEND_NODES or node["mode"] == MODE_BYPASS:
            continue
        if node["mode"] != MODE_ALWAYS:
            raise ValueError(f"node {node['id']}: mode {node['mode']} is not handled")
        inputs = widget_inputs(node)
        for slot in node.get("inputs", []):
            if slot.get("link") is not None:
                origin = _origin(nodes, links, slot["link"])
                if origin is not None:
                    inputs[slot["name"]] = origin
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


def widget_inputs(node: dict) -> dict:
    """The values of a node's widgets that the frontend sends, by name (a linked widget input
    takes its link instead)."""
    values = iter(node.get("widgets_values") or [])
    control = CONTROL_AFTER_GENERATE.get(node["type"])
    upload = UPLOAD_BUTTONS.get(node["type"])
    inputs = {}
    for slot in node.get("inputs", []):
        if "widget" not in slot:
            continue
        name = slot["widget"]["name"]
        value = next(values)
        if name == control:
            next(values)
        if name != upload and slot.get("link") is None:
            inputs[name] = value
    leftover = list(values)
    if leftover:
        raise ValueError(f"node {node['id']} ({node['type']}): widget values {leftover} unused")
    return inputs


def _origin(nodes: dict, links: dict, link_id: int) -> list | None:
    """[origin id, origin slot] of a link, through bypassed nodes: the frontend takes the
    bypassed node's input at the output's index when its type matches, else its first input of
    that type; None when it has no linked one."""
    _, origin_id, origin_slot, _, _, kind = links[link_id]
    origin = nodes[origin_id]
    if origin["mode"] != MODE_BYPASS:
        return [str(origin_id), origin_slot]
    slots = origin.get("inputs", [])
    for slot in slots[origin_slot : origin_slot + 1] + slots:
        if slot["type"] == kind and slot.get("link") is not None:
            return _origin(nodes, links, slot["link"])
    return None
