"""What a family declares about itself, as data: `FamilySpec`, and where the specs are found.

Each family folder under `engine/families/` holds a `spec.py` that imports no MLX and exports
`SPECS`, the families it answers (FLUX.2 klein's folder answers three). The registry finds the
folders by itself (`family_specs`; a spec names its folder as its `package`), identifies a
model folder with each spec's `identify` (a function, or `ByClass` data), and reads what a
family takes (its file keywords, whether it quantizes or shards) from the spec, so the listing,
identification and the checks of a model's settings run without MLX. The rest of a folder is
found by its modules' names: `family.py` holds the `Family` that serves describe, manifest,
check, quantized_files and load (it may import MLX), `embedded.py` the embedded model's
`RECIPE` where the family has one, and `components.py` the rule that tells its model from
component files where it has one.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .base import Capabilities, ReferenceSizes

log = logging.getLogger("gmlx.server")

FAMILIES_PACKAGE = "gmlx_server.engine.families"


@dataclass(frozen=True)
class Published:
    """A repository of the Hugging Face Hub holding a family's model (`gmlx pull NAME`): a
    short name, the repository, the files to fetch (patterns; empty: all) and what it holds."""

    name: str
    repo: str
    include: tuple[str, ...] = ()
    holds: str = "a diffusers folder"


@dataclass(frozen=True)
class Conditioning:
    """Status `conditioning` (docs/contract.md §2.3, an extension): how the DiT places
    reference latents (None: it takes none), the text an empty prompt is encoded as, and how
    the server's own inpainting runs: the mask brought to the latent grid by `inpaint_mask`
    (None: bilinearly, the member left out) and the init image also taken as the first
    reference (`inpaint_reference`, the member left out when false)."""

    ref_method: str | None = None
    empty_prompt: str = ""
    inpaint_mask: str | None = None
    inpaint_reference: bool = False

    def status(self) -> dict:
        row = {"ref_method": self.ref_method, "empty_prompt": self.empty_prompt}
        if self.inpaint_mask is not None:
            row["inpaint_mask"] = self.inpaint_mask
        if self.inpaint_reference:
            row["inpaint_reference"] = True
        return row


@dataclass(frozen=True)
class FamilySpec:
    """One family's facts. The status (docs/contract.md §2.3) publishes `comfy`,
    `conditioning`, `edit_capable` and the strides; the capabilities route its `features`."""

    name: str  # the family's name on the wire
    title: str  # its name in prose, for messages
    # (model folder) -> (family, variant), or None when the folder is not of this family
    identify: Callable[[Path], tuple[str, str] | None]
    comfy: dict = field(default_factory=dict)  # status `comfy`: ComfyUI's model class
    conditioning: Conditioning = Conditioning()
    latent_stride: int | None = None  # None: the family reads it from its VAE's config
    latent_patch: int = 1
    max_refs: int = 0  # reference images a row may carry (0: it takes none)
    # the reference images' sizes its pipeline takes as they are (None: any size)
    reference_sizes: ReferenceSizes | None = None
    features: tuple[str, ...] = ()  # docs/contract.md §5.4
    conventions: tuple[str, ...] = ("comfy", "reference")
    # The conventions under which its DiT steps a row in parts (docs/contract.md §3.3).
    in_parts: tuple[str, ...] = ()
    # sigma = timestep_scale x timestep under both conventions (docs/contract.md §5.2): the
    # step's timestep is 1000 sigma where it is 0.001 (MOSS-Image)
    timestep_scale: float = 1.0
    # The variants' own sampling settings (steps, cfg, shift), by variant name, and the
    # schedule rule they share (docs/contract.md §5.3; None: none).
    sampling: dict = field(default_factory=dict)
    schedule: dict | None = None
    # The weight files a model entry may name for it (load_settings.FILE_KEYS).
    files: tuple[str, ...] = ()
    quantizes: bool = True  # a model entry's `quantize` applies
    encoder_vae_dtype: bool = True  # a model entry's `encoder_vae_dtype` applies
    shards: bool = False  # its DiT has a shard plan (a rank group may serve it)
    # Where its models are published (`gmlx pull`'s catalog).
    published: tuple[Published, ...] = ()
    # Its folder's package, where its modules are found by name (its spec.py's `__package__`;
    # "": a family given whole, whose modules are not looked up).
    package: str = ""

    def conditioning_status(self) -> dict:
        """Status `conditioning`: the Conditioning's members, and the sizes of reference
        images its pipeline takes as they are (`reference_sizes`, where it has bounds)."""
        row = self.conditioning.status()
        if self.reference_sizes is not None:
            row["reference_sizes"] = self.reference_sizes.status()
        return row

    @property
    def edit_capable(self) -> bool:
        """Whether its DiT takes reference latents (status `edit_capable`)."""
        return self.max_refs > 0

    def capabilities(self) -> Capabilities:
        """What its loaded model can do beyond its status (base.Capabilities), from the spec."""
        return Capabilities(
            max_refs=self.max_refs,
            reference_sizes=self.reference_sizes,
            conventions=self.conventions,
            ref_cache="ref_cache" in self.features,
            in_parts=self.in_parts,
        )

    def module_name(self, name: str) -> str | None:
        """The full name of its folder's module `name` (None: the folder has none)."""
        if not self.package or importlib.util.find_spec(f"{self.package}.{name}") is None:
            return None
        return f"{self.package}.{name}"

    def load_component_rule(self):
        """The family's component-file rule, its folder's `components.py` (None: it has none;
        an ImportError where its module cannot be imported)."""
        name = self.module_name("components")
        return None if name is None else importlib.import_module(name)

    def load_implementation(self) -> Family:
        """The `Family` its folder's `family.py` holds (an ImportError where the module cannot
        be imported, e.g. without MLX; a LookupError where the folder has no family.py or it
        holds no one Family serving this family: a mistake in the folder, not a family this
        process cannot serve)."""
        name = self.module_name("family")
        if name is None:
            folder = self.package or "(its spec names none)"
            raise LookupError(f"family {self.name}'s folder {folder} has no family.py")
        module = importlib.import_module(name)
        found = {id(v): v for v in vars(module).values() if isinstance(v, Family)}
        serving = [v for v in found.values() if v.serves(self.name)]
        if len(serving) != 1:
            raise LookupError(f"{name} holds {len(serving)} Family objects serving {self.name}")
        return serving[0]


class Family:
    """What the registry asks of a family beyond its spec. `load(model_dir, model_id,
    **options)` builds the `ImageModel` (the options: load_settings.LoadSettings.options, only
    those the spec says the family takes). A family that can tell its status and manifest from
    the files alone says so by overriding `describe` and `manifest` (engine.family.FolderFamily
    does, from the spec); these defaults say nothing."""

    def __init__(self, spec: FamilySpec, load: Callable | None = None) -> None:
        self.spec = spec
        if load is not None:
            self.load = load

    def serves(self, name: str) -> bool:
        """Whether it serves the family `name`."""
        return name == self.spec.name

    def load(self, model_dir: Path, model_id: str, **options):
        raise NotImplementedError(f"family {self.spec.name} does not say how it loads")

    def describe(self, model_dir: Path, model_id: str | None = None, **files) -> dict | None:
        """The status of a model not loaded, from its files; None: not without loading it."""
        return None

    def manifest(self, model_dir: Path, **files) -> dict | None:
        """The DiT's manifest from the files; None: not without loading it."""
        return None

    def check(self, model_dir: Path, **files) -> None:
        """Refuse broken weight files before the resident model is let go."""

    def quantized_files(self, model_dir: Path) -> dict | None:
        """For `gmlx model quantize`: by component folder, a predicate on file tensor names;
        None: the family writes no quantized folder."""
        return None


@dataclass(frozen=True)
class ByClass:
    """A spec's `identify` as data: a folder is of `family` when its `document` (model_index.json,
    or a component's config such as transformer/config.json) names `class_name`; its variant is
    the first of `variants` where the document sets `flag`, else the second. A folder without
    the document, or whose document is not a JSON object, is not of the family; a document
    that is not JSON at all is a ValueError naming it (the registry says it for the folder)."""

    family: str
    class_name: str
    flag: str
    variants: tuple[str, str]
    document: str = "model_index.json"

    def __call__(self, model_dir: Path) -> tuple[str, str] | None:
        try:
            found = read_json(Path(model_dir) / self.document)
        except OSError:
            return None
        if not isinstance(found, dict) or found.get("_class_name") != self.class_name:
            return None
        return self.family, self.variants[0] if found.get(self.flag) else self.variants[1]


def read_json(path: Path) -> dict:
    """A JSON file's object; {} when the file is absent (a ValueError naming it when it is
    not JSON)."""
    path = Path(path)
    return parsed_json(path) if path.is_file() else {}


def read_config(component_dir: Path) -> dict:
    """A component folder's config.json (FileNotFoundError when it has none, a ValueError
    naming it when it is not JSON)."""
    return parsed_json(Path(component_dir) / "config.json")


def parsed_json(path: Path):
    """A JSON file's value; a file that is not JSON is a ValueError that names it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # JSON's and UTF-8's errors
        raise ValueError(f"{path} is not JSON ({exc})") from exc


def model_index(model_dir: Path) -> dict:
    """A model folder's model_index.json."""
    return json.loads((Path(model_dir) / "model_index.json").read_text(encoding="utf-8"))


def pipeline_components(transformer: str, vae: str, text_encoder: str, tokenizer: str) -> dict:
    """model_index.json's component entries of a flow-matching pipeline folder: the DiT, the VAE
    and the scheduler (FlowMatchEulerDiscreteScheduler) by their diffusers classes, the text
    encoder and its tokenizer by their transformers classes."""
    return {
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", text_encoder],
        "tokenizer": ["transformers", tokenizer],
        "transformer": ["diffusers", transformer],
        "vae": ["diffusers", vae],
    }


def family_specs() -> dict[str, FamilySpec]:
    """Every family of the product's folders by name: each folder's `spec.SPECS`, folders in
    name order (a folder without a spec.py is left out, and logged; a spec.py that fails to
    import raises, as a family must not vanish quietly; a LookupError where a spec names
    another folder than its own as its `package`)."""
    package = importlib.import_module(FAMILIES_PACKAGE)
    found: dict[str, FamilySpec] = {}
    for folder in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if not folder.ispkg:
            continue
        name = f"{FAMILIES_PACKAGE}.{folder.name}.spec"
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            log.debug("family folder %s has no spec.py", folder.name)
            continue
        for spec in module.SPECS:
            if spec.package != module.__package__:
                raise LookupError(
                    f"family {spec.name} of {module.__package__} names {spec.package!r} as "
                    "its folder (its spec's `package` must be its spec.py's __package__)"
                )
            found[spec.name] = spec
    return found
