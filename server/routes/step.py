"""POST step: one denoise step, one row per batch entry (docs/contract.md §2.11).

The checks run in the contract's order; each numbered function below is one step of it. Only
the forward itself runs on the image worker, between two looks at the run: a run interrupted
or ended while the step waited or ran gets its step answered 409 `interrupted`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import falcon
import numpy as np
from gmlx_contract import wire
from gmlx_contract.errors import ContractError

from ..engine.base import StepResult, StepRow, kept_image_slots
from ..engine.registry import LoadedModel
from ..engine.step_inputs import (
    checked_cond,
    checked_latents,
    checked_patch_latents,
    checked_ref_latents,
)
from ..memory import StepDemand
from ..service import CachedTensor, Run, StepsService, tensor_of
from .common import (
    Resource,
    check_pixels,
    container_body,
    flag,
    is_int,
    model_field,
    send_container,
    send_json,
)


@dataclass
class RowRequest:
    """A row object as sent, after the shape checks of step 3."""

    cond: str
    refs: list[str]
    mask: str | None
    raw: dict


@dataclass
class StepRequest:
    x: np.ndarray  # float32 (B, C, h, w)
    timestep: np.ndarray  # float32 (B,)
    rows: list[RowRequest]
    fields: dict
    sample_sigmas: np.ndarray | None


class Step(Resource):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        started = req.context.gate_passed
        container = container_body(req)  # 1
        fields = container.fields
        run = self.service.run_for_step(fields.get("run"))  # 2: the run is held from here
        try:
            dry_run = flag(fields, "dry_run", False)
            request = parse_request(container)  # 3
            loaded = self.service.acquire_for_step(model_field(fields), run)  # 4
            try:
                result = execute(self.service, loaded, run, request, dry_run)
            finally:
                self.service.release(loaded)
        finally:
            self.service.step_done(run)
        if dry_run:  # the plan, nothing run (an extension of docs/contract.md §2.11)
            send_json(resp, result)
            return
        self.service.record_step(run, request.x.shape, result.forward_ms, result.prefix_cache)
        out = np.asarray(result.out, dtype=np.float32)
        send_container(resp, wire.container_pieces({"out": out}))
        server_ms = (time.perf_counter() - started) * 1000.0
        family = loaded.entry.family
        self.ctx.metrics.step(family, result.prefix_cache, result.forward_ms, server_ms)
        resp.set_header("X-Gmlx-Forward-Ms", f"{result.forward_ms:.2f}")
        resp.set_header("X-Gmlx-Server-Ms", f"{server_ms:.2f}")
        resp.set_header("X-Gmlx-Prefix-Cache", result.prefix_cache)


def execute(
    service: StepsService,
    loaded: LoadedModel,
    run: Run | None,
    request: StepRequest,
    dry_run: bool = False,
):
    """The step's checks in the contract's order, then its forward (a StepResult); with
    `dry_run` the memory plan it would make instead (a dict: MemoryPlanner.dry_run)."""
    facts = loaded.facts
    fields = request.fields
    _, _, h, w = request.x.shape
    check_pixels(w * facts.latent_stride, h * facts.latent_stride, "the step's image")  # 5
    quick = run is None or run.planned_shape != request.x.shape
    if quick and not dry_run:  # 5: the quick plan, x alone (a dry run reports the full plan)
        service.memory.check_step_quick(loaded, request.x.shape)
    check_reference_count(loaded, request.rows)  # 6
    convention = check_convention(loaded, fields.get("convention", "comfy"))  # 7
    ref_cache, skip = check_cache_and_skip(loaded, run, fields, convention)  # 8
    tensors, table = gather(service, loaded, request)  # 9
    check_sigmas(loaded, request)  # 10
    check_latents(loaded, request)  # 11
    rows = [build_row(loaded, i, row, tensors) for i, row in enumerate(request.rows)]
    if dry_run:
        cache_run = run.run_id if ref_cache else None

        def plan() -> dict:
            demand = StepDemand(loaded, request.x.shape, rows, table, cache_run)
            return service.memory.dry_run(demand)

        return service.worker.call(plan)

    flow_map = loaded.capabilities.flow_map and request.sample_sigmas is not None

    def denoise(x: np.ndarray, timestep: np.ndarray, step_rows: list, plans) -> StepResult:
        return loaded.model.denoise_step(
            x,
            timestep,
            step_rows,
            convention=convention,
            run=run.run_id if run else None,
            table=table,
            plans=plans,  # the model's plan of the rows, made once by the memory plan
            ref_cache=ref_cache,
            skip=tuple(skip),
            sample_sigmas=request.sample_sigmas if flow_map else None,
        )

    def forward() -> StepResult:
        service.check_live(run)  # interrupted while queued: do not compute
        # 11: the detailed plan, with the rows' prefixes, right before the work (sheds states,
        # releases the text encoder, or has the rows run one at a time)
        return service.memory.run_step(
            loaded,
            request.x,
            request.timestep,
            rows,
            table,
            denoise,
            ref_cache_run=run.run_id if ref_cache else None,
        )

    result = service.worker.call(forward)
    service.check_live(run)  # 12: interrupted or ended while running: the result is dropped
    return result


# ---------------------------------------------------------------- step 3: shapes


def parse_request(container: wire.Container) -> StepRequest:
    tensors, fields = container.tensors, container.fields
    if "x" not in tensors or "timestep" not in tensors:
        raise ContractError(400, "a step needs the tensors x and timestep")
    rows = fields.get("rows")
    if not isinstance(rows, list) or not rows:
        raise ContractError(400, "rows must be a non-empty list of row objects")
    x = tensor_of(container, "x")
    if x.array.ndim != 4 or x.shape[0] != len(rows):
        raise ContractError(
            400, f"x must be 4-D (B, C, h, w) with B = {len(rows)} rows; got shape {list(x.shape)}"
        )
    if 0 in x.shape[1:]:
        raise ContractError(400, f"x must hold latents; got the empty shape {list(x.shape)}")
    if len(rows) > wire.MAX_ROWS:
        raise ContractError(413, f"{len(rows)} rows is over the limit of {wire.MAX_ROWS}")
    timestep = tensor_of(container, "timestep")
    if timestep.shape not in ((len(rows),), (1,), ()):
        raise ContractError(
            400,
            f"timestep must have shape ({len(rows)},), (1,) or (); got {list(timestep.shape)}",
        )
    parsed = [_parse_row(i, row) for i, row in enumerate(rows)]
    sigmas = None
    if "sample_sigmas" in tensors:
        sigmas = tensor_of(container, "sample_sigmas").float32().reshape(-1)
    times = np.broadcast_to(timestep.float32().reshape(-1), (len(rows),))
    latents = x.float32()
    # This server: values no step can take (NaN latents: a sampler that diverged upstream)
    if not np.isfinite(times).all():
        raise ContractError(400, f"timestep must be finite; got {times.tolist()}")
    if not np.isfinite(latents).all():
        raise ContractError(400, "x holds NaN or infinite values: latents must be finite")
    return StepRequest(
        x=np.ascontiguousarray(latents),
        timestep=np.ascontiguousarray(times, dtype=np.float32),
        rows=parsed,
        fields=fields,
        sample_sigmas=sigmas,
    )


def _parse_row(index: int, row: Any) -> RowRequest:
    where = f"rows[{index}]"
    if not isinstance(row, dict):
        raise ContractError(400, f"{where} must be an object")
    cond = row.get("cond")
    if not isinstance(cond, str):
        raise ContractError(400, f"{where}.cond must be a tensor hash string")
    refs = row.get("ref_latents", [])
    if refs is None:
        refs = []
    if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
        raise ContractError(400, f"{where}.ref_latents must be a list of tensor hashes")
    mask = row.get("attention_mask")
    if mask is not None and not isinstance(mask, str):
        raise ContractError(400, f"{where}.attention_mask must be a tensor hash or null")
    return RowRequest(cond=cond, refs=refs, mask=mask, raw=row)


# ---------------------------------------------------------------- steps 6-10


def check_reference_count(loaded: LoadedModel, rows: list[RowRequest]) -> None:
    if not loaded.facts.edit_capable:
        return  # refused at step 11, after the missing check
    cap = min(loaded.capabilities.max_refs, wire.MAX_ROWS)
    for i, row in enumerate(rows):
        if len(row.refs) > cap:
            raise ContractError(
                400,
                f"rows[{i}] carries {len(row.refs)} reference latents; {loaded.entry.family}"
                f" takes at most {cap}",
            )


def check_convention(loaded: LoadedModel, convention: Any) -> str:
    if not isinstance(convention, str) or convention not in loaded.capabilities.conventions:
        raise ContractError(
            400,
            f"convention {convention!r} is not known for {loaded.entry.family}; use one of "
            f"{sorted(loaded.capabilities.conventions)}",
        )
    return convention


def check_cache_and_skip(loaded: LoadedModel, run: Run | None, fields: dict, convention: str):
    capabilities = loaded.capabilities
    ref_cache = flag(fields, "ref_cache", False)
    skip = fields.get("skip", [])
    if skip is None:
        skip = []
    if ref_cache:
        if run is None:
            raise ContractError(400, "ref_cache needs a run: name one in the step's run field")
        refusal = capabilities.ref_cache_refusal(convention, loaded.entry.family)
        if refusal:
            raise ContractError(400, refusal)
    if not isinstance(skip, list) or not all(is_int(b) for b in skip):
        raise ContractError(400, "skip must be a list of block indices")
    if skip:
        if capabilities.skip_blocks == 0:
            raise ContractError(400, f"{loaded.entry.family} skips no blocks; send skip []")
        bad = [b for b in skip if not 0 <= b < capabilities.skip_blocks]
        if bad:
            raise ContractError(
                400, f"skip blocks {bad} are out of range 0..{capabilities.skip_blocks - 1}"
            )
        if ref_cache:
            raise ContractError(400, "skip cannot be combined with ref_cache")
    return ref_cache, skip


def gather(service: StepsService, loaded: LoadedModel, request: StepRequest):
    """Step 9: every row tensor and the table, or 409 listing all that are missing."""
    tensors: dict[str, CachedTensor] = {}
    missing: set[str] = set()
    for row in request.rows:
        for digest in (row.cond, *row.refs, *([row.mask] if row.mask else [])):
            if digest in tensors:
                continue
            tensor = service.tensors.get(digest)
            if tensor is None:
                missing.add(digest)
            else:
                tensors[digest] = tensor
    table_id = request.fields.get("patch_table")
    if table_id is not None and not isinstance(table_id, str):
        raise ContractError(400, "patch_table must be a table id or null")
    table = service.table_for(loaded, table_id) if table_id else loaded.default_table
    if table_id and table is None:
        missing.add(table_id)
    if missing:
        raise ContractError(
            409,
            f"the server does not hold {len(missing)} of the step's tensors or tables; upload "
            "them (PUT tensors/{hash}, PUT patch-tables/{id}) and retry",
            missing=sorted(missing),
        )
    return tensors, table


def check_sigmas(loaded: LoadedModel, request: StepRequest) -> None:
    if not loaded.capabilities.flow_map:
        return
    sigmas = request.sample_sigmas
    if sigmas is None:
        raise ContractError(400, f"{loaded.entry.family} is a flow-map DiT: send sample_sigmas")
    if sigmas.size < 2 or not np.isfinite(sigmas).all():
        raise ContractError(400, "sample_sigmas must hold at least 2 finite values")


# ---------------------------------------------------------------- step 11: rows


def check_latents(loaded: LoadedModel, request: StepRequest) -> None:
    """x's channels, and its sides in whole patches, as the model's step takes them."""
    facts = loaded.facts
    if facts.latent_patch > 1:
        checked_patch_latents(
            request.x,
            request.rows,
            facts.latent_channels,
            facts.latent_stride,
            facts.latent_patch,
            loaded.model_id,
        )
    else:
        checked_latents(request.x, request.rows, facts.latent_channels)


def build_row(
    loaded: LoadedModel, index: int, row: RowRequest, tensors: dict[str, CachedTensor]
) -> StepRow:
    """The row's StepRow, its conditioning as wide and its references of the channels the
    model takes (base.Facts)."""
    raw = row.raw
    cond = tensors[row.cond].float32()
    if cond.ndim == 3 and cond.shape[0] == 1:
        cond = cond[0]
    if cond.ndim != 2 or cond.shape[0] < 1:
        raise ContractError(
            400, f"conditioning {row.cond} must be (1, L, D) or (L, D), not {list(cond.shape)}"
        )
    length = cond.shape[0]
    count = _token_count(raw.get("num_tokens"), row.mask, tensors, length)
    refs = tuple(_reference(tensors[r].float32(), r) for r in row.refs)
    if refs and not loaded.facts.edit_capable:
        raise ContractError(400, f"{loaded.entry.family} takes no reference latents")
    slots = _slots(raw.get("image_slots", []), len(refs), count)
    prefix_cache = flag(raw, "prefix_cache", True)
    key = f"wire:{row.cond}" if count == length else f"wire:{row.cond}:{count}"
    built = StepRow(
        cond=np.ascontiguousarray(cond[:count]),
        cond_key=key,
        ref_latents=refs,
        ref_keys=tuple(row.refs),
        image_slots=slots,
        prefix_cache=prefix_cache,
    )
    checked_cond(built, index, loaded.facts.cond_width)
    checked_ref_latents(built, index, loaded.facts.latent_channels)
    return built


def _token_count(num_tokens: Any, mask: str | None, tensors: dict, length: int) -> int:
    if num_tokens is not None and (not is_int(num_tokens) or not 0 < num_tokens <= length):
        raise ContractError(400, f"num_tokens must be an integer in 1..{length}")
    if mask is None:
        return length if num_tokens is None else num_tokens
    values = tensors[mask].float32().reshape(-1)
    kept = values > 0
    count = int(kept.sum())
    if count == 0 or not kept[:count].all():
        raise ContractError(
            400, "attention_mask must keep a prefix of the tokens (entries > 0 first, then none)"
        )
    if count > length:
        raise ContractError(400, f"attention_mask keeps {count} tokens of a {length}-row cond")
    if num_tokens is not None and num_tokens != count:
        raise ContractError(
            400, f"attention_mask keeps {count} tokens but num_tokens says {num_tokens}"
        )
    return count


def _reference(latent: np.ndarray, digest: str) -> np.ndarray:
    if latent.ndim == 4 and latent.shape[0] == 1:
        latent = latent[0]
    if latent.ndim != 3:
        raise ContractError(
            400,
            f"reference latent {digest} must be (1, C, h, w) or (C, h, w), "
            f"not {list(latent.shape)}",
        )
    return np.ascontiguousarray(latent)


def _slots(slots: Any, refs: int, text_rows: int) -> tuple[int, ...]:
    if slots is None:
        slots = []
    if not isinstance(slots, list) or not all(is_int(s) for s in slots):
        raise ContractError(400, "image_slots must be a list of integers")
    return kept_image_slots(slots, refs, text_rows)  # its EngineInputError answers 400
