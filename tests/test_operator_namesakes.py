"""Two job kinds with one name in one namespace (huorn.operator.namesakes): real kopf against KMock.

Every kind names its children after the job; before, an InferenceJob `llama` beside a
TrainingJob `llama` overwrote its ConfigMap and deleted its trainer pods as strays, and deleting
either deleted the other's children.
"""

from __future__ import annotations

from types import SimpleNamespace

from kube import builders, serving
from kube import operator as operator_mod
from kube.cluster import wait_for

from huorn.api import kinds
from huorn.operator import namesakes

pytest_plugins = ["kube.fixtures"]

NS = "team"
IJ = "inferencejobs"


def _children(kube: builders.Kube) -> dict[str, list[str]]:
    """Every pod, Service and ConfigMap of the namespace, by kind, with its owner's kind and its
    own uid (a child deleted and made again has another)."""
    out: dict[str, list[str]] = {}
    for kind, items in (("Pod", kube.core.list_namespaced_pod(NS).items),
                        ("Service", kube.core.list_namespaced_service(NS).items),
                        ("ConfigMap", kube.core.list_namespaced_config_map(NS).items)):
        live = [o for o in items if o.metadata.owner_references and not o.metadata.deletion_timestamp]
        out[kind] = sorted(f"{o.metadata.name}<{o.metadata.owner_references[0].kind}@{o.metadata.uid}"
                           for o in live)
    return out


def test_the_newer_of_two_namesakes_is_refused_and_starts_once_the_older_is_gone(
        kube: builders.Kube, operator: operator_mod.OperatorThread) -> None:
    kube.create_job(NS, builders.make_training_job("llama", "train", replicas=1, max_replicas=1))
    wait_for(lambda: kube.pods(NS, "llama", "trainer"), what="the TrainingJob's trainer pod")
    kube.run_all_pods(NS, "llama")
    wait_for(lambda: kube.job_status(NS, "llama").get("phase") == "Running", what="Running")
    before = _children(kube)
    assert [c.split("@")[0] for c in before["ConfigMap"]] == ["llama-config<TrainingJob"]

    kube.create_job(NS, serving.make_inference_job("llama", "serve"), plural=IJ)
    stalled = wait_for(lambda: kube.condition(NS, "llama", "Stalled", IJ).get("status") == "True"
                       and kube.condition(NS, "llama", "Stalled", IJ), what="the InferenceJob refused")
    assert stalled["reason"] == "NameTaken"
    assert stalled["message"].startswith("metadata.name 'llama' is taken in namespace 'team' by the "
                                         "TrainingJob llama")
    assert "another name" in stalled["message"]
    assert _children(kube) == before, "the refused job made nothing and changed nothing"
    # and it keeps none of its virtual cluster's GPUs from being lent (its minReplicas are no floor)
    assert namesakes.refused(kube.get_job(NS, "llama", IJ))
    assert operator.ctx.index.floors_of("serve") == 0
    assert kube.job_status(NS, "llama")["phase"] == "Running"

    kube.custom.delete_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, IJ, "llama")
    wait_for(lambda: not kube.job_exists(NS, "llama", IJ), what="the InferenceJob gone")
    assert _children(kube) == before, "deleting the refused job deleted none of its namesake's children"
    assert kube.job_status(NS, "llama")["phase"] == "Running"

    kube.create_job(NS, serving.make_inference_job("llama", "serve"), plural=IJ)
    wait_for(lambda: kube.condition(NS, "llama", "Stalled", IJ).get("reason") == "NameTaken",
             what="refused again")
    kube.delete_job(NS, "llama")  # the TrainingJob
    started = wait_for(lambda: (servers := [p for p in kube.pods(NS, "llama", "server")
                                             if not p.metadata.deletion_timestamp]) and servers,
                       what="the InferenceJob's replica once its namesake is gone")
    assert [p.metadata.owner_references[0].kind for p in started] == ["InferenceJob"]
    wait_for(lambda: [c.split("@")[0] for c in _children(kube)["ConfigMap"]] == ["llama-config<InferenceJob"],
             what="its own ConfigMap")


class _Jobs:
    """The API's answer to a GET of a job, for the unit tests of the decision below."""

    def __init__(self, *bodies: dict) -> None:
        self.bodies = {(b["kind"], b["metadata"]["name"]): b for b in bodies}

    async def get_custom(self, plural: str, namespace: str, name: str) -> dict | None:
        kind = next(k.kind for k in kinds.JOB_KINDS if k.plural == plural)
        return self.bodies.get((kind, name))


def _job(kind: str, created: str, uid: str, image: str | None = None) -> dict:
    status = {"image": image} if image else {}
    meta = {"name": "x", "namespace": NS, "uid": uid, "creationTimestamp": created}
    return {"kind": kind, "metadata": meta, "status": status}


async def test_one_admitted_owns_the_name_even_when_both_were_created_in_the_same_second() -> None:
    """creationTimestamp has whole seconds. The InferenceJob, reconciled first, passed (the
    TrainingJob did not exist yet) and was admitted; the TrainingJob then won the tie by kind
    order, and both ran."""
    same = "2026-12-06T10:00:00Z"
    served = _job("InferenceJob", same, "u-ij", image="mirror.example/huorn:1")
    trained = _job("TrainingJob", same, "u-tj")
    ctx = SimpleNamespace(client=_Jobs(served, trained))
    assert "by the InferenceJob x" in (await namesakes.older_namesake(ctx, trained) or "")
    assert await namesakes.older_namesake(ctx, served) is None  # admitted: never asks again
    # Neither admitted: exactly one of the two goes first, whichever asks.
    served["status"] = {}
    refused = [b["kind"] for b in (served, trained) if await namesakes.older_namesake(ctx, b)]
    assert refused == ["InferenceJob"]
    # Otherwise the older one goes first.
    served["metadata"]["creationTimestamp"] = "2026-12-06T09:59:59Z"
    refused = [b["kind"] for b in (served, trained) if await namesakes.older_namesake(ctx, b)]
    assert refused == ["TrainingJob"]
