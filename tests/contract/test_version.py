"""The contract version header rule (docs/contract.md §1.2) and the client's compatibility rule (§7.2)."""

import pytest
from gmlx_contract.errors import ContractError
from gmlx_contract.version import (
    CLIENT_SIDE,
    CONTRACT_VERSION,
    HEADER,
    MIN_CLIENT,
    SERVER_SIDE,
    check_request_version,
    parse_version,
    side_to_upgrade,
)


def refusal(value):
    with pytest.raises(ContractError) as caught:
        check_request_version(value)
    assert caught.value.status == 400
    assert caught.value.body == {"error": caught.value.message}
    return caught.value.message


def test_constants():
    assert HEADER == "X-Gmlx-Steps-Contract"
    assert CONTRACT_VERSION == (1, 0) and MIN_CLIENT == (1, 0)


@pytest.mark.parametrize("value", ["1.0", "1.5", "1", " 1.0 ", "1.99\t"])
def test_major_one_is_accepted(value):
    check_request_version(value)


def test_missing_header_names_no_side():
    text = refusal(None)
    assert HEADER in text and "1.0" in text
    assert "upgrade" not in text.lower()
    assert "step contract" not in text


@pytest.mark.parametrize("value", ["x", "1.x", "", "1.", ".1", "1.0.0", "v1", "١.٠", "-1.0"])
def test_malformed_header(value):
    text = refusal(value)
    assert "MAJOR.MINOR" in text
    assert "upgrade" not in text.lower()


@pytest.mark.parametrize("value, shown", [("2.0", "2.0"), ("2", "2.0"), ("17.3", "17.3")])
def test_newer_major_names_the_server(value, shown):
    text = refusal(value)
    assert "step contract" in text
    assert f"step contract {shown}" in text and "1.0" in text
    assert text.endswith("gmlx server")


@pytest.mark.parametrize("value, shown", [("0.9", "0.9"), ("0", "0.0")])
def test_older_major_names_the_client(value, shown):
    text = refusal(value)
    assert "step contract" in text
    assert f"step contract {shown}" in text and "1.0" in text
    assert text.endswith("client")


def test_parse_version():
    assert parse_version(" 1 ") == (1, 0)
    assert parse_version("3.14") == (3, 14)
    with pytest.raises(ValueError):
        parse_version("1.x")


def test_client_compatibility_rule():
    assert side_to_upgrade((1, 0), (1, 0)) is None
    assert side_to_upgrade((1, 7), (1, 0)) is None
    assert side_to_upgrade((1, 7), (0, 3)) is None
    assert side_to_upgrade((0, 9), (0, 0)) == SERVER_SIDE
    assert side_to_upgrade((-1, 0), (-1, 0)) == SERVER_SIDE
    assert side_to_upgrade((2, 0), (2, 0)) == CLIENT_SIDE
    assert side_to_upgrade((1, 5), (1, 1)) == CLIENT_SIDE
