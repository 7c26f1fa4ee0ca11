"""denoise_step: rows, slots, conventions and the prefix cache, against diffusers per row."""

from __future__ import annotations

import numpy as np
import pytest
from gmlx_server.engine.base import EngineInputError, StepCall, StepRow
from gmlx_server.engine.families.qwen_image21.dit import QwenImage21DiT
from gmlx_server.engine.families.qwen_image21.step import PrefixCache, denoise_step

from tests.compare import rel_l2
from tests.families.qwen_image21.dit.reference import reference_row

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny(tiny_transformers):
    folder, model, _ = tiny_transformers["default"]
    return QwenImage21DiT.load(folder), model


def make_rows(model, seed):
    """Three rows of different lengths: text only, two references in slots, one reference
    whose slot is missing (so it goes after the text)."""
    rng = np.random.default_rng(seed)
    dim, channels = model.config.context_in_dim, model.config.in_channels

    def cond(n):
        return rng.standard_normal((1, n, dim)).astype(np.float32)

    def ref(h, w):
        return rng.standard_normal((1, channels, h, w)).astype(np.float32)

    refs = (ref(4, 4), ref(2, 6))
    return [
        StepRow(cond=cond(5), cond_key="wire:a"),
        StepRow(
            cond=cond(9),
            cond_key="wire:b",
            ref_latents=refs,
            ref_keys=("r1", "r2"),
            image_slots=(2, 6),
        ),
        StepRow(cond=cond(7), cond_key="wire:c", ref_latents=refs[:1], ref_keys=("r1",)),
    ]


def expected_rows(model, rows, x, sigmas):
    out = []
    for row, xi, sigma in zip(rows, x, sigmas, strict=True):
        refs = [r[0] for r in row.ref_latents]
        slots = list(row.image_slots) + [row.cond.shape[1]] * (len(refs) - len(row.image_slots))
        out.append(reference_row(model, row.cond[0], xi, float(sigma), refs, slots))
    return np.stack(out)


def latents(model, batch, seed, hw=(4, 6)):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, model.config.in_channels, *hw)).astype(np.float32)


def test_batch_of_rows_of_different_lengths(tiny):
    dit, model = tiny
    rows = make_rows(model, seed=10)
    x = latents(model, 3, seed=11)
    sigmas = np.array([0.9, 0.5, 0.2], np.float32)
    result = denoise_step(dit, PrefixCache(1 << 30), x, sigmas, rows)
    assert result.out.dtype == np.float32 and result.out.shape == x.shape
    expected = expected_rows(model, rows, x, sigmas)
    for i in range(3):
        assert rel_l2(result.out[i], expected[i]) <= TOLERANCE


def test_batched_rows_equal_rows_alone(tiny):
    dit, model = tiny
    rows = make_rows(model, seed=12)
    x = latents(model, 3, seed=13)
    sigmas = np.array([0.3, 0.7, 1.0], np.float32)
    together = denoise_step(dit, PrefixCache(0), x, sigmas, rows).out
    for i in range(3):
        alone = denoise_step(dit, PrefixCache(0), x[i : i + 1], sigmas[i : i + 1], rows[i : i + 1])
        assert rel_l2(together[i], alone.out[0]) <= 1e-6


def test_prefix_cache_hit_equals_miss_bit_exact(tiny):
    dit, model = tiny
    rows = make_rows(model, seed=14)
    cache = PrefixCache(1 << 30)
    x = latents(model, 3, seed=15)
    sigmas = np.array([0.8, 0.8, 0.8], np.float32)
    miss = denoise_step(dit, cache, x, sigmas, rows, StepCall(run="r"))
    hit = denoise_step(dit, cache, x, sigmas, rows, StepCall(run="r"))
    off_rows = [StepRow(**{**row.__dict__, "prefix_cache": False}) for row in rows]
    off = denoise_step(dit, cache, x, sigmas, off_rows, StepCall(run="r"))
    assert (miss.prefix_cache, hit.prefix_cache, off.prefix_cache) == ("miss", "hit", "off")
    assert np.array_equal(miss.out, hit.out)
    assert np.array_equal(miss.out, off.out)


def test_cache_key_covers_latent_size_and_references(tiny):
    dit, model = tiny
    rows = make_rows(model, seed=16)
    cache = PrefixCache(1 << 30)
    denoise_step(dit, cache, latents(model, 3, 17), np.float32(0.5), rows)
    assert (
        denoise_step(dit, cache, latents(model, 3, 17), np.float32(0.4), rows).prefix_cache == "hit"
    )
    assert (
        denoise_step(
            dit, cache, latents(model, 3, 17, hw=(2, 2)), np.float32(0.4), rows
        ).prefix_cache
        == "miss"
    )
    swapped = StepRow(**{**rows[1].__dict__, "ref_keys": ("r2", "r1")})
    assert (
        denoise_step(dit, cache, latents(model, 1, 17), np.float32(0.4), [swapped]).prefix_cache
        == "miss"
    )


def test_conventions_agree_and_unknown_is_refused(tiny):
    dit, model = tiny
    rows = make_rows(model, seed=18)[:2]
    x = latents(model, 2, seed=19)
    comfy = denoise_step(dit, PrefixCache(0), x, np.array([0.6, 0.3]), rows, StepCall("comfy"))
    ref = denoise_step(dit, PrefixCache(0), x, np.array([0.6, 0.3]), rows, StepCall("reference"))
    assert np.array_equal(comfy.out, ref.out)
    expected = expected_rows(model, rows, x, [0.6, 0.3])
    assert rel_l2(comfy.out, expected) <= TOLERANCE
    with pytest.raises(EngineInputError):
        denoise_step(dit, PrefixCache(0), x, np.array([0.6, 0.3]), rows, StepCall("flux"))


def test_single_timestep_applies_to_every_row(tiny):
    dit, model = tiny
    rows = make_rows(model, seed=20)[:2]
    x = latents(model, 2, seed=21)
    one = denoise_step(dit, PrefixCache(0), x, np.array(0.4, np.float32), rows).out
    two = denoise_step(dit, PrefixCache(0), x, np.array([0.4, 0.4], np.float32), rows).out
    assert np.array_equal(one, two)
    with pytest.raises(EngineInputError):
        denoise_step(dit, PrefixCache(0), x, np.array([0.4, 0.4, 0.4]), rows)


def test_extra_slots_are_dropped_and_missing_slots_go_after_the_text(tiny):
    dit, model = tiny
    row = make_rows(model, seed=22)[1]
    x = latents(model, 1, seed=23)
    text_len = row.cond.shape[1]

    def run(slots):
        r = StepRow(**{**row.__dict__, "image_slots": slots, "prefix_cache": False})
        return denoise_step(dit, PrefixCache(0), x, np.float32(0.5), [r]).out

    assert np.array_equal(run((2, 6, 8)), run((2, 6)))
    assert np.array_equal(run((2,)), run((2, text_len)))
    assert np.array_equal(run(()), run((text_len, text_len)))
    assert rel_l2(run((2,)), run((2, 6))) > 100 * TOLERANCE


@pytest.mark.parametrize(
    "change",
    [
        {"image_slots": (6, 2)},
        {"image_slots": (2, 10)},
        {"image_slots": (-1, 2)},
        {"ref_latents": (np.zeros((1, 16, 3, 3), np.float32),), "ref_keys": ("odd",)},
        {"ref_latents": (np.zeros((1, 8, 2, 2), np.float32),), "ref_keys": ("narrow",)},
        {"cond": np.zeros((1, 4, 32), np.float32)},
        {"cond": np.zeros((1, 0, 64), np.float32)},
    ],
)
def test_bad_rows_are_refused(tiny, change):
    dit, model = tiny
    row = StepRow(**{**make_rows(model, seed=24)[1].__dict__, **change})
    with pytest.raises(EngineInputError):
        denoise_step(dit, PrefixCache(0), latents(model, 1, 25), np.float32(0.5), [row])


def test_x_must_match_rows_and_channels(tiny):
    dit, model = tiny
    rows = make_rows(model, seed=26)[:1]
    with pytest.raises(EngineInputError):
        denoise_step(dit, PrefixCache(0), latents(model, 2, 27), np.float32(0.5), rows)
    with pytest.raises(EngineInputError):
        denoise_step(dit, PrefixCache(0), np.zeros((1, 8, 2, 2), np.float32), np.float32(0.5), rows)
