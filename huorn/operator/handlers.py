"""kopf handlers: watches feed the mirror, and every path into a job goes through one reconcile.

kopf calls create, update, resume and a timer for each job, and a pod event calls the same
reconcile for the pod's job, under one lock per job, so a job is never reconciled twice at once.
The reconcile always reads the job fresh from the API: a body that a watch delivered a moment
ago may predate the graph mutation this operator just wrote into status.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import kopf

from huorn.api import base, kinds
from huorn.backends.kubernetes import manifests
from huorn.operator import (
    autoscaling,
    board,
    context,
    index,
    loans,
    monitoring,
    namesakes,
    preempting,
    queue,
    rljobs,
    serving,
    training,
    validation,
    virtualclusters,
)
from huorn.operator.context import Context

GROUP, VERSION = base.GROUP, base.VERSION
logger = logging.getLogger("huorn.operator")
# Objects a LIST response carries (its `limit`): the start-up list and the foreign resync list
# every pod of the cluster, which in one response could take much of the operator's memory.
LIST_PAGE = 500


def _ctx(memo: Any) -> Context:
    return memo.huorn


async def _reconcile_job(ctx: Context, plural: str, namespace: str, name: str) -> str | None:
    waited = time.perf_counter()
    async with ctx.job_lock(namespace, name):
        # Only a plan this reconcile makes is applied: one that a monitor tick's reconcile left,
        # while this one waited for the lock, may be stale by now (dropped under the lock, so no
        # tick can leave one between the drop and the reconcile).
        ctx.preemptions.pop((namespace, name), None)
        logger.debug("reconcile %s/%s after %.3fs in line", namespace, name, time.perf_counter() - waited)
        body = await ctx.client.get_custom(plural, namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return None
        kind = body["kind"]
        started = time.perf_counter()
        try:
            if not ctx.settings.mirror:
                await _relist_pods(ctx)
            if kind == "TrainingJob":
                phase = await training.reconcile(ctx, body)
            elif kind == "InferenceJob":
                phase = await serving.reconcile(ctx, body)
            else:
                phase = await rljobs.reconcile(ctx, body)
        except Exception:
            ctx.metrics.reconciles.labels(kind, "error").inc()
            raise
        finally:
            ctx.metrics.reconcile_seconds.labels(kind).observe(time.perf_counter() - started)
            ctx.metrics.api_retries.set(ctx.client.retries)
        ctx.metrics.reconciles.labels(kind, "stalled" if phase == "Stalled" else "ok").inc()
        took = time.perf_counter() - started
        logger.debug("reconciled %s %s/%s in %.3fs: %s", kind, namespace, name, took, phase)
    # Outside this job's lock: each victim's own lock is taken in turn.
    await preempting.apply_planned(ctx, namespace, name)
    return phase


async def _resync_mirror(ctx: Context) -> None:
    """List every Huorn pod again every `mirror_resync_seconds` and drop the records the watch
    missed the end of (index.ClusterIndex.resync_pods); their jobs are reconciled, and the line
    woken, since GPUs the mirror thought taken may be free."""
    while True:
        await asyncio.sleep(ctx.settings.mirror_resync_seconds)
        try:
            if not await ctx.leads():
                continue  # a standby's watches are paused: its mirror is stale, and it must not act
            mark = ctx.index.observations
            selector = {"app.kubernetes.io/managed-by": manifests.MANAGED_BY}
            listed = await ctx.client.list("Pod", None, selector)
            dropped = ctx.index.resync_pods(listed, mark)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("mirror resync failed; next try in %.0fs", ctx.settings.mirror_resync_seconds)
            continue
        if not dropped:
            continue
        logger.info("mirror resync dropped %d pods the watch missed: %s", len(dropped),
                    ", ".join(f"{p.namespace}/{p.name}" for p in dropped[:8]))
        wake_jobs_of(ctx, dropped)
        ctx.wake_line()


async def resync_foreign(ctx: Context) -> list[tuple[str, str]]:
    """List every pod again and bring the GPUs other controllers' pods hold in line with it
    (index.ClusterIndex.resync_foreign): a watch that reconnects does not report the pods
    deleted while it was away. Returns the pods whose GPUs it dropped; the line is woken then."""
    mark = ctx.index.observations
    pods = await ctx.client.list("Pod", None, {}, page_size=LIST_PAGE, keep=index.slim_pod)
    served = (p for p in pods if ctx.serves((p.get("metadata") or {}).get("namespace", "")))
    dropped = ctx.index.resync_foreign(served, mark)
    if dropped:
        logger.info("foreign resync dropped %d pods' GPUs the watch missed the end of: %s", len(dropped),
                    ", ".join(f"{ns}/{name}" for ns, name in dropped[:8]))
        ctx.wake_line()
    return dropped


async def _resync_foreign_loop(ctx: Context) -> None:
    """resync_foreign every `foreign_resync_seconds`, by the leader only (a standby's mirror is stale)."""
    while True:
        await asyncio.sleep(ctx.settings.foreign_resync_seconds)
        try:
            if await ctx.leads():
                await resync_foreign(ctx)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("foreign resync failed; next try in %.0fs", ctx.settings.foreign_resync_seconds)


def wake_jobs_of(ctx: Context, pods: Iterable[index.PodRecord]) -> None:
    """A reconcile of each pod's job, by the job's kind: ctx.wake reconciles TrainingJobs, and an
    InferenceJob or RLJob woken through it was looked up as a TrainingJob, found absent, and left
    as it was (a front pod's retiring Service stayed until something else touched the job)."""
    wakers = {"InferenceJob": ctx.wake_serving, "RLJob": ctx.wake_rl}
    for kind, job in sorted({(p.kind, p.job_key) for p in pods if p.job}):
        wakers.get(kind, ctx.wake)(*job)


def _waker(ctx: Context, plural: str = training.PLURAL) -> Callable[[str, str], None]:
    """ctx.wake (ctx.wake_serving for InferenceJobs): a reconcile of the job in a task of its own
    (kept referenced until it ends). A job already woken and not yet started is not woken again,
    so a gang of 64 pods going away costs each waiting job one reconcile, not 64."""
    tasks: set[asyncio.Task[Any]] = set()
    due: set[tuple[str, str]] = set()

    async def run(namespace: str, name: str) -> None:
        due.discard((namespace, name))
        # A job of a namespace another install serves is not this operator's to touch; a standby
        # (or a leader demoted since the wake was asked) leaves it to the leader.
        if ctx.serves(namespace) and await ctx.leads():
            await _reconcile_job(ctx, plural, namespace, name)

    def wake(namespace: str, name: str) -> None:
        if (namespace, name) in due:
            return
        due.add((namespace, name))
        task = asyncio.get_running_loop().create_task(run(namespace, name), name=f"wake {namespace}/{name}")
        tasks.add(task)
        task.add_done_callback(_finished(tasks))

    return wake


def _later(wake: Callable[[], Callable[[str, str], None]]) -> Callable[[str, str, float], None]:
    """ctx.wake_later (ctx.wake_rl_later): one timer per job, the earliest asked for; asking again
    for a later time changes nothing, so a reconcile can ask on every pass. `wake` is read when
    the timer fires, so the context's waker may be replaced meanwhile."""
    timers: dict[tuple[str, str], tuple[float, asyncio.TimerHandle]] = {}

    def fire(key: tuple[str, str]) -> None:
        timers.pop(key, None)
        wake()(*key)

    def wake_later(namespace: str, name: str, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        key, when = (namespace, name), loop.time() + max(0.0, seconds)
        scheduled = timers.get(key)
        if scheduled is not None:
            if scheduled[0] <= when:
                return
            scheduled[1].cancel()
        timers[key] = (when, loop.call_at(when, fire, key))

    return wake_later


def _finished(tasks: set[asyncio.Task[Any]]) -> Callable[[asyncio.Task[Any]], None]:
    def done(task: asyncio.Task[Any]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("woken reconcile %s failed: %r; its timer retries", task.get_name(),
                           task.exception())
    return done


async def _relist_pods(ctx: Context) -> None:
    pods = await ctx.client.list("Pod", None, {"app.kubernetes.io/managed-by": manifests.MANAGED_BY})
    ctx.index.pods.clear()
    for pod in pods:
        ctx.index.observe_pod(pod)


def register(registry: kopf.OperatorRegistry, tunables: context.OperatorSettings) -> None:
    """Register every handler on `registry` (a fresh one per operator keeps tests independent)."""
    settings_resync, settings_vc = tunables.resync_seconds, tunables.vc_status_seconds
    backoff = tunables.error_backoff_seconds

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
        settings.posting.enabled = True
        settings.posting.level = logging.INFO
        settings.persistence.finalizer = "huorn.io/cleanup"
        settings.watching.connect_timeout = 30
        settings.networking.request_timeout = 60
        ctx = _ctx(memo)
        # API calls run in threads (the client is synchronous); the default pool of cpu+4 threads
        # would cap a burst of reconciles at a handful of requests in flight.
        asyncio.get_running_loop().set_default_executor(
            concurrent.futures.ThreadPoolExecutor(ctx.settings.api_threads, thread_name_prefix="api")
        )
        # Fill the mirror before any job handler runs, so that the first placements after a
        # restart see every GPU already taken (the watches replay them too, but later).
        for node in await ctx.client.list("Node", None, {}):
            ctx.index.observe_node(node)  # judged again once the clusters below are known
        # Every pod, once: Huorn's, and the GPUs other controllers' pods hold (pod_changed and
        # foreign_pod_changed keep both current); one listing, as kopf's own pod watch makes.
        for pod in await ctx.client.list("Pod", None, {}, page_size=LIST_PAGE, keep=index.slim_pod):
            ns = (pod.get("metadata") or {}).get("namespace", "")
            if ctx.index.observe_pod(pod) is None and ctx.serves(ns):
                ctx.index.observe_foreign_pod(pod)
        for vc in await ctx.client.list_custom("virtualclusters", None):
            ctx.index.observe_vc(vc, judge=False)
            board.resume(ctx, vc)  # its last forecast, reserved until the board reads again
        ctx.index.judge_nodes()  # once all clusters are known: each node by its owner's tolerations
        await ctx.leads()  # huorn_leader from the start, not from the first mirror resync
        # What inference clusters keep unlent, before any placement: the watch replays the
        # InferenceJobs too, but only once job handlers may already be placing borrowers.
        for body in await ctx.client.list_custom(serving.PLURAL, None):
            # only those it serves: the watch keeps no other namespace's current, and a cluster
            # lends here only where every namespace that may use it is served (serves_all_of)
            if ctx.serves(body["metadata"]["namespace"]):
                ctx.index.observe_inference_job(body, deleted=namesakes.refused(body))
        # The line too: the first job reconciled must not take GPUs a waiting one was promised.
        for body in await ctx.client.list_custom(training.PLURAL, None):
            if (body.get("status") or {}).get("phase") in ("Succeeded", "Failed", "Suspended"):
                continue
            if not ctx.serves(body["metadata"]["namespace"]):
                continue
            try:
                job = validation.load_job(body)
            except validation.InvalidSpec:
                continue
            meta = body["metadata"]
            entry = queue.from_job(job, body, ctx.index.pods_of(meta["namespace"], meta["name"]))
            ctx.queue.record(training.with_rank_view(ctx, entry, job, body.get("status") or {}))
        for body in await ctx.client.list_custom(rljobs.PLURAL, None):
            if (body.get("status") or {}).get("phase") in ("Succeeded", "Failed", "Suspended"):
                continue
            if not ctx.serves(body["metadata"]["namespace"]):
                continue
            try:
                rl_job = validation.load_job(body)
                assert isinstance(rl_job, kinds.RLJob)
                meta = body["metadata"]
                ctx.queue.record(rljobs.entry_from_status(
                    rl_job, body, ctx.index.pods_of(meta["namespace"], meta["name"])))
            except (validation.InvalidSpec, ValueError):
                continue
        # And what each training lender keeps unlent for its line (loans.reserve_for_line), as
        # an inference cluster keeps its demand: kept in memory only, it was lost at a restart,
        # and a preempted borrower's successors took the GPUs back before the lender's first
        # tick, to be preempted again.
        for name, spec in ctx.index.vcs.items():
            if spec.get("purpose", "training") != "inference" and ctx.index.serves_all_of(name):
                need, _, _ = loans.line_wanted(ctx, name, loans.find_borrowers(ctx, name))
                loans.reserve_for_line(ctx, name, need)
        ctx.wake = _waker(ctx)
        ctx.wake_serving = _waker(ctx, serving.PLURAL)
        ctx.wake_rl = _waker(ctx, rljobs.PLURAL)
        ctx.wake_later = _later(lambda: ctx.wake)
        ctx.wake_rl_later = _later(lambda: ctx.wake_rl)
        if ctx.settings.mirror:
            memo.huorn_mirror_resync = asyncio.get_running_loop().create_task(
                _resync_mirror(ctx), name="mirror resync")
        memo.huorn_foreign_resync = asyncio.get_running_loop().create_task(
            _resync_foreign_loop(ctx), name="foreign resync")

    @kopf.on.cleanup(registry=registry)
    async def stop_background(memo: Any, **_: Any) -> None:
        for name in ("huorn_mirror_resync", "huorn_foreign_resync"):
            task = getattr(memo, name, None)
            if task is not None:
                task.cancel()

    @kopf.on.login(registry=registry)
    def login(memo: Any, **_: Any) -> kopf.ConnectionInfo:
        return _ctx(memo).connection

    @kopf.on.event("", "v1", "nodes", registry=registry)
    async def node_changed(type: str, body: Mapping[str, Any], memo: Any, **_: Any) -> None:
        ctx = _ctx(memo)
        name = body["metadata"]["name"]
        if type == "DELETED":
            ctx.index.nodes.pop(name, None)
            return
        before = ctx.index.nodes.get(name)
        record = ctx.index.observe_node(body)
        if not record.unschedulable and (before is None or before.unschedulable or record.gpus > before.gpus
                                         or record.labels != before.labels):
            # a node back to Ready, uncordoned or untainted (or new, or with more GPUs, or new
            # labels: what a waiting job's nodeSelector, or a VirtualCluster's, asks for, as its
            # waiting message says to add): jobs in line try it now; they had waited for their
            # resync timer
            ctx.wake_line()

    @kopf.on.event("", "v1", "pods", labels={manifests.LABEL_JOB: kopf.PRESENT}, registry=registry)
    async def pod_changed(type: str, body: Mapping[str, Any], memo: Any, **_: Any) -> None:
        ctx = _ctx(memo)
        before = ctx.index.pods.get((body["metadata"].get("namespace", ""), body["metadata"]["name"]))
        record = ctx.index.observe_pod(body, deleted=type == "DELETED")
        # a readiness change is news too: a replica Running since its start turns Ready once its
        # model loads (a rollout's next step, the job's readyReplicas), and unready when it fails
        # its probe; only a change of phase had woken the job, and these waited for the resync
        if record is None:
            return
        # readiness counts only while Running: a kubelet reports Ready=False on a Pending pod
        # pulling its image, which changes nothing a reconcile reads
        if before is not None and type != "DELETED" and before.phase == record.phase and \
                (record.phase != "Running" or before.ready_condition == record.ready_condition):
            return
        if before is None and type != "DELETED" and record.phase == "Pending":
            return  # a pod this operator just created: the reconcile that created it reports it
        kind = (body["metadata"].get("labels") or {}).get(manifests.LABEL_KIND, "TrainingJob")
        if kind in kinds.KINDS:
            await _reconcile_job(ctx, kinds.KINDS[kind].plural, record.namespace, record.job)
        if record.gpus and (type == "DELETED" or not record.holds_resources):
            ctx.wake_line()

    # Pods of other controllers (Kueue, notebooks) hold GPUs of nodes Huorn places on. kopf opens
    # one watch per resource whatever its handlers' label filters (no server-side selector is
    # set), so pod_changed's watch already streams every pod: this handler adds no API load,
    # only a dict update per event. A namespaced install sees only its namespaces' pods.
    @kopf.on.event("", "v1", "pods", labels={manifests.LABEL_JOB: kopf.ABSENT}, registry=registry)
    async def foreign_pod_changed(type: str, body: Mapping[str, Any], memo: Any, **_: Any) -> None:
        ctx = _ctx(memo)
        if ctx.index.observe_foreign_pod(body, deleted=type == "DELETED"):
            ctx.wake_line()

    # InferenceJobs' replicas keep their cluster's GPUs from being lent (index.build_snapshot);
    # a watch replays every object on start, so a restarted operator has it back before placing
    @kopf.on.event(GROUP, VERSION, "inferencejobs", registry=registry)
    async def inference_changed(type: str, body: Mapping[str, Any], memo: Any, **_: Any) -> None:
        # one refused for its name runs nothing, and reserves nothing (namesakes)
        _ctx(memo).index.observe_inference_job(body, deleted=type == "DELETED" or namesakes.refused(body))

    @kopf.on.event(GROUP, VERSION, "virtualclusters", registry=registry)
    async def vc_changed(type: str, body: Mapping[str, Any], memo: Any, **_: Any) -> None:
        ctx = _ctx(memo)
        if type == "DELETED":
            opened = virtualclusters.forget(ctx, body["metadata"]["name"])
            board.forget(ctx, body["metadata"]["name"])
        else:
            opened = ctx.index.observe_vc(body)
        if opened:
            # nodes that take new pods since this change (members.tolerations now cover their
            # taints, or a node changed owner): jobs in line try them now, not at their resync
            ctx.wake_line()

    @kopf.on.resume(GROUP, VERSION, "virtualclusters", registry=registry)
    @kopf.on.create(GROUP, VERSION, "virtualclusters", registry=registry)
    @kopf.on.update(GROUP, VERSION, "virtualclusters", registry=registry)
    @kopf.timer(GROUP, VERSION, "virtualclusters", interval=settings_vc, registry=registry, backoff=backoff)
    async def vc_reconcile(body: Mapping[str, Any], memo: Any, **_: Any) -> None:
        ctx = _ctx(memo)
        fresh = await ctx.client.get_custom("virtualclusters", None, body["metadata"]["name"])
        if fresh is not None:
            # The board first, so that reclaim and placement's reserve use this tick's forecast;
            # reclaim next, so the status written last already counts the loans given back.
            try:
                await board.update(ctx, fresh)
            except Exception:
                # NB: reclaim must not depend on the board: an error it did not foresee (a bad
                # URL once) failed the whole tick, and nothing was reclaimed for the cluster's
                # own InferenceJobs either; the last forecast stays in force in the index
                logger.exception("virtual cluster %s: the prediction board failed; reclaiming on the "
                                 "last forecast", fresh["metadata"]["name"])
            await loans.reclaim(ctx, fresh)
            await virtualclusters.reconcile(ctx, fresh)

    # One monitor per TrainingJob: the shared loop (huorn.backends.monitor) fed by pod telemetry.
    # cancellation_timeout: a tick blocked on a pod's HTTP timeout must not hold up a deletion or
    # a shutdown for long; the tick's work is all in the API objects, so cancelling loses nothing.
    @kopf.daemon(GROUP, VERSION, "trainingjobs", registry=registry, cancellation_timeout=5.0,
                 initial_delay=tunables.monitor_seconds)
    async def job_monitor(namespace: str, name: str, memo: Any, stopped: Any, **_: Any) -> None:
        await monitoring.run_daemon(_ctx(memo), namespace, name, stopped)

    # One autoscaler per InferenceJob: its replicas' /metrics, the HPA's rule, a recorded resize.
    @kopf.daemon(GROUP, VERSION, serving.PLURAL, registry=registry, cancellation_timeout=5.0,
                 initial_delay=tunables.autoscale_seconds)
    async def inference_autoscaler(namespace: str, name: str, memo: Any, stopped: Any, **_: Any) -> None:
        await autoscaling.run_daemon(_ctx(memo), namespace, name, stopped)

    # One progress poll per RLJob: its controller's /progress on the head pod, into status.
    @kopf.daemon(GROUP, VERSION, rljobs.PLURAL, registry=registry, cancellation_timeout=5.0,
                 initial_delay=tunables.monitor_seconds)
    async def rl_progress(namespace: str, name: str, memo: Any, stopped: Any, **_: Any) -> None:
        await rljobs.run_daemon(_ctx(memo), namespace, name, stopped)

    for kind in kinds.JOB_KINDS:
        plural = kind.plural

        @kopf.on.resume(GROUP, VERSION, plural, registry=registry, backoff=backoff)
        @kopf.on.create(GROUP, VERSION, plural, registry=registry, backoff=backoff)
        @kopf.on.update(GROUP, VERSION, plural, registry=registry, backoff=backoff)
        # initial_delay: create/resume already reconcile a new job; a timer firing at once too
        # would double the API traffic of a burst of creations.
        @kopf.timer(
            GROUP, VERSION, plural, interval=settings_resync, initial_delay=settings_resync,
            registry=registry, backoff=backoff,
        )
        async def job_reconcile(namespace: str, name: str, memo: Any, resource: Any, **_: Any) -> None:
            await _reconcile_job(_ctx(memo), resource.plural, namespace, name)

        @kopf.on.delete(GROUP, VERSION, plural, registry=registry, backoff=backoff)
        async def job_delete(
            body: Mapping[str, Any],
            namespace: str,
            name: str,
            memo: Any,
            **_: Any,
        ) -> None:
            ctx = _ctx(memo)
            async with ctx.job_lock(namespace, name):
                deleted = await training.delete_children(ctx, body)
            ctx.post_event(body, "Normal", "Deleted", f"deleted {deleted} child objects")
            ctx.metrics.record_phase(body["kind"], f"{namespace}/{name}", None)
            if body["kind"] == serving.KIND:
                ctx.metrics.forget_inference_job(namespace, name)
            if not namesakes.refused(body):  # what is kept under its name is its namesake's
                ctx.forget_job(namespace, name)
