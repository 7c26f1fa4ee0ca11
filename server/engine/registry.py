"""The model registry: which image models exist, which is the default, which are loaded.

A model is a folder holding a diffusers `model_index.json`, found directly under one of the
configured model dirs (or given as an extra folder, e.g. the embedded default); its id is the
folder's name. The family is found by asking each family's spec (engine/spec.py: every family
folder's `spec.SPECS`, found by themselves) to `identify` the folder, without MLX; the `Family`
its folder's `family.py` holds describes, checks and loads it, and the `ImageModel` it builds
must carry the whole seam (base.seam_gaps: a model lacking a member fails its load, naming
it).

Loading, unloading and everything a loaded model does happen on the image worker thread; the
methods that do so say so. Holds (an open run, a step between its checks and its forward) keep
a model loaded: unloading a held model is refused 409 `busy`, and so is evicting it to make
room for another, which is answered 503 (load deferred for capacity).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gmlx_contract.errors import ContractError

from .base import Capabilities, EngineInputError, Facts, ImageModel, seam_gaps
from .load_settings import LoadSettings
from .spec import Family, FamilySpec, family_specs

log = logging.getLogger("gmlx.server")

MODEL_INDEX = "model_index.json"
# How long `resolve` trusts its last listing of the model folders and its last look at a folder's
# model_index.json: a step resolves its model, and listing every folder per step is file-system
# work on the request path. GET models always lists afresh; a miss looks again at once.
LISTING_TTL_S = 2.0
# How long the models from component files, as `component_sets` lists them (ComfyUI's model
# folders walked, their headers read), are reused before they are asked for again: a listing
# runs on a step's path (through `resolve`), and walking ComfyUI's folders costs 0.3 s for
# 200 files (docs/benchmarks.md). A set's folder is made again only when its files change.
SET_LISTING_TTL_S = 10.0

# The family whose embedded model is the embedded default: offered first, and the default
# when no default model is configured. Each embedded model's module (a family folder's
# `embedded.py`) provides its RECIPE, whose `ensure()` gives its folder, written on first use
# (engine/embedded.py).
EMBEDDED_DEFAULT_FAMILY = "qwen_image21"


def embedded_modules() -> list[Any]:
    """The embedded models' modules that can be imported (none without the server's extras),
    the embedded default's first."""
    specs = sorted(family_specs().values(), key=lambda s: s.name != EMBEDDED_DEFAULT_FAMILY)
    modules = []
    names = [spec.module_name("embedded") for spec in specs]
    for name in dict.fromkeys(name for name in names if name is not None):
        try:
            modules.append(importlib.import_module(name))
        except ImportError as exc:
            log.debug("no embedded model %s: %s", name, exc)
    return modules


def embedded_modules_served(default_model: str | None, model_dirs: Sequence[Path] = ()) -> list:
    """The embedded models a configuration serves: every one where it names no default_model
    (the embedded default first, and the default), else the one its default_model names, unless
    a folder of that name in model_dirs is that model."""
    modules = embedded_modules()
    if not default_model:
        return modules
    if any((Path(folder) / default_model / MODEL_INDEX).is_file() for folder in model_dirs):
        return []
    return [module for module in modules if module.RECIPE.name == default_model]


def implementation(spec: FamilySpec) -> Family | None:
    """The family's `Family`, its module imported on first use; None where it cannot be
    imported (e.g. without MLX)."""
    try:
        return spec.load_implementation()
    except ImportError as exc:
        log.debug("family %s is not available: %s", spec.name, exc)
        return None


@dataclass(frozen=True)
class ModelEntry:
    model_id: str
    path: Path
    family: str | None  # None: no family module recognises the folder
    variant: str | None


@dataclass
class LoadedModel:
    """One loaded instance of a model. Patch tables live here, so a reload forgets them (the
    steps service keeps them, least recently used first: StepsService.table_for)."""

    entry: ModelEntry
    model: ImageModel
    generation: int
    # what the routes check before running work, read once when the model loads
    facts: Facts
    capabilities: Capabilities
    tables: dict[str, Any] = field(default_factory=dict)
    holds: int = 0
    # The entry's configured adapters (config `[models."id"] adapters`) and their patch table:
    # a step naming no table runs under it (docs/contract.md §2.9), as do the in-process samplings.
    default_adapters: tuple = ()
    default_table: Any = None

    @property
    def model_id(self) -> str:
        return self.entry.model_id


def unreadable_index(folder: Path) -> str:
    """Why a folder's model_index.json says no family, where it cannot say one ("": it is a
    JSON object)."""
    try:
        index = json.loads((folder / MODEL_INDEX).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # JSON's and UTF-8's errors are ValueErrors
        return f": its {MODEL_INDEX} cannot be read ({exc})"
    return "" if isinstance(index, dict) else f": its {MODEL_INDEX} is not a JSON object"


def load_refusal(entry: ModelEntry, exc: Exception) -> ContractError:
    """A family's refusal of a model's files as the load's answer: 404 for a missing file, 400
    for files or settings the family cannot load (EngineInputError, ValueError, KeyError: the
    refusal says which, a file of the wrong shapes or a setting against the stored precision),
    503 for anything else."""
    if isinstance(exc, FileNotFoundError):
        return ContractError(404, f"model {entry.model_id!r}: a file is missing: {exc}")
    if isinstance(exc, (EngineInputError, ValueError, KeyError)):
        return ContractError(400, f"model {entry.model_id!r} ({entry.family}) cannot load: {exc}")
    return ContractError(503, f"model {entry.model_id!r} failed to load: {exc}")


def _model_folder(child: Path) -> bool:
    """Whether a model dir's child is a model folder: one holding model_index.json, not hidden
    (a folder being written, `weights.written_whole`'s, is hidden until it is whole)."""
    return not child.name.startswith(".") and (child / MODEL_INDEX).is_file()


class ModelRegistry:
    def __init__(
        self,
        model_dirs: Iterable[Path] = (),
        default_model: str | None = None,
        extra_models: Iterable[Path] = (),
        families: dict[str, FamilySpec | Family] | None = None,
        max_resident: int = 1,
        load_hooks: Any = None,
        settings: Callable[[str], LoadSettings] | None = None,
        component_sets: Callable[[], dict] | None = None,
        sets_dir: Path | None = None,
    ) -> None:
        """`load_hooks` (lora_files.DefaultAdapters) has `check(model_id, manifest)`, asked
        before a model's weights load with the family's manifest of its folder, and
        `give(loaded)`, run on each newly loaded instance before anyone sees it; a ValueError
        or ContractError from either fails the load with its status (400 for a ValueError),
        naming the model. `settings(model_id)` is how a model loads (load_settings.LoadSettings:
        its quantization, its encoder and VAE dtype, its GGUF files; no function: as its folder
        stores it). `families`: by name, each family's spec (its Family imported on first use)
        or its Family itself (default: every family folder's spec; tests pass their own).
        `component_sets()`: the models from component files, by id (components.ComponentFiles),
        each served from its folder under `sets_dir` (default: the cache's)."""
        self.model_dirs = [Path(d).expanduser() for d in model_dirs]
        self.load_hooks = load_hooks
        self.settings = settings
        self.extra_models = [Path(p).expanduser() for p in extra_models]
        self.component_sets = component_sets
        self.sets_dir = sets_dir
        self._set_errors: dict[str, Exception] = {}  # model id -> why its set cannot be served
        self._sets_listed: tuple[float, dict] | None = None  # (when, component_sets())
        # a set's files -> (their stamps, its folder), for sets that could be served
        self._set_made: dict[Any, tuple[tuple, Path]] = {}
        self.default_model = default_model or None
        given = family_specs() if families is None else families
        self.families: dict[str, FamilySpec] = {}
        self._given: dict[str, Family] = {}  # the families given whole
        for name, family in given.items():
            if isinstance(family, FamilySpec):
                self.families[name] = family
            else:
                self.families[name], self._given[name] = family.spec, family
        # family name -> its Family, imported on first use; `wrap_families` may replace them
        self._implementations: dict[str, Family] = {}
        self._wrap: Callable[[FamilySpec, Family], Family] | None = None
        self.max_resident = max_resident
        self._lock = threading.RLock()
        self._loaded: dict[str, LoadedModel] = {}
        self._generation = 0
        self.loading: set[str] = set()  # the models loading now
        self.loads = 0  # models loaded, and the seconds their loads took (server/metrics.py)
        self.load_seconds = 0.0
        # path -> (model_index.json mtime, family, variant, when that mtime was read)
        self._identified: dict[Path, tuple[float, str | None, str | None, float]] = {}
        self._unidentified: dict[Path, str] = {}  # why a family could not read a folder
        self._listing: tuple[float, dict[str, Path]] | None = None  # (when, folders())
        self._clock = time.monotonic

    # ------------------------------------------------------------ discovery

    def available_families(self) -> list[str]:
        """The families this server can load: those whose implementation imports."""
        return sorted(name for name in self.families if self.family(name) is not None)

    def family(self, name: str) -> Family | None:
        """The family's `Family` (None: not available in this server)."""
        found = self._implementations.get(name)
        spec = self.families.get(name)
        if found is None and spec is not None:
            found = self._given.get(name) or implementation(spec)
            if found is not None and self._wrap is not None:
                found = self._wrap(spec, found)
            if found is not None:
                self._implementations[name] = found
        return found

    def wrap_families(self, wrap: Callable[[FamilySpec, Family], Family]) -> None:
        """Serve every family through `wrap(spec, family)` (a rank group's: it loads a model on
        every rank)."""
        self._wrap = wrap
        self._implementations.clear()

    def folders(self) -> dict[str, Path]:
        """Model id -> folder, first found wins (extra folders first, then the model dirs),
        listed now (and kept for `resolve`)."""
        found: dict[str, Path] = {}
        for path in self._model_folders():
            found.setdefault(path.name, path)
        for model_id, folder in self._set_folders().items():
            found.setdefault(model_id, folder)
        with self._lock:
            self._listing = (self._clock(), found)
        return found

    def shadowed(self) -> list[tuple[Path, Path]]:
        """(hidden, served): each model folder that another of the same name, found before it,
        hides (`folders`: the first found wins)."""
        served: dict[str, Path] = {}
        hidden = []
        for path in self._model_folders():
            first = served.setdefault(path.name, path)
            if first != path:
                hidden.append((path, first))
        return hidden

    def _model_folders(self) -> Iterator[Path]:
        """The model folders, in the order they are found: the extra folders, then each model
        dir's, by name."""
        for path in self.extra_models:
            if (path / MODEL_INDEX).is_file():
                yield path
        for root in self.model_dirs:
            try:
                children = sorted(root.iterdir())
            except OSError:
                continue
            yield from (child for child in children if _model_folder(child))

    def _set_folders(self) -> dict[str, Path]:
        """Each model from component files by id, its folder (engine/components.py); a set that
        cannot be served is left out, and why is kept for `resolve` to say."""
        if self.component_sets is None:
            return {}
        try:
            from .components import ComponentError, set_folder
        except ImportError as exc:  # without the serving extras: no header readers
            log.debug("no models from component files: %s", exc)
            return {}

        now = self._clock()
        with self._lock:
            listed = self._sets_listed
        if listed is None or now - listed[0] >= SET_LISTING_TTL_S:
            listed = (now, self.component_sets())
            with self._lock:
                self._sets_listed = listed
        folders, errors = {}, {}
        for model_id, files in listed[1].items():
            try:
                folders[model_id] = self._set_folder(files, set_folder)
            except (ComponentError, OSError) as exc:
                errors[model_id] = exc
        with self._lock:
            said = {(model_id, str(exc)) for model_id, exc in self._set_errors.items()}
            self._set_errors = errors
        for model_id, exc in errors.items():
            if (model_id, str(exc)) not in said:  # said once, until the reason changes
                log.warning("model %r from component files cannot be served: %s", model_id, exc)
        return folders

    def _set_folder(self, files: Any, make: Callable) -> Path:
        """The set's folder, made again (`make`: components.set_folder) only when one of its
        files, or a folder beside them that may gain a tokenizer, changed since."""
        paths = [*files.paths().values(), Path(files.dit).parent, Path(files.text_encoder).parent]
        stamps = tuple((p.stat().st_size, p.stat().st_mtime_ns) for p in map(Path, paths))
        made = self._set_made.get(files)
        if made is not None and made[0] == stamps and made[1].is_dir():
            return made[1]
        folder = make(files, self.families, self.sets_dir)
        self._set_made[files] = (stamps, folder)
        return folder

    def _recent_folders(self) -> dict[str, Path]:
        """The last listing when younger than LISTING_TTL_S, else a new one."""
        with self._lock:
            listing = self._listing
        if listing is not None and self._clock() - listing[0] < LISTING_TTL_S:
            return listing[1]
        return self.folders()

    def _forget_listing(self) -> None:
        with self._lock:
            self._listing = None

    def entries(self) -> list[ModelEntry]:
        return [self._identify(mid, path) for mid, path in sorted(self.folders().items())]

    def _identify(self, model_id: str, path: Path, max_age: float = 0.0) -> ModelEntry:
        """The folder's family; an identification younger than max_age seconds is reused
        without looking at the folder again."""
        cached = self._identified.get(path)
        now = self._clock()
        if cached and now - cached[3] < max_age:
            return ModelEntry(model_id, path, cached[1], cached[2])
        try:
            stamp = (path / MODEL_INDEX).stat().st_mtime
        except OSError:
            return ModelEntry(model_id, path, None, None)
        # the same model_index.json: the same family. A folder of none is looked at again once
        # a listing's time has passed (a family may read another of its files, copied in or
        # mended since), at once where a family failed to read one.
        if cached and cached[0] == stamp and cached[1] is not None:
            self._identified[path] = (stamp, cached[1], cached[2], now)
            return ModelEntry(model_id, path, cached[1], cached[2])
        unread = path in self._unidentified
        if cached and cached[0] == stamp and not unread and now - cached[3] < LISTING_TTL_S:
            return ModelEntry(model_id, path, None, None)
        family, variant = None, None
        self._unidentified.pop(path, None)
        for name, spec in self.families.items():
            try:
                found = spec.identify(path)
            except Exception as exc:  # noqa: BLE001 - "not this family" may be said by raising
                found = None
                self._unidentified.setdefault(path, f"read as {name}: {exc}")
            if found:
                family, variant = found
                self._unidentified.pop(path, None)  # another family's error is not this one's
                break
        self._identified[path] = (stamp, family, variant, now)
        return ModelEntry(model_id, path, family, variant)

    def default_id(self) -> str | None:
        return self.default_model

    def resolve(self, model_id: Any) -> ModelEntry:
        """The entry of a model id ('' or None: the default), or a ContractError with the
        statuses of docs/contract.md §2 for the routes that load on demand (404 unknown or vanished,
        400 no default / not of a family the server has)."""
        if model_id is not None and not isinstance(model_id, str):
            raise ContractError(400, f"model must be a string, not {type(model_id).__name__}")
        if not model_id:
            model_id = self.default_model
            if not model_id:
                raise ContractError(
                    400, "no model named and the server has no default model; name one"
                )
        entry = self._find(model_id, self._recent_folders(), LISTING_TTL_S)
        if entry is None or entry.family is None:  # added, changed or gone since: look again
            entry = self._find(model_id, self.folders(), 0.0)
        if entry is None:
            refused = self._set_errors.get(model_id)
            if refused is not None:
                status = 404 if isinstance(refused, FileNotFoundError) else 400
                raise ContractError(status, self.resolve_refusal(model_id))
            raise ContractError(404, self._unknown(model_id))
        if entry.family is None:
            raise ContractError(
                400,
                f"model {model_id!r} at {entry.path} is not of a family this server can load "
                f"({', '.join(self.available_families()) or 'none'}){self.why_unidentified(entry)}",
            )
        return entry

    def why_unidentified(self, entry: ModelEntry) -> str:
        """Why no family reads the folder, where that is known: its model_index.json unread,
        or a family whose pipeline it names failed to read one of its files."""
        index = unreadable_index(entry.path)
        reason = self._unidentified.get(entry.path)
        return index or (f": {reason}" if reason else "")

    def resolve_refusal(self, model_id: str) -> str | None:
        """Why the model from component files `model_id` cannot be served (as the last listing
        found), or None."""
        refused = self._set_errors.get(model_id)
        return None if refused is None else f"model {model_id!r} cannot be served: {refused}"

    def _unknown(self, model_id: str) -> str:
        """Why `model_id` names no model: where folders were looked for, and what is there."""
        searched = ", ".join(str(d) for d in self.model_dirs) or "none configured"
        folders = ", ".join(sorted(self.folders())) or "none"
        return (
            f"unknown image model {model_id!r}: no folder of that name holding {MODEL_INDEX} in"
            f" the model_dirs ({searched}); the models here: {folders}{self.unknown_hint(model_id)}"
        )

    def unknown_hint(self, model_id: str) -> str:
        """What may be meant by an id that names no model here ("; ..."; "" when nothing): the
        published model's `gmlx pull`, where the embedded model is served, or the nearest name
        of a folder, an embedded model or a published one."""
        published = [p.name for spec in self.families.values() for p in spec.published]
        embedded = [module.RECIPE.name for module in embedded_modules()]
        if model_id in published:
            return f"; it is a published model: fetch it with `gmlx pull {model_id}`"
        if model_id in embedded:
            return (
                "; it is an embedded model, served where no default_model is configured or"
                " default_model names it"
            )
        known = [*published, *embedded, *self.folders()]
        names = {name.lower(): name for name in known if name != model_id}
        near = difflib.get_close_matches(model_id.lower(), names, n=1)
        return f"; did you mean {names[near[0]]!r}?" if near else ""

    def _find(self, model_id: str, folders: dict[str, Path], max_age: float) -> ModelEntry | None:
        path = folders.get(model_id)
        return None if path is None else self._identify(model_id, path, max_age)

    # ------------------------------------------------------------ resident state

    def loaded(self, model_id: str) -> LoadedModel | None:
        with self._lock:
            return self._loaded.get(model_id)

    def resident_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._loaded)

    def holds(self, model_id: str) -> int:
        with self._lock:
            loaded = self._loaded.get(model_id)
            return loaded.holds if loaded else 0

    def hold(self, loaded: LoadedModel) -> None:
        """One more hold on an instance already held (a run's), without resolving it again."""
        with self._lock:
            loaded.holds += 1

    def release(self, loaded: LoadedModel) -> None:
        with self._lock:
            loaded.holds = max(0, loaded.holds - 1)

    # ------------------------------------------------------------ worker-thread work

    def acquire(self, model_id: Any) -> LoadedModel:
        """Worker thread: resolve, load if needed, and take a hold (release it with `release`)."""
        entry = self.resolve(model_id)
        with self._lock:
            loaded = self._loaded.get(entry.model_id)
            if loaded is not None and loaded.entry.path == entry.path:
                loaded.holds += 1
                return loaded
        loaded = self._load(entry)
        with self._lock:
            loaded.holds += 1
        return loaded

    @staticmethod
    def _hook(model_id: str, hook: Any, *args: Any) -> None:
        """Run a load hook; its refusals become the load's, naming the model."""
        try:
            hook(*args)
        except ContractError as exc:
            raise ContractError(exc.status, f"model {model_id!r}: {exc.message}") from exc
        except ValueError as exc:
            raise ContractError(400, f"model {model_id!r}: {exc}") from exc

    def settings_for(self, entry: ModelEntry) -> LoadSettings:
        """How the entry's model loads (its folder's own way without a `settings` function)."""
        return self.settings(entry.model_id) if self.settings else LoadSettings()

    def files_for(self, entry: ModelEntry) -> dict:
        """The entry's weight files that its family reads (its spec's `files`); a file the
        family does not read is refused by the load, not here."""
        taken = self.families[entry.family].files
        return {k: v for k, v in self.settings_for(entry).files().items() if k in taken}

    def describe(self, model_id: Any) -> dict | None:
        """The status of a model that is not loaded, read from its files (its family's
        `describe`); None where the family cannot say without loading it."""
        entry = self.resolve(model_id)
        family = self.family(entry.family)
        if family is None:
            return None
        return family.describe(entry.path, entry.model_id, **self.files_for(entry))

    def manifest(self, entry: ModelEntry) -> dict | None:
        """The manifest of a model's folder (its family's `manifest`, worker thread); None
        where the family cannot say without loading it."""
        family = self.family(entry.family)
        return None if family is None else family.manifest(entry.path, **self.files_for(entry))

    def _check_before_load(self, entry: ModelEntry, family: Family) -> None:
        """Before the resident model is let go: the family's `check` of the entry's files (a
        GGUF DiT cut short, of another family or of the wrong shapes is refused here, 400),
        then the load hooks' check against the folder's manifest, where the family reads one
        (a manifest it cannot read is the load's to report)."""
        with self._load_errors(entry):
            family.check(entry.path, **self.files_for(entry))
        if self.load_hooks is None:
            return
        try:
            manifest = family.manifest(entry.path, **self.files_for(entry))
        except Exception:  # noqa: BLE001 - the load reports a broken folder with its status
            return
        if manifest is not None:
            self._hook(entry.model_id, self.load_hooks.check, entry.model_id, manifest)

    @contextlib.contextmanager
    def _load_errors(self, entry: ModelEntry):
        """A family's refusal of the entry's files as the load's status: 404 for a missing
        file, 400 for files that do not match the family."""
        try:
            yield
        except (FileNotFoundError, EngineInputError, ValueError, KeyError) as exc:
            raise load_refusal(entry, exc) from exc

    def loading_ids(self) -> list[str]:
        """The models loading now, sorted (a copy: loads start and end on other threads)."""
        with self._lock:
            return sorted(self.loading)

    def _load(self, entry: ModelEntry) -> LoadedModel:
        """The entry's model loaded, counted (`loads`, `load_seconds`) and, while it loads,
        named in `loading` (the readiness answer's)."""
        started = time.perf_counter()
        with self._lock:
            self.loading.add(entry.model_id)
        try:
            loaded = self._load_model(entry)
        finally:
            with self._lock:
                self.loading.discard(entry.model_id)
        with self._lock:
            self.loads += 1
            self.load_seconds += time.perf_counter() - started
        return loaded

    def _load_model(self, entry: ModelEntry) -> LoadedModel:
        module = self.family(entry.family)
        if module is None:
            raise ContractError(400, f"family {entry.family!r} is not available in this server")
        if not (entry.path / MODEL_INDEX).is_file():
            raise ContractError(404, f"model {entry.model_id!r} has vanished from {entry.path}")
        options = self._load_options(entry)
        self._check_before_load(entry, module)
        self._make_room(entry.model_id)
        with self._load_errors(entry):
            model = module.load(entry.path, entry.model_id, **options)
        try:
            gaps = seam_gaps(model)
            if gaps:
                raise TypeError(
                    f"family {entry.family} built a model that lacks the ImageModel seam's "
                    f"{', '.join(gaps)} (server/engine/base.py)"
                )
            loaded = LoadedModel(entry, model, 0, model.facts, model.capabilities)
            if self.load_hooks is not None:
                self._hook(entry.model_id, self.load_hooks.give, loaded)
        except Exception:
            model.close()
            raise
        with self._lock:
            self._generation += 1
            loaded.generation = self._generation
            self._loaded[entry.model_id] = loaded
        self._forget_listing()
        precision = options.get("quantization")
        log.info(
            "loaded model %s (%s %s%s)",
            entry.model_id,
            entry.family,
            entry.variant,
            f", {precision.bits}-bit groups of {precision.group_size}" if precision else "",
        )
        return loaded

    def _load_options(self, entry: ModelEntry) -> dict:
        """The keyword arguments of the family's `load` for this entry: its load settings'
        (LoadSettings.options), each refused 400 for a family whose spec does not take it."""
        options = self.settings_for(entry).options()
        spec = self.families[entry.family]
        for name in options:
            if name == "quantization" and not spec.quantizes:
                reason = "does not quantize its weights; load it without quantize"
            elif name == "encoder_vae_dtype" and not spec.encoder_vae_dtype:
                reason = "has no encoder and VAE dtype to set; leave encoder_vae_dtype out"
            elif name in ("quantization", "encoder_vae_dtype") or name in spec.files:
                continue
            else:
                reason = f"reads no GGUF file for its {name}; remove its {name} setting"
            raise ContractError(400, f"model {entry.model_id!r}: family {entry.family} {reason}")
        return options

    def _make_room(self, model_id: str) -> None:
        with self._lock:
            others = [m for m in self._loaded.values() if m.model_id != model_id]
            stale = self._loaded.get(model_id)
        if stale is not None:  # the folder moved: the old instance goes, once nothing holds it
            if stale.holds:
                raise ContractError(
                    503,
                    f"cannot load {model_id!r} from its new folder now: its instance from"
                    f" {stale.entry.path} is held by {stale.holds} run(s) or step(s); retry"
                    " after they end",
                )
            self._drop(stale)
        excess = len(others) + 1 - self.max_resident
        for loaded in sorted(others, key=lambda m: m.holds)[: max(0, excess)]:
            if loaded.holds:
                raise ContractError(
                    503,
                    f"cannot load {model_id!r} now: model {loaded.model_id!r} is held by "
                    f"{loaded.holds} run(s) or step(s); retry after they end",
                )
            self._drop(loaded)

    def unload(self, model_id: str) -> bool:
        """Worker thread: unload a model; False when it was not loaded; 409 busy when held."""
        with self._lock:
            loaded = self._loaded.get(model_id)
            if loaded is None:
                return False
            if loaded.holds:
                raise ContractError(
                    409,
                    f"model {model_id!r} is in use by {loaded.holds} run(s) or step(s); end "
                    "them first",
                    code="busy",
                    in_flight=loaded.holds,
                )
        self._drop(loaded)
        return True

    def unload_all(self) -> None:
        """Worker thread: let every model go, held or not (shutdown)."""
        with self._lock:
            everything = list(self._loaded.values())
        for loaded in everything:
            self._drop(loaded)

    def _drop(self, loaded: LoadedModel) -> None:
        with self._lock:
            if self._loaded.get(loaded.model_id) is loaded:
                del self._loaded[loaded.model_id]
        self._forget_listing()
        loaded.tables.clear()
        try:
            loaded.model.close()
        except Exception:  # noqa: BLE001 - a failing close must not keep the slot
            log.exception("closing model %s failed", loaded.model_id)
        log.info("unloaded model %s", loaded.model_id)
