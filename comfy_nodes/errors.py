"""The pack's own error: text that starts with "gmlx:" (docs/contract.md §7.8). Pure."""

from __future__ import annotations


class GmlxError(Exception):
    """A refusal or failure the pack reports to ComfyUI.

    The text always starts with "gmlx:" so a user sees at once which part refused; it names
    what was refused and, where it can, the node upstream that caused it.
    """

    # ComfyUI names a failed node's exception type by its module and name; loaded from
    # custom_nodes/ the module's name is its path, so the type says the pack's package instead.
    __module__ = "gmlx_comfy.errors"

    def __init__(self, message: str) -> None:
        if not message.startswith("gmlx:"):
            message = "gmlx: " + message
        super().__init__(message)


def named_nodes(names: list[str]) -> str:
    """' (from node X, Y)' naming upstream nodes, or '' when none were found."""
    names = sorted({n for n in names if n})
    if not names:
        return ""
    return " (from node " + ", ".join(names) + ")"
