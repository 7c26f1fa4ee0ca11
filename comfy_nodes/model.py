"""The remote MODEL: a ComfyUI ModelPatcher over a flow BaseModel whose DiT is one HTTP step.

ComfyUI's own samplers, guiders, model-sampling patches and LoRA loaders work unchanged: the
`diffusion_model` of the BaseModel sends one `POST step` per call (docs/contract.md §7.5), the patcher
begins a run at sampling start and ends it at cleanup (§7.8), and LoRA patches become a patch
table (§7.7). Imports ComfyUI; only ever imported inside a ComfyUI process.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from typing import Any

import comfy.conds
import comfy.latent_formats
import comfy.lora
import comfy.model_base
import comfy.model_management
import comfy.model_patcher
import comfy.patcher_extension
import comfy.sample
import comfy.supported_models
import comfy.supported_models_base
import numpy as np
import torch
from gmlx_contract.errors import NoAnswer, StepError
from gmlx_contract.lora_keys import layer_aliases

from . import stock
from .connection import Connection
from .errors import GmlxError, named_nodes
from .families import (
    COMFY_BASE_CLASSES,
    PACK_BUILT_CLASSES,
    flow_map,
    latent_normalisation,
    ref_method,
)
from .interrupts import COMFY_INTERRUPT, call_or_interrupt
from .patches import (
    AdapterHashes,
    Aliases,
    PatcherTables,
    build_table,
    half_matching_text,
    lora_key_map,
    misfit_patch,
    unmapped_patches_text,
    unmatched_stems,
)
from .request import (
    CallCheck,
    as_f32,
    build_rows,
    changed_facts,
    check_call,
    latent_patch,
    prefix_cache_enabled,
    refusal_text,
    step_timestep,
    suspects,
    typed_where_it_belongs,
    wrapped_to_patch,
)
from .tensor_hashes import TensorHashes, mark_row_sources

log = logging.getLogger("gmlx_comfy")

# Bytes the patcher claims for its (remote) weights: ComfyUI must see the model as loaded,
# yet never plan host memory for weights that live on the server.
REMOTE_WEIGHT_BYTES = 1
# Calls whose timings are kept for diagnostics.
TIMINGS_KEPT = 256
WIRE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


# ---------------------------------------------------------------- latent format and conds


class GmlxLatentFormat(comfy.latent_formats.LatentFormat):
    """Latent format of a server model: LATENT carries what the VAE routes carry, the DiT
    takes model space; `normalisation` (mean, std) maps one to the other, None = identity.
    One latent cell is `stride` pixels a side (`gmlx_stride`: see stock.py)."""

    latent_dimensions = 2

    def __init__(self, channels: int, stride: int, normalisation: tuple[list, list] | None) -> None:
        self.latent_channels = channels
        self.spacial_downscale_ratio = self.gmlx_stride = stride
        self.scale_factor = 1.0
        self.latent_rgb_factors = None
        if normalisation is None:
            self.mean = self.std = None
        else:
            self.mean = torch.tensor(normalisation[0], dtype=torch.float32)
            self.std = torch.tensor(normalisation[1], dtype=torch.float32)

    def process_in(self, latent: torch.Tensor) -> torch.Tensor:
        if self.mean is None:
            return latent
        return (latent - per_channel(self.mean, latent)) / per_channel(self.std, latent)

    def process_out(self, latent: torch.Tensor) -> torch.Tensor:
        if self.mean is None:
            return latent
        return latent * per_channel(self.std, latent) + per_channel(self.mean, latent)


def per_channel(values: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    """(C,) values shaped to broadcast over `latent`'s channel axis, an image's (B, C, h, w) or
    a single-frame video's (B, C, 1, h, w)."""
    shape = (1, -1) + (1,) * (latent.ndim - 2)
    return values.to(latent.device, latent.dtype).view(shape)


class GmlxCrossAttn(comfy.conds.CONDRegular):
    """A conditioning that batches with others of any length: shorter rows are zero-padded
    and the real lengths travel in `num_tokens`, so cond and uncond share one step call."""

    def can_concat(self, other: Any) -> bool:
        a, b = self.cond.shape, other.cond.shape
        return len(a) == len(b) == 3 and a[2] == b[2] and self.cond.device == other.cond.device

    def concat(self, others: list) -> torch.Tensor:
        conds = [self.cond] + [o.cond for o in others]
        longest = max(c.shape[1] for c in conds)
        padded = [torch.nn.functional.pad(c, (0, 0, 0, longest - c.shape[1])) for c in conds]
        out = torch.cat(padded)
        mark_row_sources(out, conds)
        return out


class GmlxRefLatents(comfy.conds.CONDList):
    """Reference latents that remember, once concatenated for a step, which tensors their rows
    came from (so their hashes are memoised across steps, as the conditioning's are)."""

    def concat(self, others: list) -> list:
        out = super().concat(others)
        for k, batch in enumerate(out):
            mark_row_sources(batch, [self.cond[k]] + [o.cond[k] for o in others])
        return out


class GmlxRowValues(comfy.conds.CONDRegular):
    """Plain per-row values (token counts, image slots) that follow the batch rows."""

    def process_cond(self, batch_size: int, **kwargs: Any) -> GmlxRowValues:
        values = self.cond if len(self.cond) == batch_size else self.cond[:1] * batch_size
        return self._copy_with(list(values))

    def can_concat(self, other: Any) -> bool:
        return True

    def concat(self, others: list) -> list:
        out = list(self.cond)
        for other in others:
            out += other.cond
        return out

    def size(self) -> list[int]:
        return [1]


# ---------------------------------------------------------------- the DiT stand-in


class RunGone(GmlxError):
    """A step's run is unknown to the server (404): it restarted, or the run went idle."""


class RemoteDiT(torch.nn.Module):
    """Stands where ComfyUI expects the DiT: its forward is one `POST step`.

    Its state dict holds the server manifest's weight names as zero-stride placeholders, the
    weights stock LoRA loaders patch, and one for each of the manifest's `lora_aliases` (whose
    patches `aliases` lands on the manifest's layers); `lora_keys` maps every LoRA key form
    onto them.
    """

    def __init__(self, conn: Connection, model_id: str, status: dict, manifest: dict) -> None:
        super().__init__()
        self.conn = conn
        self.model_id = model_id
        self.status = status
        self.family = status.get("family")
        self.patch = latent_patch(status)  # x's sides are padded to whole patches of it
        self.dtype = torch.float32
        self.placeholders = _placeholders(manifest)
        self.lora_keys = lora_key_map(manifest)
        self.aliases = Aliases(manifest)
        self.hashes = AdapterHashes()
        self.row_hashes = TensorHashes(as_f32)
        self.tables = PatcherTables()
        self.tables_generation = conn.generation  # the server's, when these were defined
        self.timings: list[dict[str, Any]] = []
        self.warned: set[str] = set()
        self._owner: weakref.ref | None = None

    @property
    def owner(self) -> Any:
        """The GmlxModel this stands in: held weakly, so that the model is freed as soon as
        ComfyUI drops it (a cycle would outlive its patcher until a full garbage collection,
        which ComfyUI reports as a potential memory leak)."""
        return self._owner() if self._owner is not None else None

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        for name, tensor in self.placeholders.items():
            destination[prefix + name] = tensor

    # -------------------------------------------------------- LoRA table

    def sync_table(self, patcher: Any) -> str | None:
        """The patch table id of `patcher`'s live patches, defined on the server once per
        patch uuid (a strength change is one small PUT; matrices go up once), and anew where
        the client no longer keeps the table to define it again (`StepClient.keeps_table`)."""
        uuid = getattr(patcher, "patches_uuid", None)
        if self.tables_generation != self.conn.generation:  # the server restarted
            self.tables.clear()
            self.tables_generation = self.conn.generation
        known = self.tables.ids.get(uuid)
        if uuid in self.tables.ids and (known is None or self.conn.client.keeps_table(known)):
            self.tables.watch(patcher, uuid)
            return known
        table = build_table(
            self.model_id,
            patcher.patches,
            self.hashes,
            getattr(patcher, "hook_patches", None),
            self.aliases,
        )
        table_id = None
        if table.doc is not None:
            self.conn.ensure_adapters(table.adapters)
            with self.conn.lock:
                table_id = self.conn.client.put_patch_table(
                    table.doc, self.model_id, table.adapters
                )
        self.tables.defined(patcher, uuid, table_id)
        return table_id

    # -------------------------------------------------------- forward

    def forward(
        self,
        x: torch.Tensor,
        timesteps: torch.Tensor,
        context: torch.Tensor | None = None,
        control: Any = None,
        transformer_options: dict | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if x.ndim == 5 and x.shape[2] == 1:  # a single-frame video latent; the step's x is 4-D
            out = self.forward(
                x[:, :, 0], timesteps, context, control, transformer_options, **kwargs
            )
            return out[:, :, None]
        options = transformer_options or {}
        check = self._check(kwargs, options, control)
        patcher = getattr(self.owner, "current_patcher", None)
        table_id = self.sync_table(patcher) if patcher is not None else None
        run = getattr(patcher, "gmlx_run", None)
        if context is None:
            raise GmlxError("gmlx: the remote model needs a text conditioning")
        batch = x.shape[0]
        rows = build_rows(
            batch,
            context,
            num_tokens=kwargs.get("num_tokens"),
            ref_latents=list(kwargs.get("ref_latents") or []),
            image_slots=kwargs.get("image_slots"),
            prefix_cache=prefix_cache_enabled(options),
            hashes=self.row_hashes,
        )
        height, width = x.shape[-2:]
        x_np = wrapped_to_patch(as_f32(x), self.patch)
        t_np = step_timestep(as_f32(timesteps), batch)
        sample_sigmas = self._sample_sigmas(options)
        # ComfyUI's Flux KV Cache: the run keeps the references' K/V (docs/contract.md §3.4)
        ref_cache = check.ref_cache and run is not None and bool(kwargs.get("ref_latents"))

        def work(run: str | None):
            return self.conn.client.step(
                x_np,
                t_np,
                rows.rows,
                model=self.model_id,
                run=run,
                convention="comfy",
                patch_table=table_id,
                ref_cache=ref_cache,
                skip=check.skip or None,
                sample_sigmas=sample_sigmas,
                uploads=rows.tensors,
            )

        try:
            answer = self._call(lambda: work(run), run)
        except RunGone:
            run = self._begin_again(patcher, run)
            answer = self._call(lambda: work(run), run)
        self._keep_timing(answer)
        out = torch.from_numpy(np.array(answer.out[..., :height, :width], dtype=np.float32))
        return out.to(device=x.device, dtype=x.dtype)

    def let_go_of_dropped_tables(self) -> None:
        """Have the client forget the tables of patchers ComfyUI let go of (PatcherTables), once
        per sampling, where the connection is free (else at a later one: an abandoned call may
        still answer a 409 from the client's tables)."""
        if self.conn.lock.acquire(blocking=False):
            try:
                self.tables.let_go(self.conn.client.forget_table)
            finally:
                self.conn.lock.release()

    def check_unchanged(self) -> None:
        """Refuse a sampling where the server's model of this id is no longer the one this
        MODEL was built from (the server restarted on other files, or the folder changed):
        ComfyUI keeps a loader's output from prompt to prompt, and the latent format or the
        sampling this MODEL holds would no longer be the model's."""
        try:
            now = self.conn.call(lambda: self.conn.client.status(self.model_id))
        except StepError as err:
            raise GmlxError(str(err)) from err
        changed = changed_facts(self.status, now)
        if changed:
            raise GmlxError(
                f"gmlx: the server's {self.model_id!r} is no longer the model this MODEL was"
                f" loaded from (its {', '.join(changed)} changed: other files, or the server"
                " restarted on other ones); run the gmlx loaders again (change one of their"
                " inputs, or free ComfyUI's node cache)"
            )

    def _sample_sigmas(self, options: dict) -> np.ndarray | None:
        """A flow-map DiT's step sends the sampler's whole schedule (ComfyUI's
        `transformer_options["sample_sigmas"]`); other DiTs send none."""
        if not flow_map(self.status):
            return None
        sigmas = options.get("sample_sigmas")
        if sigmas is None:
            raise GmlxError(
                f"gmlx: {self.model_id!r} is a flow-map model: each step needs the sampler's"
                " schedule (transformer_options['sample_sigmas']), which this sampler did not set;"
                " sample it with a stock KSampler or SamplerCustom"
            )
        return as_f32(sigmas).reshape(-1)

    def _check(self, kwargs: dict, options: dict, control: Any) -> CallCheck:
        check = check_call(
            kwargs,
            options,
            control=control,
            edit_capable=bool(self.status.get("edit_capable", True)),
            default_ref_method=ref_method(self.status),
            ref_cache="ref_cache" in self.conn.features,
            skip_blocks="skip_blocks" in self.conn.features,
        )
        for key in check.unknown_options:
            if key not in self.warned:
                self.warned.add(key)
                log.warning("gmlx: ignoring transformer_options key %r (unknown to the pack)", key)
        if check.refusals:
            upstream = named_nodes(suspects(running_prompt_classes(), check.suspect_words))
            raise GmlxError(refusal_text(check.refusals, upstream))
        return check

    def _call(self, work, run: str | None):
        def on_cancel() -> None:
            if run is None:
                return
            try:
                self.conn.control_client(5.0).interrupt(run)
            except (StepError, OSError) as err:
                log.warning("gmlx: could not interrupt run %s: %s", run, err)

        try:
            return self.conn.call(work, on_cancel=on_cancel)
        except StepError as err:
            if err.code == "interrupted" and COMFY_INTERRUPT.requested():
                COMFY_INTERRUPT.throw()
            if isinstance(err, NoAnswer) and err.timed_out:
                on_cancel()  # the step given up on: the server stops working on it for nobody
            if err.status == 404 and run is not None and repr(run) in str(err):  # the run's 404
                raise RunGone(str(err)) from err
            raise GmlxError(str(err)) from err

    def _begin_again(self, patcher: Any, lost: str) -> str:
        """A run in place of `lost`, which the server no longer knows (it restarted, or the
        run sat idle past its `idle_s`): the sampling goes on, its step sent again in the new
        run (the server's 409 `missing` then brings back what a restart lost)."""
        with self.conn.lock:
            try:
                run = self.conn.client.begin_run(self.model_id)
            except StepError as err:
                raise GmlxError(f"{err} (beginning a run again: run {lost} was lost)") from err
        log.warning(
            "gmlx: the server no longer knows run %s; the sampling goes on in run %s", lost, run
        )
        patcher.gmlx_run = run
        return run

    def _keep_timing(self, answer: Any) -> None:
        self.timings.append(
            {
                "wall_ms": answer.wall_ms,
                "server_ms": answer.server_ms,
                "forward_ms": answer.forward_ms,
                "prefix_cache": answer.prefix_cache,
            }
        )
        del self.timings[:-TIMINGS_KEPT]


def _placeholders(manifest: dict) -> dict[str, torch.Tensor]:
    """Zero-stride tensors of the manifest's shapes (quantised tensors count as bf16), and of
    each alias's: its pieces' rows together, their layer's columns and dtype."""
    singles: dict[torch.dtype, torch.Tensor] = {}
    out = {}
    for entry in manifest.get("tensors", []):
        dtype = WIRE_DTYPES.get(entry.get("dtype"), torch.bfloat16)
        single = singles.setdefault(dtype, torch.zeros((), dtype=dtype))
        out[entry["name"]] = single.expand(*[int(d) for d in entry["shape"]])
    for alias, pieces in layer_aliases(manifest).items():
        first = out[pieces[0].layer + ".weight"]
        rows = sum(piece.length for piece in pieces)
        out[alias + ".weight"] = singles[first.dtype].expand(rows, *first.shape[1:])
    return out


def _running_prompts() -> list[tuple[str, dict]]:
    """(prompt id, prompt) of each prompt ComfyUI is running; none outside a ComfyUI server."""
    try:
        import server  # ComfyUI's own module

        running = list(server.PromptServer.instance.prompt_queue.currently_running.values())
    except Exception:  # noqa: BLE001 - naming culprits is best effort
        return []
    return [(item[1], item[2]) for item in running if len(item) > 2]


def running_prompt_classes() -> list[str]:
    """Class names of the nodes in the prompt ComfyUI is running (for naming culprits)."""
    return [
        node.get("class_type", "")
        for _, prompt in _running_prompts()
        for node in prompt.values()
        if isinstance(node, dict)
    ]


def _executing_node() -> tuple[str | None, dict | None]:
    """(id, prompt entry) of the node ComfyUI is executing; (None, None) outside a prompt, the
    entry None where the prompt is not found."""
    try:
        from comfy_execution.utils import get_executing_context

        context = get_executing_context()
    except ImportError:
        context = None
    if context is None:
        return None, None
    for prompt_id, prompt in _running_prompts():
        node = prompt.get(context.node_id) if prompt_id == context.prompt_id else None
        if isinstance(node, dict):
            return context.node_id, node
    return context.node_id, None


def _lora_name(node: dict | None) -> str | None:
    name = (node or {}).get("inputs", {}).get("lora_name")
    return name if isinstance(name, str) else None


def executing_patch_source() -> str:
    """What the executing node patches the model from, as an error names it: "the LoRA file
    'x'" for a node with a `lora_name` input, else the node; "a LoRA" outside a prompt."""
    node_id, node = _executing_node()
    if node_id is None:
        return "a LoRA"
    name = _lora_name(node)
    if name is not None:
        return f"the LoRA file {name!r}"
    return f"node {node_id}" + (f" ({node.get('class_type')})" if node else "")


def warn_half_matching_lora(model_id: str, key_map: dict[str, str]) -> None:
    """When the executing node's LoRA file has layers that name none of the model's (ComfyUI
    leaves them out, logging each as 'lora key not loaded'), say so in ComfyUI's log and on the
    node itself, as one line naming the file and how much of it applies."""
    node_id, node = _executing_node()
    name = _lora_name(node)
    if name is None:
        return
    try:
        import folder_paths
        from safetensors import safe_open

        with safe_open(folder_paths.get_full_path_or_raise("loras", name), "np") as lora:
            keys = list(lora.keys())
    except Exception:  # noqa: BLE001 - ComfyUI read the file already; the warning is best effort
        return
    unmatched, total = unmatched_stems(keys, key_map)
    if not unmatched:
        return
    text = half_matching_text(f"the LoRA file {name!r}", model_id, unmatched, total)
    log.warning("%s", text)
    try:
        import server  # ComfyUI's own module

        server.PromptServer.instance.send_progress_text(text, node_id)
    except Exception:  # noqa: BLE001 - an older ComfyUI shows no text on a node
        pass


# ---------------------------------------------------------------- BaseModel and patcher


class GmlxModelConfig(comfy.supported_models_base.BASE):
    """Model config of a pack-built family; its values come from the server's status."""

    unet_config: dict = {}
    sampling_settings: dict = {}
    latent_format = comfy.latent_formats.LatentFormat
    supported_inference_dtypes = [torch.float32]
    memory_usage_factor = 1.0


def model_config_for(status: dict) -> GmlxModelConfig:
    latent = status.get("latent") or {}
    comfy_info = status.get("comfy") or {}
    channels = int(latent.get("channels", 16))
    config = GmlxModelConfig(
        {
            "image_model": comfy_info.get("image_model"),
            "disable_unet_model_creation": True,
            # what ComfyUI's Flux BaseModel reads to see that x carries no concat channels
            "in_channels": channels,
            "out_channels": channels,
        }
    )
    sampling = status.get("sampling") or {}
    # Flow matching with timestep = sigma / timestep_scale (docs/contract.md §5.2, the comfy
    # convention: sigma x 1000 for MOSS-Image), the variant's static shift.
    multiplier = 1.0 / float(sampling.get("timestep_scale") or 1.0)
    config.sampling_settings = {
        "multiplier": multiplier,
        "shift": float(sampling.get("shift") or 1.0),
    }
    stride = latent.get("stride") or (status.get("vae") or {}).get("stride")
    if not stride:
        raise GmlxError("gmlx: the server's status gives no latent stride (latent.stride)")
    try:
        normalisation = latent_normalisation(status)
    except ValueError as err:
        raise GmlxError(str(err)) from err
    config.latent_format = GmlxLatentFormat(channels, int(stride), normalisation)
    return config


class GmlxModel(comfy.model_base.BaseModel):
    """A flow BaseModel whose diffusion_model is a RemoteDiT."""

    def __init__(self, config: GmlxModelConfig, remote: RemoteDiT) -> None:
        super().__init__(config, comfy.model_base.ModelType.FLOW, device=torch.device("cpu"))
        self.diffusion_model = remote
        remote._owner = weakref.ref(self)

    @property
    def gmlx_lora_keys(self) -> dict[str, str]:
        """LoRA stem -> weight key for every form the pack reads (see stock.py)."""
        return self.diffusion_model.lora_keys

    @property
    def gmlx_alias_weights(self) -> frozenset[str]:
        """The placeholder weights that stand for the manifest's `lora_aliases` (see stock.py)."""
        return self.diffusion_model.aliases.weights

    def get_dtype(self) -> torch.dtype:
        return torch.float32

    def extra_conds(self, **kwargs: Any) -> dict:
        out = super().extra_conds(**kwargs)
        cross_attn = typed_where_it_belongs(kwargs)
        if cross_attn is not None:
            out["c_crossattn"] = GmlxCrossAttn(cross_attn)
            out["num_tokens"] = GmlxRowValues([int(cross_attn.shape[1])] * cross_attn.shape[0])
        slots = kwargs.get("image_slots")
        if slots:
            out["image_slots"] = GmlxRowValues([[int(s) for s in slots]])
        refs = kwargs.get("reference_latents")
        if refs:
            out["ref_latents"] = GmlxRefLatents([self.process_latent_in(r) for r in refs])
            method = kwargs.get("reference_latents_method")
            if method is not None:
                out["ref_latents_method"] = comfy.conds.CONDConstant(method)
        return out

    def memory_required(self, input_shape: Any, cond_shapes: dict | None = None) -> float:
        # The forward runs on the server: ComfyUI may batch every row into one call.
        return 1.0


def model_type_for(model_class: str) -> type[GmlxModel]:
    """GmlxModel, also derived from ComfyUI's own BaseModel class of `model_class` when this
    ComfyUI knows the class (COMFY_BASE_CLASSES); the pack's conds and DiT stand-in win."""
    base_name = COMFY_BASE_CLASSES.get(model_class)
    base = getattr(comfy.model_base, base_name, None) if base_name else None
    if base is None or not hasattr(comfy.supported_models, model_class):
        return GmlxModel
    return _derived_model_type(base)


@functools.cache
def _derived_model_type(base: type) -> type[GmlxModel]:
    return type(f"Gmlx{base.__name__}", (GmlxModel, base), {})


class GmlxModelPatcher(comfy.model_patcher.ModelPatcher):
    """A ModelPatcher with no local weights: loading only marks it loaded and defines the
    LoRA table; sampling start begins a server run and cleanup ends it."""

    gmlx_run: str | None = None

    @property
    def remote(self) -> RemoteDiT:
        return self.model.diffusion_model

    def load(
        self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False
    ):
        with self.use_ejected():
            self.model.device = device_to or self.load_device
            self.model.model_lowvram = False
            self.model.model_loaded_weight_memory = REMOTE_WEIGHT_BYTES
            self.model.current_weight_patches_uuid = self.patches_uuid
            for callback in self.get_all_callbacks(comfy.patcher_extension.CallbacksMP.ON_LOAD):
                callback(self, device_to, lowvram_model_memory, force_patch_weights, full_load)
        # ComfyUI loads a model whose patches changed before the sampling's pre_run: where the
        # server has gone since, this is the first call to find it.
        self.remote.conn.ensure_reachable()
        self.remote.check_unchanged()  # before its patches are put to another model
        self.remote.sync_table(self)

    def partially_unload(self, device_to, memory_to_free=0):
        return 0

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        """Stock add_patches; patches of which none lands on a weight (a LoRA of other keys)
        are refused, naming the LoRA file."""
        added = super().add_patches(patches, strength_patch, strength_model)
        if not added and strength_patch != 0.0:
            foreign = sorted(str(k if isinstance(k, str) else k[0]) for k in patches)
            raise GmlxError(
                unmapped_patches_text(executing_patch_source(), self.remote.model_id, foreign)
            )
        counts: dict[str, int] = {}  # the entries this call appended, by weight key
        for k in added:
            key = k if isinstance(k, str) else k[0]
            counts[key] = counts.get(key, 0) + 1
        shapes = {key: tuple(value.shape) for key, value in self.model.state_dict().items()}
        misfit = misfit_patch({k: self.patches[k][-n:] for k, n in counts.items()}, shapes)
        if misfit is not None:  # refused here, naming the file, not at the sampler
            for key, n in counts.items():
                del self.patches[key][-n:]
            raise GmlxError(
                f"gmlx: {executing_patch_source()} does not fit {self.remote.model_id!r}: {misfit}"
            )
        if strength_patch != 0.0:
            warn_half_matching_lora(self.remote.model_id, self.remote.lora_keys)
        return added

    def pre_run(self):
        super().pre_run()
        self.remote.conn.ensure_reachable()
        self.remote.check_unchanged()
        self.remote.let_go_of_dropped_tables()
        self.remote.sync_table(self)
        conn = self.remote.conn
        guard, abandoned, begun = threading.Lock(), [False], []

        def begin() -> str:  # loads the DiT where it is not resident: cancellable, and on a
            # client of its own, so an abandoned load holds up no other call
            with conn.control_client() as client:  # the setting's bound
                run = client.begin_run(self.remote.model_id)
            with guard:
                ended = abandoned[0]
                begun.extend([] if ended else [run])
            if ended:  # cancelled while it loaded: no sampling will end it
                _end_run(conn, run)
            return run

        def cancel() -> None:  # a begin that has returned, but not yet to this thread
            with guard:
                abandoned[0] = True
                runs = begun[:]
            for run in runs:
                _end_run(conn, run)

        try:
            self.gmlx_run = call_or_interrupt(begin, COMFY_INTERRUPT, cancel)
        except StepError as err:
            raise GmlxError(str(err)) from err

    def cleanup(self):
        run, self.gmlx_run = self.gmlx_run, None
        try:
            if run is not None:
                _end_run(self.remote.conn, run)
        finally:
            super().cleanup()


def _end_run(conn: Any, run: str) -> None:
    """End a run on the server (its model then free to go), on a client of its own."""
    try:
        with conn.control_client(30.0) as client:
            client.end_run(run)
    except (StepError, OSError) as err:
        log.warning("gmlx: could not end run %s: %s", run, err)


def fused_qkv(name: str) -> bool:
    """Whether a manifest weight fuses q, k and v alone (`.qkv.`, `to_qkv.`), which ComfyUI's
    LoRA keys name unfused. A layer the DiT's own names fuse with more (FLUX.2's
    `to_qkv_mlp_proj`) is a layer of its own, which LoRA files name as it is."""
    return ".qkv." in name or ".to_qkv." in name


def load_remote_model(conn: Connection, model_id: str) -> GmlxModelPatcher:
    """Build the MODEL of `model_id` from its status and manifest (docs/contract.md §7.3)."""
    with conn.lock:
        status = conn.client.status(model_id)
        manifest = conn.client.manifest(model_id)
    model_class = (status.get("comfy") or {}).get("model_class")
    if not model_class:
        raise GmlxError(f"gmlx: the server's status of {model_id!r} names no comfy.model_class")
    if model_class not in PACK_BUILT_CLASSES:
        raise GmlxError(
            f"gmlx: {model_id!r} is a {model_class} model; this pack builds "
            f"{', '.join(sorted(PACK_BUILT_CLASSES))} models only"
        )
    # Where ComfyUI has the model class, its LoRA keys name q, k and v apart; a class only the
    # pack builds has no other naming than its files' (MOSS-Image's text blocks fuse qkv).
    fused = [t["name"] for t in manifest.get("tensors", []) if fused_qkv(t["name"])]
    if fused and hasattr(comfy.supported_models, model_class):
        raise GmlxError(
            f"gmlx: {model_id!r} stores fused qkv weights ({fused[0]}, ...); LoRA keys cannot "
            "map to that layout"
        )
    stock.install(comfy.lora, comfy.sample)
    remote = RemoteDiT(conn, model_id, status, manifest)
    base = model_type_for(model_class)(model_config_for(status), remote)
    device = torch.device("cpu")
    return GmlxModelPatcher(
        base, load_device=device, offload_device=device, size=REMOTE_WEIGHT_BYTES
    )
