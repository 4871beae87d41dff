"""Start the operator: kubeconfig or in-cluster login, namespaces, peering, metrics endpoint.

`run_operator` blocks until `stop_flag` is set (or a signal arrives), so the CLI calls it
directly and tests call it in a thread of their own, where kopf runs its own event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import kopf
import kubernetes
import prometheus_client as prom

from huorn.backends.kubernetes import client as kube
from huorn.operator import context, handlers


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


def post_event(body: Any, kind: str, reason: str, message: str) -> None:
    kopf.event(body, type=kind, reason=reason, message=message[:1024])


def build_context(
    api: kubernetes.client.ApiClient,
    settings: context.OperatorSettings | None = None,
) -> context.Context:
    settings = settings or context.OperatorSettings()
    return context.Context(
        client=kube.KubeClient(api, settings.retry),
        post_event=post_event,
        settings=settings,
        connection=build_connection(api),
    )


def run_operator(
    api: kubernetes.client.ApiClient,
    *,
    namespaces: Sequence[str] = (),
    peering: str | None = None,
    priority: int = 0,
    settings: context.OperatorSettings | None = None,
    metrics_port: int | None = None,
    stop_flag: threading.Event | None = None,
    ready_flag: threading.Event | None = None,
    ctx: context.Context | None = None,
) -> context.Context:
    """Run until stopped; returns the context (its metrics and mirror) for inspection."""
    ctx = ctx or build_context(api, settings)
    if metrics_port is not None:
        prom.start_http_server(metrics_port, registry=ctx.metrics.registry)
    registry = kopf.OperatorRegistry()
    handlers.register(registry, ctx.settings)
    kopf.run(
        registry=registry,
        memo=kopf.Memo(huorn=ctx),
        standalone=peering is None,
        peering_name=peering,
        priority=priority,
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )
    return ctx
