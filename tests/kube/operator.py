"""Run Huorn's real kopf operator against an emulated (or real) cluster from a test.

In a thread for most tests (fast start, its metrics readable), or as a subprocess that a test
can SIGKILL at any moment, which is what an operator killed by the kubelet looks like.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import kubernetes

from huorn.backends.kubernetes import retry
from huorn.operator import context, runner

FAST = context.OperatorSettings(
    resync_seconds=2.0,
    vc_status_seconds=1.0,
    error_backoff_seconds=0.5,
    mirror_resync_seconds=2.0,
    replacement_backoff_seconds=0.5,
    replacement_backoff_max_seconds=2.0,
    retry=retry.RetryPolicy(attempts=10, base_delay=0.05, max_delay=0.5),
)


class OperatorThread:
    """`with OperatorThread(api) as op:` runs the operator until the block ends."""

    def __init__(
        self, api: kubernetes.client.ApiClient, settings: context.OperatorSettings = FAST,
        peering: str | None = None, priority: int | None = None, health_port: int | None = None,
    ) -> None:
        self.ctx = runner.build_context(api, settings)
        self.peering, self.priority, self.health_port = peering, priority, health_port
        self.api = api
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="huorn-operator", daemon=True)

    def _run(self) -> None:
        try:
            runner.run_operator(
                self.api, ctx=self.ctx, stop_flag=self.stop, ready_flag=self.ready,
                peering=self.peering, priority=self.priority, health_port=self.health_port,
            )
        except BaseException as exc:  # surfaced by __exit__
            self.error = exc

    def __enter__(self) -> OperatorThread:
        self._thread.start()
        if not self.ready.wait(timeout=60):
            raise AssertionError(f"operator did not become ready: {self.error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._thread.join(timeout=60)
        if self._thread.is_alive():
            raise AssertionError("operator did not stop within 60 s")


class OperatorProcess:
    """The operator as `huorn operator --kubeconfig ...` in a child process, killable with SIGKILL."""

    def __init__(self, kubeconfig: Path, log: Path) -> None:
        self.kubeconfig = kubeconfig
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "HUORN_OPERATOR_FAST": "1"}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "huorn.cli.operator", "--kubeconfig", str(self.kubeconfig),
                 "--all-namespaces", "--resync-seconds", "2", "--metrics-port", "0"],
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None


async def direct_context(api: kubernetes.client.ApiClient,
                         settings: context.OperatorSettings = FAST) -> context.Context:
    """An operator's context with no operator running: nodes and VirtualClusters in its mirror,
    pods only when a test reports them, so a test replays a window between the operator's own
    writes and their watch events deterministically, reconciling by hand."""
    ctx = runner.build_context(api, settings)
    ctx.post_event = lambda *args, **kwargs: None  # kopf's poster needs a running operator
    for node in await ctx.client.list("Node", None, {}):
        ctx.index.observe_node(node)
    for vc in await ctx.client.list_custom("virtualclusters", None):
        ctx.index.observe_vc(vc)  # and the nodes judged with their owners' tolerations, as at start-up
    return ctx
