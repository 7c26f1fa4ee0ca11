"""FLUX.2 klein in the conformance suite (tests/families/test_conformance.py): its tiny folder is
the embedded model's recipe (a 4B, distilled)."""

from gmlx_server.engine.families.flux2_klein.embedded import write_embedded_model

FAMILY = "flux2_klein"


def write_folder(folder):
    write_embedded_model(folder)


# What its conformance LoRA table patches: fused and unfused layers, whole and in bands.
LORA_LAYERS = {
    "transformer_blocks.0.attn.to_k": None,
    "transformer_blocks.1.attn.add_v_proj": [0, 8, 16],  # output rows 8..23 of v only
    "transformer_blocks.0.ff_context.linear_in": None,
    "single_transformer_blocks.0.attn.to_qkv_mlp_proj": [0, 64, 64],  # k's rows of the fused
    "single_transformer_blocks.1.attn.to_out": [1, 64, 192],  # the MLP's input columns
    "double_stream_modulation_img.linear": None,
    "x_embedder": None,
    "context_embedder": None,
}
