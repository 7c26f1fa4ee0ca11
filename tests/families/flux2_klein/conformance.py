"""FLUX.2 klein in the conformance suite (tests/families/test_conformance.py): its tiny folder is
the embedded model's recipe (a 4B, distilled)."""

from gmlx_server.engine.families.flux2_klein.embedded import write_embedded_model

FAMILY = "flux2_klein"


def write_folder(folder):
    write_embedded_model(folder)
