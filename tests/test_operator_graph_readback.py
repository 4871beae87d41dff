"""What the reconcile reads back from the graph in status: the parts of a decision it acts on
must survive the bounded log (serialise.to_status keeps only the newest entries that fit in 16 KiB
and cuts a large detail), and only the job's own failures may spend spec.remediation.maxRestarts."""

from __future__ import annotations

import huorn.graph.jobs  # noqa: F401  (registers the TrainingJob compiler)
from huorn import graph as graph_pkg
from huorn.graph import managers, model


def build_graph(eval_vertex: bool = False, hi: int = 4) -> model.Graph:
    annotations = {"huorn.io/eval": "true"} if eval_vertex else {}
    return graph_pkg.compile({
        "apiVersion": "huorn.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "demo", "annotations": annotations},
        "spec": {"virtualCluster": "train", "elasticity": {"minReplicas": 1, "maxReplicas": hi}},
    })


def test_an_eval_run_again_on_a_newer_checkpoint_spends_no_restart() -> None:
    """An eval slower than the checkpoint interval runs again on every checkpoint; each re-run
    used to count as a pod replacement, and after maxRestarts (3) of them the first real
    failure of a trainer pod failed the job."""
    from huorn.graph import mutate
    from huorn.operator import training

    g = build_graph(eval_vertex=True)
    ms = managers.build_default_managers()
    ms.dispatch(g, managers.Event(managers.EDGE_FIRED, "trainer->eval:checkpoint",
                                  {"step": 10, "path": "/c/10"}))
    for step in (20, 30, 40, 50):
        g.vertex("eval").params["checkpoint"] = {"step": step, "path": f"/c/{step}"}
        again = ms.dispatch(g, managers.Event(managers.VERTEX_COMPLETED, "eval", {
            "reason": "done", "inputs": [{"step": step - 10, "path": f"/c/{step - 10}"}]}))
        assert [m.action for m in again] == ["replace"]
    assert g.vertex("eval").instances[0].generation == 4
    assert training.restarts_used(g, {}) == 0
    assert training.ignored_failures(g) is None, "nor are they failures (status.ignoredFailures)"
    # a trainer's failure still counts
    ms.dispatch(g, managers.Event(managers.INSTANCE_FAILED, "trainer",
                                  {"instance": "trainer-0", "reason": "x"}))
    assert training.restarts_used(g, {}) == 1
    # a failure a pod failure policy ignores is one
    mutate.replace_instance(g, "trainer-0-g1", reason="evicted; Ignore rule", counted=False, failure=True)
    assert training.ignored_failures(g) == 1 and training.restarts_used(g, {}) == 1


def test_a_large_shrink_keeps_the_grace_of_every_replica_it_removed_through_status() -> None:
    """A reclaim's shrink names the replicas it gives up and the grace their pods are deleted
    with (preempting.shrink_gang); the reconcile that finishes it after a restart reads both from
    the log in status. Forty names are over the log's 512-byte cut of one detail."""
    from huorn.graph import mutate, serialise
    from huorn.operator import training

    g = build_graph(hi=64)
    mutate.resize(g, "trainer", 50, reason="goodput says 50")
    mutate.replace_instance(g, "trainer-7", reason="failed")  # a later generation among them
    going = [i.name for i in g.vertex("trainer").instances][:40]
    assert "trainer-7-g1" in going
    m = mutate.resize(g, "trainer", 10, reason="reclaim: the lender needs its nodes back", remove=going)
    assert m is not None
    m.detail[training.GRACE_KEY] = 120
    assert serialise.measure(m.detail) > serialise.DETAIL_LIMIT
    back = serialise.from_status(serialise.to_status(g))
    assert training.deletion_graces(back) == dict.fromkeys(going, 120)
    shrink = back.log[-1]
    assert sorted(shrink.detail["removed"]) == sorted(going)
    assert (shrink.detail["from"], shrink.detail["to"]) == (50, 10)
    assert serialise.measure(serialise.to_status(back)["log"][-1]["detail"]) <= serialise.DETAIL_LIMIT


def _running_trainer_pods(g: model.Graph, ref: object) -> dict:
    from huorn.backends.kubernetes import manifests
    from huorn.operator.index import PodRecord

    return {manifests.pod_name(ref, i): PodRecord("team", manifests.pod_name(ref, i), "demo", "trainer",
                                                  i.name, "node-a", 1, 1000, "train", phase="Running")
            for i in g.vertex("trainer").instances}


def test_a_split_rolled_once_is_not_rolled_again_after_its_set_param_left_the_log() -> None:
    """S3's split and S2's counts are delivered once per set-param (status.resplitVersion,
    status.controlVersion). Once ~200 later decisions pushed the set-param out of the 16 KiB log,
    its version read as the graph's, which every later mutation moved: the gang was drained and
    restarted again after each one, for good."""
    from huorn.backends.kubernetes import manifests
    from huorn.graph import mutate, serialise
    from huorn.operator import training

    g = build_graph()
    mutate.resize(g, "trainer", 2, reason="goodput says 2")
    ms = managers.build_default_managers()
    for key, value in (("stageLayers", [3, 1]), ("microbatches", [7, 1])):
        done = ms.dispatch(g, managers.Event(managers.PARAMETER_DECISION, "trainer", {
            "key": key, "value": value, "reason": f"remediation: {key} {value}"}))
        assert [m.action for m in done] == ["set-param"]
    split, control = manifests.stage_split(g), manifests.micro_batch_control(g)
    assert split is not None and control is not None
    for n in range(200):  # unrelated decisions: the monitor's ladder record, say
        mutate.set_param(g, "trainer", "mitigation", {"level": "observe", "n": n}, reason=f"tick {n}")
    g = serialise.from_status(serialise.to_status(g))
    assert not any(m.detail.get("key") in ("stageLayers", "microbatches") for m in g.log), "left the log"
    rolled = manifests.stage_split(g)
    assert rolled is not None and rolled.version == split.version and rolled.reason == split.reason
    mutate.set_param(g, "trainer", "mitigation", {"level": "observe", "n": -1}, reason="one more")
    g = serialise.from_status(serialise.to_status(g))
    after, counts = manifests.stage_split(g), manifests.micro_batch_control(g)
    assert after is not None and after.version == split.version
    assert counts is not None and (counts.version, counts.reason) == (control.version, control.reason)
    ref = manifests.JobRef("TrainingJob", "demo", "team", "uid-1", "huorn.io/v1alpha1")
    base: dict = {}
    assert training._plan_resplit(g, ref, _running_trainer_pods(g, ref), {"resplitVersion": split.version},
                                  base) == []
    assert "resplitVersion" not in base
    # a new split is rolled, once
    ms.dispatch(g, managers.Event(managers.PARAMETER_DECISION, "trainer", {
        "key": "stageLayers", "value": [2, 2], "reason": "remediation: restore-even"}))
    assert len(training._plan_resplit(g, ref, _running_trainer_pods(g, ref),
                                      {"resplitVersion": split.version}, base)) == 2
    # a value set without a stamp drops the stale one: its version is no longer the value's
    mutate.set_param(g, "trainer", "stageLayers", [1, 3], reason="by hand")
    assert manifests.stage_split(g).version == g.version


def test_a_split_set_before_the_stamps_is_not_rolled_again_after_an_upgrade() -> None:
    """An S3 split set by an operator from before the stamps, its set-param gone from the log:
    read by the graph's version, which every mutation moves, it rolled the gang again after
    each later decision (found by review)."""
    from huorn.backends.kubernetes import manifests
    from huorn.operator import index, training

    g = build_graph()
    g.vertex("trainer").params["stageLayers"] = [3, 1]  # as an old operator left it, unstamped
    split = manifests.stage_split(g)
    assert split is not None and split.version == manifests.UNKNOWN_VERSION
    later = managers.Event(managers.PARAMETER_DECISION, "trainer", {"key": "lr", "value": 1, "reason": "x"})
    managers.build_default_managers().dispatch(g, later)
    assert manifests.stage_split(g).version == split.version
    status = {"resplitVersion": 17}  # a roll the old operator made
    ref = manifests.JobRef("TrainingJob", "demo", "t", "uid")
    pods = {manifests.pod_name(ref, i): index.PodRecord("t", manifests.pod_name(ref, i), "demo", "trainer",
                                                        i.name, "n0", 1, 0, "train", phase="Running")
            for i in g.vertex("trainer").instances}
    assert training._plan_resplit(g, ref, pods, status, {}) == []
    assert training._plan_resplit(g, ref, pods, {}, {}), "a split never rolled is rolled once"
