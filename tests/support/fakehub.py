"""A stand-in for the Hugging Face Hub's HTTP API on loopback, for `nnd pull` tests (no network):
it serves one folder as the repo `repo_id` at one commit, answering the few routes
huggingface_hub's snapshot_download uses (repo info, tree listing, file HEAD and GET)."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _files(folder: str) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, folder)] = f.read()
    return out


@contextmanager
def serve(folder: str, repo_id: str) -> Iterator[str]:
    """Serve `folder` as `repo_id`; yields the endpoint (HF_ENDPOINT) and stops on exit."""
    files = _files(folder)
    oids = {path: hashlib.sha1(data).hexdigest() for path, data in files.items()}

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _send(self, code: int, body: bytes, headers: dict[str, str], *, head: bool = False) -> None:
            self.send_response(code)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, obj: object) -> None:
            self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"})

        def _route(self, head: bool) -> None:
            path = urllib.parse.unquote(urllib.parse.urlparse(self.path).path)
            info = f"/api/models/{repo_id}/revision/"
            tree = f"/api/models/{repo_id}/tree/"
            resolve = f"/{repo_id}/resolve/"
            if path.startswith(info):
                siblings = [{"rfilename": p} for p in sorted(files)]
                return self._json({"id": repo_id, "modelId": repo_id, "sha": COMMIT, "siblings": siblings})
            if path.startswith(tree):
                return self._json(
                    [{"type": "file", "path": p, "size": len(files[p]), "oid": oids[p]} for p in sorted(files)]
                )
            if path.startswith(resolve):
                name = path[len(resolve) :].split("/", 1)[1]
                if name in files:
                    headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{oids[name]}"'}
                    return self._send(200, files[name], headers, head=head)
            self._send(404, b'{"error": "not found"}', {"X-Error-Code": "RepoNotFound"}, head=head)

        def do_GET(self) -> None:  # noqa: N802
            self._route(head=False)

        def do_HEAD(self) -> None:  # noqa: N802
            self._route(head=True)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
