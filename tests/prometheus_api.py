"""A Prometheus HTTP API endpoint for tests: `query_range` over a rate that the test sets.

The operator's board reads an inference cluster's request rate from Prometheus; no Prometheus
runs here, so this serves the one endpoint it reads, in Prometheus's own JSON, over real HTTP.
The rate is a function of time that the test replaces as its scenario moves on; `fail` makes
the next answers an error of the kind Prometheus gives (status, errorType, error).
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class PrometheusApi:
    def __init__(self) -> None:
        self.rate: Callable[[float], float | None] = lambda t: 0.0  # None: no sample at t
        self.series = 1  # the rate is split evenly over this many series (the board sums them)
        self.fail: tuple[int, str] | None = None  # (HTTP status, Prometheus error message)
        self.queries: list[dict[str, str]] = []
        self.url = ""

    def answer(self, params: dict[str, str]) -> tuple[int, dict[str, Any]]:
        self.queries.append(params)
        if self.fail is not None:
            code, message = self.fail
            return code, {"status": "error", "errorType": "bad_data", "error": message}
        start, end, step = float(params["start"]), float(params["end"]), float(params["step"])
        points = []
        t = start
        while t <= end + 1e-9:
            value = self.rate(t)
            if value is not None:
                points.append((t, value))
            t += step
        result = [{"metric": {"series": str(i)},
                   "values": [[p, str(v / self.series)] for p, v in points]}
                  for i in range(self.series)] if points else []
        return 200, {"status": "success", "data": {"resultType": "matrix", "result": result}}


@contextmanager
def serve() -> Iterator[PrometheusApi]:
    api = PrometheusApi()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            if url.path != "/api/v1/query_range":
                code, body = 404, {"status": "error", "errorType": "not_found", "error": url.path}
            else:
                code, body = api.answer(dict(urllib.parse.parse_qsl(url.query)))
            raw = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    api.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield api
    finally:
        server.shutdown()
        server.server_close()
