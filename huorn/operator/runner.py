"""Start the operator: kubeconfig or in-cluster login, namespaces, peering, metrics endpoint.

`run_operator` blocks until `stop_flag` is set (or a signal arrives), so the CLI calls it
directly and tests call it in a thread of their own, where kopf runs its own event loop.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import secrets
import socket
import threading
from collections.abc import Sequence
from typing import Any

import kopf
import kubernetes
import prometheus_client as prom

from huorn.backends.kubernetes import client as kube
from huorn.operator import context, handlers
from huorn.operator.leadership import Leadership

logger = logging.getLogger(__name__)

# kopf pauses *every* peer that shares the highest priority (it cannot tell which should lead),
# so replicas started alike, as a Deployment starts them, must not all default to one value.
PEERING_PRIORITY_RANGE = 1 << 30


def build_connection(api: kubernetes.client.ApiClient) -> kopf.ConnectionInfo:
    """kopf's credentials from the same Configuration the backend's client uses."""
    config = api.configuration
    auth = (config.api_key or {}).get("authorization") or (config.api_key or {}).get("BearerToken") or ""
    scheme, _, token = auth.partition(" ") if " " in auth else ("Bearer", "", auth)
    return kopf.ConnectionInfo(
        server=config.host,
        ca_path=config.ssl_ca_cert,
        insecure=not config.verify_ssl,
        scheme=scheme if token else None,
        token=token or None,
        certificate_path=config.cert_file,
        private_key_path=config.key_file,
        username=config.username or None,
        password=config.password or None,
        default_namespace="default",
    )


class MetricsPortError(Exception):
    """The metrics endpoint cannot listen: raised before kopf starts, so nothing has acted yet."""


DEFAULT_HEALTH_ADDRESS = "0.0.0.0"


def liveness_endpoint(address: str, port: int) -> str:
    """kopf's liveness URL on `address` (an IPv4 or IPv6 address, no host name), port `port`.

    kopf binds the URL's host: 0.0.0.0 serves IPv4 only, so on an IPv6-only cluster (or one whose
    pods' primary address is IPv6) the kubelet's probes never reached it; `::` serves IPv6. An
    IPv6 address goes in brackets, as a URL needs. A non-IP raises ValueError.
    """
    ip = ipaddress.ip_address(address)
    host = f"[{ip.compressed}]" if ip.version == 6 else ip.compressed
    return f"http://{host}:{port}/healthz"


def peering_priority(priority: int | None) -> int:
    """The given priority, or a random one for a replica that was given none.

    Two replicas of one Deployment get the same flags; with one shared default kopf would pause
    both and no operator would act. A draw from 2^30 values collides for two replicas about once
    in a billion, and a collision still pauses rather than lets two operators act.
    """
    return priority if priority is not None else 1 + secrets.randbelow(PEERING_PRIORITY_RANGE)


def event_poster(client: kube.KubeClient) -> context.EventPoster:
    """Events through kopf's queue inside a kopf handler, and through the API client outside
    one: kopf keeps its queue only in each object's task, and a reconcile that a background
    resync woke (handlers._resync_mirror) raised LookupError at its first Event and died there,
    after writing its placement and before creating its pods."""
    background: set[asyncio.Task[None]] = set()

    def post(body: Any, kind: str, reason: str, message: str) -> None:
        try:
            kopf.event(body, type=kind, reason=reason, message=message[:1024])
            return
        except LookupError:
            pass
        task = asyncio.get_running_loop().create_task(
            client.create_event(body, kind, reason, message, component="huorn"), name=f"event {reason}")
        background.add(task)
        task.add_done_callback(lambda done: (background.discard(done), _log_failure(done, reason)))

    return post


def _log_failure(task: asyncio.Task[None], reason: str) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("event %s could not be written: %s", reason, task.exception())


def build_context(
    api: kubernetes.client.ApiClient,
    settings: context.OperatorSettings | None = None,
) -> context.Context:
    settings = settings or context.OperatorSettings()
    client = kube.KubeClient(api, settings.retry)
    return context.Context(
        client=client,
        post_event=event_poster(client),
        settings=settings,
        connection=build_connection(api),
    )


def run_operator(
    api: kubernetes.client.ApiClient,
    *,
    namespaces: Sequence[str] = (),
    peering: str | None = None,
    priority: int | None = None,
    settings: context.OperatorSettings | None = None,
    metrics_port: int | None = None,
    health_port: int | None = None,
    health_address: str = DEFAULT_HEALTH_ADDRESS,
    stop_flag: threading.Event | None = None,
    ready_flag: threading.Event | None = None,
    ctx: context.Context | None = None,
) -> context.Context:
    """Run until stopped; returns the context (its metrics and mirror) for inspection.

    With `peering`, the replica with the highest `priority` acts and the others wait; without a
    priority each replica draws its own (`peering_priority`).
    """
    # before anything starts: a bad address raises ValueError here
    endpoint = liveness_endpoint(health_address, health_port) if health_port else None
    ctx = ctx or build_context(api, settings)
    ctx.serve_only(namespaces)
    identity = None
    if peering is not None:
        priority = peering_priority(priority)
        # Our own name in the peering object, so that ctx.leads() can find this replica there.
        identity = f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"
        ctx.leadership = Leadership(peering, identity, priority)
        logger.info("peering %r as %s at priority %d: the highest priority among the peers acts",
                    peering, identity, priority)
    if metrics_port is not None:
        try:
            prom.start_http_server(metrics_port, registry=ctx.metrics.registry)
        except OSError as error:
            raise MetricsPortError(f"cannot listen on port {metrics_port} ({error.strerror})") from None
    registry = kopf.OperatorRegistry()
    handlers.register(registry, ctx.settings)
    kopf.run(
        registry=registry,
        memo=kopf.Memo(huorn=ctx),
        standalone=peering is None,
        peering_name=peering,
        priority=priority or 0,
        identity=identity,
        # served from kopf's own loop once the startup handlers are done, so a wedged loop or a
        # startup stuck on the API fails it
        liveness_endpoint=endpoint,
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )
    return ctx
