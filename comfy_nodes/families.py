"""Facts of the families the pack builds itself (ComfyUI 0.3.64 knows neither of them).

A server says what the pack needs to know of a family in its status: `vae.latents_mean` and
`vae.latents_std`, and `conditioning.ref_method` and `conditioning.empty_prompt`. The tables here
are the fallback for older servers that do not. Pure: plain data and arithmetic on status
documents.
"""

from __future__ import annotations

from typing import Any

# The Qwen-Image 2.1 VAE's published latent normalisation (the defaults of diffusers'
# AutoencoderKLQwenImage21 config, which the released checkpoint carries). Used only when a
# server's status does not publish `vae.latents_mean` / `vae.latents_std` itself.
QWEN_IMAGE21_LATENTS_MEAN = [
    0.5126,
    0.7721,
    -0.0631,
    1.3506,
    -0.7855,
    -2.1025,
    -0.3458,
    1.3722,
    1.8873,
    -1.7177,
    -0.651,
    0.2732,
    0.7562,
    -0.6163,
    -1.0277,
    3.8363,
    2.021,
    0.0472,
    0.932,
    2.0087,
    2.4954,
    -0.1391,
    -1.4249,
    1.8464,
    -0.5236,
    1.2826,
    3.7046,
    -1.3035,
    2.7286,
    -1.4518,
    -1.9036,
    -1.9955,
    -0.0342,
    -1.0265,
    -0.7636,
    3.0555,
    0.0746,
    -3.0751,
    -0.1076,
    1.7376,
    -1.0914,
    -1.9435,
    -0.2784,
    -1.368,
    0.4809,
    -0.4433,
    0.3764,
    0.5729,
    -2.0595,
    1.096,
    -1.326,
    -2.0211,
    -5.0179,
    0.5275,
    4.0162,
    1.8505,
    0.3026,
    1.9373,
    1.4937,
    0.2632,
    0.5547,
    -1.7121,
    -0.1562,
    0.0304,
]
QWEN_IMAGE21_LATENTS_STD = [
    3.2001,
    3.2936,
    3.4321,
    3.0091,
    3.1061,
    4.0379,
    4.0705,
    3.791,
    3.0785,
    3.65,
    3.9308,
    3.0904,
    2.8778,
    3.7675,
    3.732,
    5.0756,
    3.2864,
    4.0397,
    3.1317,
    4.0443,
    2.9249,
    3.9454,
    3.0988,
    4.2489,
    3.4896,
    3.8513,
    3.9323,
    3.4719,
    3.7498,
    4.283,
    3.5694,
    4.2467,
    3.9037,
    3.2947,
    5.077,
    3.5075,
    3.27,
    3.4767,
    2.8063,
    5.1125,
    3.5327,
    4.7833,
    3.1286,
    4.1819,
    3.8527,
    3.8312,
    3.5605,
    4.3875,
    3.9624,
    4.0168,
    3.5643,
    4.055,
    5.5614,
    4.2963,
    4.408,
    3.4959,
    3.8747,
    3.7608,
    3.5735,
    3.149,
    3.7662,
    3.6746,
    3.4563,
    3.8161,
]

PUBLISHED_NORMALISATION = {
    "qwen_image21": (QWEN_IMAGE21_LATENTS_MEAN, QWEN_IMAGE21_LATENTS_STD),
}

# model_class (status `comfy.model_class`) -> family the pack builds a ComfyUI model for.
PACK_BUILT_CLASSES = {
    "QwenImage21": "qwen_image21",
    "ZImage": "z_image",
    "Flux2": "flux2_klein",
    "Krea2": "krea2",  # no ComfyUI has it (0.8.0 neither)
    "Flux3": "flux3_klein",  # no ComfyUI has it (0.8.0 neither)
    "MOSSImage": "moss_image",  # no ComfyUI has it (0.8.0 neither)
}
# model_class -> ComfyUI's own BaseModel class (in comfy.model_base) the pack's model also
# derives from on a ComfyUI that knows the model class (comfy.supported_models has it), so stock
# code that tells models apart by class treats it as that family's. Z-Image: 0.33 has it, 0.3.64
# not (its Lumina2 is Lumina Image 2.0 alone). FLUX.2 (klein): 0.33 has Flux2, 0.3.64 not.
COMFY_BASE_CLASSES = {"ZImage": "Lumina2", "Flux2": "Flux2"}
# The DiT's own reference placement method (ComfyUI's `ref_latents_method` default), for
# servers whose status has no `conditioning.ref_method`: only families that such an older
# server served (every server that serves a later family publishes it).
DEFAULT_REF_METHOD = {"qwen_image21": "index"}
# Families whose encoder refuses an empty prompt: the pack sends one space (docs/contract.md §7.4),
# for servers whose status has no `conditioning.empty_prompt`.
SPACE_FOR_EMPTY_PROMPT = frozenset(("qwen_image", "qwen_image21", "krea2", "flux3_klein"))


def flow_map(status: dict[str, Any]) -> bool:
    """Whether the model's DiT is a flow map, whose steps send the sampler's schedule
    (status `sampling.flow_map`, docs/contract.md §7.5)."""
    return bool((status.get("sampling") or {}).get("flow_map"))


def ref_method(status: dict[str, Any]) -> str | None:
    """The DiT's own reference placement: status `conditioning.ref_method`, else the table's."""
    published = (status.get("conditioning") or {}).get("ref_method")
    return published if isinstance(published, str) else DEFAULT_REF_METHOD.get(status.get("family"))


def empty_prompt(family: str | None, published: Any = None) -> str:
    """What an empty prompt is sent as: the status's `conditioning.empty_prompt` (`published`),
    else one space for the families of SPACE_FOR_EMPTY_PROMPT, else the empty text."""
    if isinstance(published, str):
        return published
    return " " if family in SPACE_FOR_EMPTY_PROMPT else ""


def latent_normalisation(status: dict[str, Any]) -> tuple[list[float], list[float]] | None:
    """(mean, std) that take VAE latents to the DiT's model space, or None for identity.

    docs/contract.md §2.12: the VAE routes carry the VAE's own latent space unless status
    `vae.space` is "model"; the step always takes model space = (z - mean) / std
    (§2.11). A server may publish the normalisation in `vae.latents_mean` /
    `vae.latents_std` (our server does); else the family's published constants apply.
    """
    vae = status.get("vae") or {}
    if vae.get("space") == "model":
        return None
    mean, std = vae.get("latents_mean"), vae.get("latents_std")
    channels = int((status.get("latent") or {}).get("channels", 0))
    if isinstance(mean, list) and isinstance(std, list):
        pair = ([float(v) for v in mean], [float(v) for v in std])
    elif status.get("family") in PUBLISHED_NORMALISATION:
        pair = PUBLISHED_NORMALISATION[status["family"]]
    else:
        raise ValueError(
            f"gmlx: the server publishes no latent normalisation for family "
            f"{status.get('family')!r} and this pack knows none; upgrade the pack or the server"
        )
    if len(pair[0]) != channels or len(pair[1]) != channels:
        raise ValueError(
            f"gmlx: the latent normalisation has {len(pair[0])}/{len(pair[1])} values for "
            f"{channels} latent channels"
        )
    return pair
