"""How a network's config is read, and what a config key the network does not read must hold.

A DiT's config class is data: each of its fields a `setting` that names the diffusers key it is
read from, the released model's default and how the value is taken (`read_settings`), so its
reader is one call and the keys it reads one table.

Every key of a family's DiT or VAE config class either changes what the network reads (and its
config reader reads it), is fixed
to the one value the network builds (`FIXED`, checked here: another value is refused, naming
the key), or changes nothing the server computes (the reader's `NOT_READ`, with the reason).
tests/engine/test_config_keys.py walks each diffusers config class's keys against the three."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field, fields
from typing import Any


def setting(key: str, default: Any, convert: Callable[[Any], Any] | None = None) -> Any:
    """A config dataclass field read from the config's `key` (`default` where the config has
    no such key), passed through `convert` where given (float, tuple, bool, int)."""
    return field(default=default, metadata={"key": key, "convert": convert})


def read_settings(cls: type, config: dict, **given: Any) -> Any:
    """An instance of the config dataclass `cls` from a config dict: each `setting` field from
    its key; `given`, fields the reader worked out itself."""
    values = dict(given)
    for entry in fields(cls):
        key = entry.metadata.get("key")
        if entry.name in values or key is None:
            continue
        value = config.get(key, entry.default)
        values[entry.name] = _taken(key, value, entry.default, entry.metadata["convert"])
    return cls(**values)


def _taken(key: str, value: Any, default: Any, convert: Callable[[Any], Any] | None) -> Any:
    """A config value as its setting takes it; a ValueError naming the key where it is not of
    the default's kind (a number, never negative, and whole where the default is, unless the
    setting takes it as a float; a list; a string; a boolean)."""
    wanted = _kind(default, convert)
    if wanted is not None and not _is_kind(value, wanted):
        raise ValueError(f"config key {key!r} is {value!r}, not {wanted}")
    return value if convert is None else convert(value)


WHOLE, NUMBER, LIST, TEXT, BOOLEAN = (
    "a whole number of at least 0",
    "a number of at least 0",
    "a list",
    "a string",
    "a boolean",
)


def _kind(default: Any, convert: Callable[[Any], Any] | None) -> str | None:
    if isinstance(default, bool):
        return BOOLEAN
    if isinstance(default, int):
        return NUMBER if convert is float else WHOLE
    if isinstance(default, float):
        return NUMBER
    if isinstance(default, (list, tuple)):
        return LIST
    return TEXT if isinstance(default, str) else None


def _is_kind(value: Any, kind: str) -> bool:
    if kind in (WHOLE, NUMBER):
        types = int if kind == WHOLE else (int, float)
        return isinstance(value, types) and not isinstance(value, bool) and value >= 0
    if kind == LIST:
        return isinstance(value, (list, tuple))
    return isinstance(value, str if kind == TEXT else bool)


class HeadsOfDim:
    """What a config of width `dim` in `num_heads` heads derives: a head's width."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads


class FluxWidths:
    """What a FLUX DiT's config (`num_heads` heads of `head_dim`, an MLP of `mlp_ratio`, the
    tapped text layers' `joint_attention_dim`, patchified latents of `in_channels`) derives:
    the model's width and its MLP's, a row's conditioning width (the wire's D) and a step's
    latent channels."""

    @property
    def dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def mlp_dim(self) -> int:
        return int(self.dim * self.mlp_ratio)

    @property
    def cond_width(self) -> int:
        return self.joint_attention_dim

    @property
    def latent_channels(self) -> int:
        return self.in_channels


def flux_width_settings(dit: Any, image_in, query_norm, mlp_in, rope_axes: int) -> dict:
    """A FLUX DiT's width settings (Flux2Transformer2DModel's and Flux3Transformer2DModel's
    config keys) told from its file's header `dit` (file_headers.Header; each tensor by its
    names in the namings the file may use): a head is as wide as a block's query norm, the
    model as its image input projection's rows, the MLP's fused gate and up twice the MLP's
    width, and RoPE splits the head into `rope_axes` equal axes."""
    dim = dit.first_shape(image_in)[0]
    head_dim = dit.first_shape(query_norm)[0]
    return {
        "attention_head_dim": head_dim,
        "num_attention_heads": dim // head_dim,
        "mlp_ratio": dit.first_shape(mlp_in)[0] / 2 / dim,
        "axes_dims_rope": [head_dim // rope_axes] * rope_axes,
    }


def check_rope_axes(axes_dims: tuple[int, ...], head_dim: int) -> None:
    """Refuse RoPE axes that do not add up to the attention head (ValueError naming both)."""
    if sum(axes_dims) != head_dim:
        raise ValueError(
            f"axes_dims_rope {list(axes_dims)} must add up to attention_head_dim {head_dim}"
        )


def check_fixed(config: dict, fixed: dict[str, Any], title: str) -> None:
    """Refuse (ValueError naming the key) a config whose key of `fixed` holds another value than
    the one the network builds; an absent key is diffusers' default, which that value is. A
    callable value is a test of the config's value instead (True: built)."""
    for key, built in fixed.items():
        if key not in config:
            continue
        value = config[key]
        ok = built(value) if callable(built) else _same(value, built)
        if not ok:
            wanted = getattr(built, "__doc__", None) if callable(built) else repr(built)
            raise ValueError(
                f"{title}: config key {key!r} is {value!r}; this server builds only {wanted}"
            )


def all_of(block: str):
    """A test that every entry of a block-type list is `block`."""

    def test(value) -> bool:
        return isinstance(value, (list, tuple)) and all(entry == block for entry in value)

    test.__doc__ = f"a list of {block!r}"
    return test


def _same(value: Any, built: Any) -> bool:
    if isinstance(value, (list, tuple)) and isinstance(built, (list, tuple)):
        return list(value) == list(built)
    return value == built
