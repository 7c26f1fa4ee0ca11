"""Krea 2 in the conformance suite (tests/families/test_conformance.py): the tests' tiny folder
of the diffusers references."""

from tests.families.krea2.tiny import build_tiny_folder

FAMILY = "krea2"


def write_folder(folder):
    build_tiny_folder(folder)
