"""The twin-blocks family in the conformance suite (tests/families/test_conformance.py): a
family of the tests alone, handed to the registry as its Family."""

from .checkpoint import write_folder as write_checkpoint
from .family import TWIN_BLOCKS

FAMILY = TWIN_BLOCKS.spec.name
FAMILY_OBJECT = TWIN_BLOCKS


def write_folder(folder):
    write_checkpoint(folder.parent, folder.name)


# What its conformance LoRA table patches: fused and unfused layers, whole and in bands.
LORA_LAYERS = {
    "double_blocks.0.img_attn.to_k": None,
    "double_blocks.1.txt_attn.to_q": None,
    "double_blocks.1.txt_attn.to_v": [0, 4, 8],  # output rows 4..11 of v only
    "single_blocks.0.attn.to_v": None,
    "single_blocks.1.attn.to_out": [1, 2, 6],  # input columns 2..7
    "img_in": None,
}


# Its Qwen3ForCausalLM file's lm_head is never read.
HELD_BELOW_ESTIMATE = ("encoder",)
