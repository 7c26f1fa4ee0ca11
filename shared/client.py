"""The requests-based client of the step routes, shared by the bench and the ComfyUI pack.

One keep-alive `requests.Session` per client. Every request carries `Authorization: Bearer
<key>` when a key is set, and every request but `/health` and `capabilities` carries the
contract version header (docs/contract.md §1.2, §4). Answers are read in one call rather than in
requests' 10 KiB chunks, and containers are parsed over that one buffer without copies.
Arrays handed back are read-only numpy views over the answer's bytes. Step requests, the one
call per sampler step, go over the client's own keep-alive connections (`step_http`, see
`_post_step`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any
from urllib.parse import quote

import numpy as np
import requests
import urllib3
from requests.adapters import HTTPAdapter
from requests.utils import select_proxy
from urllib3.util.retry import Retry

from .errors import (
    ContractMismatch,
    NoAnswer,
    NotGmlxServer,
    StepError,
    WireError,
    no_answer_reason,
    parse_json_or_none,
    waited_for_answer,
)
from .hashing import canonical_json, table_id, tensor_hash
from .step_http import StepConnections
from .version import (
    CONTRACT_VERSION,
    HEADER,
    HEADER_VALUE,
    SERVER_SIDE,
    format_version,
    side_to_upgrade,
)
from .wire import (
    CONTAINER_TYPE,
    JSON_TYPE,
    Container,
    container_pieces,
    is_container_type,
    read_container,
)
from .wire import write_container as _write

log = logging.getLogger("gmlx_contract")

PREFIX = "/internal/image-steps/v1"
DEFAULT_TIMEOUT = 600.0
HEALTH_TIMEOUT = 2.0
CAPABILITIES_TIMEOUT = 30.0
INTERRUPT_TIMEOUT = 5.0

# What a 401 or 403 means to the person running the client (docs/contract.md §7.2).
HINTS = {
    401: "set the gmlx API key (GMLX_API_KEY) to the server's server.api_key",
    403: "run the client on the server's machine, or enable server.image.steps_remote "
    "on the gmlx server",
}


def client_gmlx_version() -> str:
    """This installation's gmlx version, as the handshake's messages name it."""
    try:
        return metadata.version("gmlx-steps")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass
class Reply:
    """One HTTP answer, its body read whole."""

    status: int
    headers: Mapping[str, str]
    body: bytes


@dataclass
class StepAnswer:
    """The answer to one step: `out` (F32, shape of `x`) and the per-call timings."""

    out: np.ndarray
    forward_ms: float | None  # X-Gmlx-Forward-Ms: the model evaluation alone
    server_ms: float | None  # X-Gmlx-Server-Ms: the whole route on the server
    prefix_cache: str | None  # X-Gmlx-Prefix-Cache: hit, miss, off or none
    wall_ms: float  # this client's time for the step request(s), uploads excluded
    retried: bool = False  # whether a 409 `missing` was answered by uploading and retrying


# The patch tables a client keeps to define again where the server lost one (a step's 409):
# the latest defined or stepped on. Each holds its adapter matrices, so the bound keeps a
# client from holding every LoRA it ever sent.
TABLES_KEPT = 8


@dataclass
class _Table:
    """What it takes to define a patch table again after the server lost it (docs/contract.md §7.6)."""

    doc: Any
    model: str | None
    adapters: dict[str, np.ndarray]


class StepClient:
    """Client of one gmlx step server at `base_url` (the server root; may carry a path)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        timeout_hint: str = "",
    ):
        """`timeout`: how long a request may wait for its answer; `timeout_hint`: how the
        client's user gives it longer, said when a request runs out of time."""
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.timeout_hint = timeout_hint
        self.session = requests.Session()
        # Re-send a request only when it never went out (connection errors), never after.
        retry = Retry(total=1, connect=1, read=0, redirect=0, status=0, other=0)
        adapter = HTTPAdapter(max_retries=retry)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        # A health probe that cannot connect has its answer (nothing listens): no retry, and
        # none of urllib3's "Retrying" warnings while a caller polls a server that is starting.
        self.session.mount(self.base_url + "/health", HTTPAdapter(max_retries=0))
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        # Hashes of tensors the server is believed to hold (uploads and encode answers).
        self.known: set[str] = set()
        self._tables: OrderedDict[str, _Table] = OrderedDict()
        self.warnings: list[str] = []
        self._base_path = urllib3.util.parse_url(self.base_url).path or ""
        self._link: StepConnections | None = None
        self._step_link_checked = False

    def close(self) -> None:
        self.session.close()
        if self._link is not None:
            self._link.close()

    def set_timeout(self, timeout: float, hint: str = "") -> None:
        """Wait `timeout` for answers from now on (its user changed the setting; `hint`: how to
        change it again): the step connections open anew with it."""
        self.timeout_hint = hint
        if timeout != self.timeout:
            self.timeout = timeout
            if self._link is not None:
                self._link.timeout = timeout
                self._link.close()

    def __enter__(self) -> StepClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def forget_known(self) -> None:
        """Forget which tensors the server holds, so the next steps upload them again."""
        self.known.clear()

    # ------------------------------------------------------------ transport

    def _request(
        self,
        method: str,
        path: str,
        *,
        routed: bool = True,
        versioned: bool = True,
        data: bytes | None = None,
        content_type: str | None = None,
        params: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> Reply:
        url = self.base_url + (f"{PREFIX}/{path}" if routed else path)
        timeout = self.timeout if timeout is None else timeout
        headers = {}
        if versioned:
            headers[HEADER] = HEADER_VALUE
        if content_type:
            headers["Content-Type"] = content_type
        try:
            response = self.session.request(
                method,
                url,
                data=data,
                headers=headers,
                params=params,
                timeout=timeout,
                stream=True,
            )
            # One read of the whole body; finishing it returns the connection to the pool.
            body = response.raw.read(decode_content=True) or b""
        except (requests.RequestException, urllib3.exceptions.HTTPError) as error:
            raise self._no_answer(method, path, error, timeout) from error
        return Reply(response.status_code, response.headers, body)

    def _no_answer(self, method: str, path: str, error: BaseException, timeout: float) -> NoAnswer:
        reason = no_answer_reason(error, timeout)
        if waited_for_answer(error):
            own = self.timeout_hint and timeout == self.timeout  # not a call of its own bound
            hint = f"; {self.timeout_hint}" if own else ""
            return NoAnswer(
                f"gmlx: {method} {path} got no answer from the gmlx server at {self.base_url}"
                f" within {timeout:g} s: it may still be working on it (a large image, a model"
                f" loading from a slow disk){hint}",
                reason,
                timed_out=True,
            )
        return NoAnswer(
            f"gmlx: {method} {path} got no answer from the gmlx server at {self.base_url} "
            f"({reason}); check that it runs there (`gmlx serve` starts one)",
            reason,
        )

    def _call(self, method: str, path: str, **kwargs: Any) -> Reply:
        """A request whose success is 200; anything else raises StepError."""
        reply = self._request(method, path, **kwargs)
        if reply.status != 200:
            raise self._refusal(method, path, reply)
        return reply

    def _refusal(self, method: str, path: str, reply: Reply) -> StepError:
        return StepError.from_response(
            f"{method} {path} at {self.base_url}", reply.status, reply.body, HINTS.get(reply.status)
        )

    def _json(self, method: str, path: str, doc: Any = None, **kwargs: Any) -> Any:
        """A JSON route: send `doc` (if any), return the parsed 200 answer."""
        if doc is not None:
            kwargs.update(data=canonical_json(doc), content_type=JSON_TYPE)
        reply = self._call(method, path, **kwargs)
        return self._parse_json(method, path, reply)

    def _parse_json(self, method: str, path: str, reply: Reply) -> Any:
        parsed = parse_json_or_none(reply.body)
        if parsed is None:
            raise StepError(
                f"gmlx: {method} {path} at {self.base_url} answered status {reply.status} with "
                f"a body that is not JSON: {reply.body[:300]!r}",
                status=reply.status,
            )
        return parsed

    def _container_call(
        self, path: str, tensors: dict[str, np.ndarray], fields: dict[str, Any]
    ) -> Container:
        reply = self._call("POST", path, data=_write(tensors, fields), content_type=CONTAINER_TYPE)
        return self._parse_container("POST", path, reply)

    def _parse_container(self, method: str, path: str, reply: Reply) -> Container:
        content_type = reply.headers.get("Content-Type")
        if not is_container_type(content_type):
            raise StepError(
                f"gmlx: {method} {path} at {self.base_url} answered {content_type!r} instead "
                f"of {CONTAINER_TYPE}",
                status=reply.status,
            )
        try:
            return read_container(reply.body)
        except WireError as error:
            raise StepError(
                f"gmlx: {method} {path} at {self.base_url} answered a malformed container: {error}",
                status=reply.status,
            ) from error

    @staticmethod
    def _tensor(container: Container, name: str, what: str) -> np.ndarray:
        if name not in container.tensors:
            raise StepError(f"gmlx: {what} answered a container without the tensor {name!r}")
        return container.tensors[name]

    # ------------------------------------------------------------ handshake (docs/contract.md §7.2)

    def health(self) -> bool:
        """Whether `GET <base>/health` answers 200 within 2 s."""
        try:
            reply = self._health()
        except StepError:
            return False
        return reply.status == 200

    def _health(self) -> Reply:
        return self._request(
            "GET", "/health", routed=False, versioned=False, timeout=HEALTH_TIMEOUT
        )

    def capabilities(self) -> dict[str, Any]:
        """`GET capabilities` (unversioned, 30 s)."""
        reply = self._call("GET", "capabilities", versioned=False, timeout=CAPABILITIES_TIMEOUT)
        return self._parse_json("GET", "capabilities", reply)

    def handshake(self) -> dict[str, Any]:
        """Check that a compatible gmlx step server answers; return its capabilities.

        Raises NotGmlxServer when nothing, or something else, answers (a caller may try the
        next address); ContractMismatch when it speaks an incompatible contract; StepError
        for other failures (401: set the key; 403: run locally or enable steps_remote).
        """
        self._handshake_health()
        caps = self._handshake_capabilities()
        self._check_compatible(caps)
        return caps

    def _handshake_health(self) -> None:
        try:
            reply = self._health()
        except NoAnswer as error:
            raise NotGmlxServer(self.base_url, error.reason) from error
        if reply.status in HINTS:
            raise self._refusal("GET", "/health", reply)
        if reply.status != 200:
            raise NotGmlxServer(
                self.base_url,
                f"GET /health answered status {reply.status}: not a gmlx image server",
                status=reply.status,
            )

    def _handshake_capabilities(self) -> dict[str, Any]:
        try:
            reply = self._request(
                "GET", "capabilities", versioned=False, timeout=CAPABILITIES_TIMEOUT
            )
        except NoAnswer as error:
            raise NotGmlxServer(self.base_url, f"GET capabilities: {error.reason}") from error
        if reply.status == 404:
            raise NotGmlxServer(
                self.base_url,
                f"GET {PREFIX}/capabilities answered 404: not a gmlx image server, or one "
                "with server.image.steps_api off",
                status=404,
            )
        if reply.status != 200:
            raise self._refusal("GET", "capabilities", reply)
        caps = parse_json_or_none(reply.body)
        if not isinstance(caps, dict):
            raise NotGmlxServer(
                self.base_url,
                "its capabilities are not a JSON object: not a gmlx image server",
                status=200,
            )
        for key in ("contract", "min_client"):
            if key in caps and _version_pair(caps[key]) is None:
                raise NotGmlxServer(
                    self.base_url,
                    f"its capabilities member {key!r} is not an object of integers major and "
                    "minor: not a gmlx image server",
                    status=200,
                )
        return caps

    def _check_compatible(self, caps: dict[str, Any]) -> None:
        contract = _version_pair(caps["contract"]) if "contract" in caps else (-1, 0)
        min_client = _version_pair(caps["min_client"]) if "min_client" in caps else (contract[0], 0)
        server_gmlx = str(caps.get("gmlx_version", "unknown"))
        own_gmlx = client_gmlx_version()
        side = side_to_upgrade(contract, min_client)
        if side is not None:
            speaks = (
                f"step contract {format_version(contract)}"
                if contract[0] >= 0
                else "no step contract"
            )
            action = (
                "restart or upgrade the gmlx server"
                if side == SERVER_SIDE
                else "restart ComfyUI or reinstall the gmlx nodes (upgrade the client)"
            )
            raise ContractMismatch(
                f"gmlx: the gmlx server at {self.base_url} (gmlx {server_gmlx}) speaks {speaks} "
                f"and serves clients from {format_version(min_client)}, but this client "
                f"(gmlx {own_gmlx}) speaks step contract {format_version(CONTRACT_VERSION)}; "
                f"the {side} is the side to upgrade: {action}",
                status=200,
                body=caps,
            )
        if server_gmlx != own_gmlx:
            warning = (
                f"gmlx: the server at {self.base_url} runs gmlx {server_gmlx} and this client "
                f"gmlx {own_gmlx}; they speak the same step contract"
            )
            self.warnings.append(warning)
            log.warning(warning)

    # ------------------------------------------------------------ models

    def models(self) -> dict[str, Any]:
        return self._json("GET", "models")

    def status(self, model: str) -> dict[str, Any]:
        return self._json("GET", f"models/{_segment(model)}/status")

    def manifest(self, model: str) -> dict[str, Any]:
        return self._json("GET", f"models/{_segment(model)}/manifest")

    def load(self, model: str) -> dict[str, Any]:
        return self._json("POST", "models/load", {"model": model})

    def unload(self, model: str) -> dict[str, Any]:
        return self._json("POST", "models/unload", {"model": model})

    # ------------------------------------------------------------ encode

    def encode(
        self,
        text: str,
        model: str | None = None,
        images: Iterable[np.ndarray] | None = None,
        refs: bool = True,
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Encode a prompt (with reference images as uint8 (H, W, 3|4) arrays) -> (tensors,
        fields). The answer's tensors are stored on the server, so they count as known."""
        images = list(images or [])
        fields: dict[str, Any] = {"text": text}
        if model is not None:
            fields["model"] = model
        if images:
            fields["refs"] = refs
            tensors = {f"image_{i}": _image_u8(image) for i, image in enumerate(images)}
            reply = self._call(
                "POST", "encode", data=_write(tensors, fields), content_type=CONTAINER_TYPE
            )
        else:
            reply = self._call(
                "POST", "encode", data=canonical_json(fields), content_type=JSON_TYPE
            )
        container = self._parse_container("POST", "encode", reply)
        self._mark_known(container.fields)
        return container.tensors, container.fields

    def _mark_known(self, fields: dict[str, Any]) -> None:
        named = [fields.get("cond"), fields.get("cond_typed"), *(fields.get("ref_latents") or [])]
        self.known.update(h for h in named if isinstance(h, str))

    # ------------------------------------------------------------ uploads (docs/contract.md §2.7)

    def has_tensor(self, digest: str) -> bool:
        return self._head(f"tensors/{digest}")

    def put_tensor(self, array: np.ndarray, dtype: str | None = None) -> str:
        digest = self._put(f"tensors/{digest_of(array, dtype)}", array, dtype)
        self.known.add(digest)
        return digest

    def has_adapter(self, digest: str) -> bool:
        return self._head(f"adapters/{digest}")

    def put_adapter(self, array: np.ndarray, dtype: str | None = None) -> str:
        return self._put(f"adapters/{digest_of(array, dtype)}", array, dtype)

    def ensure_adapter(self, array: np.ndarray, dtype: str | None = None) -> str:
        """Upload an adapter matrix unless the server holds it (HEAD, then PUT; §7.7)."""
        digest = digest_of(array, dtype)
        if not self.has_adapter(digest):
            self.put_adapter(array, dtype)
        return digest

    def _head(self, path: str) -> bool:
        reply = self._request("HEAD", path)
        if reply.status in (200, 404):
            return reply.status == 200
        raise self._refusal("HEAD", path, reply)

    def _put(self, path: str, array: np.ndarray, dtype: str | None) -> str:
        body = _write({"t": array}, dtypes={"t": dtype} if dtype else None)
        answer = self._json("PUT", path, data=body, content_type=CONTAINER_TYPE)
        digest = path.rsplit("/", 1)[1]
        if not isinstance(answer, dict) or answer.get("hash") != digest:
            raise StepError(
                f"gmlx: PUT {path} at {self.base_url} answered {answer!r} instead of its hash"
            )
        return digest

    # ------------------------------------------------------------ patch tables (docs/contract.md §2.9)

    def put_patch_table(
        self, doc: Any, model: str | None, adapters: Mapping[str, np.ndarray] | None = None
    ) -> str:
        """Define a patch table for `model`; return its id.

        The body is the canonical JSON, so the id is the hash of the bytes sent. With
        `adapters` (hash -> matrix), a 409 `missing` uploads the named matrices and re-PUTs
        once; the table is remembered so a step can define it again if the server loses it.
        """
        digest = table_id(doc)
        self._tables[digest] = _Table(doc, model, dict(adapters or {}))
        self._keep_table(digest)
        path = f"patch-tables/{digest}"
        body = canonical_json(doc)
        params = {"model": model} if model else None
        reply = self._request("PUT", path, data=body, content_type=JSON_TYPE, params=params)
        if reply.status == 409 and adapters:
            self._upload_missing_adapters(self._refusal("PUT", path, reply), adapters)
            reply = self._request("PUT", path, data=body, content_type=JSON_TYPE, params=params)
        if reply.status != 200:
            raise self._refusal("PUT", path, reply)
        answer = self._parse_json("PUT", path, reply)
        if not isinstance(answer, dict) or answer.get("id") != digest:
            raise StepError(
                f"gmlx: PUT {path} at {self.base_url} answered {answer!r} instead of its id"
            )
        return digest

    def keeps_table(self, digest: str) -> bool:
        """Whether the client can still define the table `digest` again where the server lost
        it (it is among the TABLES_KEPT latest used); a caller defines it anew otherwise."""
        return digest in self._tables

    def forget_table(self, digest: str) -> None:
        """Keep the table `digest` no longer (its adapter matrices let go): its user dropped
        what it was made of, and defines it anew should it come back."""
        self._tables.pop(digest, None)

    def _keep_table(self, digest: str) -> None:
        """`digest` is the latest table used; the oldest beyond TABLES_KEPT are let go."""
        self._tables.move_to_end(digest)
        while len(self._tables) > TABLES_KEPT:
            self._tables.popitem(last=False)

    def _upload_missing_adapters(
        self, refusal: StepError, adapters: Mapping[str, np.ndarray]
    ) -> None:
        absent = [h for h in refusal.missing if h not in adapters]
        if not refusal.missing or absent:
            raise refusal
        for digest in refusal.missing:
            if self.put_adapter(adapters[digest]) != digest:
                raise StepError(f"gmlx: the adapter given for {digest} hashes differently")

    # ------------------------------------------------------------ runs (docs/contract.md §2.10)

    def begin_run(self, model: str | None) -> str:
        answer = self._json("POST", "runs/begin", {"model": model} if model else {})
        return str(answer["run"])

    def end_run(self, run: str) -> bool:
        return bool(self._json("POST", f"runs/{_segment(run)}/end", {})["ended"])

    def interrupt(self, run: str | None, timeout: float = INTERRUPT_TIMEOUT) -> int:
        return int(self._json("POST", "interrupt", {"run": run}, timeout=timeout)["interrupted"])

    # ------------------------------------------------------------ step (docs/contract.md §2.11, §7.5, §7.6)

    def step(
        self,
        x: np.ndarray,
        timestep: Any,
        rows: list[dict[str, Any]],
        *,
        model: str | None = None,
        run: str | None = None,
        convention: str = "comfy",
        patch_table: str | None = None,
        ref_cache: bool = False,
        skip: list[int] | None = None,
        sample_sigmas: Any = None,
        uploads: Mapping[str, np.ndarray] | None = None,
    ) -> StepAnswer:
        """One denoise step. `rows` are row objects naming tensors by hash; `uploads` maps
        hashes to the tensors themselves, so that rows' tensors not known to be on the
        server are PUT first (no HEAD), and a 409 `missing` is answered by uploading them
        (and re-defining a lost patch table) and retrying once."""
        uploads = uploads or {}
        self._upload_unknown(rows, uploads)
        if patch_table in self._tables:
            self._keep_table(patch_table)
        fields: dict[str, Any] = {"rows": rows, "convention": convention}
        optional = {"model": model, "run": run, "patch_table": patch_table, "skip": skip}
        fields.update({k: v for k, v in optional.items() if v is not None})
        if ref_cache:
            fields["ref_cache"] = True
        tensors = {"x": _latents(x), "timestep": np.asarray(timestep, dtype=np.float32)}
        if sample_sigmas is not None:
            tensors["sample_sigmas"] = np.asarray(sample_sigmas, dtype=np.float32)
        body = container_pieces(tensors, fields)

        wall = 0.0
        reply, elapsed = self._timed_step(body)
        wall += elapsed
        retried = reply.status == 409
        if retried:
            refusal = self._refusal("POST", "step", reply)
            if refusal.code is not None or not refusal.missing:
                raise refusal
            self._supply_missing(refusal, uploads, patch_table)
            reply, elapsed = self._timed_step(body)
            wall += elapsed
        if reply.status != 200:
            raise self._refusal("POST", "step", reply)
        out = self._tensor(self._parse_container("POST", "step", reply), "out", "POST step")
        return StepAnswer(
            out=out,
            forward_ms=_header_ms(reply.headers, "X-Gmlx-Forward-Ms"),
            server_ms=_header_ms(reply.headers, "X-Gmlx-Server-Ms"),
            prefix_cache=reply.headers.get("X-Gmlx-Prefix-Cache"),
            wall_ms=wall,
            retried=retried,
        )

    def _timed_step(self, body: list[bytes | memoryview]) -> tuple[Reply, float]:
        start = time.perf_counter()
        reply = self._post_step(body)
        return reply, (time.perf_counter() - start) * 1000.0

    def _post_step(self, pieces: list[bytes | memoryview]) -> Reply:
        """POST step on the client's own keep-alive connections (`step_http`), where requests,
        urllib3 and http.client cost 0.5 ms more per 1024x1024 step: the container's pieces
        go out in one gathered send and the answer lands in one buffer. Same headers, timeout
        and retry rule as `_request`, which still serves https and proxied servers."""
        link = self._step_link()
        if link is None:
            return self._request("POST", "step", data=b"".join(pieces), content_type=CONTAINER_TYPE)
        headers = {**self.session.headers, HEADER: HEADER_VALUE, "Content-Type": CONTAINER_TYPE}
        headers["Accept-Encoding"] = "identity"  # the body is read as it comes
        try:
            answer = link.post(f"{self._base_path}{PREFIX}/step", headers, pieces)
        except OSError as error:
            raise self._no_answer("POST", "step", error, self.timeout) from error
        body = answer.body
        if not is_container_type(answer.headers.get("Content-Type")):
            body = bytes(body)  # JSON refusals are parsed as bytes
        return Reply(answer.status, answer.headers, body)

    def _step_link(self) -> StepConnections | None:
        """The step connections, when nothing stands between client and server: plain http and
        no proxy (the session's settings merged with the environment's, as requests does per
        call, read at the first step)."""
        if self._step_link_checked:
            return self._link
        self._step_link_checked = True
        if self.base_url.startswith("http://"):
            settings = self.session.merge_environment_settings(self.base_url, {}, None, None, None)
            if not select_proxy(self.base_url, settings["proxies"]):
                url = urllib3.util.parse_url(self.base_url)
                host = (url.host or "").strip("[]")
                self._link = StepConnections(host, url.port or 80, self.timeout)
        return self._link

    def _upload_unknown(
        self, rows: list[dict[str, Any]], uploads: Mapping[str, np.ndarray]
    ) -> None:
        for digest in row_hashes(rows):
            if digest not in self.known and digest in uploads:
                self._upload_as(digest, uploads[digest])

    def _upload_as(self, digest: str, array: np.ndarray) -> None:
        got = self.put_tensor(array)
        if got != digest:
            raise StepError(f"gmlx: the tensor given for {digest} hashes to {got}")

    def _supply_missing(
        self, refusal: StepError, uploads: Mapping[str, np.ndarray], patch_table: str | None
    ) -> None:
        """Answer a step's 409 `missing`; raise `refusal` when this call cannot supply all."""
        missing = refusal.missing
        self.known.difference_update(missing)
        unsuppliable = [
            h for h in missing if h not in uploads and not (h == patch_table and h in self._tables)
        ]
        if unsuppliable:
            raise StepError(
                f"{refusal} (this call has no upload for {', '.join(unsuppliable)})",
                status=refusal.status,
                body=refusal.body,
            )
        if patch_table in missing:
            # The server lost the table (e.g. the model was reloaded): it may have lost more.
            self.forget_known()
            table = self._tables[patch_table]
            self.put_patch_table(table.doc, table.model, table.adapters)
        for digest in missing:
            if digest != patch_table:
                self._upload_as(digest, uploads[digest])

    # ------------------------------------------------------------ VAE (docs/contract.md §2.12, §2.13)

    def vae_decode(
        self, latents: np.ndarray, model: str | None = None, alpha: bool = False
    ) -> np.ndarray:
        """Latents (B, C, h, w) -> images (B, H, W, 3 or 4) F32 in [0, 1]."""
        fields: dict[str, Any] = {"alpha": alpha}
        if model is not None:
            fields["model"] = model
        container = self._container_call("vae/decode", {"latents": _latents(latents)}, fields)
        return self._tensor(container, "image", "POST vae/decode")

    def vae_encode(self, image: np.ndarray, model: str | None = None) -> np.ndarray:
        """Images (B, H, W, C) in [0, 1] -> latents (B, C, h, w) F32."""
        fields = {"model": model} if model is not None else {}
        container = self._container_call("vae/encode", {"image": _latents(image)}, fields)
        return self._tensor(container, "latents", "POST vae/encode")


# ---------------------------------------------------------------- helpers


def digest_of(array: np.ndarray, dtype: str | None = None) -> str:
    return tensor_hash(array, dtype)


def row_hashes(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Every tensor hash the rows name (cond, attention_mask, ref_latents), first seen first."""
    seen: dict[str, None] = {}
    for row in rows:
        named = [row.get("cond"), row.get("attention_mask"), *(row.get("ref_latents") or [])]
        seen.update((h, None) for h in named if isinstance(h, str))
    return list(seen)


def _version_pair(value: Any) -> tuple[int, int] | None:
    """`{"major": int, "minor": int}` -> (major, minor), else None."""
    if not isinstance(value, dict):
        return None
    major, minor = value.get("major"), value.get("minor")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (major, minor)):
        return None
    return major, minor


def _segment(text: str) -> str:
    """A path segment: percent-encoded, `/` included."""
    return quote(text, safe="")


def _header_ms(headers: Mapping[str, str], name: str) -> float | None:
    value = headers.get(name)
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _latents(array: Any) -> np.ndarray:
    """Float latents or images as sent: float32 or float16 stay, anything else becomes float32."""
    array = np.asarray(array)
    if array.dtype in (np.float32, np.float16):
        return array
    return array.astype(np.float32)


def _image_u8(image: Any) -> np.ndarray:
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] not in (3, 4):
        raise ValueError(
            f"reference images must be uint8 arrays (H, W, 3) or (H, W, 4); got {image.dtype} "
            f"{image.shape}"
        )
    return image
