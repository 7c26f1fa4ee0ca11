"""Component files at full size, headers only: each family's real DiT, text encoder and VAE
written on the meta device's shapes as the single files ComfyUI holds (sparse files: a header
and no data), in ComfyUI's and BFL's names. The configs told from them are the real
models' (diffusers' and transformers' configs of Z-Image Turbo, FLUX.2 klein 4B and 9B,
Qwen3-4B and -8B, FLUX.1's and FLUX.2's VAEs), and a ComfyUI folder of many such files lists its
sets from their headers alone."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import torch
from gmlx_server.engine import components
from gmlx_server.engine.components import ComponentFiles, comfy_sets, identify
from gmlx_server.engine.families.z_image.layout import DiTConfig as ZConfig
from gmlx_server.engine.spec import family_specs

from tests.engine.comfy_files import ldm_name
from tests.families.flux2_klein.tiny.bfl import bfl_state_dict
from tests.families.z_image.test_gguf import comfy_layout

BYTES = {"BF16": 2, "F32": 4}


def write_sparse(path, shapes: dict, prefix: str = "", dtype: str = "BF16"):
    """A safetensors file of `shapes` whose data is a hole (the header alone is written)."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = math.prod(shape) * BYTES[dtype]
        header[prefix + name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw)
        handle.truncate(8 + len(raw) + offset)
    return path


def meta_model(build):
    with torch.device("meta"):
        return build()


def meta_shapes(build) -> dict:
    return {name: tuple(value.shape) for name, value in meta_model(build).state_dict().items()}


def renamed_shapes(shapes: dict, rename) -> dict:
    """`rename` (a state-dict renaming that fuses along rows) applied to shapes: each tensor
    stands in as a row vector of its index, so the fused rows and the first source show."""
    names = list(shapes)
    vectors = {n: np.full(shapes[n][0], i, np.int64) for i, n in enumerate(names)}
    return {name: (len(v), *shapes[names[v[0]]][1:]) for name, v in rename(vectors).items()}


def qwen3(hidden, layers, heads, kv, intermediate):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=128,
    )
    return config, meta_shapes(lambda: Qwen3ForCausalLM(config))


def vae_file(path, build):
    shapes = meta_shapes(build)
    blocks = len({n.split(".")[2] for n in shapes if n.startswith("decoder.up_blocks.")})
    ldm = {ldm_name(n, blocks): s for n, s in shapes.items()}
    ldm = {
        n: (*s, 1, 1)
        if ".mid.attn_1." in n
        and n.endswith(("q.weight", "k.weight", "v.weight", "proj_out.weight"))
        else s
        for n, s in ldm.items()
    }
    return write_sparse(path, ldm)


# FLUX.1's autoencoder (ae.safetensors), the VAE Z-Image decodes with.
FLUX1_VAE = dict(
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    latent_channels=16,
    layers_per_block=2,
    use_quant_conv=False,
    use_post_quant_conv=False,
)


def flux1_vae_file(path):
    from diffusers import AutoencoderKL

    return vae_file(path, lambda: AutoencoderKL(**FLUX1_VAE))


def z_image_comfy_shapes():
    """Z-Image Turbo's DiT (diffusers' defaults, on the meta device) and its tensors' shapes in
    ComfyUI's names."""
    from diffusers import ZImageTransformer2DModel

    reference = meta_model(ZImageTransformer2DModel)
    shapes = {name: tuple(value.shape) for name, value in reference.state_dict().items()}
    layout = comfy_layout(ZConfig.from_dict(dict(reference.config)))
    comfy = {
        name: (sum(shapes[p][0] for p in parts), *shapes[parts[0]][1:])
        for name, parts in layout.items()
    }
    return comfy, reference


def z_image_dit_files(paths) -> None:
    """Z-Image Turbo's DiT in ComfyUI's names as sparse files (copying one would write its
    holes out)."""
    comfy, _ = z_image_comfy_shapes()
    for path in paths:
        write_sparse(path, comfy, "model.diffusion_model.")


@pytest.fixture(scope="module")
def qwen3_4b(tmp_path_factory):
    config, shapes = qwen3(2560, 36, 32, 8, 9728)
    return config, write_sparse(tmp_path_factory.mktemp("te") / "qwen_3_4b.safetensors", shapes)


def test_z_image_turbos_files_give_its_configs(tmp_path, qwen3_4b):
    comfy, reference = z_image_comfy_shapes()
    dit = write_sparse(tmp_path / "z_image_turbo_bf16.safetensors", comfy, "model.diffusion_model.")
    vae = flux1_vae_file(tmp_path / "ae.safetensors")
    text_config, encoder = qwen3_4b
    found = identify(ComponentFiles(dit, encoder, vae), family_specs())
    assert (found.family, found.variant) == ("z_image", "turbo")
    told = components.configs(found)
    for key in (
        "dim",
        "n_layers",
        "n_refiner_layers",
        "n_heads",
        "n_kv_heads",
        "cap_feat_dim",
        "in_channels",
        "axes_dims",
    ):
        assert list(np.atleast_1d(told["transformer/config.json"][key])) == list(
            np.atleast_1d(reference.config[key])
        ), key
    te = told["text_encoder/config.json"]
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
    ):
        assert te[key] == getattr(text_config, key), key
    vae_config = told["vae/config.json"]
    for key, value in FLUX1_VAE.items():
        assert list(np.atleast_1d(vae_config[key])) == list(np.atleast_1d(value)), key


@pytest.mark.parametrize(
    "size, dit, encoder",
    [
        (
            "4b",
            dict(
                num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680
            ),
            (2560, 36, 32, 8, 9728),
        ),
        (
            "9b",
            dict(
                num_layers=8,
                num_single_layers=24,
                num_attention_heads=32,
                joint_attention_dim=12288,
            ),
            (4096, 36, 32, 8, 12288),
        ),
    ],
)
def test_flux2_kleins_files_give_its_configs(tmp_path, size, dit, encoder):
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    config = dict(guidance_embeds=False, **dit)
    shapes = meta_shapes(lambda: Flux2Transformer2DModel(**config))
    dit_path = write_sparse(
        tmp_path / f"flux-2-klein-{size}.safetensors", renamed_shapes(shapes, bfl_state_dict)
    )
    text_config, te_shapes = qwen3(*encoder)
    te = write_sparse(tmp_path / "qwen_3.safetensors", te_shapes)
    vae = vae_file(tmp_path / "flux2-vae.safetensors", AutoencoderKLFlux2)
    found = identify(ComponentFiles(dit_path, te, vae), family_specs())
    assert (found.family, found.variant) == (
        {"4b": "flux2_klein", "9b": "flux2_klein_9b"}[size],
        "distilled",
    )
    told = components.configs(found)["transformer/config.json"]
    for key, value in {
        **config,
        "attention_head_dim": 128,
        "mlp_ratio": 3.0,
        "in_channels": 128,
    }.items():
        assert told[key] == value, key
    assert told["axes_dims_rope"] == [32, 32, 32, 32]
    assert (
        components.configs(found)["text_encoder/config.json"]["hidden_size"]
        == text_config.hidden_size
    )


def test_a_comfyui_folder_lists_its_sets_from_headers(tmp_path):
    """200 full-size files (sparse: 2.2 TB of nominal data) list as the sets they make."""
    models = tmp_path / "models"
    for kind in ("diffusion_models", "text_encoders", "vae"):
        (models / kind).mkdir(parents=True)
    z_image_dit_files(
        models / "diffusion_models" / f"z_image_turbo_{i:03d}.safetensors" for i in range(180)
    )
    write_sparse(
        models / "text_encoders" / "qwen_3_4b.safetensors", qwen3(2560, 36, 32, 8, 9728)[1]
    )
    flux1_vae_file(models / "vae" / "ae.safetensors")
    for i in range(18):  # files of no family: another VAE, a broken file
        (models / "vae" / f"broken_{i}.safetensors").write_bytes(
            b"\x10\x00\x00\x00\x00\x00\x00\x00{}"
        )
    folders = {
        key: [models / name for name in names] for key, names in components.COMFY_FOLDERS.items()
    }
    sets = comfy_sets(folders, family_specs())
    assert len(sets) == 180
    assert "z_image_turbo_007 + qwen_3_4b + ae" in sets
