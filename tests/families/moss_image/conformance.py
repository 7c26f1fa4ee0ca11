"""MOSS-Image in the conformance suite (tests/families/test_conformance.py): the tests' tiny
folder (the embedded recipe's shape)."""

from tests.families.moss_image.tiny import build_tiny_folder

FAMILY = "moss_image"


def write_folder(folder):
    build_tiny_folder(folder)
