"""An emulated cluster in a background thread, reachable like a real one through a kubeconfig.

The emulator runs in its own event loop and thread so that tests, the operator (in a thread or a
subprocess) and the official kubernetes client all talk to it over HTTP, exactly as they would
to a real API server. The same helpers therefore serve the e2e suite against a real cluster.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kmock
import kubernetes
import yaml

from kube import emulator

DEFAULT_TIMEOUT = 60.0


def write_kubeconfig(path: Path, server: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "tester", "user": {"token": "emulator"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}],
    }
    path.write_text(yaml.safe_dump(config))
    return path


class EmulatedCluster:
    """Start with `with EmulatedCluster(tmp_path) as cluster:`; `cluster.kmock` is the emulator."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.loop = asyncio.new_event_loop()
        self.kmock: emulator.HuornEmulator | None = None
        self._server: kmock.Server | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="kmock", daemon=True)
        self.kubeconfig: Path | None = None

    def __enter__(self) -> EmulatedCluster:
        self._thread.start()
        self.call(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    async def _start(self) -> None:
        self.kmock = emulator.HuornEmulator()
        await self.kmock.__aenter__()
        self.kmock.declare_resources()
        self._server = kmock.Server(self.kmock)
        await self._server.__aenter__()
        self.url = str(self._server.url).rstrip("/")
        self.kubeconfig = write_kubeconfig(self.workdir / "kubeconfig", self.url)

    async def _stop(self) -> None:
        # Watches of a stopped operator may still be open; closing the server ends them.
        if self._server is not None:
            await self._server.__aexit__(None, None, None)
        if self.kmock is not None:
            await self.kmock.__aexit__(None, None, None)

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        future: concurrent.futures.Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout=timeout)

    def api_client(self) -> kubernetes.client.ApiClient:
        config = kubernetes.client.Configuration()
        config.host = self.url
        config.api_key = {"authorization": "Bearer emulator"}
        config.connection_pool_maxsize = 32
        return kubernetes.client.ApiClient(config)


def wait_for(predicate: Callable[[], Any], timeout: float = DEFAULT_TIMEOUT, what: str = "") -> Any:
    """Poll until `predicate()` is truthy; the operator works in another thread, so time is real."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except kubernetes.client.ApiException as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what or predicate}: last={last!r}")


def hold_kopf_lists(cluster: EmulatedCluster, plural: str, seconds: float = 3.0) -> list[Any]:
    """Hold kopf's lists of `plural` (those that start its watch, and so its handlers) for
    `seconds`, as a busy API server may, while the operator's own client is answered at once: what
    a restarted operator needs before its first placement must not wait for a watch. Returns the
    requests held."""
    held: list[Any] = []

    async def hold(request: Any) -> None:
        agent = next((v for k, v in request.headers.items() if k.lower() == "user-agent"), "")
        if agent.startswith("kopf/"):
            held.append(request)
            await asyncio.sleep(seconds)
        raise NotImplementedError  # matched, answered by what comes next (the emulator); kept active

    assert cluster.kmock is not None
    cluster.kmock[f"list {plural}"] << hold
    return held
