"""The API's CPU per request in one process, no sockets: the app called as an ASGI callable.

    PYTHONPATH=<tree> python scripts/api_inproc.py sqlite 3000 20          # or a postgresql+psycopg:// URL

Seeds a file and two (failed) batches in a fresh database, then sends ``N`` GETs (list files,
retrieve the file, list batches, retrieve each batch, in turn) from ``CONC`` concurrent tasks,
three rounds, and prints the process's CPU time per request for each round. It leaves out
uvicorn, the sockets and the load generator, which ``scripts/api_load.py`` includes: a steadier
figure on a shared machine for the app's own share (routing, dependencies, the hop to a thread, the
read, the answer). ``ONLY=/v1/files/`` keeps the paths that contain that text (default ``/v1/``;
``ONLY=/healthz`` sends probes only).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from typing import Any

LINE = (b'{"custom_id":"a","method":"POST","url":"/v1/chat/completions",'
        b'"body":{"messages":[{"role":"user","content":"hi"}]}}\n')


def main() -> None:
    url, n, conc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tmp = tempfile.mkdtemp(prefix="api-inproc-")
    os.environ.update(SPECBATCH_DATABASE_URL=f"sqlite:///{tmp}/db.sqlite" if url == "sqlite" else url,
                      SPECBATCH_FILES_DIR=f"{tmp}/files", SPECBATCH_BROKER_URL="memory://")
    from specbatch.api.app import create_app
    from specbatch.config import get_settings
    from specbatch.jobs import batches

    app = create_app(get_settings())
    sb = app.state.sb

    async def call(method: str, path: str, body: bytes = b"", headers: list[Any] | None = None) -> tuple[int, bytes]:
        p, _, q = path.partition("?")
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": p, "raw_path": p.encode(), "query_string": q.encode(), "root_path": "",
                 "headers": [(b"host", b"127.0.0.1"), *(headers or [])], "client": ("127.0.0.1", 1),
                 "server": ("127.0.0.1", 8000), "state": {}}
        sent: list[Any] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: Any) -> None:
            sent.append(message)

        await app(scope, receive, send)
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    async def run() -> None:
        async with app.router.lifespan_context(app):
            form = (b"--b\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--b\r\n"
                    b"Content-Disposition: form-data; name=\"file\"; filename=\"a.jsonl\"\r\n\r\n" + LINE +
                    b"\r\n--b--\r\n")
            status, body = await call("POST", "/v1/files", form, [(b"content-type", b"multipart/form-data; boundary=b"),
                                                                 (b"content-length", str(len(form)).encode())])
            assert status == 200, body
            file_id = json.loads(body)["id"]
            ids = [batches.new_batch_id() for _ in range(2)]
            for batch_id in ids:
                with sb.factory.begin() as s:
                    batches.create_batch(s, batch_id=batch_id, input_file_id=file_id, endpoint="/v1/chat/completions",
                                         completion_window="24h", metadata={}, owner=None,
                                         errors=[{"code": "invalid_file", "line": 1, "param": None, "message": "m"}])
            paths = ["/v1/files?limit=20", f"/v1/files/{file_id}", "/v1/batches?limit=20",
                     *[f"/v1/batches/{b}" for b in ids], "/healthz"]
            paths = [p for p in paths if os.environ.get("ONLY", "/v1/") in p]

            async def client(k: int) -> None:
                for i in range(n // conc):
                    status, body = await call("GET", paths[(i + k) % len(paths)])
                    assert status == 200, body

            for rnd in range(3):
                c0 = time.process_time()
                await asyncio.gather(*(client(k) for k in range(conc)))
                print(json.dumps({"round": rnd, "cpu_us_per_req": round(1e6 * (time.process_time() - c0) / n)}))

    import uvloop
    uvloop.run(run())


if __name__ == "__main__":
    main()
