"""The activator of a scaled-to-zero InferenceJob, as real processes: it holds a request while no
replica answers, says so on /metrics (what the autoscaler scales on), and answers it from the
first replica that comes up; past activationTimeoutSeconds it answers 503 naming the field."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import prometheus_client
import pytest
import runtime_harness as harness
from aiohttp import web
from kube import serving
from kube.cluster import wait_for

from huorn.backends import replica_metrics
from huorn.runtime import activator, router

REPLICA_IP, ACTIVATOR_IP = "127.0.0.2", "127.0.0.6"


@pytest.fixture()
def replicas(tmp_path: Path) -> Iterator[serving.Replicas]:
    r = serving.Replicas(serving.save_tiny_model(tmp_path / "ckpt"), tmp_path / "run")
    yield r
    r.close()


def held(url: str) -> float | None:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as answer:
        return replica_metrics.parse_held(answer.read().decode())


def model_ids(url: str) -> list[str]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as answer:
        return [model["id"] for model in json.loads(answer.read())["data"]]


def test_a_request_is_held_until_a_replica_serves_it(tmp_path: Path, replicas: serving.Replicas) -> None:
    activator = serving.Activator(tmp_path / "activator", ACTIVATOR_IP, f"http://{REPLICA_IP}:{replicas.port}")
    try:
        assert held(activator.url) == 0
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(serving.complete, activator.url)
            wait_for(lambda: held(activator.url) == 1, what="the request held")
            assert not answer.done()  # nothing serves yet: no replica at the upstream
            replicas.start(REPLICA_IP)  # a replica loads its model, as after a scale-up from zero
            status, body = answer.result(timeout=120)
        assert status == 200 and body["tokens"] > 0 and isinstance(body["text"], str)
        assert held(activator.url) == 0
        # with a replica up the activator forwards at once
        assert serving.complete(activator.url, timeout=30)[0] == 200
        # it answers /v1/models itself: the name a request's `model` must give, as the replica has it
        assert model_ids(activator.url) == model_ids(f"http://{REPLICA_IP}:{replicas.port}") == ["chat"]
    finally:
        activator.close()


def test_a_request_held_past_the_timeout_gets_503_naming_the_field(tmp_path: Path) -> None:
    nowhere = "http://127.0.0.7:9"  # nothing listens: no replica will ever answer
    activator = serving.Activator(tmp_path / "activator", ACTIVATOR_IP, nowhere, timeout_seconds=2.0)
    try:
        status, body = serving.complete(activator.url, timeout=30)
        assert status == 503 and "spec.autoscaling.activationTimeoutSeconds" in body["error"]["message"]
        with urllib.request.urlopen(f"{activator.url}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        assert 'huorn_activator_requests_total{outcome="timeout"} 1.0' in text
    finally:
        activator.close()


# ------------------------------------------------------------------ in process
async def _dropping_replica(delay: float) -> tuple[asyncio.Server, str, list[int]]:
    """A replica that takes each connection and drops it after `delay` s without an answer (as a
    Service without endpoints makes a connection hang until its time-out, or a replica dies)."""
    taken: list[int] = []

    async def take(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        taken.append(1)
        await asyncio.sleep(delay)
        writer.close()

    server = await asyncio.start_server(take, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", taken


async def test_a_held_request_counts_as_held_while_it_tries_the_upstream_again() -> None:
    """The autoscaler wakes a replica from what the gauge reads: a request waiting for a replica
    must read as held during its tries as well as between them."""
    server, upstream, taken = await _dropping_replica(0.4)
    front = activator.Activator(upstream, timeout_seconds=2.5, model="chat")
    async with server, harness.serving_app(front.app()) as session:
        asking = asyncio.create_task(session.post("/v1/completions", json={"prompt": "Q?"}))
        while not taken:
            await asyncio.sleep(0.01)
        readings = []
        while not asking.done():
            readings.append(front.holding)
            await asyncio.sleep(0.05)
        assert (await asking).status == 503
    assert len(taken) >= 3 and set(readings) == {1}
    assert front.holding == 0


async def _replica(ip: str, answer: bytes | None) -> tuple[asyncio.Server, str]:
    """A replica at `ip` that reads a request and sends `answer` raw, then hangs up (None: it
    never answers)."""
    async def take(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if answer is None:
            await asyncio.sleep(3600)
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(take, ip, 0)
    return server, f"http://{ip}:{server.sockets[0].getsockname()[1]}"


def _router_front(urls: list[str]) -> activator.Activator:
    return activator.Activator(None, 5.0, router.PrefixRouter(1024, 1.25), router.static_resolver(urls),
                               model="chat")


async def test_an_answer_cut_short_is_tried_on_another_replica_and_no_count_in_flight_leaks() -> None:
    """A replica that dies mid-answer (fewer bytes than its Content-Length): the request goes to
    the next replica, as for a refused connection, and neither stays counted in flight."""
    cut = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"te"
    whole = b'{"text": "ok"}'
    good = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(whole), whole)
    (dying, first), (living, second) = await _replica("127.0.0.1", cut), await _replica("127.0.0.2", good)
    front = _router_front([first, second])
    async with dying, living, harness.serving_app(front.app()) as session:
        # a prompt shorter than a block goes to the least loaded replica, ties by URL: the dying one
        async with session.post("/v1/completions", json={"prompt": "Q?"}) as answer:
            assert answer.status == 200 and await answer.json() == {"text": "ok"}
        assert front.router is not None
        assert {url: r.in_flight for url, r in front.router.replicas.items()} == {first: 0, second: 0}


async def test_a_full_replicas_429_reaches_the_client_with_its_retry_after() -> None:
    """Before, the router passed the status and body on but not Retry-After, and a client's SDK
    retried an overloaded replica at once."""
    body = b'{"error": {"message": "overloaded", "code": "rate_limit_exceeded"}}'
    full = (b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    replica, url = await _replica("127.0.0.1", full)
    front = _router_front([url])
    async with replica, harness.serving_app(front.app()) as session:
        answer = await session.post("/v1/completions", json={"prompt": "Q?"})
        assert answer.status == 429 and answer.headers.get("Retry-After") == "1"
        assert (await answer.json())["error"]["code"] == "rate_limit_exceeded"


async def test_a_request_cancelled_mid_forward_is_no_longer_counted_in_flight() -> None:
    """aiohttp cancels a handler whose client hung up (handler_cancellation) or as the server
    stops: the replica it was sent to must not stay loaded by it in the router's eyes."""
    silent, url = await _replica("127.0.0.1", None)
    front = _router_front([url])
    runner = web.AppRunner(front.app(), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    assert front.router is not None
    try:
        async with silent, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as session:
            with pytest.raises(TimeoutError):
                await session.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Q?"})
        for _ in range(50):  # the cancellation reaches the handler once the loop notices the hang-up
            if front.router.replicas[url].in_flight == 0:
                break
            await asyncio.sleep(0.1)
        assert front.router.replicas[url].in_flight == 0
    finally:
        await runner.cleanup()


async def test_the_router_follows_its_replicas_past_a_failed_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router, "RESOLVE_SECONDS", 0.01)
    answers: list[object] = [RuntimeError("resolver broke"), ["http://10.0.0.2:8000"]]

    async def resolve() -> list[str]:
        answer = answers.pop(0) if answers else ["http://10.0.0.2:8000"]
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[return-value]

    front = activator.Activator(None, 5.0, router.PrefixRouter(1024, 1.25), resolve, model="chat")
    following = asyncio.create_task(front.follow_replicas())
    await asyncio.sleep(0.2)
    assert not following.done() and front.router is not None
    following.cancel()
    assert list(front.router.replicas) == ["http://10.0.0.2:8000"]


async def _start(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


@pytest.mark.parametrize("replicas", [0, 1])
async def test_as_it_stops_a_held_request_is_answered_503_and_a_forwarded_one_finishes(replicas: int) -> None:
    """A replaced router (its loadFactor changed) gets SIGTERM, then SIGKILL after the pod's grace:
    a request it holds must not wait for the kill (a reset, not an answer), and one a replica is
    answering must get that answer."""
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(1.5)
        return web.json_response({"text": "late"})

    replica = web.Application()
    replica.add_routes([web.post("/v1/completions", slow)])
    replica_runner, replica_url = await _start(replica)
    front = _router_front([replica_url][:replicas])
    front.timeout_seconds = 30
    runner, url = await _start(front.app())
    try:
        async with aiohttp.ClientSession() as session:
            asking = asyncio.create_task(session.post(f"{url}/v1/completions", json={"prompt": "Q?"}))
            await asyncio.sleep(0.3)
            started = time.monotonic()
            await runner.cleanup()  # what SIGTERM does (serve.run_until_signal)
            answer = await asking
            assert time.monotonic() - started < 5
            if replicas:
                assert answer.status == 200 and await answer.json() == {"text": "late"}
            else:
                assert answer.status == 503 and "stopping" in (await answer.json())["error"]["message"]
    finally:
        await replica_runner.cleanup()



@pytest.mark.parametrize(("holds", "known", "ready"),
                         [(False, [], False), (False, ["http://10.0.0.2:8000"], True), (True, [], True)])
async def test_a_router_knowing_no_replica_is_ready_only_to_hold_for_a_scale_from_zero(
        holds: bool, known: list[str], ready: bool) -> None:
    """minReplicas ≥ 1: a router whose DNS lists no replica fails its readiness probe, so the
    operator keeps the job's Service on the replicas; minReplicas 0: holding is its job."""
    async def resolve() -> list[str]:
        return list(known)

    front = activator.Activator(None, 5.0, router.PrefixRouter(1024, 1.25), resolve,
                                holds_without_replicas=holds, model="chat")
    async with harness.serving_app(front.app()) as session, session.get("/healthz") as answer:
        body = await answer.json()
    assert (answer.status == 200) == ready and body["ok"] == ready and body["replicas"] == len(known)


async def test_a_streamed_answer_passes_through_the_router_as_it_comes() -> None:
    """The replica sends its first event and waits until the client has read it: a router that
    buffered the answer would never let it, and the request would time out."""
    read_first = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"text": "a"}\n\n')
        await asyncio.wait_for(read_first.wait(), 30)
        await response.write(b'data: {"done": true}\n\ndata: [DONE]\n\n')
        await response.write_eof()
        return response

    replica = web.Application()
    replica.add_routes([web.post("/v1/completions", stream)])
    runner, url = await _start(replica)
    front = _router_front([url])
    try:
        async with harness.serving_app(front.app()) as session, \
                session.post("/v1/completions", json={"prompt": "Q?", "stream": True}) as answer:
            assert answer.headers["Content-Type"].startswith("text/event-stream")
            first = await asyncio.wait_for(answer.content.readuntil(b"\n\n"), 30)
            read_first.set()
            rest = await asyncio.wait_for(answer.content.read(), 30)
        assert first == b'data: {"text": "a"}\n\n' and rest.endswith(b"data: [DONE]\n\n")
        assert front.router is not None and front.router.replicas[url].in_flight == 0
    finally:
        await runner.cleanup()


async def test_a_stream_cut_mid_answer_ends_with_an_error_event_not_a_second_answer() -> None:
    """Part of the answer already reached the client: it cannot be tried again elsewhere."""
    event = b'data: {"text": "a"}\n\n'
    cut = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"%x\r\n%s\r\n" % (len(event), event))  # one chunk, then the replica hangs up
    whole = b'{"text": "from the other replica"}'
    good = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(whole), whole)
    (dying, first), (living, second) = await _replica("127.0.0.1", cut), await _replica("127.0.0.2", good)
    front = _router_front([first, second])
    async with dying, living, harness.serving_app(front.app()) as session, \
            session.post("/v1/completions", json={"prompt": "Q?", "stream": True}) as answer:
        text = (await answer.content.read()).decode()
    assert text.startswith('data: {"text": "a"}')
    last = json.loads(text.split("\n\n")[-2][len("data: "):])
    assert "stopped mid-answer" in last["error"]["message"]  # where the openai SDK reads it
    assert "other replica" not in text
    assert 'huorn_activator_requests_total{outcome="cut"} 1.0' in prometheus_text(front)


def prometheus_text(front: activator.Activator) -> str:
    return prometheus_client.generate_latest(front.registry).decode()


async def test_a_client_hanging_up_mid_stream_leaves_its_replica_well_and_closes_the_upstream() -> None:
    """A closed client is, to aiohttp, a ClientConnectionError like a dropped replica: the stop
    button of a chat UI must neither leave a well replica out nor forget what it holds, and the
    replica must see the hang-up, to stop decoding."""
    replica_saw_hang_up = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for _ in range(600):
                await response.write(b'data: {"text": "a"}\n\n')
                await asyncio.sleep(0.05)
        except ConnectionResetError:
            replica_saw_hang_up.set()
        return response

    replica = web.Application()
    replica.add_routes([web.post("/v1/completions", stream)])
    runner, url = await _start(replica)
    front = _router_front([url])
    prompt = {"prompt": "Q" * 40, "stream": True}  # two blocks: what the router remembers sending
    try:
        async with harness.serving_app(front.app()) as session:
            answer = await session.post("/v1/completions", json=prompt)
            await asyncio.wait_for(answer.content.readuntil(b"\n\n"), 30)
            answer.close()  # the client hangs up
            await asyncio.wait_for(replica_saw_hang_up.wait(), 30)
            for _ in range(50):
                if front.router is not None and front.router.replicas[url].in_flight == 0:
                    break
                await asyncio.sleep(0.1)
        assert front.router is not None
        assert front.router.replicas[url].in_flight == 0
        assert front.router.replicas[url].down_until == 0 and front.router.replicas[url].sent
        text = prometheus_text(front)
        assert 'outcome="cut"' not in text
        assert 'huorn_activator_requests_total{outcome="abandoned"} 1.0' in text
    finally:
        await runner.cleanup()


async def test_a_stream_whose_replica_dies_before_its_first_event_is_tried_on_another() -> None:
    """The client has heard nothing yet (the request waited in the replica's queue): it can be
    answered whole by the next replica rather than cut."""
    dead = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    event = b'data: {"text": "from the other replica"}\n\ndata: [DONE]\n\n'
    good = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
    (dying, first), (living, second) = await _replica("127.0.0.1", dead), await _replica("127.0.0.2", good)
    front = _router_front([first, second])
    async with dying, living, harness.serving_app(front.app()) as session, \
            session.post("/v1/completions", json={"prompt": "Q?", "stream": True}) as answer:
        text = (await answer.content.read()).decode()
    assert text == event.decode()
    assert 'outcome="cut"' not in prometheus_text(front)


async def test_the_router_lets_every_request_through_to_its_replicas_past_a_hundred_at_once() -> None:
    """aiohttp's default connector holds at most 100 connections in all: the 101st request waited
    inside the router, out of the replicas' queues and of every count the autoscaler reads. The
    replicas answer only once all 150 are inside them, so one kept back hangs the lot."""
    clients, inside, all_in = 150, [0], asyncio.Event()

    async def barrier(request: web.Request) -> web.Response:
        await request.read()
        inside[0] += 1
        if inside[0] >= clients:
            all_in.set()
        await all_in.wait()
        return web.json_response({"text": "ok"})

    runners = []
    for _ in range(2):
        replica = web.Application()
        replica.add_routes([web.post("/v1/completions", barrier)])
        runners.append(await _start(replica))
    front = _router_front([url for _, url in runners])
    runner, url = await _start(front.app())
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def ask(i: int) -> int:
                async with session.post(f"{url}/v1/completions", json={"prompt": f"q{i}"}) as answer:
                    return answer.status

            asking = asyncio.gather(*(ask(i) for i in range(clients)))
            try:
                statuses = await asyncio.wait_for(asking, 30)
            except TimeoutError:
                pytest.fail(f"only {inside[0]} of {clients} requests reached the replicas")
        assert statuses == [200] * clients
    finally:
        all_in.set()  # let any handler still waiting finish, so the servers stop at once
        await runner.cleanup()
        for replica_runner, _ in runners:
            await replica_runner.cleanup()


@pytest.mark.parametrize("front_kind", ["activator", "router"])
async def test_at_zero_replicas_the_model_list_is_answered_at_once_without_waking_a_replica(
        front_kind: str) -> None:
    """UIs and health checks poll /v1/models: forwarded, each poll was held, read by the autoscaler
    as demand (a cold start that takes GPUs back) and answered 503 only at the activation timeout."""
    server, upstream, taken = await _dropping_replica(0.4)  # no replica: connections go nowhere

    async def no_replicas() -> list[str]:
        return []

    front = (activator.Activator(upstream, 5.0, model="chat") if front_kind == "activator" else
             activator.Activator(None, 5.0, router.PrefixRouter(1024, 1.25), no_replicas, model="chat"))
    async with server, harness.serving_app(front.app()) as session, \
            session.get("/v1/models", timeout=aiohttp.ClientTimeout(total=1)) as answer:
        assert answer.status == 200
        body = await answer.json()
    assert body["object"] == "list" and [(m["id"], m["object"], m["owned_by"]) for m in body["data"]] == [
        ("chat", "model", "huorn")]
    text = prometheus_text(front)
    # a held request always leaves a sample of how long it waited
    assert "huorn_activator_held_requests 0.0" in text and "huorn_activator_hold_seconds_count 0.0" in text
    assert not taken
    # nor does a path no replica serves wait for one: it is refused at once
    async with server, harness.serving_app(front.app()) as session, \
            session.get("/", timeout=aiohttp.ClientTimeout(total=1)) as answer:
        assert answer.status == 404 and (await answer.json())["error"]["code"] == "not_found"
    assert "huorn_activator_held_requests 0.0" in prometheus_text(front) and not taken
