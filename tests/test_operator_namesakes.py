"""Two job kinds with one name in one namespace (huorn.operator.namesakes): real kopf against KMock.

Every kind names its children after the job; before, an InferenceJob `llama` beside a
TrainingJob `llama` overwrote its ConfigMap and deleted its trainer pods as strays, and deleting
either deleted the other's children.
"""

from __future__ import annotations

from kube import builders, serving
from kube import operator as operator_mod
from kube.cluster import wait_for

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
    assert stalled["message"].startswith("metadata.name 'llama' is taken in namespace 'team' by the older "
                                         "TrainingJob llama")
    assert "another name" in stalled["message"]
    assert _children(kube) == before, "the refused job made nothing and changed nothing"
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
