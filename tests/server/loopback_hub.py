"""A loopback server answering the Hugging Face Hub's file routes for the repositories it is
given (the tests point `HF_ENDPOINT` at it): the model info with its files' sizes and hashes
(`/api/models/{repo}[/revision/{rev}]`) and each file's HEAD and GET
(`/{repo}/resolve/{rev}/{path}`, LFS files with `X-Linked-Etag` = their sha256, ranges for a
resumed download). It can cut a file's first download halfway (`cut`) and serve a file whose
bytes differ from the hashes it lists (`corrupt`), and records the requests."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".safetensors", ".gguf")


class LoopbackHub:
    def __init__(self, repos: dict[str, Path]):
        """`repos`: repository id -> the folder whose files it holds."""
        self.repos = {repo: Path(folder) for repo, folder in repos.items()}
        self.cut: set[str] = set()  # files whose next GET stops halfway
        self.corrupt: set[str] = set()  # files served with a byte flipped
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub.answer(self, body=False)

            def do_GET(self):
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- the routes ------------------------------------------------------------------

    def files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}

    def info(self, repo: str) -> dict:
        siblings = []
        for name, path in self.files(repo).items():
            data = path.read_bytes()
            entry = {"rfilename": name, "size": len(data), "blobId": _blob_id(data)}
            if name.endswith(LFS_SUFFIXES):
                entry["lfs"] = {
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "size": len(data),
                    "pointerSize": 134,
                }
            siblings.append(entry)
        return {"id": repo, "modelId": repo, "sha": COMMIT, "siblings": siblings, "private": False}

    def answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(handler.path).path)
        self.requests.append((handler.command, path, handler.headers.get("Range")))
        for repo in self.repos:
            if path in (
                f"/api/models/{repo}",
                f"/api/models/{repo}/revision/main",
                f"/api/models/{repo}/revision/{COMMIT}",
            ):
                return self.send(
                    handler,
                    200,
                    json.dumps(self.info(repo)).encode(),
                    {"Content-Type": "application/json"},
                    body,
                )
            for revision in ("main", COMMIT):
                prefix = f"/{repo}/resolve/{revision}/"
                if path.startswith(prefix):
                    return self.file(handler, repo, path[len(prefix) :], body)
        self.send(
            handler,
            404,
            b'{"error": "Repository not found"}',
            {"X-Error-Code": "RepoNotFound"},
            body,
        )

    def file(self, handler, repo: str, name: str, body: bool) -> None:
        files = self.files(repo)
        if name not in files:
            return self.send(handler, 404, b"{}", {"X-Error-Code": "EntryNotFound"}, body)
        data = files[name].read_bytes()
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{_blob_id(data)}"', "Accept-Ranges": "bytes"}
        if name.endswith(LFS_SUFFIXES):
            headers["X-Linked-Etag"] = f'"{hashlib.sha256(data).hexdigest()}"'
            headers["X-Linked-Size"] = str(len(data))
        if body and name in self.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        start, status = 0, 200
        wanted = handler.headers.get("Range")
        if wanted and wanted.startswith("bytes="):
            start = int(wanted[len("bytes=") :].split("-")[0])
            status = 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        part = data[start:]
        if body and name in self.cut:
            self.cut.discard(name)
            handler.send_response(status)
            for key, value in {**headers, "Content-Length": str(len(part))}.items():
                handler.send_header(key, value)
            handler.end_headers()
            handler.wfile.write(part[: len(part) // 2])
            handler.wfile.flush()
            handler.close_connection = True
            handler.connection.shutdown(2)
            return
        self.send(handler, status, part, headers, body)

    @staticmethod
    def send(handler, status: int, data: bytes, headers: dict, body: bool) -> None:
        handler.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            handler.send_header(key, value)
        handler.end_headers()
        if body:
            handler.wfile.write(data)


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
