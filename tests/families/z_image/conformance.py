"""Z-Image in the conformance suite (tests/families/test_conformance.py): its tiny folder is
the embedded model's recipe."""

from gmlx_server.engine.families.z_image.embedded import write_embedded_model

FAMILY = "z_image"


def write_folder(folder):
    write_embedded_model(folder)
