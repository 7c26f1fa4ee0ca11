"""GGUF files as MLX weights (engine/gguf.py): floats, prefixes, orig_shape, the raw blocks of
quantized tensors, and the refusals."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gmlx_server.engine import gguf as gguf_files
from gmlx_server.engine.gguf import GGUFError, GGUFFile

from tests.engine.gguf_files import encoded, random_blocks, reference, write_gguf


def test_floats_prefixes_and_orig_shape(tmp_path):
    rng = np.random.default_rng(0)
    value = rng.standard_normal((8, 64)).astype(np.float32)
    tensors = {
        f"model.diffusion_model.{kind.name}.weight": (kind, encoded(kind, value, rng))
        for kind in (T.F32, T.F16, T.BF16, T.Q8_0)
    }
    flat = value.reshape(2, 256)  # ComfyUI-GGUF's rows of 256, with the shape it came from
    tensors["model.diffusion_model.flat.weight"] = (T.Q8_0, encoded(T.Q8_0, flat, rng))
    orig = {"model.diffusion_model.flat.weight": (8, 64)}
    path = write_gguf(tmp_path / "m.gguf", tensors, orig_shapes=orig)
    file = GGUFFile(path)
    assert file.architecture == "qwen_image"
    assert sorted(file.entries) == [
        "BF16.weight",
        "F16.weight",
        "F32.weight",
        "Q8_0.weight",
        "flat.weight",
    ]
    assert {name: entry.shape for name, entry in file.entries.items()} == dict.fromkeys(
        file.entries, (8, 64)
    )
    for kind in (T.F32, T.F16, T.BF16):
        got = file.read(f"{kind.name}.weight")
        assert got.dtype == gguf_files.FLOAT_TYPES[kind]
        expected = reference(kind, tensors[f"model.diffusion_model.{kind.name}.weight"][1])
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), expected.reshape(8, 64))
    assert isinstance(file.read("Q8_0.weight"), gguf_files.Quantized)
    # a reshaped tensor comes back in its own shape, dequantized exactly
    restored = file.read("flat.weight", mx.float32)
    expected = reference(T.Q8_0, tensors["model.diffusion_model.flat.weight"][1]).reshape(8, 64)
    np.testing.assert_array_equal(np.array(restored), expected)
    assert file.type_counts() == {"BF16": 1, "F16": 1, "F32": 1, "Q8_0": 2}


def test_a_file_cut_short_is_refused_naming_the_tensor(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {
        "a.weight": (T.F32, rng.standard_normal((4, 64)).astype(np.float32)),
        "b.weight": (T.Q4_K, random_blocks(T.Q4_K, (64, 256), rng)),
    }
    path = write_gguf(tmp_path / "m.gguf", tensors)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFError, match=r"cut\.gguf .*cut short: tensor b\.weight"):
        GGUFFile(cut)
    cut.write_bytes(data[:40])  # inside the header
    with pytest.raises(GGUFError, match=r"cut\.gguf is not a readable GGUF file"):
        GGUFFile(cut)
    not_gguf = tmp_path / "model.safetensors.gguf"
    not_gguf.write_bytes(b"\x00" * 64)
    with pytest.raises(GGUFError, match="model.safetensors.gguf"):
        GGUFFile(not_gguf)


def test_a_type_the_server_does_not_read_is_refused_naming_it(tmp_path):
    rng = np.random.default_rng(2)
    tensors = {"odd.weight": (T.IQ4_NL, rng.integers(0, 256, (4, 18 * 8), dtype=np.uint8))}
    path = write_gguf(tmp_path / "m.gguf", tensors)
    with pytest.raises(GGUFError, match=r"m\.gguf: tensor odd\.weight is IQ4_NL"):
        GGUFFile(path)


def mapped_rss(path) -> int:
    """Resident bytes of this process's mappings of `path` (Linux's /proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = len(fields) >= 6 and fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


SPILL = 2 * 1024 * 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's smaps")
@pytest.mark.parametrize("kind", [T.F32, T.Q8_0])
def test_a_read_tensor_leaves_no_file_pages_resident(tmp_path, kind):
    """The loader drops a tensor's pages of the memory-mapped file once read, so a load's RSS
    holds what it loaded, not also the file; the values are the file's."""
    rng = np.random.default_rng(4)
    tensors = {
        f"t{i}": (kind, encoded(kind, rng.standard_normal((2048, 2048)), rng)) for i in range(3)
    }
    path = write_gguf(tmp_path / "pages.gguf", tensors)
    file = GGUFFile(path)
    header = mapped_rss(path)  # the metadata the reader parsed
    for name, (_, data) in tensors.items():
        value = file.read(name, as_float=True)
        np.testing.assert_array_equal(np.array(value), reference(kind, data))
        # what may stay: the pages the kernel mapped past the tensor's end with the last ones
        # it read (it maps a page-cache folio whole), dropped when the next tensor is read
        assert mapped_rss(path) - header <= SPILL, name
    assert file.entries["t0"].nbytes >= 2 * SPILL  # what each read would have left resident
