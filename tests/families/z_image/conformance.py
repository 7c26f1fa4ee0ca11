"""Z-Image in the conformance suite (tests/families/test_conformance.py): its tiny folder is
the embedded model's recipe."""

from gmlx_server.engine.families.z_image.embedded import write_embedded_model

FAMILY = "z_image"


def write_folder(folder):
    write_embedded_model(folder)


# What its conformance LoRA table patches: fused and unfused layers, whole and in bands.
LORA_LAYERS = {
    "noise_refiner.0.feed_forward.w3": None,
    "context_refiner.0.attention.to_out.0": [1, 8, 16],  # input columns 8..23
    "layers.0.attention.to_k": None,
    "layers.1.attention.to_v": [0, 4, 8],  # output rows 4..11 of v only
    "layers.1.adaLN_modulation.0": None,
    "all_x_embedder.2-1": None,
    "t_embedder.mlp.0": None,
}


# Its Qwen3ForCausalLM file's lm_head is never read.
HELD_BELOW_ESTIMATE = ("encoder",)
