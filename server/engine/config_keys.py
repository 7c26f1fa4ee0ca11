"""What a config key the network does not read must hold: every key of a family's DiT or VAE
config class either changes what the network reads (and its config reader reads it), is fixed
to the one value the network builds (`FIXED`, checked here: another value is refused, naming
the key), or changes nothing the server computes (the reader's `NOT_READ`, with the reason).
tests/engine/test_config_keys.py walks each diffusers config class's keys against the three."""

from __future__ import annotations

from typing import Any


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
