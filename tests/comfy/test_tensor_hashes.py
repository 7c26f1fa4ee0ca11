"""Row hashes memoised across steps (docs/contract.md §7.5): the same bytes hash once, edits rehash."""

import gc
import weakref

import numpy as np
import torch
from gmlx_comfy.request import as_f32, build_rows
from gmlx_comfy.tensor_hashes import MEMO_ENTRIES, TensorHashes, mark_row_sources
from gmlx_contract.hashing import tensor_hash


def _context(seed, shape=(2, 6, 8)):
    torch.manual_seed(seed)
    return torch.randn(*shape)


def test_the_same_tensor_is_hashed_once_across_steps():
    context, hashes = _context(0), TensorHashes(as_f32)
    first = build_rows(2, context, hashes=hashes)
    second = build_rows(2, context, hashes=hashes)
    assert hashes.hashed == 2 and first.rows == second.rows
    # per-row slices of one storage (context[i:i+1]) are told apart by their offset
    assert [r["cond"] for r in first.rows] == [
        tensor_hash(context[0:1].numpy()),
        tensor_hash(context[1:2].numpy()),
    ]
    np.testing.assert_array_equal(first.tensors[first.rows[1]["cond"]], context[1:2].numpy())


def test_token_prefixes_and_rows_of_one_storage_hash_apart():
    context, hashes = _context(1), TensorHashes(as_f32)
    rows = build_rows(2, context, num_tokens=[6, 4], hashes=hashes).rows
    again = build_rows(2, context, num_tokens=[4, 4], hashes=hashes).rows
    assert rows[1]["cond"] == again[1]["cond"] == tensor_hash(context[1:2, :4].numpy())
    assert again[0]["cond"] == tensor_hash(context[0:1, :4].numpy()) != rows[0]["cond"]
    assert hashes.hashed == 3


def test_a_tensor_edited_in_place_is_hashed_afresh():
    context, hashes = _context(2), TensorHashes(as_f32)
    before = build_rows(1, context[:1], hashes=hashes).rows[0]["cond"]
    context[0, 0, 0] += 1.0  # bumps the version counter shared by every view
    after = build_rows(1, context[:1], hashes=hashes).rows[0]["cond"]
    assert after != before and after == tensor_hash(context[:1].numpy())


def test_a_freed_tensor_is_not_mistaken_for_a_new_one_at_its_address():
    hashes = TensorHashes(as_f32)
    for seed in range(4):  # the allocator hands the freed block back, same shape and version
        context = _context(seed, (1, 64, 64))
        assert hashes.digest(context) == tensor_hash(context.numpy())
        del context
        gc.collect()
    assert hashes.hashed == 4


def test_rows_of_a_per_step_concatenation_hash_once_from_their_sources():
    """ComfyUI concatenates (and pads) cond and uncond afresh for each step."""
    cond, uncond = _context(3, (1, 6, 8)), _context(4, (1, 3, 8))
    hashes = TensorHashes(as_f32)
    for _ in range(3):
        batch = torch.cat([cond, torch.nn.functional.pad(uncond, (0, 0, 0, 3))])
        mark_row_sources(batch, [cond, uncond])
        out = build_rows(2, batch, num_tokens=[6, 3], hashes=hashes)
        del batch
    assert hashes.hashed == 2
    assert [r["cond"] for r in out.rows] == [tensor_hash(cond.numpy()), tensor_hash(uncond.numpy())]
    uncond.mul_(2.0)
    batch = torch.cat([cond, torch.nn.functional.pad(uncond, (0, 0, 0, 3))])
    mark_row_sources(batch, [cond, uncond])
    rows = build_rows(2, batch, num_tokens=[6, 3], hashes=hashes).rows
    assert rows[1]["cond"] == tensor_hash(uncond.numpy()) and hashes.hashed == 3


def test_a_batch_edited_after_concatenation_is_read_from_itself():
    cond, uncond = _context(5, (1, 4, 8)), _context(6, (1, 4, 8))
    batch = torch.cat([cond, uncond])
    mark_row_sources(batch, [cond, uncond])
    batch[1] = 0.0
    rows = build_rows(2, batch, hashes=TensorHashes(as_f32)).rows
    assert rows[1]["cond"] == tensor_hash(np.zeros((1, 4, 8), np.float32))


def test_reference_latents_and_inference_tensors():
    with torch.inference_mode():  # ComfyUI samples under inference mode: no version counter
        context, ref = _context(7, (1, 4, 8)), _context(8, (1, 16, 4, 4))
        refs = torch.cat([ref, ref])
        mark_row_sources(refs, [ref, ref])
    hashes = TensorHashes(as_f32)
    rows = build_rows(2, context, ref_latents=[refs], hashes=hashes).rows
    build_rows(2, context, ref_latents=[refs], hashes=hashes)
    assert rows[0]["ref_latents"] == rows[1]["ref_latents"] == [tensor_hash(ref.numpy())]
    assert hashes.hashed == 2


def test_half_precision_rows_hash_as_float32_and_numpy_is_never_memoised():
    context = _context(9, (1, 3, 4)).to(torch.bfloat16)
    hashes = TensorHashes(as_f32)
    out = build_rows(1, context, hashes=hashes)
    assert out.rows[0]["cond"] == tensor_hash(context.float().numpy())
    assert next(iter(out.tensors.values())).dtype == np.float32
    array = context.float().numpy()
    hashes.digest(array)
    array[0, 0, 0] += 1.0  # numpy keeps no version counter: hashed every time
    assert hashes.digest(array) == tensor_hash(array) and hashes.hashed == 3


def test_the_memo_is_bounded_and_holds_no_tensor():
    hashes = TensorHashes(as_f32)
    tensors = [torch.full((1, 2, 2), float(i)) for i in range(MEMO_ENTRIES + 10)]
    for t in tensors:
        hashes.digest(t)
    assert len(hashes) == MEMO_ENTRIES
    probe = torch.zeros(1, 2, 2)
    hashes.digest(probe)
    freed = weakref.ref(probe.untyped_storage())
    del probe
    gc.collect()
    assert freed() is None  # the memo kept no reference to the tensor or its storage
