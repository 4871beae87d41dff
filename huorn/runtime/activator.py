"""The activator of an InferenceJob that scales to zero: it holds requests while no replica runs.

    python -m huorn.runtime.activator --config /etc/huorn/config.json --upstream http://chat-replicas:80

With `autoscaling.minReplicas: 0` the operator runs this beside the replicas (one small CPU pod)
and points the job's Service at it whenever no replica is ready. Every request it receives is
forwarded to `--upstream` (the `<job>-replicas` Service, which selects the ready replicas); while
that has no ready endpoint the connection fails, and the activator holds the request and tries
again every `RETRY_SECONDS`, up to `spec.autoscaling.activationTimeoutSeconds`. What it holds is
the signal to scale up: the operator's autoscaler reads `huorn_activator_held_requests` from
`/metrics` and asks for a replica at once. Once a replica is ready the Service points at the
replicas again and the activator is out of the path (Knative's activator does the same).

- A request is answered with the replica's status and body. One held past the timeout gets 503
  with `Retry-After`, naming the field that sets the timeout.
- A request whose replica failed mid-answer (the connection dropped) is tried again: a completion
  has no side effect, so the cost of a retry is only the decode.
- `GET /healthz` and `GET /metrics` are its own, never forwarded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp
import prometheus_client
from aiohttp import web

from huorn.runtime import serve as serve_mod
from huorn.runtime.serve import ServeConfig

RETRY_SECONDS = 0.5  # between tries while no replica answers: well under a model's load time
CONNECT_SECONDS = 2.0  # a connection that takes longer is to a replica that is not there
SESSION = web.AppKey("session", aiohttp.ClientSession)


class Activator:
    def __init__(self, upstream: str, timeout_seconds: float) -> None:
        self.upstream, self.timeout_seconds = upstream.rstrip("/"), timeout_seconds
        self.holding = 0
        r = self.registry = prometheus_client.CollectorRegistry()
        self.held = prometheus_client.Gauge(
            "huorn_activator_held_requests", "Requests waiting for a replica to become ready", registry=r)
        self.requests = prometheus_client.Counter(
            "huorn_activator_requests", "Requests answered, by outcome", ["outcome"], registry=r)
        self.hold_seconds = prometheus_client.Histogram(
            "huorn_activator_hold_seconds", "Seconds a request waited for a replica", registry=r,
            buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, float("inf")))

    async def forward(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept")}
        session = request.app[SESSION]
        started = time.monotonic()
        deadline = started + self.timeout_seconds
        self.holding += 1
        self.held.set(self.holding)
        try:
            while True:
                try:
                    async with session.request(request.method, self.upstream + request.rel_url.path_qs,
                                               data=body, headers=headers) as answer:
                        payload = await answer.read()
                        self.requests.labels("forwarded").inc()
                        return web.Response(status=answer.status, body=payload,
                                            content_type=answer.content_type)
                except (TimeoutError, aiohttp.ClientConnectionError):
                    if time.monotonic() + RETRY_SECONDS > deadline:
                        break
                    await asyncio.sleep(RETRY_SECONDS)
        finally:
            self.holding -= 1
            self.held.set(self.holding)
            self.hold_seconds.observe(time.monotonic() - started)
        self.requests.labels("timeout").inc()
        message = (f"no replica became ready within {self.timeout_seconds:g} s "
                   "(spec.autoscaling.activationTimeoutSeconds); try again")
        return web.json_response({"error": message}, status=503, headers={"Retry-After": "5"})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "held": self.holding})

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=prometheus_client.generate_latest(self.registry),
                            content_type="text/plain", charset="utf-8")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.add_routes([web.get("/healthz", self.healthz), web.get("/metrics", self.metrics_text),
                        web.route("*", "/{tail:.*}", self.forward)])

        async def session(app: web.Application):  # type: ignore[no-untyped-def]
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_SECONDS)
            app[SESSION] = aiohttp.ClientSession(timeout=timeout)
            yield
            await app[SESSION].close()

        app.cleanup_ctx.append(session)
        return app


async def serve(cfg: ServeConfig, upstream: str) -> None:
    activator = Activator(upstream, cfg.spec.autoscaling.activation_timeout_seconds)
    await serve_mod.run_until_signal(activator.app(), cfg, "activator.json", {"upstream": upstream},
                                     f"activator of {cfg.job_name} → {upstream}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="the job's serving config (JSON)")
    parser.add_argument("--upstream", required=True, help="URL of the Service of the ready replicas")
    args = parser.parse_args(argv)
    try:
        cfg = ServeConfig.model_validate(json.loads(args.config.read_text()))
    except (OSError, ValueError) as error:
        print(f"activator: {args.config}: {error}", file=sys.stderr)
        return 2
    asyncio.run(serve(cfg, args.upstream))
    return 0


if __name__ == "__main__":
    sys.exit(main())
