"""Jobs that finished under an operator older than the terminal conditions: real kopf against KMock.

Such a job has phase Succeeded or Failed but neither a Succeeded nor a Failed condition, so
`kubectl wait --for=condition=Succeeded` on it would wait forever. The first reconcile after the
upgrade adds the condition once; later reconciles write nothing to a finished job's status.
"""

from __future__ import annotations

from typing import Any

import kmock
from kube import builders
from kube import operator as operator_mod
from kube.cluster import EmulatedCluster, wait_for

pytest_plugins = ["kube.fixtures"]

NS = "team"
T0 = "2026-01-01T00:00:00Z"


def _cond(kind: str, status: str, reason: str, message: str = "") -> dict[str, Any]:
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": T0, "observedGeneration": 1}


# What an older operator left: a TrainingJob's Ready was False reason Succeeded; an RLJob's stayed
# Ready True reason Completed; a failed job of either kind was Ready False and Stalled with its reason.
RL_DONE = "the controller finished every step (its step log and checkpoints are on the checkpoint volume)"
OLD = {
    ("trainingjobs", "done"): {
        "phase": "Succeeded", "completionTime": T0, "replicas": 0,
        "conditions": [_cond("Ready", "False", "Succeeded", "training finished"),
                       _cond("Reconciling", "False", "AsExpected"), _cond("Stalled", "False", "AsExpected")]},
    ("trainingjobs", "bad"): {
        "phase": "Failed", "completionTime": T0, "replicas": 0, "message": "past the deadline",
        "conditions": [_cond("Ready", "False", "DeadlineExceeded", "past the deadline"),
                       _cond("Reconciling", "False", "AsExpected"),
                       _cond("Stalled", "True", "DeadlineExceeded", "past the deadline")]},
    ("rljobs", "rl-done"): {
        "phase": "Succeeded", "completionTime": T0, "replicas": 0, "message": RL_DONE,
        "conditions": [_cond("Ready", "True", "Completed", RL_DONE),
                       _cond("Reconciling", "False", "AsExpected"), _cond("Stalled", "False", "AsExpected")]},
    ("rljobs", "rl-bad"): {
        "phase": "Failed", "completionTime": T0, "replicas": 0,
        "message": "the controller refused its config",
        "conditions": [_cond("Ready", "False", "ControllerRefused", "the controller refused its config"),
                       _cond("Reconciling", "False", "AsExpected"),
                       _cond("Stalled", "True", "ControllerRefused", "the controller refused its config")]},
}
# (terminal condition, its reason, its message)
EXPECTED = {
    ("trainingjobs", "done"): ("Succeeded", "Succeeded", "training finished"),
    ("trainingjobs", "bad"): ("Failed", "DeadlineExceeded", "past the deadline"),
    ("rljobs", "rl-done"): ("Succeeded", "Succeeded", RL_DONE),
    ("rljobs", "rl-bad"): ("Failed", "ControllerRefused", "the controller refused its config"),
}


def _create_finished(kube: builders.Kube) -> None:
    for (plural, name), status in OLD.items():
        body = (builders.make_training_job(name, "train", replicas=1, max_replicas=1, gpus=1)
                if plural == "trainingjobs" else builders.make_rl_job(name, "train"))
        kube.create_job(NS, body, plural=plural)
        kube.custom.patch_namespaced_custom_object_status(builders.GROUP, builders.VERSION, NS, plural, name,
                                                          {"status": status})


def _conditions(kube: builders.Kube, plural: str, name: str) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in kube.job_status(NS, name, plural).get("conditions") or []}


def test_a_job_finished_before_the_upgrade_gets_its_terminal_condition_once(
        cluster: EmulatedCluster, kube: builders.Kube) -> None:
    _create_finished(kube)
    status_writes: list[tuple[str, str]] = []  # (plural, name) of each PATCH of a job's status
    reads: list[tuple[str, str]] = []  # (plural, name) of each GET of one job: a reconcile starts

    async def note(request: kmock.Request) -> None:
        plural = request.resource.plural if request.resource is not None else ""
        if (plural, request.name) in OLD:
            if request.method.upper() == "PATCH" and request.subresource == "status":
                status_writes.append((plural, request.name))
            elif request.method.upper() == "GET" and request.name:
                reads.append((plural, request.name))
        raise NotImplementedError  # answered by the emulator

    assert cluster.kmock is not None
    cluster.kmock[kmock.resource(builders.GROUP, builders.VERSION, "trainingjobs")] << note
    cluster.kmock[kmock.resource(builders.GROUP, builders.VERSION, "rljobs")] << note
    with operator_mod.OperatorThread(cluster.api_client()):
        for (plural, name), (ended, reason, message) in EXPECTED.items():
            conds = wait_for(lambda p=plural, n=name, e=ended: (c := _conditions(kube, p, n)).get(e, {}).get(
                "status") == "True" and c, what=f"the {ended} condition of {plural}/{name}")
            assert (conds[ended]["reason"], conds[ended]["message"]) == (reason, message)
            assert ("Failed" if ended == "Succeeded" else "Succeeded") not in conds
            # not Ready any more, with the end's reason; the other conditions as the old operator left them
            assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", reason)
            old = {c["type"]: c for c in OLD[(plural, name)]["conditions"]}
            for kind in ("Reconciling", "Stalled"):
                assert {k: conds[kind][k] for k in ("status", "reason", "message", "lastTransitionTime")} == {
                    k: old[kind][k] for k in ("status", "reason", "message", "lastTransitionTime")}
            # nothing else of a finished job's status is rewritten
            after = kube.job_status(NS, name, plural)
            assert {k: v for k, v in after.items() if k != "conditions"} == {
                k: v for k, v in OLD[(plural, name)].items() if k != "conditions"}
        # Two more reconciles of every job (a reconcile GETs its job under the job's lock, so the
        # second GET means the reconcile after the write has ended): no second status write.
        seen = {key: reads.count(key) for key in OLD}
        wait_for(lambda: all(reads.count(key) >= seen[key] + 2 for key in OLD),
                 what="two more reconciles of each finished job", timeout=30)
    assert sorted(status_writes) == sorted(OLD), status_writes
