"""An `AutoencoderKL`'s diffusers config told from one VAE file's header, in diffusers' names or
the ldm names of BFL's and ComfyUI's files (ldm_names): the channels and depths from the
shapes; the group count and the latent normalisation, which shapes cannot tell, are the
family's (`facts`). No MLX: the listing of model files reads it."""

from __future__ import annotations

from ..file_headers import Header, HeaderError
from . import ldm_names

BATCH_NORM_MEAN = "bn.running_mean"


def diffusers_shapes(header: Header) -> dict[str, tuple[int, ...]]:
    if not ldm_names.is_ldm(header.shapes):
        return header.shapes
    blocks = ldm_names.up_blocks(header.shapes)
    return {ldm_names.diffusers_name(n, blocks): s for n, s in header.shapes.items()}


def latent_channels(header: Header) -> int | None:
    """The latent channels the decoder takes (None: not an AutoencoderKL file)."""
    conv_in = diffusers_shapes(header).get("decoder.conv_in.weight")
    return conv_in[1] if conv_in is not None and len(conv_in) == 4 else None


def has_batch_norm(header: Header) -> bool:
    return BATCH_NORM_MEAN in header.shapes


def config(header: Header, facts: dict) -> dict:
    """vae/config.json for the file: `facts` (class name, norm groups, scaling, ...) over the
    sizes its shapes give."""
    shapes = diffusers_shapes(header)
    needed = ("encoder.conv_in.weight", "decoder.conv_in.weight", "decoder.conv_out.weight")
    for name in needed:
        if name not in shapes:
            raise HeaderError(f"{header.path} is not an AutoencoderKL VAE: it has no {name}")
    blocks = header.count("encoder.down.", "encoder.down_blocks.")
    channels = []
    for i in range(blocks):
        resnet = f"encoder.down_blocks.{i}.resnets.0.conv1.weight"
        if resnet not in shapes:
            raise HeaderError(f"{header.path} has no tensor for {resnet}")
        channels.append(shapes[resnet][0])
    resnets = header.count("encoder.down.0.block.", "encoder.down_blocks.0.resnets.")
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
    }
