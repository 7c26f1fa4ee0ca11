"""FLUX.2 klein in the conformance suite (tests/families/test_conformance.py): the tests' tiny
4B folder, one single-stream block."""

from tests.families.flux2_klein.tiny.folder import build_tiny_folder

FAMILY = "flux2_klein"


def write_folder(folder):
    build_tiny_folder(folder, "flux2_klein", num_single_layers=1)
