"""A model from its component files, with no diffusers folder: a DiT, a text encoder and a VAE,
each one `.safetensors` or `.gguf` file, as ComfyUI's model folders hold them
(`diffusion_models/`, `text_encoders/`, `vae/`) or a model entry names them.

The family comes from the DiT's tensors (each family folder's `components.py`, as ComfyUI's model
detection finds it), the variant from the entry, else from what the rule reads in the file
names, else the entry must name it. The configs diffusers keeps in JSON come from the family's
rule: sizes from the tensors' shapes, the rest from the family's own facts. They are written,
with links to the files and the tokenizer, into a small folder of the server's cache
(`set_folder`): a folder in diffusers' layout whose weights are the user's files, unchanged, so
the rest of the engine serves it as any other folder. Headers alone are read (no MLX, no tensor
data), so the listing and the refusals of a bad set come before anything loads.

A rule (a family folder's `components.py`, found by its name) provides:
- `family(dit) -> str | None`: the family of a DiT's header, None when not its;
- optionally `variant(dit, name) -> str | None`: the variant the files say (`name`: the DiT
  file's stem; default: the one of the spec's variants that the name holds, `named_variant`);
- `configs(family, variant, dit, encoder, vae) -> {relative path: JSON}`: the folder's configs,
  a ComponentError (naming file and tensor) when the parts do not fit each other;
- `fits_encoder(dit, encoder)`, `fits_vae(dit, vae)`: whether files fit, for the listing;
- `TOKENIZER_REPO`: where the family's tokenizer is published (the refusal's hint), and
  optionally `TOKENIZER_INCLUDE`, its file's path there (default: a `tokenizer/` folder).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import file_headers
from .cache_home import cache_home
from .embedded import ensure
from .file_headers import Header, HeaderError

log = logging.getLogger("gmlx.server")

# Bump when set_folder writes something else for the same files.
SET_GENERATOR = 2
SETS_FOLDER = "sets"
# Under the sets' folder: each tokenizer built from a GGUF file's tokens or ComfyUI's copy of
# Qwen's, once for every set that reads it (a real one is megabytes).
TOKENIZERS_FOLDER = "tokenizers"
# ComfyUI's model folders by component, its legacy names too (folder_paths.py).
COMFY_FOLDERS = {
    "dit": ("diffusion_models", "unet"),
    "text_encoder": ("text_encoders", "clip"),
    "vae": ("vae",),
}
WEIGHT_SUFFIXES = (".safetensors", ".gguf")
# ComfyUI's own copy of Qwen's tokenizer (vocab.json, merges.txt, tokenizer_config.json),
# under a ComfyUI checkout.
COMFY_QWEN_TOKENIZER = Path("comfy") / "text_encoders" / "qwen25_tokenizer"
TOKENIZER_FILE = "tokenizer.json"


class ComponentError(ValueError):
    """A set of files the server cannot serve as one model; the text names file and tensor."""


@dataclass(frozen=True)
class ComponentFiles:
    """A model's files: each component's weights, and optionally a tokenizer folder, the
    family and the variant (what the files cannot tell)."""

    dit: Path
    text_encoder: Path
    vae: Path
    tokenizer: Path | None = None
    family: str | None = None
    variant: str | None = None
    comfyui: Path | None = None  # the ComfyUI checkout whose tokenizer files may serve

    def paths(self) -> dict[str, Path]:
        return {"dit": self.dit, "text_encoder": self.text_encoder, "vae": self.vae}


@dataclass(frozen=True)
class IdentifiedSet:
    files: ComponentFiles
    family: str
    variant: str
    rule: Any
    headers: dict[str, Header]


def named_variant(name: str, variants) -> str | None:
    """The one of `variants` a file's name holds (None: none, or more than one)."""
    named = [variant for variant in variants if variant in name]
    return named[0] if len(named) == 1 else None


def rules(specs: dict) -> dict[str, Any]:
    """The component rule of each family that has one and can import it, by family name."""
    found = {}
    for name, spec in specs.items():
        try:
            rule = spec.load_component_rule()
        except ImportError:
            continue
        if rule is not None:
            found[name] = rule
    return found


def header(path: Path) -> Header:
    """A file's header (kept while its size and time stay); a ComponentError naming the file
    when it cannot be read (`read_kept`)."""
    try:
        return read_kept(Path(path))
    except FileNotFoundError:
        raise
    except HeaderError as exc:
        raise ComponentError(str(exc)) from None


def file_variant(rule, dit: Header, name: str, variants) -> str | None:
    """The variant a DiT file says: its rule's `variant`, else the one of `variants` its
    name holds."""
    if hasattr(rule, "variant"):
        return rule.variant(dit, name)
    return named_variant(name, variants)


def identify(files: ComponentFiles, specs: dict) -> IdentifiedSet:
    """The set's family and variant, from the entry or the DiT's tensors; a ComponentError
    saying which setting to add when the files cannot tell."""
    for key, path in files.paths().items():
        if not Path(path).is_file():
            raise FileNotFoundError(f"the {key} file {path} does not exist")
    dit = header(files.dit)
    found = rules(specs)
    family = files.family
    if family is None:
        family = next((f for rule in found.values() if (f := passes(rule.family, dit))), None)
        if family is None:
            arch = f" (GGUF architecture {dit.architecture})" if dit.architecture else ""
            raise ComponentError(
                f"{files.dit} is not the DiT of a family this server serves from its files"
                f"{arch}: {', '.join(sorted(found)) or 'none'}"
            )
    elif family not in found:
        raise ComponentError(
            f"family {family!r} is not served from component files here"
            f" (these are: {', '.join(sorted(found)) or 'none'})"
        )
    elif passes(found[family].family, dit) is None:
        raise ComponentError(f"{files.dit} is not a {specs[family].title} DiT")
    rule = found[family]
    variants = tuple(specs[family].sampling)
    variant = files.variant or file_variant(rule, dit, Path(files.dit).stem.lower(), variants)
    if variant is None:
        raise ComponentError(
            f"{files.dit} does not say which {specs[family].title} variant it is; name it in the"
            f" model entry: variant = one of {', '.join(repr(v) for v in variants)}"
        )
    if variant not in variants:
        raise ComponentError(
            f"variant {variant!r} is not one of {specs[family].title}'s ({', '.join(variants)})"
        )
    headers = {"dit": dit, "text_encoder": header(files.text_encoder), "vae": header(files.vae)}
    return IdentifiedSet(files, family, variant, rule, headers)


def configs(found: IdentifiedSet) -> dict[str, dict]:
    """The set's configs by relative path (model_index.json, transformer/config.json, ...); a
    ComponentError naming the files where a tensor the rule reads is missing or has another
    rank."""
    h = found.headers
    try:
        return found.rule.configs(
            found.family, found.variant, h["dit"], h["text_encoder"], h["vae"]
        )
    except (IndexError, TypeError) as exc:
        raise ComponentError(f"{unfit_files(found.files.paths().values())}: {exc!r}") from None
    except HeaderError as exc:  # a file without a tensor the rule reads: the error names it
        raise ComponentError(str(exc)) from None


def unfit_files(paths) -> str:
    """What files whose tensors break a family rule are: a tensor of another rank than the
    family reads, in one of them."""
    return f"a tensor of {' or '.join(str(p) for p in paths)} is not of the rank its family has"


def tokenizer_source(found: IdentifiedSet) -> tuple[str, Path]:
    """Where the set's tokenizer comes from, the first of: the entry's tokenizer folder, the
    GGUF text encoder's own tokens, a `tokenizer/` folder beside the DiT or the text encoder,
    the ComfyUI checkout's copy of Qwen's; else a ComponentError naming the file to fetch."""
    files = found.files
    if files.tokenizer is not None:
        if not (Path(files.tokenizer) / TOKENIZER_FILE).is_file():
            raise ComponentError(f"the tokenizer folder {files.tokenizer} has no {TOKENIZER_FILE}")
        return "folder", Path(files.tokenizer)
    encoder = found.headers["text_encoder"]
    if Path(files.text_encoder).suffix.lower() == ".gguf" and encoder.metadata.get(
        "tokenizer.ggml.model"
    ):
        return "gguf", Path(files.text_encoder)
    for beside in (Path(files.dit).parent, Path(files.text_encoder).parent):
        if (beside / "tokenizer" / TOKENIZER_FILE).is_file():
            return "folder", beside / "tokenizer"
    for root in comfyui_roots(files):
        if (root / COMFY_QWEN_TOKENIZER / "vocab.json").is_file():
            return "bpe", root / COMFY_QWEN_TOKENIZER
    repo = found.rule.TOKENIZER_REPO
    published = getattr(found.rule, "TOKENIZER_INCLUDE", None)
    path, pattern = (
        (published, published) if published else (f"tokenizer/{TOKENIZER_FILE}", "tokenizer/*")
    )
    # `gmlx pull --to` writes the repository's paths under its folder
    beside = Path(files.text_encoder).parent
    to = beside if path.startswith("tokenizer/") else beside / "tokenizer"
    raise ComponentError(
        f"no tokenizer for {files.text_encoder}: it is not a GGUF file carrying its tokens, and"
        f" no tokenizer/{TOKENIZER_FILE} is beside it; fetch {repo}'s {path} into a tokenizer/"
        f" folder beside {Path(files.text_encoder).name}"
        f" (`gmlx pull {repo} --include '{pattern}' --to '{to}'`), or name a folder holding it"
        " (tokenizer = ...)"
    )


def comfyui_roots(files: ComponentFiles) -> list[Path]:
    """ComfyUI checkouts the files may belong to: the one named, then the folder above a
    `models/` folder holding any of them."""
    roots = [Path(files.comfyui)] if files.comfyui else []
    for path in files.paths().values():
        for parent in Path(path).resolve().parents:
            if parent.name == "models":
                roots.append(parent.parent)
                break
    return list(dict.fromkeys(roots))


def fingerprint(found: IdentifiedSet, tokenizer: tuple[str, Path]) -> str:
    """What decides the set's folder: the files (path, size, time), family, variant, tokenizer."""
    parts: dict[str, Any] = {"generator": SET_GENERATOR}
    for key, path in found.files.paths().items():
        stat = Path(path).stat()
        parts[key] = [str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns]
    parts.update(
        family=found.family, variant=found.variant, tokenizer=[tokenizer[0], str(tokenizer[1])]
    )
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def set_folder(files: ComponentFiles, specs: dict, cache_dir: Path | None = None) -> Path:
    """The set's folder in the cache (written when missing or when the files changed): its
    configs, links to the weight files and its tokenizer; a ComponentError or
    FileNotFoundError when the set cannot be served, before anything loads."""
    found = identify(files, specs)
    written = configs(found)
    tokenizer = tokenizer_source(found)
    digest = fingerprint(found, tokenizer)
    wanted = {"name": "component set", "generator": SET_GENERATOR, "fingerprint": digest}
    root = Path(cache_dir) if cache_dir is not None else cache_home() / SETS_FOLDER
    tokenizer_dir = tokenizer_folder(root, *tokenizer)

    def write(folder: Path) -> None:
        for relative, doc in written.items():
            target = folder / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(doc, indent=2))
        link(folder / "transformer", files.dit, None)
        link(folder / "text_encoder", files.text_encoder, "model.safetensors")
        link(folder / "vae", files.vae, "diffusion_pytorch_model.safetensors")
        os.symlink(tokenizer_dir, folder / "tokenizer")

    return ensure(root, cache_folder_name(files.dit, digest), wanted, write)


def cache_folder_name(path: Path, digest: str) -> str:
    """A cache folder's name: the file's stem in safe characters, then the digest's start."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(path).stem)[:48]
    return f"{stem}-{digest[:12]}"


def link(folder: Path, path: Path, safetensors_name: str | None) -> None:
    """`folder`/<name> pointing at `path` (a safetensors file under `safetensors_name`, when
    given, so the folder reads as the component's usual one)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = Path(path).resolve()
    name = path.name
    if safetensors_name and path.suffix.lower() == ".safetensors":
        name = safetensors_name
    os.symlink(path, folder / name)


def tokenizer_folder(root: Path, kind: str, source: Path) -> Path:
    """The folder holding the set's tokenizer.json, from the source `tokenizer_source` found:
    a tokenizer folder as it is; one built from a GGUF file's tokens or ComfyUI's copy of
    Qwen's, under root/TOKENIZERS_FOLDER, built once for every set that reads the same source
    in the same state."""
    source = Path(source).resolve()
    if kind == "folder":
        return source
    files = sorted(p for p in source.iterdir() if p.is_file()) if source.is_dir() else [source]
    parts = [SET_GENERATOR, kind, str(source)]
    parts += [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    digest = hashlib.sha256(json.dumps(parts).encode()).hexdigest()
    wanted = {"name": "tokenizer", "generator": SET_GENERATOR, "fingerprint": digest}
    name = cache_folder_name(source, digest)
    return ensure(
        root / TOKENIZERS_FOLDER, name, wanted, lambda f: write_tokenizer(f, kind, source)
    )


def write_tokenizer(folder: Path, kind: str, source: Path) -> None:
    """folder/tokenizer.json built from a GGUF file's tokens (`kind` "gguf") or from ComfyUI's
    copy of Qwen's vocab and merges ("bpe")."""
    from .encoders.qwen3.vocab_files import bpe_tokenizer, gguf_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    try:
        if kind == "gguf":
            built = gguf_tokenizer(file_headers.gguf_tokenizer(source), str(source))
        else:
            built = bpe_tokenizer(source)
    except (ValueError, KeyError, OSError) as exc:
        raise ComponentError(f"cannot build the tokenizer from {source}: {exc}") from None
    (folder / TOKENIZER_FILE).write_text(built.to_str())


# -- ComfyUI's model folders ------------------------------------------------------------------


def comfy_files(folders: dict[str, list[Path]]) -> dict[str, list[Path]]:
    """The weight files of each component (COMFY_FOLDERS' keys) in its folders, sorted by name
    within each folder; a folder that does not exist holds none."""
    found: dict[str, list[Path]] = {}
    for key, roots in folders.items():
        paths = []
        for folder in roots:
            if Path(folder).is_dir():
                paths += [
                    p
                    for p in sorted(Path(folder).rglob("*"))
                    if p.suffix.lower() in WEIGHT_SUFFIXES and p.is_file()
                ]
        found[key] = list(dict.fromkeys(paths))
    return found


# path -> ((size, time), the header or the HeaderError reading it gave)
_HEADERS: dict[Path, tuple[tuple[int, int], Header | HeaderError]] = {}
# the files (paths and sizes) whose tensors broke a rule's test, said once in the log
_UNFIT: set[tuple] = set()


def read_kept(path: Path) -> Header:
    """file_headers.read, kept while the file's size and time stay (a listing reads each file
    once); a HeaderError likewise, said once in the log (a listing leaves the file out), also
    for a safetensors tensor stored in a dtype the server does not read (a float8 file:
    file_headers.READ_DTYPES)."""
    stat = path.stat()
    stamp = (stat.st_size, stat.st_mtime_ns)
    kept = _HEADERS.get(path)
    if kept is None or kept[0] != stamp:
        try:
            read: Header | HeaderError = file_headers.read(path)
            if path.suffix.lower() != ".gguf":  # a GGUF's types are ggml's
                stored = {read.prefix + name: dtype for name, dtype in read.types.items()}
                file_headers.check_read_dtypes(path, stored)
        except HeaderError as exc:
            log.warning("a model file that cannot be served: %s", exc)
            read = exc
        kept = _HEADERS[path] = (stamp, read)
    if isinstance(kept[1], HeaderError):
        raise kept[1]
    return kept[1]


def cached_header(path: Path) -> Header | None:
    """read_kept, None for a file that is not a readable weight file."""
    try:
        return read_kept(path)
    except (HeaderError, OSError):
        return None


def comfy_sets(
    folders: dict[str, list[Path]], specs: dict, comfyui: Path | None = None
) -> dict[str, ComponentFiles]:
    """Every complete set the folders' files make (`folders`: by component, as comfy_files
    takes them), by model id (`dit + text encoder + vae`, the files' stems): each DiT a
    family's rule recognises, with each text encoder and VAE its rule says fit it
    (`fits_encoder`, `fits_vae`). Headers only. `comfyui`: the ComfyUI folder whose tokenizer
    copy the sets may use."""
    files = comfy_files(folders)
    found = rules(specs)
    headers = {key: [(p, cached_header(p)) for p in paths] for key, paths in files.items()}
    sets: dict[str, ComponentFiles] = {}
    for dit_path, dit in headers["dit"]:
        if dit is None:
            continue
        family = next((f for rule in found.values() if (f := passes(rule.family, dit))), None)
        if family is None:
            continue
        rule = found[family]
        for encoder_path, encoder in headers["text_encoder"]:
            if encoder is None or not passes(rule.fits_encoder, dit, encoder):
                continue
            for vae_path, vae in headers["vae"]:
                if vae is None or not passes(rule.fits_vae, dit, vae):
                    continue
                model_id = f"{dit_path.stem} + {encoder_path.stem} + {vae_path.stem}"
                sets.setdefault(
                    model_id, ComponentFiles(dit_path, encoder_path, vae_path, comfyui=comfyui)
                )
    return sets


def passes(test, *headers: Header) -> Any:
    """A rule's test of files' headers; files whose tensors break it (a tensor of another rank
    than the family's) fail it, said once in the log."""
    try:
        return test(*headers)
    except (IndexError, TypeError) as exc:
        stamps = tuple((h.path, h.size) for h in headers)
        if stamps not in _UNFIT:
            _UNFIT.add(stamps)
            log.warning("%s: %r", unfit_files(h.path for h in headers), exc)
        return None
