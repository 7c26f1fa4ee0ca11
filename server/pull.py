"""`gmlx pull`: a model's files from the Hugging Face Hub into the first `model_dirs` folder.

`gmlx pull REPO` (an `owner/name` repository, or a family's published name: `gmlx pull
--list`) reads the repository's file list, prints the model id the files will serve as and
the disk and memory they will need, then downloads them with `huggingface_hub` (resumable:
a cut connection is taken up where it stopped; a progress bar), each file checked against the
Hub's hash (its sha256 for LFS files, its git blob id for the others) and refused, removed,
when it does not match. `HF_ENDPOINT` names another hub (a mirror, or the tests' loopback one).

- `--include PATTERN` (repeatable): only the files matching a pattern (fnmatch, on the path
  in the repository).
- `--quantize N`: the folder is written quantized (as `gmlx model quantize` writes it), shard
  by shard as the files arrive: each float shard is downloaded, quantized into the folder and
  removed before the next, so the float model is never whole on disk or in memory.
- `--gguf TYPE`: of a repository of GGUF files, those of that type (`Q4_K_M`, ...) alone.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from .engine.precision import BITS, DEFAULT_GROUP_SIZE, Quantization
from .parsers import FLAG_FORMS, folder_to_write, quantization_argument
from .process import prepared_for

RETRIES = 3  # a file whose download fails is tried again this often, resuming where it stopped
# How long the Hub may take to answer the file listing (huggingface_hub waits for ever): a
# network that takes the connection and never answers (a login page, a dropping firewall).
HUB_TIMEOUT_S = 30.0
WEIGHTS_SUFFIX = ".safetensors"
STAGING = ".pull-float"  # the float shards of a quantized pull, one at a time
BF16_BYTES = 2


class PullError(ValueError):
    """A pull that cannot go on; the text says why and what to do."""


@dataclass(frozen=True)
class RepoFile:
    """One file of the repository: its path, size and the Hub's hash of it (sha256 for LFS
    files, else the git blob id)."""

    name: str
    size: int
    sha256: str | None = None
    blob_id: str | None = None

    @property
    def component(self) -> str:
        return self.name.split("/", 1)[0] if "/" in self.name else ""


@dataclass(frozen=True)
class Plan:
    repo: str
    commit: str
    files: tuple[RepoFile, ...]
    target: Path
    quantization: Quantization | None = None

    @property
    def model_id(self) -> str:
        return self.target.name

    def disk_bytes(self) -> int:
        """What the pull leaves on disk (quantized components at their quantized size)."""
        return sum(self.held_bytes(f) for f in self.files)

    def held_bytes(self, file: RepoFile) -> int:
        """A file's bytes once pulled: a quantized component's weights at `bits` per weight
        plus their float32 scale and bias per group, from bf16 (an estimate: norms and
        embeddings stay float)."""
        if not (self.quantization and self.quantized(file)):
            return file.size
        q = self.quantization
        per_weight = q.bits / 8 + 8 / q.group_size
        return int(file.size / BF16_BYTES * per_weight)

    def weight_bytes(self) -> int:
        """The weight files' bytes once pulled: what a load holds at the files' precision."""
        return sum(
            self.held_bytes(f)
            for f in self.files
            if f.name.endswith(WEIGHTS_SUFFIX) or f.name.endswith(".gguf")
        )

    def quantized(self, file: RepoFile) -> bool:
        return file.name.endswith(WEIGHTS_SUFFIX) and file.component in QUANTIZED_COMPONENTS


# The components a quantized load (and `gmlx model quantize`) quantizes.
QUANTIZED_COMPONENTS = ("transformer", "text_encoder")


def published() -> dict:
    """Every family's published repositories by short name: (family spec, Published)."""
    from .engine.spec import family_specs

    return {
        entry.name: (spec, entry) for spec in family_specs().values() for entry in spec.published
    }


def resolve(name: str) -> tuple[str, tuple[str, ...], str]:
    """(repository, default patterns, folder name) of a published name (its folder is named
    so) or an `owner/name` repository (its folder: the repository's name)."""
    known = published()
    if name in known:
        entry = known[name][1]
        return entry.repo, entry.include, name
    if name.count("/") != 1 or not all(name.split("/")):
        names = ", ".join(sorted(known)) or "none"
        raise PullError(
            f"{name!r} is neither a repository (owner/name) nor a published model name"
            f" ({names}; `gmlx pull --list`)"
        )
    return name, (), name.split("/")[1]


def repo_files(repo: str, revision: str | None) -> tuple[str, list[RepoFile]]:
    """The repository's commit and files, with their sizes and hashes."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    api = HfApi()
    try:
        info = api.model_info(repo, revision=revision, files_metadata=True, timeout=HUB_TIMEOUT_S)
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise PullError(
            f"the Hub has no {repo}{'@' + revision if revision else ''}: {exc}"
        ) from None
    except HfHubHTTPError as exc:
        raise PullError(f"cannot read {repo}'s files from the Hub: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - no answer at all: httpx's errors are no OSErrors
        raise PullError(
            f"cannot reach the Hub at {api.endpoint} ({type(exc).__name__}: {exc}); check the"
            " network, or name a mirror with HF_ENDPOINT"
        ) from None
    files = []
    for sibling in info.siblings or []:
        lfs = sibling.lfs
        files.append(
            RepoFile(
                sibling.rfilename,
                int(sibling.size or (lfs.size if lfs else 0) or 0),
                lfs.sha256 if lfs else None,
                sibling.blob_id,
            )
        )
    return info.sha, files


def select(files: list[RepoFile], include: tuple[str, ...], gguf: str | None) -> list[RepoFile]:
    """The files the patterns pick (none: all but the repository's .gitattributes), of a GGUF
    type when `gguf` names one; a PullError when none are left."""
    chosen = [f for f in files if f.name != ".gitattributes"]
    if include:
        chosen = [f for f in chosen if any(fnmatch.fnmatch(f.name, p) for p in include)]
    if gguf:
        ggufs = [f for f in chosen if f.name.lower().endswith(".gguf")]
        chosen = [f for f in ggufs if gguf.lower() in Path(f.name).name.lower()]
        if not chosen:
            present = ", ".join(sorted(Path(f.name).name for f in ggufs)) or "none"
            raise PullError(f"no .gguf file of type {gguf} here (its GGUF files: {present})")
    if not chosen:
        raise PullError(
            f"no file matches {', '.join(include)}" if include else "the repository is empty"
        )
    return chosen


def target_folder(model_dirs: list[Path], to: Path | None, name: str, quantization) -> Path:
    """Where the files go: `to`, else the first model_dirs folder / `name` (with the bits of a
    quantized pull)."""
    if to is not None:
        return Path(to).expanduser()
    if not model_dirs:
        raise PullError(
            "no model_dirs folder to pull into: set [server] model_dirs in the config (or"
            " GMLX_MODEL_DIRS), or name a folder with --to"
        )
    name += f"-{quantization.bits}bit" if quantization else ""
    return Path(model_dirs[0]).expanduser() / name


def file_hash(path: Path, file: RepoFile) -> tuple[str, str]:
    """(expected, got) hashes of a downloaded file: sha256 for LFS files, else git's blob id."""
    if file.sha256:
        digest = hashlib.sha256()
        expected = file.sha256
    else:
        digest = hashlib.sha1()
        digest.update(f"blob {path.stat().st_size}\0".encode())
        expected = file.blob_id or ""
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return expected, digest.hexdigest()


def fetch(plan: Plan, file: RepoFile, folder: Path) -> Path:
    """One file into `folder` (under its repository path), retried and resumed on a cut
    connection, then checked against its hash (a PullError, the file removed, on mismatch)."""
    from huggingface_hub import hf_hub_download

    error: Exception | None = None
    for _ in range(RETRIES):
        try:
            path = Path(
                hf_hub_download(plan.repo, file.name, revision=plan.commit, local_dir=folder)
            )
            break
        except Exception as exc:  # noqa: BLE001 - a connection lost for good, a full disk
            error = exc
    else:
        raise PullError(f"{file.name} did not download after {RETRIES} tries: {error}")
    expected, got = file_hash(path, file)
    if expected and expected != got:
        path.unlink()
        raise PullError(
            f"{file.name} is refused: its hash {got} is not the Hub's {expected} (a corrupted"
            " download or a changed file); it was removed, pull again"
        )
    return path


def pull(plan: Plan, say=print) -> Path:
    """Download the plan's files (small files first), quantizing shard by shard with a
    quantization; the model folder."""
    target = plan.target
    target.mkdir(parents=True, exist_ok=True)
    small = [f for f in plan.files if not f.name.endswith(WEIGHTS_SUFFIX)]
    weights = [f for f in plan.files if f.name.endswith(WEIGHTS_SUFFIX)]
    for file in small:
        fetch(plan, file, target)
    choices = quantized_choices(target) if plan.quantization else {}
    staging = target / STAGING
    written: dict[str, dict[str, str]] = {}
    for file in weights:
        include = choices.get(file.component)
        if include is None:
            fetch(plan, file, target)
            continue
        from .engine.weights import quantize_shard

        path = fetch(plan, file, staging)
        say(f"quantizing {file.name} to {plan.quantization.bits} bits")
        written.setdefault(file.component, {}).update(
            quantize_shard(path, target / file.component, plan.quantization, include)
        )
        path.unlink()
    shutil.rmtree(staging, ignore_errors=True)
    if written:
        from .engine.weights import finish_quantized

        for component, weight_map in written.items():
            folder = target / component
            finish_quantized(folder, folder, plan.quantization, weight_map)
    return target


def quantized_choices(folder: Path) -> dict:
    """What a quantized load of the pulled folder's family quantizes, by component (its
    Family's `quantized_files`); a PullError for a folder no family serves quantized."""
    from .engine.registry import ModelRegistry

    registry = ModelRegistry(extra_models=[folder])
    entries = [entry for entry in registry.entries() if entry.family]
    family = registry.family(entries[0].family) if entries else None
    choices = family.quantized_files(folder) if family is not None else None
    if not choices:
        raise PullError(
            f"{folder} is not a folder of a family that quantizes; pull it without --quantize"
        )
    return choices


def gigabytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "pull", help="download a model from the Hugging Face Hub into the model_dirs folder"
    )
    parser.add_argument("repo", nargs="?", help="owner/name, or a published model name (--list)")
    parser.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="PATTERN",
        help="pull only the files whose path in the repository matches this glob (repeatable;"
        " a published model's own patterns otherwise, else every file)",
    )
    parser.add_argument("--revision", default=None, help="a branch, tag or commit")
    parser.add_argument(
        "--quantize",
        default=None,
        help=f"write the folder quantized to BITS bits per weight ({', '.join(map(str, BITS))}),"
        " shard by shard, as `gmlx model quantize` writes it",
        **FLAG_FORMS["quantize"],
    )
    parser.add_argument(
        "--group-size",
        default=None,
        help=f"with --quantize: weights per quantization group (default {DEFAULT_GROUP_SIZE})",
        **FLAG_FORMS["group_size"],
    )
    parser.add_argument("--gguf", default=None, metavar="TYPE", help="GGUF files of this type")
    parser.add_argument("--to", type=folder_to_write, default=None, help="the folder to pull into")
    parser.add_argument("--list", action="store_true", help="the published model names")
    parser.add_argument("--config", type=Path, default=None, help="TOML config file")
    parser.set_defaults(func=pull_command)


def pull_command(args: argparse.Namespace) -> int:
    from .config import ConfigError, check_writable_folder, load_config

    if args.list:
        for name, (spec, entry) in sorted(published().items()):
            print(f"{name}: {entry.repo} ({spec.title}, {entry.holds})")
        return 0
    if not args.repo:
        print(
            "gmlx pull: name a repository (owner/name) or a published model (--list)",
            file=sys.stderr,
        )
        return 2
    try:  # the arguments and the configuration: exit 2, as the other commands'
        if args.quantize is not None and args.gguf:
            raise ValueError(
                "--quantize and --gguf exclude each other: GGUF files are quantized already"
            )
        quantization = quantization_argument(args)
        config = load_config(args.config)
        if args.to is not None:
            check_writable_folder(Path(args.to).expanduser(), "--to")
    except (ConfigError, ValueError) as exc:
        print(f"gmlx pull: {exc}", file=sys.stderr)
        return 2
    if quantization is not None and not prepared_for("pull"):  # before mlx quantizes a shard
        return 2
    try:
        repo, include, name = resolve(args.repo)
        target = target_folder(config.model_dirs, args.to, name, quantization)
        commit, files = repo_files(repo, args.revision)
        chosen = select(files, tuple(args.include) or include, args.gguf)
        plan = Plan(repo, commit, tuple(chosen), target, quantization)
        print(f"model {plan.model_id}: {len(chosen)} files of {repo} into {target}")
        print(
            f"disk: about {gigabytes(plan.disk_bytes())}; weights in memory: about"
            f" {gigabytes(plan.weight_bytes())} at the files' precision (a float file computes"
            " in float32 on the CPU backend: twice a bf16 file's bytes)"
        )
        pull(plan)
    except (PullError, ValueError) as exc:
        print(f"gmlx pull: {exc}", file=sys.stderr)
        return 1
    print(f"pulled {repo} into {target}: serve it as model {plan.model_id!r}")
    return 0
