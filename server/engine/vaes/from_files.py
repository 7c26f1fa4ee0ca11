"""A VAE's diffusers config told from one file's header: an `AutoencoderKL` in diffusers' names
or the ldm names of BFL's and ComfyUI's files (ldm_names), an `AutoencoderKLQwenImage` in
diffusers' names or Wan 2.1's (wan_names, ComfyUI's `qwen_image_vae.safetensors`). The channels
and depths come from the shapes; what shapes cannot tell (the group count, the latent
normalisation) is the family's (`facts`). No MLX: the listing of model files reads it."""

from __future__ import annotations

from ..file_headers import Header, HeaderError
from . import ldm_names, wan_names

BATCH_NORM_MEAN = "bn.running_mean"
# FLUX.2's autoencoder (`AutoencoderKLFlux2`, FLUX.2 klein's and FLUX.3 klein's): what its file
# cannot say (flux2-vae's diffusers config), and its raw latent channels.
FLUX2_VAE_FACTS = {
    "_class_name": "AutoencoderKLFlux2",
    "norm_num_groups": 32,
    "batch_norm_eps": 1e-4,
    "batch_norm_momentum": 0.1,
    "patch_size": [2, 2],
    "sample_size": 1024,
    "force_upcast": True,
}
FLUX2_LATENT_CHANNELS = 32


def diffusers_shapes(header: Header) -> dict[str, tuple[int, ...]]:
    if not ldm_names.is_ldm(header.shapes):
        return header.shapes
    blocks = ldm_names.up_blocks(header.shapes)
    return {ldm_names.diffusers_name(n, blocks): s for n, s in header.shapes.items()}


def latent_channels(header: Header) -> int | None:
    """The latent channels the decoder takes (None: not an AutoencoderKL file)."""
    conv_in = diffusers_shapes(header).get("decoder.conv_in.weight")
    return conv_in[1] if conv_in is not None and len(conv_in) == 4 else None


def channels_said(channels: int | None, tensor: str = "decoder.conv_in.weight") -> str:
    """The latent channels a decoder takes (`latent_channels`) as a refusal says them."""
    if channels is None:
        return f"it has no {tensor}"
    return f"{tensor} takes {channels} channels"


def has_batch_norm(header: Header) -> bool:
    return BATCH_NORM_MEAN in header.shapes


def is_flux2_vae(header: Header) -> bool:
    """FLUX.2's autoencoder: 32 latent channels and the batch norm over its patchified latents."""
    return latent_channels(header) == FLUX2_LATENT_CHANNELS and has_batch_norm(header)


def fits_flux2_vae(dit: Header, vae: Header) -> bool:
    """A component rule's `fits_vae` for a family that decodes with FLUX.2's autoencoder,
    whatever its DiT."""
    return is_flux2_vae(vae)


def flux2_vae_config(header: Header) -> dict:
    """vae/config.json of FLUX.2's autoencoder, for a family that decodes with it (`config`
    over FLUX2_VAE_FACTS); a components.ComponentError naming the tensor when the file is not
    it."""
    from ..components import ComponentError

    if not is_flux2_vae(header):
        raise ComponentError(flux2_vae_refusal(header))
    return config(header, FLUX2_VAE_FACTS)


def flux2_vae_refusal(header: Header) -> str:
    """Why a file is not FLUX.2's autoencoder, naming the tensor."""
    channels = latent_channels(header)
    missing = "" if has_batch_norm(header) else f"; it has no {BATCH_NORM_MEAN}"
    return (
        f"{header.path} is not FLUX.2's {FLUX2_LATENT_CHANNELS}-channel autoencoder with its"
        f" batch norm ({channels_said(channels)}{missing})"
    )


def block_widths(header: Header, shapes: dict, resnet: str, blocks: int) -> list[int]:
    """Each block's width: the output channels of the `resnet` weight (a name with `{}` for
    the block's index) in each of the `blocks` blocks."""
    widths = []
    for i in range(blocks):
        name = resnet.format(i)
        if name not in shapes:
            raise HeaderError(f"{header.path} has no tensor for {name}")
        widths.append(shapes[name][0])
    return widths


def config(header: Header, facts: dict) -> dict:
    """vae/config.json for the file: `facts` (class name, norm groups, scaling, ...) over the
    sizes its shapes give."""
    shapes = diffusers_shapes(header)
    needed = ("encoder.conv_in.weight", "decoder.conv_in.weight", "decoder.conv_out.weight")
    for name in needed:
        if name not in shapes:
            raise HeaderError(f"{header.path} is not an AutoencoderKL VAE: it has no {name}")
    blocks = header.count("encoder.down.", "encoder.down_blocks.")
    channels = block_widths(header, shapes, "encoder.down_blocks.{}.resnets.0.conv1.weight", blocks)
    resnets = header.count("encoder.down.0.block.", "encoder.down_blocks.0.resnets.")
    # A decoder of its own widths (MOSS-Image's narrower one): its up blocks, last first.
    decoder = block_widths(header, shapes, "decoder.up_blocks.{}.resnets.0.conv2.weight", blocks)
    own_decoder = decoder[::-1] != channels
    groups = facts["norm_num_groups"]
    if any(width % groups for width in channels + decoder):
        raise HeaderError(
            f"{header.path}: its blocks are {channels} wide, not multiples of the"
            f" {groups} norm groups of the VAE its family decodes with"
        )
    return {
        **facts,
        "in_channels": shapes["encoder.conv_in.weight"][1],
        "out_channels": shapes["decoder.conv_out.weight"][0],
        "latent_channels": shapes["decoder.conv_in.weight"][1],
        "block_out_channels": channels,
        "down_block_types": ["DownEncoderBlock2D"] * blocks,
        "up_block_types": ["UpDecoderBlock2D"] * blocks,
        "layers_per_block": resnets,
        "act_fn": "silu",
        "mid_block_add_attention": "encoder.mid_block.attentions.0.to_q.weight" in shapes,
        "use_quant_conv": "quant_conv.weight" in shapes,
        "use_post_quant_conv": "post_quant_conv.weight" in shapes,
        **({"decoder_block_out_channels": decoder[::-1]} if own_decoder else {}),
    }


# -- AutoencoderKLQwenImage --------------------------------------------------------------------

# Qwen-Image's published latent normalisation (diffusers' AutoencoderKLQwenImage defaults),
# which its files do not carry.
QWEN_IMAGE_LATENTS = {
    "latents_mean": [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
    "latents_std": [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160],
}  # fmt: skip


def qwen_image_shapes(header: Header) -> dict[str, tuple[int, ...]]:
    names = wan_names.diffusers_names(header.shapes)
    return {names[n]: s for n, s in header.shapes.items()}


def qwen_image_latent_channels(header: Header) -> int | None:
    """The latent channels a Qwen-Image VAE file's decoder takes (None: not one; its kernels
    are 5-D, an AutoencoderKL's 4-D)."""
    conv_in = qwen_image_shapes(header).get("decoder.conv_in.weight")
    return conv_in[1] if conv_in is not None and len(conv_in) == 5 else None


def qwen_image_config(header: Header, facts: dict) -> dict:
    """vae/config.json of an AutoencoderKLQwenImage file: `facts` (class name, latent
    normalisation) over the sizes its shapes give."""
    shapes = qwen_image_shapes(header)
    if qwen_image_latent_channels(header) is None or "encoder.conv_in.weight" not in shapes:
        raise HeaderError(
            f"{header.path} is not a Qwen-Image VAE: it has no 5-D decoder.conv_in.weight"
            f" (nor Wan's {wan_names.WAN_MARKERS[0]})"
        )
    levels: list[list[int]] = [[]]  # each level's resnet widths, between the resamplers
    temporal = []
    count = header.count("encoder.down_blocks.", "encoder.downsamples.")
    for index in range(count):
        prefix = f"encoder.down_blocks.{index}."
        if prefix + "resample.1.weight" in shapes:
            temporal.append(prefix + "time_conv.weight" in shapes)
            levels.append([])
        elif prefix + "conv1.weight" in shapes:
            levels[-1].append(shapes[prefix + "conv1.weight"][0])
    base = shapes["encoder.conv_in.weight"][0]
    return {
        **facts,
        "base_dim": base,
        "z_dim": shapes["decoder.conv_in.weight"][1],
        "dim_mult": [level[0] // base for level in levels],
        "num_res_blocks": len(levels[0]),
        "attn_scales": [],
        "temperal_downsample": temporal,
        "input_channels": shapes["encoder.conv_in.weight"][1],
    }
