"""Qwen-Image 2.1 as an `ImageModel`: the DiT, the VAE and the prompt encoder of one folder.

The folder is in diffusers layout (model_index.json with `_class_name` "QwenImage21Pipeline",
transformer/, vae/, text_encoder/, processor/, scheduler/). The variant is `turbo` when
model_index.json carries `sample_sigmas` (a fixed schedule), else `base`. Its facts as data
(identification, status facts, sampling) live in spec.py; its memory plan and model here.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from gmlx_contract.schedules import qwen_image21_rule

from ...base import EncodeResult, StepCall, StepResult, StepRow
from ...family import RESERVE_ROWS, FamilyModel, FolderFamily
from ...lora import table_id
from ...nn import cpu_ops
from ...quantize import float_weight_bytes
from ...spec import model_index
from ...vaes.qwen_image21 import QwenImage21VAEPart
from .dit import DiTConfig, QwenImage21DiT
from .prompt import QwenImage21PromptEncoder
from .spec import SPEC
from .step import PrefixCache, RowPlan, denoise_step, plan_row

# Prefix states kept outside runs (docs/contract.md §3.3), least recently used shed first.
PREFIX_BUDGET_BYTES = 2 << 30
# scheduler_config.json keys -> keys of the qwen_image21 schedule object (docs/contract.md §5.3).
SCHEDULER_KEYS = {
    "base_image_seq_len": "base_len",
    "max_image_seq_len": "max_len",
    "base_shift": "base_shift",
    "max_shift": "max_shift",
    "shift_terminal": "terminal",
}

# ---------------------------------------------------------------- memory plan (docs/contract.md §3.5)
# A step's peak beyond the weights and the states already held. The blocks run one after
# another, each block's activations freed as their last reader runs (MLX frees a buffer then;
# `memory.allocation_bound` keeps it from allocating far ahead of the work), so the peak is
# that of one block's largest phase, for every row at once, counted in buffers of the DiT's
# shapes per target token (measured phase by phase at full size: docs/benchmarks.md,
# "Full-size memory"; tests/families/qwen_image21/test_estimates.py checks the tiny model).
RESIDUAL_BUFFERS = 2  # the block's input and its normed, modulated form
QKV_BUFFERS = 3  # the fused q/k/v projection (v is a view of it)
QK_F32_BUFFERS = 5  # q and k in float32 around their RMS norm and RoPE, with a temporary
ATTENTION_BUFFERS = 4  # q and k as attended, the attention's output and its merged heads
GATE_UP_BUFFERS = 2  # gate and up, at the MLP's width
# SiLU(gate) * up at the MLP's width: cpu_ops' sigmoid (the CPU backend in float32) runs as
# several kernels, each output alive until the product is taken; elsewhere one fused product.
ACTIVATION_BUFFERS = {True: 4, False: 1}
# The next operation's output, allocated as it is queued while the one before it runs (at
# most the MLP's width).
QUEUED_BUFFERS = 1
# Per row of the target pass: its [prefix, target] keys and values, the transposed keys and the
# values with the ones column of cpu_ops.attention.
KV_BUFFERS = 4
# cpu_ops.attention (the CPU backend in float32) holds one block of scores at a time per row:
# scores, max-subtracted, exp2's temporaries. GPU backends use MLX's fused attention (none).
SCORE_BLOCK_BUFFERS = 8
# The prefix's text pieces go through mx.fast.scaled_dot_product_attention with a causal mask,
# which on the CPU backend materialises float32 scores and the softmax.
PREFIX_SCORE_BUFFERS = 3
IO_BUFFERS = 3  # x and the output, as tokens and in float32
# The reference workload behind status `activation_reserve_bytes` (family.RESERVE_PIXELS): a
# guided step (2 rows) with 1024-token prefixes built fresh, or one VAE pass.
RESERVE_PREFIX = 1024


def sampling_row(model_dir: Path) -> dict:
    """The variant's own settings (docs/contract.md §2.3): turbo samples its fixed sigmas (with the
    terminal 0.0 appended); base uses the size-dependent rule with the scheduler's constants."""
    model_dir = Path(model_dir)
    fixed = model_index(model_dir).get("sample_sigmas")
    if fixed:
        sigmas = [float(s) for s in fixed] + [0.0]
        return {
            **SPEC.sampling["turbo"],
            "steps": len(sigmas) - 1,
            "sigmas": sigmas,
            "schedule": None,
            "neg_skip": [],
        }
    overrides = {}
    config_path = model_dir / "scheduler" / "scheduler_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        overrides = {
            ours: config[theirs]
            for theirs, ours in SCHEDULER_KEYS.items()
            if config.get(theirs) is not None
        }
    return {
        **SPEC.sampling["base"],
        "sigmas": None,
        "schedule": qwen_image21_rule(**overrides),
        "neg_skip": [],
    }


def step_peak_bytes(
    config: DiTConfig,
    itemsize: int,
    tokens: int,
    prefixes: list[tuple[int, bool]],
    blocked_attention: bool,
    weight_element_bytes: int = 0,
) -> int:
    """Peak bytes of one step beyond the weights and held states, for one row per entry of
    `prefixes` = (prefix length, built now?), `tokens` = h*w target tokens, activations of
    `itemsize` bytes; `weight_element_bytes`: what the blocks' quantized weights hold per
    element beside them while their matmuls run (quantize.float_weight_bytes: a dequantized
    or decoded float matrix). Pure: no allocation. A prefix built now adds its pass and its
    new state."""
    width, hidden = config.inner_dim, config.inner_dim * config.mlp_ratio
    rows = len(prefixes)
    qkv_weight = 3 * width * width * weight_element_bytes
    gate_up_weight = 2 * hidden * width * weight_element_bytes
    down_weight = hidden * width * weight_element_bytes  # beside the activation it multiplies
    per_token = {
        "qkv": (RESIDUAL_BUFFERS + QKV_BUFFERS) * width * itemsize + QK_F32_BUFFERS * width * 4,
        "attention": (1 + QKV_BUFFERS + ATTENTION_BUFFERS) * width * itemsize,
        "gate_up": RESIDUAL_BUFFERS * width * itemsize + GATE_UP_BUFFERS * hidden * itemsize,
        "activation": width * itemsize
        + (GATE_UP_BUFFERS + ACTIVATION_BUFFERS[blocked_attention]) * hidden * itemsize,
    }
    attention = rows * tokens * per_token["attention"]
    for length, _ in prefixes:
        keys = length + tokens
        attention += KV_BUFFERS * keys * width * itemsize
        if blocked_attention:
            attention += SCORE_BLOCK_BUFFERS * _score_block_bytes(config.num_heads, tokens, keys)
    block = max(
        rows * tokens * per_token["qkv"] + qkv_weight,
        attention,
        rows * tokens * per_token["gate_up"] + gate_up_weight,
        rows * tokens * per_token["activation"] + down_weight,
    )
    total = block + QUEUED_BUFFERS * rows * tokens * hidden * itemsize
    total += IO_BUFFERS * rows * tokens * max(config.in_channels, config.out_channels) * 4
    for length, built in prefixes:
        if built:
            total += 2 * config.num_layers * length * width * itemsize  # the new state
            total += length * (max(per_token.values()) + config.context_in_dim * 4)
            if blocked_attention:
                total += PREFIX_SCORE_BUFFERS * config.num_heads * length * length * 4
    return total


def _score_block_bytes(heads: int, rows: int, keys: int) -> int:
    """The scores one block of cpu_ops.attention holds (its `_block_shape`)."""
    if rows == 0 or keys == 0:
        return 0  # an empty image (the engine refuses it afterwards)
    query_rows, group = cpu_ops._block_shape(heads, rows, keys)
    return min(rows, query_rows) * group * keys * 4


class QwenImage21(FolderFamily):
    """The folder family with Qwen-Image 2.1's sampling row (its fixed sigmas or its rule)."""

    def sampling_row(self, model_dir: Path, variant: str) -> dict:
        return sampling_row(model_dir)


class QwenImage21Model(FamilyModel):
    """A loaded Qwen-Image 2.1: its DiT, Qwen3-VL whole (references through its vision tower
    and as VAE latents) and its own VAE; prefix states kept per conditioning."""

    DIT = QwenImage21DiT
    PROMPT = QwenImage21PromptEncoder
    VAE = QwenImage21VAEPart()

    @classmethod
    def reserve_bytes(cls, config: DiTConfig, image_tokens: int, dtype: mx.Dtype) -> int:
        """Its prefixes built fresh."""
        prefixes = [(RESERVE_PREFIX, True)] * RESERVE_ROWS
        blocked = cpu_ops.use_cpu_ops(dtype)
        return step_peak_bytes(config, dtype.size, image_tokens, prefixes, blocked)

    def __init__(
        self,
        model_dir: Path,
        model_id: str,
        variant: str,
        prefix_budget_bytes: int = PREFIX_BUDGET_BYTES,
        **arguments,
    ):
        super().__init__(model_dir, model_id, variant, **arguments)
        # what a step's quantized matmuls hold of their float weights (read here, on the thread
        # that loads: the quick plan runs on an HTTP thread and never asks MLX)
        self.dit_float_weight_bytes = float_weight_bytes(self.dit.weights, self.dit.dtype.size)
        self.prefix_cache = PrefixCache(prefix_budget_bytes)

    # -- memory plan (server/memory.py asks these) ---------------------------------------

    def held_bytes(self) -> int:
        """What the model holds beyond its weights: prefix states and patched weight trees."""
        return self.prefix_cache.total_bytes + self.tables.held_bytes

    def plan_step(self, x_shape: tuple, rows: list[StepRow], table=None) -> list[RowPlan]:
        """Each row's plan (prefix layout, state key) for a step of x_shape: made once per step
        by the memory plan, then handed to step_peak_bytes, step_keys and denoise_step."""
        _, _, h, w = x_shape
        return [plan_row(row, i, self.dit, (h, w), table_id(table)) for i, row in enumerate(rows)]

    def step_peak_bytes(
        self,
        x_shape: tuple,
        rows: list[StepRow] | None,
        table=None,
        plans: list[RowPlan] | None = None,
    ) -> int:
        """A step's peak beyond weights and held states: without rows (the quick plan) the
        target pass alone; with them each row's prefix length, counting the states not held."""
        batch, _, h, w = x_shape
        if rows is None:
            prefixes = [(0, False)] * batch
        else:
            plans = self.plan_step(x_shape, rows, table) if plans is None else plans
            prefixes, seen = [], set()
            for plan in plans:
                built = not plan.cache or (
                    plan.key not in self.prefix_cache and plan.key not in seen
                )
                seen.add(plan.key)
                prefixes.append((plan.layout.length, built))
        # dit.cpu_ops was read at load: the quick plan runs on an HTTP thread, never asks MLX
        return step_peak_bytes(
            self.dit.config,
            self.dit.dtype.size,
            h * w,
            prefixes,
            self.dit.cpu_ops,
            self.dit_float_weight_bytes,
        )

    def step_keys(
        self, x_shape: tuple, rows: list[StepRow], table=None, plans: list[RowPlan] | None = None
    ) -> set:
        """The prefix-state keys a step uses (never shed to make room for that step)."""
        plans = self.plan_step(x_shape, rows, table) if plans is None else plans
        return {plan.key for plan in plans}

    def shed_states(self, need_bytes: int, keep: set) -> int:
        """Shed prefix states (unpinned ones first, least recently used first, then those of
        other runs) until `need_bytes` are freed; returns the bytes freed."""
        return self.prefix_cache.shed(need_bytes, keep)

    def encode(self, text: str, images: list[np.ndarray], refs: bool) -> EncodeResult:
        encoding = self.prompt_encoder().encode(text, list(images))
        ref_latents = []
        if refs:
            for image in encoding.vae_images:
                raw = self.vae.encode(mx.array(np.asarray(image, np.float32))[None])
                latents = self.vae.to_model_space(raw)
                ref_latents.append(np.array(latents.astype(mx.float32)))
        return EncodeResult(
            cond=np.asarray(encoding.cond, np.float32),
            ref_latents=ref_latents,
            image_slots=list(encoding.image_slots),
        )

    def step(
        self, x: np.ndarray, timestep: np.ndarray, rows: list[StepRow], call: StepCall
    ) -> StepResult:
        """`call.plans`: this step's plan_step(x.shape, rows, table), when the memory plan made
        it. The family extracts no reference K/V, skips no blocks and needs no sample sigmas
        (`capabilities`), so the route never sets those."""
        weights = self.tables.weights_for(call.table)
        return denoise_step(self.dit, self.prefix_cache, x, timestep, rows, call, weights)

    def end_run(self, run: str) -> None:
        self.prefix_cache.end_run(run)

    def state_keys(self) -> list:
        return self.prefix_cache.keys()

    def keep_states(self, keys) -> None:
        self.prefix_cache.keep_only(keys)

    def close(self) -> None:
        self.prefix_cache.clear()
        super().close()


QWEN_IMAGE21 = QwenImage21(SPEC, QwenImage21Model)
