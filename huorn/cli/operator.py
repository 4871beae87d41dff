"""`huorn operator`: run the operator, from a kubeconfig or with the pod's service account.

Flags follow kubectl: `--kubeconfig`, `--context`, `-n/--namespace` (repeatable) or
`-A/--all-namespaces`. With `--peering NAME`, several replicas of the operator elect one active
instance through kopf's peering objects (install the kopf peering CRDs; see docs/operator.md);
without it the operator runs standalone and assumes it is alone.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket

import typer

from huorn.api import common
from huorn.backends.kubernetes import client as kube
from huorn.cli.output import cannot_listen, check_number
from huorn.operator import context, runner

EXIT_USAGE = 2


def operator_command(
    ctx: typer.Context,
    kubeconfig: str | None = typer.Option(
        None, "--kubeconfig", envvar="KUBECONFIG",
        help="Kubeconfig file; when unset, in-cluster credentials, else ~/.kube/config."
    ),
    kube_context: str | None = typer.Option(None, "--context", help="Kubeconfig context to use."),
    namespace: list[str] = typer.Option([], "--namespace", "-n", metavar="NAMESPACE",
                                        help="Serve only this namespace; repeat for more."),
    all_namespaces: bool = typer.Option(False, "--all-namespaces", "-A", help="Serve every namespace."),
    peering: str | None = typer.Option(None, "--peering", help="kopf peering name for high availability."),
    priority: int | None = typer.Option(
        None, "--priority",
        help="Peering priority; the highest one acts. Default: a random one per replica."),
    metrics_port: int = typer.Option(8080, "--metrics-port", help="Prometheus /metrics port; 0 disables."),
    health_port: int = typer.Option(
        0, "--health-port",
        help="Serve kopf's liveness endpoint, GET /healthz, on this port once the operator has "
             "started (the Helm chart probes it); 0 disables."),
    health_address: str = typer.Option(
        runner.DEFAULT_HEALTH_ADDRESS, "--health-address",
        help="IP address the health endpoint listens on: 0.0.0.0 (every IPv4 address) or :: (every "
             "IPv6 address) for a cluster whose pods' primary address is IPv6 (IPv6-only, or "
             "dual-stack with IPv6 first)."),
    resync_seconds: float = typer.Option(30.0, "--resync-seconds", help="Re-reconcile every job this often."),
    pod_start_seconds: float = typer.Option(
        600.0, "--pod-start-seconds",
        help="A trainer pod still Pending this long is replaced (the job's replacement budget), an eval "
             "pod is reported failed."),
    replacement_backoff_seconds: float = typer.Option(
        10.0, "--replacement-backoff-seconds",
        help="A job's first failed pod is replaced at once; each further one within 10 min waits this "
             "long after the previous replacement, doubling up to 6 min (Kubernetes Job's back-off). "
             "0 replaces at once."),
    autoscale_seconds: float = typer.Option(
        15.0, "--autoscale-seconds",
        help="How often each InferenceJob's ready replicas are scraped and its autoscaler consulted."),
    job_image: str = typer.Option(
        common.DEFAULT_JOB_IMAGE, "--job-image",
        help="Image of the pods of a job whose spec names none (a CUDA build: GPU jobs need one); pinned "
             "in the job's status.image, so an operator upgrade moves new jobs only. The Helm chart "
             "passes its own image with jobImageSuffix."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
    no_mirror: bool = typer.Option(
        False, "--no-mirror", hidden=True, help="Benchmark baseline: list pods on every reconcile."
    ),
) -> None:
    """Run the Huorn operator until interrupted."""
    if namespace and all_namespaces:
        typer.echo("error: --namespace and --all-namespaces exclude each other; pick one", err=True)
        raise typer.Exit(EXIT_USAGE)
    if peering is not None and namespace:
        typer.echo("error: --peering needs every namespace (-A): served namespace by namespace, kopf "
                   "peers through a KopfPeering object in each, and each could elect another leader",
                   err=True)
        raise typer.Exit(EXIT_USAGE)
    if priority is not None and peering is None:
        typer.echo("error: --priority needs --peering NAME (a standalone operator has no peers)", err=True)
        raise typer.Exit(EXIT_USAGE)
    for flag, port in (("--metrics-port", metrics_port), ("--health-port", health_port)):
        if not 0 <= port <= 65535:
            typer.echo(f"error: {flag} must be in 0..65535, got {port}", err=True)
            raise typer.Exit(EXIT_USAGE)
    try:
        health_ip = ipaddress.ip_address(health_address)
    except ValueError:
        typer.echo(f"error: --health-address must be an IP address such as 0.0.0.0 (IPv4) or :: (IPv6), "
                   f"got {health_address!r}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    if metrics_port and metrics_port == health_port:
        typer.echo(f"error: --health-port {health_port} is --metrics-port too; give each its own port",
                   err=True)
        raise typer.Exit(EXIT_USAGE)
    for flag, seconds in (("--resync-seconds", resync_seconds), ("--autoscale-seconds", autoscale_seconds),
                          ("--pod-start-seconds", pod_start_seconds)):
        check_number(flag, seconds, 0, above=True)
    check_number("--replacement-backoff-seconds", replacement_backoff_seconds, 0, 360)
    if not job_image or any(c.isspace() for c in job_image):
        typer.echo(f"error: --job-image must be an image reference such as registry/huorn:0.1.0, got "
                   f"{job_image!r}", err=True)
        raise typer.Exit(EXIT_USAGE)
    # Checked here, before the credentials and the logging: the endpoints bind again at start
    # (and a metrics port taken in between is still named).
    endpoints = (("--metrics-port", metrics_port, None), ("--health-port", health_port, health_ip))
    for flag, port, address in endpoints:
        why = _cannot_listen_on(address, port) if port else None
        if why is not None:
            where = f" on --health-address {address}" if address is not None else ""
            fix = " (or another --health-address)" if address is not None else ""
            typer.echo(f"error: {flag} {port}: cannot listen there{where} ({why}); choose another port{fix}, "
                       "or 0 to turn the endpoint off", err=True)
            raise typer.Exit(EXIT_USAGE)
    # Tests that kill and restart the operator shorten the backoffs the same way in every run.
    fast = os.environ.get("HUORN_OPERATOR_FAST") == "1"
    settings = context.OperatorSettings(
        resync_seconds=resync_seconds, error_backoff_seconds=0.5 if fast else 5.0,
        vc_status_seconds=1.0 if fast else 10.0, mirror=not no_mirror,
        mirror_resync_seconds=2.0 if fast else 60.0,
        trainer_start_seconds=pod_start_seconds, eval_start_seconds=pod_start_seconds,
        replacement_backoff_seconds=0.5 if fast else replacement_backoff_seconds,
        replacement_backoff_max_seconds=2.0 if fast else 360.0,
        autoscale_seconds=autoscale_seconds, job_image=job_image,
    )
    # NB: the kubernetes client says "No configuration found" for a path that does not exist, and
    # "pass --kubeconfig" is no fix to someone who did; name the file, as kubectl does.
    # Named as the user gave it: a path read from $KUBECONFIG is not fixed by a flag never passed.
    # NB: by name: typer carries its own copy of click, whose ParameterSource is not click's
    from_env = getattr(ctx.get_parameter_source("kubeconfig"), "name", "") == "ENVIRONMENT"
    source = "$KUBECONFIG" if from_env else "--kubeconfig"
    if kubeconfig and os.pathsep not in kubeconfig and not os.path.isfile(kubeconfig):
        what = "is a directory" if os.path.isdir(kubeconfig) else "no such file"
        typer.echo(f"error: {source} {kubeconfig}: {what}; give the path of a kubeconfig file", err=True)
        raise typer.Exit(EXIT_USAGE)
    try:
        api = kube.build_api_client(kubeconfig, kube_context)
    except Exception as exc:
        if kubeconfig:
            typer.echo(f"error: {source} {kubeconfig}: cannot load credentials ({exc}); give a valid "
                       "kubeconfig file", err=True)
        else:
            typer.echo(f"error: cannot load credentials ({exc}); pass --kubeconfig or run in a cluster",
                       err=True)
        raise typer.Exit(EXIT_USAGE) from None
    # Only once every argument is known good: the handler goes on the root logger for the
    # process (force: in place of any), which a refused command must leave as it found it.
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        force=True,
    )
    try:
        runner.run_operator(
            api, namespaces=namespace, peering=peering, priority=priority, settings=settings,
            metrics_port=metrics_port or None, health_port=health_port or None,
            health_address=health_address,
        )
    except runner.MetricsPortError as error:
        typer.echo(f"error: --metrics-port {metrics_port}: {error}; choose another port, or 0 to "
                   "turn the endpoint off", err=True)
        raise typer.Exit(EXIT_USAGE) from None


def _cannot_listen_on(address: ipaddress.IPv4Address | ipaddress.IPv6Address | None, port: int) -> str | None:
    """Why `port` cannot be bound on `address` (None: every IPv4 address) now, or None."""
    if address is None or address.version == 4:
        return cannot_listen(port, str(address or ""))
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((str(address), port))
    except OSError as error:
        return error.strerror or str(error)
    return None


if __name__ == "__main__":
    # `python -m huorn.cli.operator` starts without importing every other subcommand (and torch),
    # which is what a container entrypoint and the kill-and-restart tests want. Plain help, as
    # `huorn operator --help` (typer.run's rich boxes cut long flags at 80 columns).
    entrypoint = typer.Typer(add_completion=False, rich_markup_mode=None)
    entrypoint.command()(operator_command)
    entrypoint()
