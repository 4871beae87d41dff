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
- A request whose replica failed mid-answer (the connection dropped, or the answer was cut short)
  is tried again: a completion has no side effect, so the cost of a retry is only the decode.
- Every request the activator gets counts as held until it is answered, its tries included: the
  Service sends here only while no replica is ready.
- `GET /healthz` and `GET /metrics` are its own, never forwarded; so is `GET /v1/models`, which
  UIs and health checks poll: it names the job (as a replica does) without holding or waking.
- On SIGTERM (its pod replaced or deleted) the requests it holds are answered 503 with
  `Retry-After` at once; those a replica is answering are let finish.

With `spec.routing.policy: prefix` the same process is the job's router, in the path for good:
given the replicas themselves (`--replicas-dns`, a headless Service, or `--replica` URLs) instead
of one upstream, it sends each request to the replica that `huorn.runtime.router.PrefixRouter`
chooses, and a request whose replica refuses the connection goes to the next choice at once. It
holds requests only while no replica answers, and `huorn_activator_held_requests` counts only
those: requests being answered are not held.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp
import prometheus_client
from aiohttp import web

from huorn.runtime import config as run_config
from huorn.runtime import router as routing
from huorn.runtime import serve as serve_mod
from huorn.runtime.serve import ServeConfig

RETRY_SECONDS = 0.5  # between tries while no replica answers: well under a model's load time
CONNECT_SECONDS = 2.0  # a connection that takes longer is to a replica that is not there
SESSION = web.AppKey("session", aiohttp.ClientSession)
RESOLVER = web.AppKey("resolver", asyncio.Task)


class Activator:
    """Forwards every request to `upstream`, or, given a `router` and the `resolver` of its
    replicas, to the replica the router chooses."""

    def __init__(self, upstream: str | None, timeout_seconds: float,
                 router: routing.PrefixRouter | None = None,
                 resolver: routing.Resolver | None = None, holds_without_replicas: bool = True, *,
                 model: str) -> None:
        """`model`: the name `GET /v1/models` gives, the job's, as its replicas give it.
        `holds_without_replicas`: whether a router knowing no replica is ready (to hold requests
        while the job scales from zero); otherwise its /healthz fails until it knows one, and the
        operator keeps the job's Service on the replicas themselves: a router whose DNS never
        lists them (a wrong cluster domain, a network policy) then costs the cache, not every
        request held until the time-out."""
        if (upstream is None) == (router is None) or (router is None) != (resolver is None):
            raise ValueError("give either an upstream, or a router with the resolver of its replicas")
        self.upstream = upstream.rstrip("/") if upstream else None
        self.timeout_seconds, self.router, self.resolver = timeout_seconds, router, resolver
        self.holds_without_replicas = holds_without_replicas
        self.model, self.started = model, int(time.time())
        self.holding = 0
        # Set as the server stops: requests answered by a replica are let finish (aiohttp waits for
        # them), held ones are answered 503 at once rather than cut off by the pod's SIGKILL.
        self.stopping = False
        r = self.registry = router.registry if router is not None else prometheus_client.CollectorRegistry()
        self.held = prometheus_client.Gauge(
            "huorn_activator_held_requests", "Requests waiting for a replica to become ready", registry=r)
        self.requests = prometheus_client.Counter(
            "huorn_activator_requests", "Requests answered, by outcome", ["outcome"], registry=r)
        self.hold_seconds = prometheus_client.Histogram(
            "huorn_activator_hold_seconds", "Seconds a request waited for a replica", registry=r,
            buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, float("inf")))

    def choose(self, body: bytes, path: str) -> str | None:
        if self.router is None:
            return self.upstream
        tokens = (routing.prompt_tokens(body) if path == "/v1/completions" else
                  routing.prompt_tokens(body, is_chat=True) if path == "/v1/chat/completions" else None)
        choice = self.router.choose(tokens)
        return choice.url if choice is not None else None

    def finished(self, url: str, failed: bool) -> bool:
        """Whether another replica may answer at once (else the request waits a retry period)."""
        if self.router is None:
            return False
        self.router.finished(url, failed)
        return failed and any(r.down_until <= time.monotonic() for r in self.router.replicas.values())

    def hold(self, held: bool) -> None:
        self.holding += 1 if held else -1
        self.held.set(self.holding)

    async def forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept")}
        session = request.app[SESSION]
        started = time.monotonic()
        deadline = started + self.timeout_seconds
        # An activator's upstream is a Service that no ready replica is behind (else the job's
        # Service would not send here): each of its requests waits for a replica from arrival to
        # answer, through its tries too, which can take CONNECT_SECONDS each against a Service
        # with no endpoint. Counted off during a try, it would read 0 to the autoscaler most of
        # the time and no replica would be woken. A router's requests wait only while no replica
        # answers.
        held = self.router is None
        waited = False
        if held:
            self.hold(True)
        try:
            while True:
                url = self.choose(body, request.rel_url.path)
                again = False
                if url is not None:
                    if held and self.router is not None:
                        self.hold(held := False)
                    failed = True
                    streamed: web.StreamResponse | None = None
                    try:
                        async with session.request(request.method, url + request.rel_url.path_qs,
                                                   data=body, headers=headers) as answer:
                            if answer.content_type == "text/event-stream":
                                # a streamed answer is passed on as it comes, a token at a time; the
                                # client hears nothing until its first event, so a replica lost while
                                # the request waits in its queue is one to try again, not a cut
                                chunks = answer.content.iter_any()
                                chunk = await anext(chunks, b"")
                                streamed = web.StreamResponse(status=answer.status, headers={
                                    "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                                if not await self.pass_on(request, streamed, chunk, chunks):
                                    # the client hung up: leaving the block closes the replica's
                                    # connection, which ends its decoding; the replica is well
                                    self.finished(url, failed=False)
                                    self.requests.labels("abandoned").inc()
                                    return streamed
                            else:
                                payload = await answer.read()
                        failed = False
                    except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):
                        # refused, or dropped mid-answer: a completion is safe to try again, unless
                        # part of a streamed answer already reached the client
                        if streamed is not None:
                            self.finished(url, failed=True)
                            self.requests.labels("cut").inc()
                            await streamed.write(serve_mod.sse(serve_mod.stream_error(
                                "the replica stopped mid-answer; try again")))
                            return streamed
                    except BaseException:
                        # cancelled (the client went, the server stops) or a reply that is not
                        # HTTP: the request is over for the replica either way, and its count
                        # in flight must come down or it is shunned for good
                        self.finished(url, failed=False)
                        raise
                    if not failed:
                        self.finished(url, failed=False)
                        self.requests.labels("forwarded").inc()
                        if streamed is not None:
                            await streamed.write_eof()
                            return streamed
                        # a replica's Retry-After (its queue is full: 429) reaches the client,
                        # whose SDK waits that long before it retries
                        kept = {k: answer.headers[k] for k in ("Retry-After",) if k in answer.headers}
                        return web.Response(status=answer.status, body=payload,
                                            content_type=answer.content_type, headers=kept)
                    again = self.finished(url, failed=True)
                if again:
                    continue
                if not held:
                    self.hold(held := True)
                waited = True
                if self.stopping or time.monotonic() + RETRY_SECONDS > deadline:
                    break
                await asyncio.sleep(RETRY_SECONDS)
        finally:
            if held:
                self.hold(False)
            if waited:
                self.hold_seconds.observe(time.monotonic() - started)
        if self.stopping:
            self.requests.labels("stopping").inc()
            message = "this activator is stopping (its pod is replaced or deleted); try again"
        else:
            self.requests.labels("timeout").inc()
            message = (f"no replica became ready within {self.timeout_seconds:g} s "
                       "(spec.autoscaling.activationTimeoutSeconds); try again")
        return serve_mod.error_response(message, 503, headers={"Retry-After": "5"})

    async def pass_on(self, request: web.Request, streamed: web.StreamResponse, chunk: bytes,
                      chunks: AsyncIterator[bytes]) -> bool:
        """Send a replica's stream on to the client; False if the client hung up. Only the
        client's side is caught here: a replica's failure reaches the caller, which cuts the
        stream (aiohttp raises a closed client as a ClientConnectionError, as it does a replica
        that dropped, and a client's stop button would leave a well replica out and forgotten)."""
        try:
            await streamed.prepare(request)
            await streamed.write(chunk)
        except ConnectionResetError:
            return False
        async for chunk in chunks:
            try:
                await streamed.write(chunk)
            except ConnectionResetError:
                return False
        return True

    async def follow_replicas(self) -> None:
        """Keep the router's replicas those the resolver gives now."""
        assert self.router is not None and self.resolver is not None
        while True:
            await asyncio.sleep(routing.RESOLVE_SECONDS)
            try:
                self.router.set_replicas(await self.resolver())
            except Exception as error:  # a dead task would freeze the list for good
                print(f"router: resolving the replicas failed, keeping the last list: {error!r}",
                      file=sys.stderr, flush=True)

    async def healthz(self, request: web.Request) -> web.Response:
        known = len(self.router.replicas) if self.router is not None else None
        ok = self.router is None or self.holds_without_replicas or bool(known)
        body: dict = {"ok": ok, "held": self.holding}
        if known is not None:
            body["replicas"] = known
        return web.json_response(body, status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.Response:
        """OpenAI's model list, answered here whether or not a replica is ready: the id is the
        job's name either way, and forwarded at zero replicas a poll would be held, wake a
        replica (a cold start that takes GPUs back) and wait out the activation timeout."""
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": self.started, "owned_by": "huorn"}]})

    async def not_served(self, request: web.Request) -> web.Response:
        return serve_mod.error_response(
            f"{request.method} {request.rel_url.path} is not served: a replica answers POST "
            "/v1/completions and /v1/chat/completions, and GET /v1/models", 404, "not_found")

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=prometheus_client.generate_latest(self.registry),
                            content_type="text/plain", charset="utf-8")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        # Only what a replica answers (serve.Server.app) is held and forwarded: any other path
        # held at zero replicas woke one, a cold start that takes GPUs back, for a 404.
        app.add_routes([web.get("/healthz", self.healthz), web.get("/metrics", self.metrics_text),
                        web.get("/v1/models", self.models),
                        web.post("/v1/completions", self.forward),
                        web.post("/v1/chat/completions", self.forward),
                        web.route("*", "/{tail:.*}", self.not_served)])

        async def session(app: web.Application):  # type: ignore[no-untyped-def]
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_SECONDS)
            # aiohttp's default connector keeps at most 100 connections in all and makes the rest
            # wait for one, unseen: in the router, out of the replicas' queues (whose 429 is the
            # back-pressure) and of every count the autoscaler reads. Idle ones are still kept.
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
            app[SESSION] = aiohttp.ClientSession(connector=connector, timeout=timeout)
            if self.router is not None:
                assert self.resolver is not None
                self.router.set_replicas(await self.resolver())  # before the first request
                app[RESOLVER] = asyncio.create_task(self.follow_replicas())
            yield
            if self.router is not None:
                app[RESOLVER].cancel()
            await app[SESSION].close()

        async def stop(app: web.Application) -> None:
            self.stopping = True

        app.cleanup_ctx.append(session)
        app.on_shutdown.append(stop)
        return app


async def serve(cfg: ServeConfig, upstream: str | None, replicas_dns: str | None = None,
                replicas: Sequence[str] = ()) -> None:
    timeout = cfg.spec.autoscaling.activation_timeout_seconds
    if upstream is not None:
        activator = Activator(upstream, timeout, model=cfg.job_name)
        what, facts = f"activator of {cfg.job_name} → {upstream}", {"upstream": upstream}
    else:
        resolver = routing.dns_resolver(replicas_dns) if replicas_dns else routing.static_resolver(replicas)
        router = routing.PrefixRouter(cfg.spec.serving.prefix_cache_tokens, cfg.spec.routing.load_factor)
        activator = Activator(None, timeout, router, resolver,
                              holds_without_replicas=cfg.spec.autoscaling.min_replicas == 0,
                              model=cfg.job_name)
        source = replicas_dns or ", ".join(replicas)
        what, facts = f"prefix router of {cfg.job_name} → {source}", {"replicas": source}
    await serve_mod.run_until_signal(activator.app(), cfg, "activator.json", facts, what)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="the job's serving config (JSON)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--upstream", help="URL of the Service of the ready replicas (activator only)")
    where.add_argument("--replicas-dns", metavar="HOST:PORT",
                       help="route by prompt prefix to the addresses of this headless Service's name")
    where.add_argument("--replica", action="append", metavar="URL",
                       help="route by prompt prefix to these replicas (repeat the flag)")
    args = parser.parse_args(argv)
    try:
        cfg = run_config.read_config(args.config, ServeConfig, "serving config")
        if args.replicas_dns:  # a malformed address is refused before serving
            routing.dns_resolver(args.replicas_dns)
        elif args.replica:
            routing.static_resolver(args.replica)
    except (OSError, ValueError) as error:
        print(f"activator: {args.config}: {error}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(cfg, args.upstream, args.replicas_dns, args.replica or ()))
    except ValueError as error:  # e.g. its port is taken
        print(f"activator: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
