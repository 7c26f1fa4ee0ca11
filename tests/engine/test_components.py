"""What models from component files rest on (engine/components.py): the header reader against
`gguf`'s GGUFReader and safetensors' own, refusing files cut short; the ldm VAE names against
diffusers' single-file conversion; Qwen's tokenizer rebuilt from ComfyUI's vocab/merges copy and
from a GGUF file's metadata, encoding as tokenizer.json does; ComfyUI's folders listed as sets,
headers only."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gmlx_server.engine import file_headers
from gmlx_server.engine.encoders.qwen3.tiny_tokenizer import train_tokenizer
from gmlx_server.engine.encoders.qwen3.vocab_files import bpe_tokenizer, gguf_tokenizer
from gmlx_server.engine.file_headers import HeaderError
from gmlx_server.engine.vaes import ldm_names
from safetensors.numpy import load_file, save_file
from safetensors.torch import save_file as save_torch
from tokenizers import Tokenizer

from tests.contract.frames import frame
from tests.engine.comfy_files import ldm_vae, write_comfy_tokenizer, write_gguf_text_encoder
from tests.engine.gguf_files import encoded, write_gguf

TEXTS = [
    "a red fox in the snow, 35mm <|im_start|>user\nhello<|im_end|>",
    "<think>\n\n</think>\n\nEin Fuchs im Schnee. 雪の中のキツネ。",
    "  spaces   and\ttabs\r\n0123456789 <|image_pad|><|vision_end|>",
]


def test_gguf_headers_read_as_gguf_reads_them(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "blk.0.attn_q.weight": (T.Q8_0, encoded(T.Q8_0, rng.standard_normal((64, 64)), rng)),
        "blk.0.ffn_down.weight": (T.Q4_K, encoded(T.Q4_K, rng.standard_normal((32, 256)), rng)),
        "token_embd.weight": (T.F32, rng.standard_normal((10, 64)).astype(np.float32)),
        "flat.weight": (T.F16, rng.standard_normal((2, 256)).astype(np.float16)),
    }
    path = write_gguf(
        tmp_path / "t.gguf", tensors, arch="qwen3", orig_shapes={"flat.weight": (16, 32)}
    )
    header = file_headers.read(path)
    reader = GGUFReader(str(path))
    for tensor in reader.tensors:
        expected = (
            (16, 32) if tensor.name == "flat.weight" else tuple(reversed(tensor.shape.tolist()))
        )
        assert header.shapes[tensor.name] == expected
        assert header.types[tensor.name] == tensor.tensor_type.name
    assert header.architecture == "qwen3"
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-10])
    with pytest.raises(HeaderError, match="cut short"):
        file_headers.read(tmp_path / "cut.gguf")
    (tmp_path / "head.gguf").write_bytes(data[:40])
    with pytest.raises(HeaderError, match="cut short"):
        file_headers.read(tmp_path / "head.gguf")


def test_safetensors_headers_strip_a_dit_prefix_and_refuse_a_cut_file(tmp_path):
    path = tmp_path / "dit.safetensors"
    save_file({"model.diffusion_model.a.weight": np.zeros((3, 4), np.float32)}, str(path))
    header = file_headers.read(path)
    assert header.shapes == {"a.weight": (3, 4)} and header.prefix == "model.diffusion_model."
    (tmp_path / "cut.safetensors").write_bytes(path.read_bytes()[:-4])
    with pytest.raises(HeaderError, match="cut short"):
        file_headers.read(tmp_path / "cut.safetensors")


def test_ldm_vae_names_are_what_diffusers_converts(tmp_path):
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    config = {
        "block_out_channels": (32, 32, 32, 32),
        "down_block_types": ("DownEncoderBlock2D",) * 4,
        "up_block_types": ("UpDecoderBlock2D",) * 4,
        "latent_channels": 16,
        "layers_per_block": 2,
        "norm_num_groups": 32,
    }
    weights = {n: v.numpy() for n, v in AutoencoderKL(**config).state_dict().items()}
    ldm = ldm_vae(weights)
    assert ldm_names.is_ldm(ldm) and not ldm_names.is_ldm(weights)
    back = convert_ldm_vae_checkpoint({n: torch.from_numpy(v) for n, v in ldm.items()}, config)
    assert set(back) == set(weights)
    renamed = ldm_names.renamed(ldm)
    assert set(renamed) == set(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(back[name].numpy(), value, err_msg=name)
        np.testing.assert_array_equal(renamed[name], value, err_msg=name)


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_tokenizer([*TEXTS, "the quick brown fox jumps over the lazy dog"] * 3, 300).save(
        str(path)
    )
    return path


def test_qwens_tokenizer_from_comfyuis_copy_encodes_as_tokenizer_json(tokenizer_json, tmp_path):
    reference = Tokenizer.from_file(str(tokenizer_json))
    rebuilt = bpe_tokenizer(write_comfy_tokenizer(tokenizer_json, tmp_path / "qwen25_tokenizer"))
    for text in TEXTS:
        assert (
            rebuilt.encode(text, add_special_tokens=False).ids
            == reference.encode(text, add_special_tokens=False).ids
        )


def test_qwens_tokenizer_from_gguf_metadata_encodes_as_tokenizer_json(tokenizer_json, tmp_path):
    weights = {"model.embed_tokens.weight": np.zeros((4, 8), np.float32)}
    path = write_gguf_text_encoder(tmp_path / "te.gguf", weights, tokenizer_json)
    metadata = file_headers.gguf_tokenizer(path)
    assert metadata["tokenizer.ggml.pre"] == "qwen2"
    assert "tokenizer.ggml.tokens" not in file_headers.read(path).metadata  # listing skips them
    reference = Tokenizer.from_file(str(tokenizer_json))
    rebuilt = gguf_tokenizer(metadata)
    for text in TEXTS:
        assert (
            rebuilt.encode(text, add_special_tokens=False).ids
            == reference.encode(text, add_special_tokens=False).ids
        )
    with pytest.raises(ValueError, match="not Qwen's byte-level BPE"):
        gguf_tokenizer({**metadata, "tokenizer.ggml.model": "llama"})


GOOD_ENTRY = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}


@pytest.mark.parametrize(
    "doc",
    [
        [1, 2, 3],
        {"a.weight": "F32"},
        {"a.weight": {**GOOD_ENTRY, "shape": 4}},
        {"a.weight": {**GOOD_ENTRY, "shape": [-1]}},
        {"a.weight": {**GOOD_ENTRY, "data_offsets": "0,4"}},
        {"a.weight": {**GOOD_ENTRY, "data_offsets": [4, 0]}},
        {"a.weight": {"shape": [1], "data_offsets": [0, 4]}},
    ],
)
def test_a_safetensors_header_of_another_structure_is_refused_naming_the_file(tmp_path, doc):
    path = tmp_path / "odd.safetensors"
    path.write_bytes(frame(doc))
    with pytest.raises(HeaderError) as caught:
        file_headers.read(path)
    assert str(path) in str(caught.value)
    if isinstance(doc, dict):
        assert "'a.weight'" in str(caught.value)


def test_a_gguf_tensor_of_a_type_gguf_does_not_know_is_refused_naming_it(tmp_path):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((4, 32)).astype(np.float32)
    path = write_gguf(tmp_path / "new.gguf", {"blk.0.w.weight": (T.F32, weight)}, arch="qwen3")
    path.write_bytes(_relabel(path.read_bytes(), "blk.0.w.weight", 99))
    with pytest.raises(HeaderError, match=r"tensor blk\.0\.w\.weight is stored in GGML type 99"):
        file_headers.read(path)


def _tensor_info_at(data: bytes, name: str) -> int:
    """Where tensor `name`'s dims count stands in a GGUF file's bytes."""
    return data.index(name.encode()) + len(name)


def _relabel(data: bytes, name: str, kind: T) -> bytes:
    """A GGUF file's bytes with tensor `name`'s type id rewritten (its data left as it was)."""
    edited = bytearray(data)
    at = _tensor_info_at(data, name)
    (dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", edited, at + 4 + 8 * dims, kind)
    return bytes(edited)


def _reshape(data: bytes, name: str, row: int) -> bytes:
    """A GGUF file's bytes with tensor `name`'s row length (ggml's first dim) rewritten."""
    edited = bytearray(data)
    struct.pack_into("<Q", edited, _tensor_info_at(data, name) + 4, row)
    return bytes(edited)


def _realigned(data: bytes, value: int) -> bytes:
    """A GGUF file's bytes with its general.alignment (a uint32 entry) rewritten."""
    edited = bytearray(data)
    key = b"general.alignment"
    struct.pack_into("<I", edited, data.index(key) + len(key) + 4, value)
    return bytes(edited)


@pytest.mark.parametrize(
    "edit, refusal",
    [
        (
            lambda d: _relabel(d, "a.weight", T.F16),
            r"tensor b\.weight's data is at byte 1024 of the data section, not at 512",
        ),
        (
            lambda d: _relabel(d, "a.weight", T.Q8_0),
            r"not at 288 where tensor a\.weight \(Q8_0, 64 x 4\) ends",
        ),
        (lambda d: _relabel(d, "b.weight", T.F32), r"tensor c\.weight's data"),
        (lambda d: _reshape(d, "b.weight", 128), r"where tensor b\.weight \(F16, 128 x 8\)"),
        (lambda d: _relabel(d, "a.weight", T.Q4_K), r"a\.weight is Q4_K in rows of 64 values"),
        (lambda d: _realigned(d, 24), r"alignment.* power of two"),
    ],
)
def test_a_gguf_header_whose_types_or_shapes_do_not_fit_its_data_is_refused(
    tmp_path, edit, refusal
):
    """A relabelled type or an edited shape moves where each tensor's data would end; both
    readers refuse the file naming the tensors, as llama.cpp does, rather than read garbage."""
    from gmlx_server.engine.gguf import GGUFError, GGUFFile

    rng = np.random.default_rng(3)
    tensors = {
        "a.weight": (T.F32, rng.standard_normal((4, 64)).astype(np.float32)),
        "b.weight": (T.F16, rng.standard_normal((8, 64)).astype(np.float16)),
        "c.weight": (T.F32, rng.standard_normal((2, 64)).astype(np.float32)),
    }
    aligned = lambda writer: writer.add_uint32("general.alignment", 32)  # noqa: E731
    path = write_gguf(tmp_path / "m.gguf", tensors, arch="qwen3", metadata=aligned)
    assert file_headers.read(path).shapes["b.weight"] == (8, 64)
    GGUFFile(path)
    lying = tmp_path / "lying.gguf"
    lying.write_bytes(edit(path.read_bytes()))
    with pytest.raises(HeaderError, match=refusal) as caught:
        file_headers.read(lying)
    assert str(lying) in str(caught.value)
    with pytest.raises(GGUFError, match=refusal):
        GGUFFile(lying)


def test_bad_files_in_comfyuis_folders_are_left_out_and_said_once(tmp_path, caplog):
    """Files the listing cannot read, or whose tensors break a family's tests (a tensor of
    another rank), leave the healthy set listed and are named once in the log."""
    from gmlx_server.engine import components
    from gmlx_server.engine.families.z_image.components import CAPTION
    from gmlx_server.engine.spec import family_specs

    from tests.engine.comfy_files import float32_weights
    from tests.families.z_image.tiny.comfy import DIT_FILE, write_comfy_models

    _, models = write_comfy_models(tmp_path)
    dits, encoders = models / "diffusion_models", models / "text_encoders"
    (dits / "list.safetensors").write_bytes(frame([1, 2, 3]))
    write_gguf(dits / "new.gguf", {"w.weight": (T.F32, np.zeros((2, 32), np.float32))})
    (dits / "new.gguf").write_bytes(_relabel((dits / "new.gguf").read_bytes(), "w.weight", 99))
    flat = load_file(str(dits / DIT_FILE))
    flat["model.diffusion_model." + CAPTION] = flat["model.diffusion_model." + CAPTION].ravel()
    save_file(flat, str(dits / "flat_caption.safetensors"))
    encoder = float32_weights(encoders)
    encoder = {n: v.ravel() if "embed_tokens" in n else v for n, v in encoder.items()}
    save_file(encoder, str(encoders / "flat_embed.safetensors"))
    fp8 = {n: torch.from_numpy(v) for n, v in float32_weights(encoders).items()}
    fp8 = {n: v.to(torch.float8_e4m3fn) if "embed_tokens" in n else v for n, v in fp8.items()}
    save_torch(fp8, str(encoders / "qwen_3_fp8.safetensors"))
    folders = {k: [models / n for n in names] for k, names in components.COMFY_FOLDERS.items()}
    with caplog.at_level("WARNING", logger="gmlx.server"):
        assert list(components.comfy_sets(folders, family_specs())) == [
            "z_image_turbo_tiny + qwen_3_tiny + ae_tiny"
        ]
        said = [r.getMessage() for r in caplog.records]
        components.comfy_sets(folders, family_specs())
    for bad in ("list.safetensors", "new.gguf", "flat_caption.safetensors", "flat_embed"):
        assert [m for m in said if bad in m], (bad, said)
    assert [m for m in said if "qwen_3_fp8.safetensors: tensor" in m and "F8_E4M3" in m], said
    assert len(caplog.records) == len(said)  # the second listing says nothing again
