"""The server's configuration: a TOML file, then environment variables, then flags.

File (default ~/.config/gmlx-steps/config.toml):

    [server]
    host = "127.0.0.1"
    port = 8080
    api_key = "..."                 # required for a non-loopback bind
    model_dirs = ["~/models"]       # folders of model folders (relative: to this file's)
    default_model = "qwen-image-2.1"
    threads = 8

    [server.image]
    tensor_cache_mb = 64
    adapter_cache_mb = 256
    steps_api = true
    steps_remote = false
    run_idle_s = 120.0              # a run idle this long is ended
    run_sweep_s = 5.0               # how often idle runs are looked for
    memory_headroom_mb = 2048       # memory left to the system and other programs
    memory_budget_mb = 0            # the image worker's memory; 0: the machine's, less headroom
    encoder_residency = "auto"      # the text encoder between encodes: "keep" it loaded,
                                    # "release" it after every encode (loaded again for the
                                    # next), or "auto": release it only when a step or a VAE
                                    # pass would not fit beside it (server/memory.py)
    image_url_ttl_s = 3600.0        # the OpenAI routes' images answered by URL are kept this
    image_url_store_mb = 512        # long, in at most this much disk (the oldest go first),
    image_url_dir = ""              # in this folder, relative to this file's ("": a temporary
                                    # one, removed at stop)

    [models."qwen-image-2.1"]       # settings of one model entry, by its id
    adapters = ["~/loras/style.safetensors:0.8"]   # LoRA files (FILE[:STRENGTH], relative to
                                    # this file's folder) that steps naming no patch table run
                                    # under (docs/contract.md §2.9)
    quantize = 4                    # quantize the DiT and the text encoder as they load: 3, 4,
    group_size = 64                 # 5, 6 or 8 bits, in groups of 32, 64 or 128 (default 64)
    encoder_vae_dtype = "auto"      # the text encoder's and the VAE's compute dtype: "auto"
                                    # (bf16 on a GPU backend, f32 on the CPU one), or "f32",
                                    # "bf16", "f16" to force one (nn.dtypes.encoder_vae_dtype)
    dit = "~/gguf/qwen-image-2.1-Q4_K_M.gguf"   # the DiT's weights from this GGUF file (relative
                                    # to this file's folder) instead of the folder's
                                    # transformer/ weights; its config.json still describes it
                                    # (FLUX.2 klein: also BFL's single .safetensors file)
    text_encoder = "~/gguf/Qwen3-4B-Q4_K_M.gguf"  # likewise the text encoder's (llama.cpp's
                                    # names; Z-Image's Qwen3)
    mmproj = "~/gguf/mmproj-Qwen3-VL-8B-F16.gguf"  # and its vision tower's (Qwen-Image 2.1's
                                    # Qwen3-VL: text_encoder and mmproj together)

    [models."flux3-klein"]
    prompt_upsampler = "~/models/flux-3-image-klein-pup"  # a chat model folder that rewrites
    prompt_upsampling = true        # prompts on encode, always unless a request says false

    [models."z-image-turbo"]        # a model from its component files, no model folder: dit,
    dit = "~/ComfyUI/models/diffusion_models/z_image_turbo_bf16.safetensors"  # text_encoder
    text_encoder = "~/ComfyUI/models/text_encoders/qwen_3_4b.safetensors"   # (.safetensors or
    vae = "~/ComfyUI/models/vae/ae.safetensors"                            # .gguf) and vae
    variant = "turbo"               # what the files cannot tell: the variant, the family
                                    # (flux2_klein_9b_kv), a tokenizer folder (tokenizer.json)

and in [server], `comfyui_model_dirs = ["~/ComfyUI/models"]`: ComfyUI model folders whose
diffusion_models/, text_encoders/ and vae/ files are served as every set they make (the
ComfyUI folders `gmlx comfyui install` recorded are read too, with their
extra_model_paths.yaml: server/comfyui_models.py).

Every table and key the file holds must be one of these: an unknown one (a typo: `model_dir`,
`[sever]`) is refused at start-up, naming the nearest known one.

Environment: GMLX_HOST, GMLX_PORT, GMLX_API_KEY, GMLX_MODEL_DIRS (os.pathsep-separated),
GMLX_DEFAULT_MODEL. A `GMLX_` variable that names nothing the project reads (ENVIRONMENT) is
refused the same way. Flags (`--host`, `--port`, `--quantize`, `--group-size`) override both;
`--quantize` applies to every model, over the entries' own `quantize`. The commands that load
a model themselves take a model entry's settings as flags of the same names (MODEL_SETTINGS,
parsers.add_model_arguments), read by the same parser (`model_settings`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import ipaddress
import math
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package
    import tomli as tomllib

from .engine.load_settings import FILE_KEYS, GGUF_WEIGHTS_SETTING, LoadSettings, gguf_weights
from .engine.precision import (
    AUTO,
    BITS,
    DEFAULT_GROUP_SIZE,
    ENCODER_VAE_DTYPES,
    GROUP_SIZES,
    Quantization,
)

DEFAULT_CONFIG_PATH = Path("~/.config/gmlx-steps/config.toml")
# `[server.image] encoder_residency` (server/memory.py).
ENCODER_RESIDENCIES = ("keep", "release", "auto")


class ConfigError(ValueError):
    """A configuration the server cannot start with; the text says what to change."""


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # GMLX_LOG_LEVEL's
MAX_THREADS = 1024  # server.threads
MAX_PORT = 65535  # server.port, GMLX_PORT and --port (0: the server picks one)
# Every `GMLX_` environment variable the project reads, and what reads it: the server's
# configuration reads the first five and checks GMLX_GGUF_WEIGHTS (`_apply_env`); one not listed
# here is a typo.
ENVIRONMENT = {
    "GMLX_HOST": "[server] host",
    "GMLX_PORT": "[server] port",
    "GMLX_API_KEY": "[server] api_key",
    "GMLX_MODEL_DIRS": "[server] model_dirs, separated by the system's path separator",
    "GMLX_DEFAULT_MODEL": "[server] default_model",
    "GMLX_BLAS": "the BLAS library MLX's Linux CPU backend uses, or off (engine/blas.py)",
    "GMLX_LOG_LEVEL": "the server's log level (INFO)",
    "GMLX_HEARTBEAT": "where rank 0 of a rank group hears the other ranks (host:port)",
    "GMLX_DIT_COMPILE": "0 runs every DiT eagerly, 1 compiles every one (engine/nn/compiled.py)",
    "GMLX_GGUF_WEIGHTS": "how a GGUF file's quantized weights are held: blocks (the file's own,"
    " exact; the default) or affine (MLX's quantization; engine/gguf.py)",
    "GMLX_DEBUG": "the image commands print a failure's traceback",
    "GMLX_BASE_URL": "the ComfyUI pack's server URL (docs/comfyui.md)",
    "GMLX_COMFY_SETTINGS": "the ComfyUI pack's settings file",
    "GMLX_DEFAULT_IMAGE_MODEL": "the ComfyUI pack's default model",
    "GMLX_COMMAND": "the command the ComfyUI pack starts the server with",
    "GMLX_REQUEST_TIMEOUT_S": "how long the ComfyUI pack waits for the server's answers",
    "GMLX_SITE": "the ComfyUI end-to-end tests: the project's site-packages (docs/comfyui.md)",
    "GMLX_FUZZ_EXAMPLES": "the heavy tier's long fuzz runs: inputs per test (docs/reliability.md)",
}


@dataclass
class ImageConfig:
    tensor_cache_mb: int = 64
    adapter_cache_mb: int = 256
    steps_api: bool = True
    steps_remote: bool = False
    run_idle_s: float = 120.0
    run_sweep_s: float = 5.0
    memory_headroom_mb: int = 2048
    memory_budget_mb: int = 0  # 0: the machine's memory less the headroom (server/memory.py)
    encoder_residency: str = "auto"  # one of ENCODER_RESIDENCIES
    image_url_ttl_s: float = 3600.0  # server/image_store.py
    image_url_store_mb: int = 512
    image_url_dir: str = ""  # "": a temporary folder of the server's own


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA file and the strength it is applied at: `FILE[:STRENGTH]` on the command line and
    in a model entry's `adapters`."""

    path: Path
    strength: float = 1.0

    def record(self) -> dict:
        """The adapter as the bench's record names it (settings.adapters)."""
        return {
            "file": self.path.name,
            "bytes": self.path.stat().st_size,
            "strength": self.strength,
        }


def parse_adapter(text: str, base: Path | None = None) -> AdapterSpec:
    """`FILE` or `FILE:STRENGTH`; a FILE with a colon in its name is taken whole when the part
    after the last colon is not a number. A relative FILE is under `base` (the configuration
    file's folder), else the working folder. The file must exist and the strength be finite
    (ValueError)."""
    name, strength = text, 1.0
    head, sep, tail = text.rpartition(":")
    if sep and head:
        try:
            name, strength = head, float(tail)
        except ValueError:
            pass
    if not math.isfinite(strength):
        raise ValueError(f"the strength of {text!r} must be a finite number")
    path = _under(Path(name).expanduser(), base)
    if not path.is_file():
        if sep and head and name == text and _under(Path(head).expanduser(), base).is_file():
            raise ValueError(f"the strength {tail!r} of {text!r} is not a number")
        raise ValueError(f"no LoRA file at {str(path)!r}")
    return AdapterSpec(path, strength)


def _under(path: Path, base: Path | None) -> Path:
    return base / path if base is not None and not path.is_absolute() else path


@dataclass
class ModelSettings(LoadSettings):
    """What the configuration says about one model entry (`[models."id"]`): how its model
    loads (LoadSettings), the adapters its steps run under by default and, for a model from
    its component files (engine/components.py), its VAE file and what the files cannot tell
    (family, variant, tokenizer folder)."""

    adapters: tuple[AdapterSpec, ...] = ()
    vae: Path | None = None
    family: str | None = None
    variant: str | None = None
    tokenizer: Path | None = None
    # A chat model folder that rewrites prompts on encode, and whether it does when the request
    # leaves it open (docs/contract.md §2.6, engine/upsampling.py).
    prompt_upsampler: Path | None = None
    prompt_upsampling: bool = False

    def component_files(self):
        """The entry's components.ComponentFiles (None: the entry names no VAE file, so its
        model is a folder)."""
        if self.vae is None:
            return None
        from .engine.components import ComponentFiles

        return ComponentFiles(
            self.dit, self.text_encoder, self.vae, self.tokenizer, self.family, self.variant
        )

    def load_settings(self) -> LoadSettings:
        """These settings alone; a model from component files reads its files through its set's
        folder, which links them, so they are not named again."""
        settings = super().load_settings()
        if self.vae is not None:
            settings.dit = settings.text_encoder = None
        return settings


# A model entry's keys (`[models."id"]`), each with what it sets: the configuration reads these,
# and a command that loads a model folder directly takes each but `adapters` as a flag of the
# same name (`--text-encoder` for `text_encoder`: parsers.add_model_arguments).
MODEL_SETTINGS = {
    "adapters": "LoRA files (FILE[:STRENGTH]) that steps naming no patch table run under",
    "quantize": "quantize the DiT's and the text encoder's linear layers to this many bits as"
    f" they load ({', '.join(map(str, BITS))})",
    "group_size": f"with quantize: weights per scale and bias ({', '.join(map(str, GROUP_SIZES))};"
    f" {DEFAULT_GROUP_SIZE} when left out)",
    "encoder_vae_dtype": "the text encoder's and the VAE's compute dtype"
    f" ({', '.join(ENCODER_VAE_DTYPES)}; {AUTO}: bf16 on a GPU backend, f32 on the CPU one)",
    "dit": "a GGUF file or a single safetensors file (ComfyUI's, BFL's) holding the DiT's"
    " weights, in place of the folder's transformer/ weights",
    "text_encoder": "a GGUF file holding the text encoder's weights (llama.cpp's names; with vae,"
    " also one safetensors file)",
    "mmproj": "the GGUF file of the text encoder's vision tower (llama.cpp's mmproj; with"
    " text_encoder)",
    "vae": "the VAE's safetensors file: with dit and text_encoder, the model is served from these"
    " component files, with no model folder",
    "family": "with vae: the family, where the files cannot tell it (flux2_klein_9b_kv)",
    "variant": "with vae: the variant, where the files cannot tell it (the family's own name:"
    " turbo or base, distilled or base, turbo or raw, sft or base)",
    "tokenizer": "with vae: a folder holding the text encoder's tokenizer.json",
    "prompt_upsampler": "a chat model folder (Qwen3.5 in transformers' layout, with its chat"
    " template) that rewrites a text-only encode's prompt where asked (FLUX.3 klein's upsampler)",
    "prompt_upsampling": "with prompt_upsampler: whether an encode that does not say is rewritten"
    " (true or false; default false)",
}
MODEL_SETTING_KEYS = tuple(MODEL_SETTINGS)
GGUF_SUFFIX = ".gguf"
# The files each file setting may name: a DiT also comes as one safetensors file (BFL's).
FILE_SUFFIXES = {
    "dit": (GGUF_SUFFIX, ".safetensors"),
    "text_encoder": (GGUF_SUFFIX, ".safetensors"),
    "mmproj": (GGUF_SUFFIX,),
    "vae": (".safetensors",),
}


# The file's tables and keys (a model entry's keys: MODEL_SETTING_KEYS).
FILE_TABLES = ("server", "models")
SERVER_KEYS = (
    "host",
    "port",
    "api_key",
    "model_dirs",
    "comfyui_model_dirs",
    "default_model",
    "threads",
    "image",
)
IMAGE_KEYS = tuple(f.name for f in dataclasses.fields(ImageConfig))


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    model_dirs: list[Path] = field(default_factory=list)
    comfyui_model_dirs: list[Path] = field(default_factory=list)  # ComfyUI `models/` folders
    default_model: str | None = None
    threads: int = 8
    image: ImageConfig = field(default_factory=ImageConfig)
    models: dict[str, ModelSettings] = field(default_factory=dict)  # by model id
    quantization: Quantization | None = None  # `--quantize`: every model's, over its entry's
    source: Path | None = None  # the file read, if any

    def load_settings_for(self, model_id: str) -> LoadSettings:
        """How a model loads: its entry's settings (the folder's own without an entry), at
        `--quantize` where that is given."""
        entry = self.models.get(model_id)
        settings = LoadSettings() if entry is None else entry.load_settings()
        if self.quantization is not None:
            settings.quantization = self.quantization
        return settings

    def component_sets(self) -> dict:
        """Every model from component files, by id (components.ComponentFiles): the ComfyUI
        model folders' sets (server/comfyui_models.py), then the entries naming a `vae`; an
        entry of a listed set's id adds what the files cannot tell (family, variant,
        tokenizer)."""
        from .comfyui_models import comfyui_sets

        sets = comfyui_sets(self.comfyui_model_dirs)
        for model_id, entry in self.models.items():
            own = entry.component_files()
            if own is not None:
                sets[model_id] = own
            elif model_id in sets:
                sets[model_id] = dataclasses.replace(
                    sets[model_id],
                    **{
                        k: getattr(entry, k)
                        for k in ("family", "variant", "tokenizer")
                        if getattr(entry, k)
                    },
                )
        return sets

    @property
    def loopback_bind(self) -> bool:
        return is_loopback_host(self.host)

    def check_startable(self) -> None:
        """Refuse settings that would expose the server without protection, or that would
        fail its first request of a kind (an image store it cannot make), and a host that
        names no address to listen on."""
        host = self.host.strip("[]")  # as Waitress reads it: brackets, `*` for every address
        try:
            socket.getaddrinfo(
                None if host == "*" else host,
                self.port,
                type=socket.SOCK_STREAM,
                flags=socket.AI_PASSIVE,
            )
        except (OSError, UnicodeError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            raise ConfigError(
                f"cannot listen on host {self.host!r}: it names no address here ({reason});"
                " set server.host, GMLX_HOST or --host to an address or name of this machine"
            ) from None
        if not self.loopback_bind and not self.api_key:
            raise ConfigError(
                f"refusing to listen on {self.host!r} without server.api_key: a non-loopback "
                "bind needs an API key (set [server] api_key or GMLX_API_KEY), or bind 127.0.0.1"
            )
        if self.image.image_url_dir:
            check_writable_folder(Path(self.image.image_url_dir), "server.image.image_url_dir")


def check_writable_folder(folder: Path, key: str) -> None:
    """A folder this user may write in, or one it may make (a ConfigError naming `key`, the
    setting or flag that named it, otherwise)."""
    refused = unwritable_folder(folder)
    if refused:
        raise ConfigError(f"{key} {folder}: {refused}")


def unwritable_folder(folder: Path) -> str | None:
    """Why this user can neither write in `folder` nor make it (None: it can): the nearest of
    it and its parents that exists is a file, or a folder it may not write in."""
    path = folder.absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"this user may not write in {existing}"
    return None


@functools.lru_cache(maxsize=1024)  # every request's Host header, behind a loopback bind
def is_loopback_host(host: str) -> bool:
    """True for names and addresses that only this machine can reach."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def load_config(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    host: str | None = None,
    port: int | None = None,
    quantization: Quantization | None = None,
) -> ServerConfig:
    """Read the file (a missing default file is fine, a missing named file is not), apply the
    environment, then the flags (`quantization`: `--quantize`'s), and validate the result."""
    env = os.environ if env is None else env
    config = ServerConfig()
    config_path = Path(path).expanduser() if path else DEFAULT_CONFIG_PATH.expanduser()
    if config_path.is_file():
        _apply_file(config, config_path)
    elif path:
        what = "is a folder, not a file" if config_path.is_dir() else "does not exist"
        raise ConfigError(f"config file {config_path} {what}")
    _apply_env(config, env)
    if host is not None:
        config.host = host
    if port is not None:
        config.port = port
    if quantization is not None:
        config.quantization = quantization
    _validate(config)
    return config


def _apply_file(config: ServerConfig, path: Path) -> None:
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    config.source = path
    try:
        _apply_doc(config, doc, path)
        _validate(config)  # the file's values over valid defaults: a refusal is the file's
    except ConfigError as exc:  # every refusal of the file names it, here alone
        raise ConfigError(f"{path}: {exc}") from None


def _apply_doc(config: ServerConfig, doc: dict, path: Path) -> None:
    _refuse_unknown(doc, FILE_TABLES, "", "table")
    server = _table(doc, "server")
    _refuse_unknown(server, SERVER_KEYS, "[server]", "setting")
    image = _table(server, "image", "server.image")
    _refuse_unknown(image, IMAGE_KEYS, "[server.image]", "setting")
    if "host" in server:
        config.host = _typed(server, "host", str)
    if "port" in server:
        config.port = _typed(server, "port", int)
    if "api_key" in server:
        config.api_key = _typed(server, "api_key", str) or None
    for key in ("model_dirs", "comfyui_model_dirs"):
        if key in server:
            dirs = server[key]
            if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
                raise ConfigError(f"server.{key} must be a list of folder paths")
            # relative: to the file's folder, as every path the file names
            setattr(config, key, [path.parent / Path(d).expanduser() for d in dirs])
    if "default_model" in server:
        config.default_model = _typed(server, "default_model", str) or None
    if "threads" in server:
        config.threads = _typed(server, "threads", int)
    for name in ("tensor_cache_mb", "adapter_cache_mb"):
        if name in image:
            setattr(config.image, name, _typed(image, name, int))
    for name in ("memory_headroom_mb", "memory_budget_mb", "image_url_store_mb"):
        if name in image:
            setattr(config.image, name, _typed(image, name, int))
    for name in ("steps_api", "steps_remote"):
        if name in image:
            setattr(config.image, name, _typed(image, name, bool))
    for name in ("run_idle_s", "run_sweep_s", "image_url_ttl_s"):
        if name in image:
            setattr(config.image, name, float(_typed(image, name, (int, float))))
    if _typed(image, "image_url_dir", str) if "image_url_dir" in image else "":
        folder = path.parent / Path(image["image_url_dir"]).expanduser()  # relative: to the file
        config.image.image_url_dir = str(folder)
    if "encoder_residency" in image:
        config.image.encoder_residency = _choice(
            image, "encoder_residency", ENCODER_RESIDENCIES, "server.image"
        )
    for model_id, table in _table(doc, "models").items():
        config.models[model_id] = _model_settings(model_id, table, path.parent)


def _model_settings(model_id: str, table: Any, folder: Path) -> ModelSettings:
    where = f"[models.{model_id!r}]"
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    _refuse_unknown(table, MODEL_SETTING_KEYS, where, "setting")
    return model_settings(table, folder, where)


# The tables of the server's settings, for a setting written in another table.
SETTING_TABLES = {
    **{key: "[server.image]" for key in IMAGE_KEYS},
    **{key: "[server]" for key in SERVER_KEYS},
    "image": "[server], as the table [server.image]",
}


def _refuse_unknown(table: dict, known: tuple[str, ...], where: str, kind: str) -> None:
    """A ConfigError for the first key of `table` not in `known`, after `where` (the table;
    "": the file's top), naming the table it is a setting of, else the nearest known."""
    unknown = sorted(set(table) - set(known))
    if unknown:
        listed = ", ".join(known)
        place = f"{where}: " if where else ""
        name = unknown[0]
        home = SETTING_TABLES.get(name)
        hint = f": it is a setting of {home}" if home else _nearest(name, known)
        raise ConfigError(f"{place}unknown {kind} {name!r}{hint} (known: {listed})")


def _nearest(word: str, known) -> str:
    """': did you mean X?' for the known word nearest `word`, or '' when none is near."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f": did you mean {close[0]!r}?" if close else ""


def model_settings(
    table: dict, folder: Path, where: str = "", name: Callable[[str], str] = str
) -> ModelSettings:
    """The settings a model entry's `table` gives (keys of MODEL_SETTINGS; relative paths under
    `folder`), or a ConfigError saying what is wrong: after `where` (the entry), naming each key
    by `name` (the flags name theirs `--group-size`)."""

    def refuse(text: str) -> ConfigError:
        return ConfigError(f"{where}: {text}" if where else text)

    adapters = table.get("adapters", [])
    if not isinstance(adapters, list) or not all(isinstance(a, str) for a in adapters):
        raise refuse(f'{name("adapters")} must be a list of "FILE[:STRENGTH]" strings')
    try:
        specs = tuple(parse_adapter(text, folder) for text in adapters)
    except ValueError as exc:
        raise refuse(f"{name('adapters')}: {exc}") from None
    dtype = AUTO
    if "encoder_vae_dtype" in table:
        dtype = _typed(table, "encoder_vae_dtype", str)
        if dtype not in ENCODER_VAE_DTYPES:
            listed = ", ".join(f'"{c}"' for c in ENCODER_VAE_DTYPES)
            raise refuse(f"{name('encoder_vae_dtype')} must be one of {listed}, not {dtype!r}")
    files = {}
    for key in (*FILE_KEYS, "vae"):
        if key in table:
            path = Path(_typed(table, key, str)).expanduser()
            files[key] = folder / path if not path.is_absolute() else path
            suffixes = FILE_SUFFIXES[key]
            if path.suffix.lower() not in suffixes:
                names = " or ".join(suffixes)
                raise refuse(f"{name(key)} must name a {names} file, not {str(files[key])!r}")
            if not files[key].is_file():
                raise refuse(f"{name(key)}: no file at {str(files[key])!r}")
    if "quantize" not in table:
        if "group_size" in table:
            raise refuse(f"{name('group_size')} needs {name('quantize')} (the bits)")
        quantization = None
    else:
        try:  # a wrong type (ConfigError, a ValueError) is named after the entry too
            bits = _typed(table, "quantize", int)
            group_size = _typed(table, "group_size", int) if "group_size" in table else None
            quantization = Quantization(
                bits, DEFAULT_GROUP_SIZE if group_size is None else group_size
            )
        except ValueError as exc:
            raise refuse(str(exc)) from None
    facts = {key: _typed(table, key, str) for key in ("family", "variant") if key in table}
    if "tokenizer" in table:
        facts["tokenizer"] = folder / Path(_typed(table, "tokenizer", str)).expanduser()
        if not facts["tokenizer"].is_dir():
            raise refuse(f"{name('tokenizer')}: no folder at {str(facts['tokenizer'])!r}")
    upsampling = upsampling_settings(table, folder, refuse, name)
    if "vae" in files:
        missing = [key for key in ("dit", "text_encoder") if key not in files]
        if missing:
            raise refuse(
                f"{name('vae')} makes a model of component files, which needs"
                f" {' and '.join(name(key) for key in missing)} too"
            )
    return ModelSettings(
        adapters=specs,
        quantization=quantization,
        encoder_vae_dtype=dtype,
        **files,
        **facts,
        **upsampling,
    )


def upsampling_settings(table: dict, folder: Path, refuse, name) -> dict:
    """An entry's prompt_upsampler (a folder holding a config.json) and prompt_upsampling."""
    found: dict = {}
    if "prompt_upsampler" in table:
        path = folder / Path(_typed(table, "prompt_upsampler", str)).expanduser()
        if not (path / "config.json").is_file():
            raise refuse(
                f"{name('prompt_upsampler')}: no chat model folder (config.json) at {str(path)!r}"
            )
        found["prompt_upsampler"] = path
    if "prompt_upsampling" in table:
        found["prompt_upsampling"] = _typed(table, "prompt_upsampling", bool)
        if found["prompt_upsampling"] and "prompt_upsampler" not in found:
            raise refuse(f"{name('prompt_upsampling')} needs {name('prompt_upsampler')}")
    return found


def model_settings_over(
    entry: ModelSettings | None, table: dict, folder: Path, name: Callable[[str], str] = str
) -> ModelSettings:
    """`entry` (None: an entry setting nothing) with what `table` sets in place of its own: a
    command's flags over a model entry (`quantize` and `group_size` set its quantization)."""
    given = model_settings(table, folder, name=name)
    fields = {"quantization" if key in ("quantize", "group_size") else key for key in table}
    return dataclasses.replace(entry or ModelSettings(), **{f: getattr(given, f) for f in fields})


def _choice(table: dict, key: str, choices: tuple[str, ...], where: str) -> str:
    value = _typed(table, key, str)
    if value not in choices:
        listed = ", ".join(f'"{c}"' for c in choices)
        raise ConfigError(f"{where}: {key} must be one of {listed}, not {value!r}")
    return value


def _table(doc: dict, name: str, full_name: str | None = None) -> dict:
    """`doc`'s table `name` ({} where absent), whose name in the file is `full_name`."""
    value = doc.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(f"[{full_name or name}] must be a table")
    return value


# What a config value of each kind `_typed` reads must be, in words.
KIND_WORDS = {str: "a string", int: "an integer", bool: "true or false", (int, float): "a number"}


def _typed(table: dict, key: str, kind):
    value = table[key]
    # bool is an int in Python; a flag written as `port = true` is still a mistake.
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise ConfigError(f"config key {key!r} must be {KIND_WORDS[kind]}, not {value!r}")
    return value


def _check_choice(env: Mapping[str, str], name: str, choices: tuple, upper: bool = False) -> None:
    """An environment variable, where set, is one of `choices` (in any case with `upper`)."""
    value = env.get(name)
    if value is not None and (value.upper() if upper else value) not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, not {value!r}")


def _apply_env(config: ServerConfig, env: Mapping[str, str]) -> None:
    for name in sorted(env):
        if name.startswith("GMLX_") and name not in ENVIRONMENT:
            raise ConfigError(
                f"environment variable {name} names no setting{_nearest(name, ENVIRONMENT)}"
                f" (known: {', '.join(ENVIRONMENT)})"
            )
    try:
        gguf_weights(env.get(GGUF_WEIGHTS_SETTING))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _check_choice(env, "GMLX_LOG_LEVEL", LOG_LEVELS, upper=True)
    _check_choice(env, "GMLX_DIT_COMPILE", ("0", "1"))
    if env.get("GMLX_HOST"):
        config.host = env["GMLX_HOST"]
    if env.get("GMLX_PORT"):
        try:
            config.port = int(env["GMLX_PORT"])
        except ValueError as exc:
            raise ConfigError(f"GMLX_PORT must be an integer, not {env['GMLX_PORT']!r}") from exc
        if not 0 <= config.port <= MAX_PORT:
            raise ConfigError(f"GMLX_PORT must be from 0 to {MAX_PORT}, not {config.port}")
    if env.get("GMLX_API_KEY"):
        config.api_key = env["GMLX_API_KEY"]
    if env.get("GMLX_MODEL_DIRS"):
        parts = [p for p in env["GMLX_MODEL_DIRS"].split(os.pathsep) if p]
        config.model_dirs = [Path(p).expanduser() for p in parts]
    if env.get("GMLX_DEFAULT_MODEL"):
        config.default_model = env["GMLX_DEFAULT_MODEL"]


def _validate(config: ServerConfig) -> None:
    if not 0 <= config.port <= MAX_PORT:
        raise ConfigError(f"port {config.port} is outside 0..{MAX_PORT}")
    if config.api_key is not None and config.api_key != config.api_key.strip():
        # HTTP header values lose their outer white space: no client could ever send this key
        raise ConfigError(
            "server.api_key (or GMLX_API_KEY) begins or ends with white space (a secret file's"
            " newline?), which no client's header can carry: remove it"
        )
    if not 2 <= config.threads <= MAX_THREADS:
        # One thread could not answer an interrupt while a step is in flight; Waitress starts
        # every thread at start (a hundred thousand took minutes before the first answer).
        raise ConfigError(f"server.threads must be from 2 to {MAX_THREADS}, not {config.threads}")
    image = config.image
    for name in ("tensor_cache_mb", "adapter_cache_mb"):
        if getattr(image, name) <= 0:
            raise ConfigError(f"server.image.{name} must be a positive integer")
    for name in ("memory_headroom_mb", "memory_budget_mb"):
        if getattr(image, name) < 0:
            raise ConfigError(f"server.image.{name} must not be negative")
    for name in ("run_idle_s", "run_sweep_s", "image_url_ttl_s", "image_url_store_mb"):
        if not getattr(image, name) > 0:  # NaN too
            raise ConfigError(f"server.image.{name} must be positive, not {getattr(image, name)}")
