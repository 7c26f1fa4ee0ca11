"""The contract version header and its rule (docs/contract.md §1.2), plus the client's compatibility
rule of the handshake (§7.2). Minor numbers are never compared."""

from __future__ import annotations

import re

from .errors import ContractError

HEADER = "X-Gmlx-Steps-Contract"
CONTRACT_VERSION = (1, 0)
MIN_CLIENT = (1, 0)

# Sides a version refusal tells the reader to upgrade.
SERVER_SIDE = "gmlx server"
CLIENT_SIDE = "client"

_VERSION_RE = re.compile(r"([0-9]+)(?:\.([0-9]+))?", re.ASCII)


def format_version(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


HEADER_VALUE = format_version(CONTRACT_VERSION)


def parse_version(text: str) -> tuple[int, int]:
    """`MAJOR.MINOR` (or bare `MAJOR`, minor 0), surrounding whitespace ignored."""
    match = _VERSION_RE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not of the form MAJOR.MINOR")
    return int(match.group(1)), int(match.group(2) or 0)


def check_request_version(value: str | None) -> None:
    """Accept a request's header value of major 1, else raise ContractError(400)."""
    speaks = format_version(CONTRACT_VERSION)
    if value is None:
        # Deliberately names no side to upgrade: the header is simply missing.
        raise ContractError(
            400, f"the {HEADER} header is missing; send {HEADER}: {speaks} with every request"
        )
    try:
        major, minor = parse_version(value)
    except ValueError:
        raise ContractError(
            400,
            f"the {HEADER} header must have the form MAJOR.MINOR (e.g. {speaks}); got {value!r}",
        ) from None
    if major == CONTRACT_VERSION[0]:
        return
    side = SERVER_SIDE if major > CONTRACT_VERSION[0] else CLIENT_SIDE
    raise ContractError(
        400,
        f"step contract {major}.{minor} is not served: this gmlx server speaks step contract "
        f"{speaks} (oldest client served: {format_version(MIN_CLIENT)}); upgrade the {side}",
    )


def side_to_upgrade(contract: tuple[int, int], min_client: tuple[int, int]) -> str | None:
    """The client's compatibility rule (docs/contract.md §7.2 step 3).

    None when this client can use a server publishing `contract` and `min_client`; else the
    side that must act: SERVER_SIDE when the server is older than this client, CLIENT_SIDE
    when this client is too old for it.
    """
    if contract[0] == CONTRACT_VERSION[0] and min_client <= CONTRACT_VERSION:
        return None
    if contract[0] < CONTRACT_VERSION[0]:
        return SERVER_SIDE
    return CLIENT_SIDE
