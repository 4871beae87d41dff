"""Pieces of the operator's monitor without a cluster: observations from real telemetry servers,
the daemon loop in fake time, cordon bookkeeping, reclaim arithmetic and the replica rule."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kopf._cogs.aiokits import aioenums

from huorn.api import kinds
from huorn.backends import monitor
from huorn.backends.kubernetes import manifests, observe
from huorn.graph import compiler, mutate, serialise
from huorn.operator import context, cordon, index, loans, monitoring, training
from huorn.runtime import telemetry as runtime_telemetry
from huorn.scheduler import loaning


def build_job(policy: str = "goodput", lo: int = 1, hi: int = 4) -> object:
    body = {
        "apiVersion": "huorn.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "llm", "namespace": "t"},
        "spec": {"virtualCluster": "train", "resources": {"gpus": 2},
                 "elasticity": {"minReplicas": lo, "maxReplicas": hi, "policy": policy},
                 # 4 × 840: divisible by microBatch × minReplicas for any minReplicas of 1..8
                 "optimization": {"steps": 10, "globalBatch": 3360, "microBatch": 4}},
    }
    return kinds.RESOURCE_MODELS["TrainingJob"].model_validate(body)


def test_observation_from_real_telemetry_servers_counts_replicas_and_skips_seen_steps() -> None:
    ranks = [runtime_telemetry.Telemetry("llm", r, 4, f"trainer-{r // 2}") for r in (0, 2)]
    try:
        port = ranks[0].serve("127.0.0.2", 0)
        ranks[1].serve("127.0.0.3", port)
        for step in range(1, 6):
            for t in ranks:
                t.record_step(step, 0.5, 0.1, 2.0, 100.0, None)
        targets = observe.build_targets({"trainer-0": "127.0.0.2", "trainer-1": "127.0.0.3",
                                         "gone": "127.0.0.9", "starting": ""}, port)
        assert "starting" not in targets
        snaps = observe.fetch_snapshots(targets, timeout=2.0)
        assert sorted(snaps) == ["trainer-0", "trainer-1"], "an unreachable pod is left out"
        obs = observe.build_observation(50.0, snaps, after_step=3, gpus_per_replica=2)
        assert [s["step"] for s in obs.steps] == [4, 5]
        assert {s["world_size"] for s in obs.steps} == {2}, "4 ranks of 2 GPUs per pod are 2 replicas"
        assert obs.telemetry["trainer-1"]["replica"] == "trainer-1" and obs.time == 50.0
    finally:
        for t in ranks:
            t.close()


@pytest.mark.looptime
async def test_daemon_ticks_every_period_and_survives_a_failing_tick(looptime, monkeypatch) -> None:
    ticks: list[float] = []

    async def tick(ctx: object, namespace: str, name: str) -> list:
        ticks.append(float(looptime))
        if len(ticks) == 2:
            raise RuntimeError("API down for a moment")
        return []

    class Settings:
        monitor_seconds = 5.0

    class Ctx:
        settings = Settings()

    monkeypatch.setattr(monitoring, "tick_job", tick)
    setter: aioenums.FlagSetter = aioenums.FlagSetter()
    stopped = aioenums.AsyncFlagWaiter(setter)
    task = asyncio.create_task(monitoring.run_daemon(Ctx(), "t", "llm", stopped))  # type: ignore[arg-type]
    await asyncio.sleep(12.0)
    setter.set()
    await task
    assert ticks == [0.0, 5.0, 10.0]
    assert float(looptime) == pytest.approx(12.0), "a stop ends the wait at once, not after the period"


def test_cordons_pending_only_after_the_last_cordoned_version() -> None:
    graph = compiler.compile(build_job("fixed", 2, 2))
    first = mutate.replace_instance(graph, "trainer-0", reason="remediation S4: x")
    first.detail[cordon.DETAIL_KEY] = "a0"
    mutate.replace_instance(graph, "trainer-1", reason="pod failed")  # a plain restart cordons nothing
    second = mutate.replace_instance(graph, "trainer-0-g1", reason="remediation S4: y")
    second.detail[cordon.DETAIL_KEY] = "a1"
    assert cordon.pending_cordons(graph, 0) == [(first.version, "a0"), (second.version, "a1")]
    assert cordon.pending_cordons(graph, first.version) == [(second.version, "a1")]
    assert cordon.pending_cordons(graph, second.version) == []


def test_demand_counts_only_the_lenders_inference_jobs() -> None:
    jobs = [
        {"spec": {"virtualCluster": "serve", "resources": {"gpus": 2}, "autoscaling": {"minReplicas": 3}}},
        {"spec": {"virtualCluster": "serve", "resources": {"gpus": 1}}},
        {"spec": {"virtualCluster": "other", "resources": {"gpus": 8}, "autoscaling": {"minReplicas": 1}}},
    ]
    cluster_index = index.ClusterIndex()
    for n, job in enumerate(jobs):
        cluster_index.observe_inference_job({"metadata": {"namespace": "team", "name": f"j{n}"}, **job})
    assert cluster_index.demand_of("serve") == 7
    # a replica a rolling update keeps beside its successor holds its GPUs: it is demand too
    rolling = {"spec": {"virtualCluster": "serve", "resources": {"gpus": 2}},
               "status": {"desiredReplicas": 1, "surgingReplicas": 1}}
    cluster_index.observe_inference_job({"metadata": {"namespace": "team", "name": "rolling"}, **rolling})
    assert cluster_index.demand_of("serve") == 7 + 4


def test_a_planned_preemption_becomes_a_shrink_only_when_a_shrink_covers_the_need() -> None:
    lender = loaning.snapshot.VirtualClusterView("serve", purpose="inference", lendable=True,
                                                 max_gpus_lent=8, reclaim_grace_seconds=45)
    loan = loaning.LoanView("t/elastic", replicas_on_lender=2, replicas_total=2, min_replicas=1,
                            gpus_per_replica=2)
    (planned,) = loaning.plan_reclaim(lender, 2, [loan], 0.0, "demand")
    shrink = loans.as_shrink(planned, loan, 2)
    assert (shrink.action, shrink.replicas_released, shrink.gpus_released) == ("shrink", 1, 2)
    assert "gives back 2" in shrink.reason and shrink.deadline == planned.deadline
    assert loans.as_shrink(planned, loan, 4).action == planned.action, "one replica must stay"
    at_min = loaning.LoanView("t/fixed", 2, 2, 2, 2)
    (blocked,) = loaning.plan_reclaim(lender, 2, [at_min], 0.0, "demand")
    assert loans.as_shrink(blocked, at_min, 2).action == "preempt"


@given(st.integers(1, 8), st.integers(0, 8), st.integers(0, 12))
def test_goodput_keeps_the_allocators_count_inside_the_spec_bounds(lo: int, extra: int, current: int) -> None:
    hi = lo + extra
    assert lo <= training.desired_replicas(build_job("goodput", lo, hi), current) <= hi
    if lo <= current <= hi:
        assert training.desired_replicas(build_job("goodput", lo, hi), current) == current
    assert training.desired_replicas(build_job("fixed", lo, hi), current) == lo


def test_a_job_declared_in_tokens_gives_the_scheduler_its_length_in_steps() -> None:
    """Huorn's JCT terms read the job's length; one declared in tokens counted as undeclared
    (ranked behind every declared job in admission) until the tokens were turned into steps."""
    job = build_job()
    by_steps = monitoring.build_policies(job, ("uid", 1)).goodput
    assert by_steps is not None and by_steps.total_steps == 10
    job.spec.optimization.tokens = 3360 * job.spec.model.context * 25 + 1  # 25 steps and a token
    job.spec.optimization.steps = None
    by_tokens = monitoring.build_policies(job, ("uid", 2)).goodput
    assert by_tokens is not None and by_tokens.total_steps == 26


class RecordingClient:
    """The one call write_progress makes, recorded."""

    def __init__(self) -> None:
        self.patches: list[dict] = []

    async def patch_status(self, plural: str, namespace: str, name: str, patch: dict) -> None:
        self.patches.append(patch)


async def test_a_step_seen_too_soon_is_written_once_its_period_has_passed() -> None:
    """Status progress is rate-limited, but the newest step is kept, not dropped: a run whose last
    steps land right after a write (found when a faster API emulator made it the usual case)
    showed a stale status.step until a step that never came."""
    client = RecordingClient()
    ctx = type("Ctx", (), {"client": client, "settings": context.OperatorSettings(progress_seconds=30.0)})()
    state = monitoring.build_policies(build_job(), ("uid", 1))
    telemetry = {"r0": {"rank": 0, "parameters": {"checkpoint": {"step": 4, "time": 1.0, "path": "/c/4"}}}}

    def seen(at: float, *steps: int) -> monitor.Observation:
        return monitor.Observation(time=at, telemetry=telemetry,
                                   steps=[{"step": s, "loss": 2.0 - s / 10} for s in steps])

    assert await monitoring.write_progress(ctx, "t", "llm", state, seen(100.0, 4, 5))
    assert client.patches[-1]["step"] == 5 and client.patches[-1]["lastCheckpoint"]["step"] == 4
    assert not await monitoring.write_progress(ctx, "t", "llm", state, seen(101.0, 6))  # too soon
    assert not await monitoring.write_progress(ctx, "t", "llm", state, seen(120.0))  # still too soon
    assert await monitoring.write_progress(ctx, "t", "llm", state, seen(131.0))  # no new step, but due
    assert client.patches[-1]["step"] == 6 and client.patches[-1]["loss"] == pytest.approx(1.4)
    assert not await monitoring.write_progress(ctx, "t", "llm", state, seen(170.0))  # written once
    assert len(client.patches) == 2


async def test_a_poll_that_a_finished_reconcile_overtook_writes_no_progress(monkeypatch) -> None:
    """The progress write is made under the job lock, against the phase read there: a poll begun
    while the job ran, and answered after a reconcile marked it Succeeded (progress 100, no time
    left), had written its older progress over that for good."""
    job = {
        "apiVersion": "huorn.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "llm", "namespace": "t", "uid": "u", "generation": 1},
        "spec": {"virtualCluster": "train", "elasticity": {"minReplicas": 1, "maxReplicas": 1},
                 "optimization": {"steps": 10}},
    }
    graph = compiler.compile(kinds.RESOURCE_MODELS["TrainingJob"].model_validate(job))
    stored = {**job, "status": {"phase": "Running", "graph": serialise.to_status(graph)}}

    class Client:
        def __init__(self) -> None:
            self.patches: list[dict] = []

        async def get_custom(self, plural: str, namespace: str, name: str) -> dict:
            return stored

        async def patch_status(self, plural: str, namespace: str, name: str, patch: dict) -> None:
            self.patches.append(patch)

    client = Client()
    ctx = context.Context(client=client, post_event=lambda *a: None)  # type: ignore[arg-type]
    ref = manifests.JobRef.from_body(job)
    trainer = graph.vertex("trainer").instances[0]
    ctx.index.observe_pod({
        "metadata": {"namespace": "t", "name": manifests.pod_name(ref, trainer),
                     "labels": {"huorn.io/job": "llm", "huorn.io/vertex": "trainer",
                                "huorn.io/instance": trainer.name}},
        "spec": {"nodeName": "a0"}, "status": {"phase": "Running", "podIP": "10.0.0.7"}})
    telemetry = {"r0": {"rank": 0, "parameters": {}}}

    async def poll_overtaken(ctx, body, graph, state, gpus) -> monitor.Observation:
        # the reconcile that saw the trainers finish ran while this poll waited for their answer
        stored["status"] = {**stored["status"], "phase": "Succeeded", "progressPercent": 100}
        return monitor.Observation(time=1.0, telemetry=telemetry, steps=[{"step": 9, "loss": 1.0}])

    monkeypatch.setattr(monitoring, "fetch_observation", poll_overtaken)
    assert await monitoring.tick_job(ctx, "t", "llm") == []
    assert client.patches == []

    stored["status"] = {**stored["status"], "phase": "Running"}  # the same poll, not overtaken
    monkeypatch.setattr(monitoring, "fetch_observation", lambda *a: _observed(telemetry))
    await monitoring.tick_job(ctx, "t", "llm")
    assert [p.get("step") for p in client.patches][:1] == [9], "a poll of a running job is written"


async def _observed(telemetry: dict) -> monitor.Observation:
    return monitor.Observation(time=1.0, telemetry=telemetry, steps=[{"step": 9, "loss": 1.0}])


def test_a_ladder_record_that_only_observes_is_a_remediation_event_as_its_plans_are() -> None:
    """A stall outside collectives or a recovery is written as a note (it must not overwrite the
    plan's parameter); its Event still says Remediation, as a plan's does, not a bare 'Note'."""
    g = compiler.compile({"apiVersion": "huorn.io/v1alpha1", "kind": "TrainingJob",
                          "metadata": {"name": "j"}, "spec": {"virtualCluster": "train"}})
    seen = mutate.note(g, "trainer", "stalled outside collectives", {"key": monitoring.MITIGATION_PARAM})
    assert monitoring._event_reason(seen) == "Remediation"
    assert g.log[-1] is seen and g.action_counts["note"] == 1
