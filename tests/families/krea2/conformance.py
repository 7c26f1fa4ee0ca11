"""Krea 2 in the conformance suite (tests/families/test_conformance.py): the tests' tiny folder
of the diffusers references."""

from tests.families.krea2.tiny import build_tiny_folder

FAMILY = "krea2"


def write_folder(folder):
    build_tiny_folder(folder)


# Qwen-Image's VAE holds its causal 3-D kernels as the 2-D kernels of one frame: fewer bytes
# than its file.
HELD_BELOW_ESTIMATE = ("vae",)
