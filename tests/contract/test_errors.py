"""Error types (docs/contract.md §1.9, §7.8)."""

import json

from gmlx_contract.errors import (
    ContractError,
    ContractMismatch,
    NotGmlxServer,
    StepError,
    WireError,
    no_answer_reason,
)


def test_contract_error_body_and_status():
    error = ContractError(409, "not held", missing=["a", "b"])
    assert error.status == 409
    assert error.body == {"error": "not held", "missing": ["a", "b"]}
    assert str(error) == "not held"


def test_wire_error_is_a_400_contract_error():
    error = WireError("bad header")
    assert isinstance(error, ContractError)
    assert error.status == 400 and error.body == {"error": "bad header"}


def test_step_error_quotes_route_error_and_status():
    body = json.dumps({"error": "run abc was interrupted", "code": "interrupted"}).encode()
    error = StepError.from_response("POST step", 409, body)
    text = str(error)
    assert text.startswith("gmlx:")
    assert '"run abc was interrupted"' in text and "409" in text and "POST step" in text
    assert error.status == 409 and error.code == "interrupted" and error.missing == []


def test_step_error_reads_middleware_shape_and_missing():
    nested = json.dumps({"error": {"type": "authentication_error", "message": "bad key"}})
    error = StepError.from_response("GET models", 401, nested.encode(), hint="set the key")
    assert (
        '"bad key"' in str(error) and "401" in str(error) and str(error).endswith("(set the key)")
    )
    missing = StepError.from_response("POST step", 409, b'{"error":"x","missing":["h1","h2"]}')
    assert missing.missing == ["h1", "h2"]


def test_step_error_quotes_start_of_non_json_body():
    body = b"<html>" + b"x" * 1000
    error = StepError.from_response("GET capabilities", 502, body)
    assert "<html>" + "x" * 294 + '"' in str(error)
    assert "x" * 295 not in str(error)
    assert error.body is None and error.code is None


def test_client_errors_are_step_errors_with_prefix():
    for kind in (ContractMismatch, StepError):
        error = kind("no server here")
        assert isinstance(error, StepError)
        assert str(error) == "gmlx: no server here"


def test_not_a_gmlx_server_names_the_address_and_the_reason_once():
    error = NotGmlxServer("http://h:1", "connection refused", status=None)
    assert isinstance(error, StepError)
    assert str(error) == "gmlx: no gmlx server answers at http://h:1 (connection refused)"
    assert (error.url, error.reason) == ("http://h:1", "connection refused")


def _wrapped(inner: BaseException) -> BaseException:
    """An error wrapped the way requests wraps urllib3's (ConnectionError(MaxRetryError))."""
    import requests
    import urllib3

    pool = urllib3.HTTPConnectionPool("h", 1)
    try:
        try:
            raise urllib3.exceptions.NewConnectionError(pool, f"Failed: {inner}") from inner
        except urllib3.exceptions.NewConnectionError as new:
            raise urllib3.exceptions.MaxRetryError(pool, "/health", new) from new
    except urllib3.exceptions.MaxRetryError as retries:
        return requests.ConnectionError(retries)


def test_no_answer_reason_is_the_innermost_cause_in_a_few_words():
    import errno
    import socket

    refused = ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
    assert no_answer_reason(_wrapped(refused), 2) == "connection refused"
    unknown = socket.gaierror(-2, "Name or service not known")
    assert no_answer_reason(_wrapped(unknown), 2) == (
        "its host name does not resolve (Name or service not known)"
    )
    assert no_answer_reason(_wrapped(TimeoutError("timed out")), 2.5) == "no answer within 2.5 s"
    assert no_answer_reason(ConnectionError("the server closed the connection"), 1) == (
        "the server closed the connection"
    )


def test_a_connection_not_made_in_time_is_no_server_working():
    """A read timeout: the server may still be working on it; a connect timeout (a host that
    drops packets): nothing is there to work."""
    import requests
    import urllib3
    from gmlx_contract.errors import waited_for_answer

    pool = urllib3.HTTPConnectionPool("h", 1)
    read = urllib3.exceptions.ReadTimeoutError(pool, "/step", "read timed out")
    assert waited_for_answer(requests.ReadTimeout(read))
    assert waited_for_answer(TimeoutError("timed out"))  # the step link's socket
    assert not waited_for_answer(_wrapped(TimeoutError("timed out")))  # connecting
    connect = urllib3.exceptions.ConnectTimeoutError(pool, "connect timed out")
    assert not waited_for_answer(requests.ConnectTimeout(connect))
    from gmlx_contract.errors import ConnectTimedOut

    assert not waited_for_answer(ConnectTimedOut("connecting took over 600 s"))  # the step link
    assert not waited_for_answer(ConnectionRefusedError(111, "refused"))
