"""A local S3 endpoint for the tests: moto's S3 API on 127.0.0.1, with a WSGI layer in front that counts what it
serves and adds latency and faults on demand.

`S3Endpoint.start()` serves moto's app (the app `moto_server` runs) with werkzeug's threaded server on a free
loopback port, in a daemon thread of this process; `stop()` shuts it down. Clients reach it the standard way:
`AWS_ENDPOINT_URL=<endpoint.url>` with any access key (`endpoint.env`, which also turns botocore's own retries off).

- `requests` and `bytes_sent`: the requests served and the response body bytes sent, since the last `reset()`;
  `sent_under(prefix)`: the bytes sent for the objects whose path starts with `prefix` (`/bucket/digits/train/`).
- `delay_s`: seconds added before every response.
- `fail(times, status=503, path="")`: the next `times` requests whose path contains `path` are answered with
  `status` (S3's SlowDown body) instead of reaching moto; `drop(times, path="")`: their connection is closed
  with no response. `times=-1`: until `reset()`.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from moto.server import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class QuietHandler(WSGIRequestHandler):
    """No access log line per request (werkzeug's logger would fill every failing test's report)."""

    def log_request(self, *args: Any) -> None:
        pass


@dataclass
class Fault:
    kind: str  # "status" or "drop"
    times: int  # -1: until reset()
    path: str
    status: int = 503


class S3Endpoint:
    """moto's S3 on a loopback port, counting requests and bytes, with injectable delay and faults."""

    def __init__(self) -> None:
        self._app = DomainDispatcherApplication(create_backend_app)
        self._lock = threading.Lock()
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.reset()

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        return f"http://127.0.0.1:{self._server.server_port}"

    @property
    def env(self) -> dict[str, str]:
        """What a user sets to point boto3/s3fs at this endpoint (moto accepts any key)."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_MAX_ATTEMPTS": "1",  # botocore's own retries off: the template's retries meet every fault
        }

    def start(self) -> S3Endpoint:
        self._server = make_server("127.0.0.1", 0, self, threaded=True, request_handler=QuietHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-endpoint", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=10)

    def reset(self) -> None:
        """Zero the counters, remove the delay and every pending fault."""
        with self._lock:
            self.requests, self.bytes_sent, self.delay_s = 0, 0, 0.0
            self._sent_by_path: dict[str, int] = {}
            self._faults: list[Fault] = []

    def fail(self, times: int, status: int = 503, path: str = "") -> None:
        with self._lock:
            self._faults.append(Fault("status", times, path, status))

    def drop(self, times: int, path: str = "") -> None:
        with self._lock:
            self._faults.append(Fault("drop", times, path))

    def _take_fault(self, path: str) -> Fault | None:
        with self._lock:
            self.requests += 1
            for fault in self._faults:
                if fault.times != 0 and fault.path in path:
                    fault.times -= fault.times > 0
                    return fault
        return None

    def sent_under(self, prefix: str) -> int:
        with self._lock:
            return sum(sent for path, sent in self._sent_by_path.items() if path.startswith(prefix))

    def _count(self, body: Iterable[bytes], path: str) -> Iterable[bytes]:
        for chunk in body:
            with self._lock:
                self.bytes_sent += len(chunk)
                self._sent_by_path[path] = self._sent_by_path.get(path, 0) + len(chunk)
            yield chunk

    def __call__(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        if self.delay_s:
            time.sleep(self.delay_s)
        fault = self._take_fault(environ.get("PATH_INFO", ""))
        if fault is not None and fault.kind == "drop":
            connection = environ["werkzeug.socket"]
            connection.shutdown(socket.SHUT_RDWR)  # the client reads a closed connection, no status line
            start_response("500 Dropped", [])  # werkzeug's write then fails quietly on the closed socket
            return []
        if fault is not None:
            headers = [("Content-Type", "application/xml"), ("Content-Length", str(len(SLOW_DOWN)))]
            start_response(f"{fault.status} Slow Down", headers)
            return [] if environ["REQUEST_METHOD"] == "HEAD" else [SLOW_DOWN]
        return self._count(self._app(environ, start_response), environ.get("PATH_INFO", ""))


def main() -> None:
    """`python engine/tests/s3_server.py [DELAY_MS]`: serve in this process, print the URL, run until killed (a remote
    that does not share the GIL of the process it serves, for benchmarks/loader.py)."""
    import sys

    endpoint = S3Endpoint().start()
    endpoint.delay_s = float(sys.argv[1]) / 1000 if len(sys.argv) > 1 else 0.0
    print(endpoint.url, flush=True)
    endpoint._thread.join()


if __name__ == "__main__":
    main()
