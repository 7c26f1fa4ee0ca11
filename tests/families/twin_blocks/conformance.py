"""The twin-blocks family in the conformance suite (tests/families/test_conformance.py): a
family of the tests alone, handed to the registry as its Family."""

from .checkpoint import write_folder as write_checkpoint
from .family import TWIN_BLOCKS

FAMILY = TWIN_BLOCKS.spec.name
FAMILY_OBJECT = TWIN_BLOCKS


def write_folder(folder):
    write_checkpoint(folder.parent, folder.name)
