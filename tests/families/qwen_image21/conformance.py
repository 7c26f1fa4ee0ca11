"""Qwen-Image 2.1 in the conformance suite (tests/families/test_conformance.py): its tiny
folder is the embedded model's recipe."""

from gmlx_server.engine.families.qwen_image21.embedded import write_embedded_model

FAMILY = "qwen_image21"


def write_folder(folder):
    write_embedded_model(folder)


# Its Qwen3-VL's lm_head is never read, and its VAE's causal 3-D kernels are held as the 2-D
# kernels of one frame: both hold fewer bytes than their files.
HELD_BELOW_ESTIMATE = ("encoder", "vae")
