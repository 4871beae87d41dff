"""The admission line: order, who steps back for whom, and preemption's view of the running gangs."""

from __future__ import annotations

from huorn.operator import index, queue
from huorn.scheduler import placement
from huorn.scheduler.snapshot import ClusterSnapshot, VirtualClusterView


def snapshot_with_free(gpus: int) -> ClusterSnapshot:
    return ClusterSnapshot([placement.NodeView("a0", gpus, gpus, virtual_cluster="train")],
                           [VirtualClusterView("train")])


def job(name: str, priority: int, created: float, gpus: int = 2, missing: int = 1, vc: str = "train"
        ) -> queue.QueuedJob:
    return queue.QueuedJob("team", name, vc, priority, created, gpus, missing)


def test_the_line_is_priority_then_age_and_only_jobs_that_fit_hold_others_back() -> None:
    line = queue.AdmissionQueue()
    for j in (job("late-high", 60, 20.0), job("early-high", 60, 10.0), job("low", 10, 0.0),
              job("huge", 90, 0.0, gpus=8), job("other-vc", 99, 0.0, vc="serve"),
              job("running", 99, 0.0, missing=0)):
        line.record(j)
    assert [j.name for j in line.waiting()] == ["other-vc", "huge", "early-high", "late-high", "low"]
    snap = snapshot_with_free(4)
    # huge does not fit, so it holds no one back; early-high fits and goes before late-high and low.
    assert line.first_ahead_that_fits(line.jobs[("team", "late-high")], snap).name == "early-high"
    assert line.first_ahead_that_fits(line.jobs[("team", "low")], snap).name == "early-high"
    assert line.first_ahead_that_fits(line.jobs[("team", "early-high")], snap) is None
    # Growth of a running job comes after every waiting gang, whatever its priority.
    assert line.first_ahead_that_fits(line.jobs[("team", "running")], snap, growth=True).name == "early-high"
    line.forget("team", "early-high")
    line.forget("team", "late-high")
    assert line.first_ahead_that_fits(line.jobs[("team", "running")], snap, growth=True).name == "low"


def test_preemption_sees_running_gangs_and_the_ones_already_stopping() -> None:
    line = queue.AdmissionQueue()
    line.record(job("run", 10, 0.0, missing=0))
    line.record(job("going", 10, 0.0, missing=0))

    def pod(name: str, job_name: str, created: float, deleting: bool = False, phase: str = "Running"
            ) -> index.PodRecord:
        return index.PodRecord("team", name, job_name, "trainer", name, "a0", 2, 0, "train", phase=phase,
                               deleting=deleting, created=created)

    pods = [pod("run-0", "run", 5.0), pod("run-1", "run", 7.0), pod("run-old", "run", 1.0, phase="Failed"),
            pod("going-0", "going", 3.0, deleting=True), pod("stranger-0", "stranger", 2.0)]
    candidates, stopping = line.candidates(pods)
    # The gang started when its newest live pod did; a job the queue has not seen is no candidate.
    assert [(c.job, c.priority, c.started) for c in candidates] == [("team/run", 10, 7.0)]
    assert stopping == ["team/going"]


def test_the_line_is_rebuilt_from_the_jobs_status_after_a_restart() -> None:
    from huorn.api import kinds

    def body(reason: str, graph: dict | None) -> dict:
        status = {"conditions": [{"type": "Reconciling", "status": "True", "reason": reason}]}
        if graph is not None:
            status["graph"] = graph
        return {"apiVersion": "huorn.io/v1alpha1", "kind": "TrainingJob",
                "metadata": {"namespace": "team", "name": "j", "creationTimestamp": "2026-12-01T06:00:00Z"},
                "spec": {"virtualCluster": "train", "priority": 70, "resources": {"gpus": 2},
                         "elasticity": {"minReplicas": 3, "maxReplicas": 4, "policy": "goodput"}},
                "status": status}

    def entry(b: dict, pods: list[index.PodRecord] = ()) -> queue.QueuedJob:  # type: ignore[assignment]
        return queue.from_job(kinds.TrainingJob.model_validate(b), b, pods)

    never_placed = entry(body("Unplaceable", None))
    assert (never_placed.missing, never_placed.priority, never_placed.gpus) == (3, 70, 2)
    assert never_placed.elastic and never_placed.created > 0
    one_left = index.PodRecord("team", "j-trainer-0", "j", "trainer", "trainer-0", "a0", 2, 0, "train")
    graph = {"vertices": [{"name": "trainer", "replicas": 4}]}
    assert entry(body("Queued", graph), [one_left]).missing == 3
    # three of four running: at its minimum, it waits only to grow, which puts it in no line
    running = [index.PodRecord("team", f"j-trainer-{i}", "j", "trainer", f"trainer-{i}", "a0", 2, 0, "train")
               for i in range(3)]
    assert entry(body("Unplaceable", graph), running).missing == 0
    assert entry(body("Unplaceable", graph), running[:2]).missing == 2  # below it: all that is missing
    assert entry(body("Draining", graph)).missing == 0, "a job draining is not in line"


def test_a_job_with_a_node_selector_shrinks_an_elastic_gang_by_its_replicas_on_the_selected_nodes() -> None:
    """Gang v (elastic, minimum 2) runs two replicas on h0 (H100s) and two on t0 (T4s); w needs 2
    replicas of 2 GPUs. Without a selector the newest two go (on t0); selecting the H100s, the
    two on h0 go. Counted from its replicas on h0 alone, v had no surplus and was stopped whole
    (a review)."""
    from kube import builders

    from huorn.operator import context, training

    ctx = context.Context(client=None, post_event=lambda *_: None)  # type: ignore[arg-type]
    ctx.index.observe_vc(builders.make_virtual_cluster("train", pool="a"))
    ctx.index.observe_node(builders.make_node("h0", 4, pool="a", gpu="h100"))
    ctx.index.observe_node(builders.make_node("t0", 4, pool="a", gpu="t4"))
    for i, node in enumerate(["h0", "h0", "t0", "t0"]):
        pod = index.PodRecord("team", f"v-trainer-{i}", "v", "trainer", f"trainer-{i}", node, 2, 0, "train",
                              phase="Running", created=100.0 + i)
        ctx.index.pods[(pod.namespace, pod.name)] = pod
    ctx.queue.record(queue.QueuedJob("team", "v", "train", 10, 1.0, 2, 0, min_replicas=2, elastic=True))
    for selector, given in ((None, ("trainer-3", "trainer-2")), ({"gpu": "h100"}, ("trainer-1", "trainer-0")),
                            ({"gpu": "a100"}, None)):
        waiting = queue.QueuedJob("team", "w", "train", 90, 2.0, 2, missing=2, min_replicas=2,
                                  node_selector=selector)
        assert len({waiting, waiting}) == 1  # an entry stays hashable with a selector (a dict)
        ctx.queue.record(waiting)
        ctx.preemptions.clear()
        message = training.plan_preemption(ctx, waiting, 2, "needs 4 GPUs")
        if given is None:  # no node it selects: nobody is stopped or shrunk for it
            assert message == "needs 4 GPUs" and not ctx.preemptions
            continue
        assert "shrinking team/v by 2" in message
        plan = ctx.preemptions[("team", "w")][0]
        assert plan.victims == () and plan.shrinks == (("team/v", given),)
