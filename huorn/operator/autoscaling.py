"""Each InferenceJob's autoscaler in the cluster: scrape its ready replicas, read the load, and
record a resize of the server vertex when the rule (huorn.scheduler.autoscale) asks for another
count.

The replicas' own `/metrics` are the source (huorn.backends.replica_metrics reads the seconds
spent decoding, the requests, tokens and latency histogram): no Prometheus or metrics adapter
is needed for the job to scale, unlike an HPA on custom metrics. Two scrapes a period apart give
the rates. The resize is a graph mutation written into status before any pod changes (the same
write-ahead path as a TrainingJob's monitor), so a killed operator either never decided or finds
the decision in status; the reconcile that follows places or deletes the pods, and a larger
`status.desiredReplicas` is at once the cluster's demand for its lent GPUs.

With `autoscaling.forecast` each tick also reads the job's prediction board (huorn.operator.board,
the same model and Prometheus reader as an inference cluster's), whose forecast peak is a floor of
the replicas: they load before the rise, and the cluster reclaims their GPUs ahead of it too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from huorn.api import kinds
from huorn.backends import replica_metrics
from huorn.backends.kubernetes import manifests
from huorn.graph import mutate, serialise
from huorn.operator import board, daemons, serving, validation
from huorn.operator.context import Context
from huorn.operator.training import build_decisions
from huorn.scheduler import autoscale

logger = logging.getLogger("huorn.operator.autoscaling")

FORECAST_FIELD = "spec.autoscaling.forecast"


@dataclass
class ScalerState:
    """One job's autoscaler and the last scrape of each replica; rebuilt on a new uid or spec."""

    key: tuple[str, int]  # (uid, generation)
    scaler: autoscale.Autoscaler
    last: dict[str, autoscale.ReplicaSample] = field(default_factory=dict)
    board_state: board.BoardState | None = None  # with autoscaling.forecast


def build_rule(job: kinds.InferenceJob) -> autoscale.ScalingRule:
    spec = job.spec
    p99, first = spec.slo.p99_latency_ms, spec.slo.p99_time_to_first_token_ms
    return autoscale.ScalingRule(
        min_replicas=spec.autoscaling.min_replicas,
        max_replicas=spec.autoscaling.max_replicas,
        slots_per_replica=spec.serving.max_batch,
        target_utilization=spec.autoscaling.target_utilization,
        p99_seconds=p99 / 1000 if p99 is not None else None,
        ttft_p99_seconds=first / 1000 if first is not None else None,
        tokens_per_second=spec.slo.tokens_per_second,
        scale_down_delay_seconds=spec.autoscaling.scale_down_delay_seconds,
    )


def _state_for(ctx: Context, body: Mapping[str, Any], job: kinds.InferenceJob) -> ScalerState:
    meta = body["metadata"]
    key = (str(meta.get("uid", "")), int(meta.get("generation") or 0))
    state = ctx.autoscalers.get((meta["namespace"], meta["name"]))
    if state is None or state.key != key:
        # A new spec keeps the last scrape (the replicas are the same processes) and restarts
        # the window under the new rule.
        same = state is not None and state.key[0] == key[0]
        last = state.last if same else {}
        # the board too: its model is refitted only when its own settings change
        kept = state.board_state if same else None
        source = job.spec.autoscaling.forecast
        if kept is None and source is not None:
            kept = board.from_status(source.model_dump(by_alias=True), body.get("status"), "replicas")
        state = ScalerState(key, autoscale.Autoscaler(build_rule(job)), last, kept)
        ctx.autoscalers[(meta["namespace"], meta["name"])] = state
    return state


def _load_status(reading: autoscale.LoadReading | None, slots: int) -> dict[str, Any]:
    if reading is None:
        return {}
    out: dict[str, Any] = {
        "requestsPerSecond": round(reading.requests_per_second, 3),
        "tokensPerSecond": round(reading.tokens_per_second, 1),
        "utilization": round(reading.utilization(slots), 3),
    }
    if reading.p99_seconds is not None:
        out["p99LatencyMs"] = round(reading.p99_seconds * 1000, 1)
    if reading.ttft_p99_seconds is not None:
        out["p99TimeToFirstTokenMs"] = round(reading.ttft_p99_seconds * 1000, 1)
    if reading.cached_prompt_share is not None:
        out["cachedPromptShare"] = round(reading.cached_prompt_share, 3)
    return out


async def forecast_floor(ctx: Context, body: Mapping[str, Any], state: ScalerState,
                         job: kinds.InferenceJob, now: float) -> autoscale.ForecastFloor | None:
    """The replicas the job's forecast peak needs, or None without `autoscaling.forecast` (or
    before Prometheus was ever read)."""
    source = job.spec.autoscaling.forecast
    if source is None:
        state.board_state = None
        return None
    state.board_state = board.state_for(state.board_state, source.model_dump(by_alias=True))
    reading = await board.read(ctx, body, state.board_state, source, "", FORECAST_FIELD,
                               source.requests_per_replica, 0.0, "replica", now)
    if reading is None:
        return None
    return autoscale.ForecastFloor(reading.gpus, reading.peak, source.requests_per_replica)


async def tick(ctx: Context, namespace: str, name: str) -> autoscale.Recommendation | None:
    """One autoscaler pass over one job; returns its recommendation (None when nothing runs)."""
    body = await ctx.client.get_custom(serving.PLURAL, namespace, name)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return None
    status = body.get("status") or {}
    if not status.get("graph") or status.get("phase") == "Stalled":
        return None
    try:
        job = validation.load_job(body)
    except validation.InvalidSpec:
        return None
    assert isinstance(job, kinds.InferenceJob)
    ref = manifests.JobRef.from_body(body)
    observed = serialise.from_status(status["graph"])
    server = observed.vertex(serving.SERVER)
    targets = {}
    for instance in server.instances:
        pod = ctx.index.pods.get((namespace, manifests.pod_name(ref, instance)))
        if pod is not None and serving.is_ready(pod) and pod.ip:
            targets[instance.name] = f"http://{pod.ip}:{ctx.settings.serve_port}/metrics"
    # The replicas a rolling update keeps serving beside their successors take their share of the
    # traffic: unscraped, that share was missing from the load, and a rollout longer than
    # scaleDownDelaySeconds scaled the job down under the same traffic.
    for kept in serving.surging(observed, ref, ctx.index.pods_of(namespace, name),
                                ctx.index.creating(namespace, name)):
        pod = ctx.index.pods.get((namespace, kept))
        if pod is not None and serving.is_ready(pod) and pod.ip:
            targets[pod.instance] = f"http://{pod.ip}:{ctx.settings.serve_port}/metrics"
    fronts = []  # the activators' /metrics: the requests they hold, summed over the front pods
    for i in range(job.spec.routing.front_replicas if job.spec.autoscaling.min_replicas == 0 else 0):
        front = ctx.index.pods.get((namespace, manifests.activator_pod_name(ref, i)))
        if front is not None and serving.is_ready(front) and front.ip:
            fronts.append(f"{manifests.ACTIVATOR_VERTEX}-{i}")
            targets[fronts[-1]] = f"http://{front.ip}:{ctx.settings.serve_port}/metrics"
    texts = await asyncio.to_thread(replica_metrics.fetch_all, targets, ctx.settings.serve_timeout_seconds)
    now = time.time()  # the forecast's clock: the request-rate history is dated
    # Rates and the scale-down window run on the monotonic clock: a wall-clock step (NTP) larger
    # than scaleDownDelaySeconds had emptied the window and scaled a loaded service down at once.
    ticked = time.monotonic()
    held = 0.0
    for key in fronts:
        text = texts.pop(key, None)
        held += (replica_metrics.parse_held(text) or 0.0) if text is not None else 0.0
    parsed = {replica: replica_metrics.parse_metrics(text, ticked) for replica, text in texts.items()}
    samples = {replica: sample for replica, sample in parsed.items() if sample is not None}
    state = _state_for(ctx, body, job)
    reading = autoscale.read_load(state.last, samples)
    state.last = samples
    floor = await forecast_floor(ctx, body, state, job, now)
    rec = state.scaler.recommend(ticked, server.replicas, reading, floor, held)
    load = _load_status(reading, job.spec.serving.max_batch)
    seen = state.board_state
    if seen is not None and seen.reading is not None:
        load["forecast"] = board.clearing(board.reading_status(seen.reading, seen.error, "replicas"),
                                          status.get("forecast"))
    elif job.spec.autoscaling.forecast is None and status.get("forecast") is not None:
        load["forecast"] = None  # the field was removed from the spec
    target = min(server.max_replicas, max(server.min_replicas, rec.replicas))
    why = rec.reason
    if target == 0 and not fronts and server.replicas > 0:
        # no front pod is ready to hold a request and wake the job: at zero replicas nothing would
        # answer, and nothing would scale it up again (the held requests are read from ready
        # front pods); the last replica stays until one is ready. A job at zero already stays
        # there: a front pod restarting or rolled is no reason to start a GPU replica
        target, why = 1, "no activator or router is ready to hold requests: one replica stays"
    if target == server.replicas:
        if load and any(status.get(k) != v for k, v in load.items()):
            await ctx.client.patch_status(serving.PLURAL, namespace, name, load)
        return rec
    async with ctx.job_lock(namespace, name):
        fresh = await ctx.client.get_custom(serving.PLURAL, namespace, name)
        if fresh is None or not (fresh.get("status") or {}).get("graph"):
            return rec
        graph = serialise.from_status(fresh["status"]["graph"])
        before = graph.vertex(serving.SERVER).replicas
        if before != server.replicas:
            return rec  # the job changed meanwhile (a spec edit, a replacement): next tick decides
        ready = {i.name: serving.is_ready(p) for i in graph.vertex(serving.SERVER).instances
                 if (p := ctx.index.pods.get((namespace, manifests.pod_name(ref, i)))) is not None}
        mutate.resize(graph, serving.SERVER, target, reason=f"autoscaler: {why}",
                      remove=serving.shrink_order(graph, target, ready))
        patch = {**load, "graph": serialise.to_status(graph), "decisions": build_decisions(graph),
                 "desiredReplicas": target}
        await ctx.client.patch_status(serving.PLURAL, namespace, name, patch)
        ctx.index.observe_inference_job({**fresh, "status": {**fresh["status"], **patch}})
    event = "ScaledUp" if target > before else "ScaledDown"
    ctx.post_event(body, "Normal", event, f"autoscaler: {why}")
    ctx.metrics.decisions.labels(serving.KIND, "resize").inc()
    ctx.wake_serving(namespace, name)
    return rec


async def run_daemon(ctx: Context, namespace: str, name: str, stopped: Any) -> None:
    """The body of the per-InferenceJob kopf daemon (huorn.operator.daemons.every)."""
    await daemons.every(ctx.settings.autoscale_seconds, stopped, lambda: tick(ctx, namespace, name),
                        f"autoscaler tick of {namespace}/{name}", logger)
