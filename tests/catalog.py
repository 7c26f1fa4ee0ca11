"""What the product ships, in the order its listings give it: the families its specs name, and
its embedded models (the default first). The tests of every listing (the capabilities, the
family table, the configured models, `gmlx list`, the pack's model list) expect these."""

FAMILIES = [
    "flux2_klein",
    "flux2_klein_9b",
    "flux2_klein_9b_kv",
    "flux3_klein",
    "krea2",
    "moss_image",
    "qwen_image21",
    "z_image",
]
EMBEDDED_MODELS = [
    "qwen-image21-random-tiny",
    "flux2-klein-random-tiny",
    "flux3-klein-random-tiny",
    "krea2-random-tiny",
    "moss-image-random-tiny",
    "z-image-random-tiny",
]
