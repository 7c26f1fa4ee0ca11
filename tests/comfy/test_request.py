"""Step rows from ComfyUI's DiT call (docs/contract.md §7.5) and the refusals by name."""

import numpy as np
import pytest
from gmlx_comfy.errors import GmlxError
from gmlx_comfy.request import (
    build_rows,
    check_call,
    prefix_cache_enabled,
    refusal_text,
    step_timestep,
    suspects,
)
from gmlx_contract.hashing import tensor_hash


def _rng(seed=0):
    return np.random.default_rng(seed)


def test_cond_and_uncond_rows_name_their_unpadded_conditioning():
    rng = _rng()
    cond = rng.standard_normal((1, 7, 16), dtype=np.float32)
    uncond = rng.standard_normal((1, 3, 16), dtype=np.float32)
    # GmlxCrossAttn pads uncond to 7 rows with zeros when ComfyUI batches the two
    padded = np.concatenate([cond, np.pad(uncond, ((0, 0), (0, 4), (0, 0)))])
    out = build_rows(2, padded, num_tokens=[7, 3])
    assert [r["num_tokens"] for r in out.rows] == [7, 3]
    assert out.rows[0]["cond"] == tensor_hash(cond)
    assert out.rows[1]["cond"] == tensor_hash(uncond)  # the hash `encode` answered
    assert set(out.tensors) == {tensor_hash(cond), tensor_hash(uncond)}
    np.testing.assert_array_equal(out.tensors[out.rows[1]["cond"]], uncond)


def test_context_of_batch_one_is_broadcast_and_uploaded_once():
    ctx = _rng(1).standard_normal((1, 5, 8), dtype=np.float32)
    out = build_rows(3, ctx)
    assert len(out.rows) == 3 and len({r["cond"] for r in out.rows}) == 1
    assert len(out.tensors) == 1 and out.rows[0]["num_tokens"] == 5


def test_reference_latents_and_slots_per_row():
    rng = _rng(2)
    ctx = rng.standard_normal((2, 4, 8), dtype=np.float32)
    ref_a = rng.standard_normal((2, 16, 4, 4), dtype=np.float32)  # batch 2: row i takes i
    ref_b = rng.standard_normal((1, 16, 2, 2), dtype=np.float32)  # batch 1: every row takes 0
    out = build_rows(2, ctx, ref_latents=[ref_a, ref_b], image_slots=[[1, 3], [0, 2]])
    assert out.rows[0]["ref_latents"] == [tensor_hash(ref_a[0:1]), tensor_hash(ref_b)]
    assert out.rows[1]["ref_latents"] == [tensor_hash(ref_a[1:2]), tensor_hash(ref_b)]
    assert out.rows[0]["image_slots"] == [1, 3] and out.rows[1]["image_slots"] == [0, 2]
    assert "prefix_cache" not in out.rows[0]


def test_rows_without_references_carry_no_reference_members():
    out = build_rows(1, np.zeros((1, 2, 4), np.float32), prefix_cache=False)
    assert out.rows == [
        {
            "cond": tensor_hash(np.zeros((1, 2, 4), np.float32)),
            "num_tokens": 2,
            "prefix_cache": False,
        }
    ]


def test_row_tensors_are_float32_even_from_float16():
    ctx = _rng(3).standard_normal((1, 3, 4)).astype(np.float16)
    out = build_rows(1, ctx)
    (array,) = out.tensors.values()
    assert array.dtype == np.float32 and out.rows[0]["cond"] == tensor_hash(ctx.astype(np.float32))


def test_mismatched_batches_and_token_counts_are_refused():
    with pytest.raises(GmlxError, match="batch"):
        build_rows(3, np.zeros((2, 4, 8), np.float32))
    with pytest.raises(GmlxError, match="tokens"):
        build_rows(1, np.zeros((1, 4, 8), np.float32), num_tokens=[5])


def test_timestep_broadcast_and_count():
    np.testing.assert_array_equal(step_timestep(np.array([0.5]), 3), np.full(3, 0.5, np.float32))
    assert step_timestep(np.array([0.5, 0.25], np.float64), 2).dtype == np.float32
    with pytest.raises(GmlxError):
        step_timestep(np.array([0.5, 0.25]), 3)


def test_prefix_cache_option():
    assert prefix_cache_enabled({})
    assert not prefix_cache_enabled({"qwen_image21_cache": {"device": "off"}})
    assert prefix_cache_enabled({"qwen_image21_cache": {"device": "auto"}})


@pytest.mark.parametrize(
    ("cache", "refused"),
    [
        (None, False),
        ({"device": "auto", "dtype": "default"}, False),
        ({"device": "off"}, False),
        ({"device": "auto", "dtype": "int8"}, True),
        ({"device": "cpu", "dtype": "int4"}, True),
    ],
)
def test_a_qwen_image21_cache_dtype_other_than_default_is_refused(cache, refused):
    options = {} if cache is None else {"qwen_image21_cache": cache}
    refusals = check_call({}, options).refusals
    assert bool(refusals) is refused
    if refused:
        assert refusals == [
            f"Qwen-Image 2.1's cache dtype {cache['dtype']!r} (the server keeps its prefix"
            " states at the model's own dtype: choose default)"
        ]


def test_plain_call_passes():
    check = check_call(
        {"num_tokens": [3], "image_slots": None, "ref_latents": None},
        {"cond_or_uncond": [0, 1], "sigmas": 1.0, "wrappers": {"apply_model": {}}},
    )
    assert check.refusals == [] and check.unknown_options == []


def test_refusals_are_named():
    check = check_call(
        {"ref_latents": [1], "ref_latents_method": "offset", "y": 1, "guidance": 3.5},
        {
            "patches": {"attn1_patch": [print]},
            "patches_replace": {"dit": {}},
            "rope_options": {"scale_x": 2},
            "wrappers": {"diffusion_model": {"teacache": [print]}},
            "my_custom_key": 1,
        },
        control=object(),
        edit_capable=False,
        default_ref_method="index",
    )
    text = refusal_text(check.refusals, " (from node ControlNetApply)")
    for word in (
        "ControlNet",
        "patches (attn1_patch)",
        "patches_replace",
        "rope_options",
        "diffusion-model wrapper",
        "'y'",
        "edit_capable",
        "'offset'",
        "from node ControlNetApply",
    ):
        assert word in text
    assert text.startswith("gmlx:")
    assert check.unknown_options == ["my_custom_key"]
    assert "'guidance'" not in text  # ignored where the DiT has no guidance embedder
    assert "'guidance'" in refusal_text(
        check_call({"guidance": 3.5}, {}, guidance_embedder=True).refusals
    )


def test_empty_patch_dicts_are_not_refusals():
    assert check_call({}, {"patches": {}, "patches_replace": {}}).refusals == []


def test_suspects_name_matching_nodes():
    classes = ["KSampler", "ControlNetApplyAdvanced", "PerturbedAttentionGuidance"]
    assert suspects(classes, ["ControlNet"]) == ["ControlNetApplyAdvanced"]
    assert suspects(classes, ["attention"]) == ["PerturbedAttentionGuidance"]


class KV_Attn_Input:  # noqa: N801 - the class name ComfyUI's Flux KV Cache node gives its patch
    def __call__(self, q, k, v, extra_options, **kwargs):
        return {"q": q, "k": k, "v": v}


def model_input_patch(inputs):
    return inputs


FLUX_KV_CACHE = {"patches": {"attn1_patch": [KV_Attn_Input()], "post_input": [model_input_patch]}}


def test_comfy_flux_kv_cache_becomes_ref_cache_where_the_server_has_it():
    """ComfyUI's Flux KV Cache node patches attention; a server with the ref_cache feature
    takes the node's place (docs/contract.md §3.4), one without refuses it by name."""
    honoured = check_call({"ref_latents": [1]}, FLUX_KV_CACHE, ref_cache=True)
    assert honoured.refusals == [] and honoured.ref_cache is True
    refused = check_call({"ref_latents": [1]}, FLUX_KV_CACHE, ref_cache=False)
    assert refused.ref_cache is False
    assert "Flux KV Cache" in refusal_text(refused.refusals)
    other = {"patches": {"attn1_patch": [print], "post_input": [model_input_patch]}}
    assert check_call({}, other, ref_cache=True).refusals  # another attention patch
    assert check_call({}, {}, ref_cache=True).ref_cache is False


def slg_patches(*keys, module="/opt/ComfyUI/comfy_extras/nodes_slg"):
    """transformer_options as ComfyUI's skip-layer guidance nodes leave them: their identity
    function `skip` (of their node's method; ComfyUI names the module by its file's path)
    under ("single_block" or "double_block", index) of patches_replace["dit"]."""

    def skip(args, extra_args):
        return args

    skip.__module__ = module
    skip.__qualname__ = "SkipLayerGuidanceDiTSimple.execute.<locals>.skip"
    return {"patches_replace": {"dit": {key: skip for key in keys}}}


def test_skip_layer_guidance_becomes_skip_where_the_server_has_it():
    """SkipLayerGuidanceDiT(Simple)'s single-block skips are the step's `skip` on a server with
    the skip_blocks feature (docs/contract.md §7.5); anything else stays refused by name."""
    options = slg_patches(("single_block", 22), ("single_block", 3))
    honoured = check_call({}, options, skip_blocks=True)
    assert honoured.refusals == [] and honoured.skip == [3, 22]
    refused = check_call({}, options, skip_blocks=False)
    assert refused.skip == [] and "patches_replace" in refusal_text(refused.refusals)
    assert "SkipLayer" in refused.suspect_words
    for other in (
        slg_patches(("double_block", 3)),  # MOSS-Image's blocks are single-stream
        slg_patches(("single_block", 3), module="/opt/ComfyUI/custom_nodes/other"),
        {"patches_replace": {"dit": {("single_block", 3): print}}},
    ):
        assert check_call({}, other, skip_blocks=True).refusals
    assert check_call({}, {}, skip_blocks=True).skip == []


def test_latent_sides_off_the_patch_wrap_round_as_comfyuis_own_dits_pad():
    """A stock latent of 1000×600 (75×125 cells) for Z-Image (2×2 patches): padded to whole
    patches as ComfyUI's pad_to_patch_size pads (torch's circular pad, bottom and right), so
    it samples as on ComfyUI's own Z-Image; whole patches go as they are."""
    import torch
    from gmlx_comfy.request import latent_patch, wrapped_to_patch

    patch = latent_patch({"latent": {"stride": 8, "patch": 2}})
    x = np.random.default_rng(0).standard_normal((2, 16, 75, 125)).astype(np.float32)
    padded = wrapped_to_patch(x, patch)
    comfy = torch.nn.functional.pad(torch.from_numpy(x), (0, 1, 0, 1), mode="circular")
    assert padded.shape == (2, 16, 76, 126)
    np.testing.assert_array_equal(padded, comfy.numpy())
    whole = x[:, :, :74, :124]
    assert wrapped_to_patch(whole, patch) is whole
    frames = np.stack([x, x + 1], axis=2)  # a video latent's frames: its last two sides pad
    assert wrapped_to_patch(frames, patch).shape == (2, 16, 2, 76, 126)
    assert latent_patch({"latent": {"stride": 16}}) == latent_patch({}) == 1


def test_a_negative_steps_on_the_typed_prompt_unless_comfyui_zeroed_it():
    """Where the server rewrote the prompt, a negative or an edit steps on the prompt as typed;
    a conditioning ConditioningZeroOut made (zeros, its other keys kept) stays zero."""
    from gmlx_comfy.request import typed_where_it_belongs

    encoded, typed = np.ones((1, 4, 8), np.float32), np.full((1, 3, 8), 2.0, np.float32)
    conds = {"cross_attn": encoded, "gmlx_cond_typed": typed}
    assert typed_where_it_belongs(conds) is encoded  # a positive text-to-image row
    assert typed_where_it_belongs({**conds, "prompt_type": "negative"}) is typed
    assert typed_where_it_belongs({**conds, "reference_latents": [encoded]}) is typed
    zeroed = {**conds, "cross_attn": np.zeros_like(encoded), "prompt_type": "negative"}
    assert typed_where_it_belongs(zeroed) is zeroed["cross_attn"]
    assert typed_where_it_belongs({"cross_attn": encoded, "prompt_type": "negative"}) is encoded


def test_a_status_of_other_weights_differs_in_the_facts_a_model_is_built_from():
    """What a MODEL holds (latent format, sampling, conditioning, class) against the status
    now; residency and memory change with every load and say nothing of that."""
    from gmlx_comfy.request import changed_facts

    built = {
        "family": "z_image",
        "variant": "turbo",
        "sampling": {"shift": 3.0},
        "residency": {"dit": {"resident": False}},
        "memory": {"resident_bytes": 0},
    }
    loaded = {**built, "residency": {"dit": {"resident": True}}, "memory": {"resident_bytes": 9}}
    assert changed_facts(built, loaded) == []
    other = {**built, "variant": "base", "sampling": {"shift": 6.0}}
    assert changed_facts(built, other) == ["variant", "sampling.shift"]
    newer = {**built, "sampling": {"shift": 3.0, "a_member_added": 1}, "latent": {}}
    assert changed_facts(built, newer) == []  # what a newer server adds changes nothing
