"""FLUX.3 klein in the conformance suite (tests/families/test_conformance.py): the tests' tiny
distilled folder of the diffusers references (a flow map, so its steps name a schedule)."""

from tests.families.flux3_klein.tiny import build_tiny_folder

FAMILY = "flux3_klein"


def write_folder(folder):
    build_tiny_folder(folder)
