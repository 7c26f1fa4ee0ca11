"""Error types of the step contract.

Server side: `ContractError` carries the HTTP status and the JSON body of a refusal
(docs/contract.md §1.9); `WireError` is the container reader's 400.

Client side: `StepError` is what a caller of the step routes sees; its text starts with
"gmlx:" and quotes the server's `error` text and the status (docs/contract.md §7.8).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

# How much of a body that is not JSON an error message quotes (docs/contract.md §7.8).
QUOTED_BODY_BYTES = 300


class ContractError(Exception):
    """A refusal with an HTTP status and a body `{"error": message, **extra}`."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.body: dict[str, Any] = {"error": message, **extra}


class WireError(ContractError):
    """A container the reader refuses (always 400, docs/contract.md §1.3)."""

    def __init__(self, message: str, **extra: Any) -> None:
        super().__init__(400, message, **extra)


class StepError(Exception):
    """A failed call to a step server, as the client reports it.

    `status` is the HTTP status (None when no answer came back), `body` the parsed JSON
    body when there was one (else None).
    """

    def __init__(self, message: str, status: int | None = None, body: Any = None) -> None:
        if not message.startswith("gmlx:"):
            message = "gmlx: " + message
        super().__init__(message)
        self.status = status
        self.body = body

    @property
    def code(self) -> str | None:
        """The body's `code` member (e.g. "interrupted", "busy"), if any."""
        if isinstance(self.body, dict) and isinstance(self.body.get("code"), str):
            return self.body["code"]
        return None

    @property
    def missing(self) -> list[str]:
        """The body's `missing` list of a 409 (empty when absent)."""
        if isinstance(self.body, dict) and isinstance(self.body.get("missing"), list):
            return [str(item) for item in self.body["missing"]]
        return []

    @classmethod
    def from_response(
        cls, what: str, status: int, body: bytes, hint: str | None = None
    ) -> StepError:
        """Build the error for a non-success answer to `what` (e.g. "POST step")."""
        parsed = parse_json_or_none(body)
        text = error_text(parsed, body)
        message = f'gmlx: {what} failed with status {status}: "{text}"'
        if hint:
            message += f" ({hint})"
        return cls(message, status=status, body=parsed)


class NoAnswer(StepError):
    """A request that got no HTTP answer: nothing listens, the connection broke, or it timed
    out. `reason` says which in a few words (`no_answer_reason`)."""

    def __init__(self, message: str, reason: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.timed_out = timed_out  # the server may still be working on the request


class NotGmlxServer(StepError):
    """The address answers, or does not, but not as a gmlx image step server.

    `url` and `reason` (a few words: "connection refused", "GET /health answered status 404")
    let a caller that tried several addresses name each in one sentence.
    """

    def __init__(self, url: str, reason: str, status: int | None = None) -> None:
        super().__init__(f"gmlx: no gmlx server answers at {url} ({reason})", status=status)
        self.url = url
        self.reason = reason


class ContractMismatch(StepError):
    """The server speaks a step contract this client cannot use."""


def parse_json_or_none(body: bytes) -> Any:
    """The JSON document in `body`, or None when it is not JSON."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def error_text(parsed: Any, body: bytes) -> str:
    """The error text of an answer: the route shape `{"error": "..."}`, the middleware shape
    `{"error": {"message": "..."}}` (docs/contract.md §1.9), or else the start of the raw body."""
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, str):
            return error
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(parsed.get("detail"), str):
            return parsed["detail"]
    return bytes(body[:QUOTED_BODY_BYTES]).decode("utf-8", errors="replace")


def no_answer_reason(error: BaseException, timeout: float) -> str:
    """Why a request got no answer, in a few words, from the exception requests, urllib3 or
    the socket raised: "connection refused", "no answer within 2 s", "the host name 'x' does
    not resolve", or else the innermost error's text (not the whole chain of wrappers)."""
    chain = list(_causes(error))
    if timed_out(error):
        return f"no answer within {timeout:g} s"
    for cause in chain:
        if isinstance(cause, socket.gaierror):
            return f"its host name does not resolve ({cause.strerror})"
    for cause in reversed(chain):
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror[:1].lower() + cause.strerror[1:]
    innermost = chain[-1]
    return str(innermost) or type(innermost).__name__


def timed_out(error: BaseException) -> bool:
    """Whether a request that got no answer ran out of time (rather than found nothing there,
    or lost its connection)."""
    return any(isinstance(e, TimeoutError) or "Timeout" in type(e).__name__ for e in _causes(error))


class ConnectTimedOut(TimeoutError):
    """A connection that could not be made in time: nothing there answers (not a server
    still working on a request it received)."""


def waited_for_answer(error: BaseException) -> bool:
    """Whether a request ran out of time waiting for its answer, once connected (the server
    may still be working on it); a connection that could not be made (in time or at all:
    urllib3's connection errors are its ConnectTimeoutErrors) is not there."""
    from urllib3.exceptions import ConnectTimeoutError

    connecting = any(isinstance(e, (ConnectTimeoutError, ConnectTimedOut)) for e in _causes(error))
    return timed_out(error) and not connecting


def _causes(error: BaseException | None) -> Iterator[BaseException]:
    """The error, then what it wraps: urllib3's `reason`, a wrapped first argument (requests'
    ConnectionError), else the exception it was raised from."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        inner = getattr(error, "reason", None)
        if not isinstance(inner, BaseException):
            first = error.args[0] if error.args else None
            inner = first if isinstance(first, BaseException) else None
        error = inner or error.__cause__ or error.__context__
