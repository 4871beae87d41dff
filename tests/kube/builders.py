"""Builders of test objects (Kueue's MakeWorkload style) and a small API facade for assertions."""

from __future__ import annotations

from typing import Any

import kubernetes

GROUP, VERSION = "huorn.io", "v1alpha1"


def make_node(name: str, gpus: int, **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "64", "memory": "512Gi"}},
    }


def make_virtual_cluster(
    name: str,
    *,
    pool: str | None = None,
    nodes: list[str] | None = None,
    lend: int = 0,
    borrow: int = 0,
    namespaces: list[str] | None = None,
) -> dict[str, Any]:
    members: dict[str, Any] = {}
    if pool is not None:
        members["nodeSelector"] = {"matchLabels": {"pool": pool}}
    if nodes is not None:
        members["nodes"] = nodes
    spec: dict[str, Any] = {
        "members": members,
        "lending": {"lendable": lend > 0, "maxGPUsLent": lend},
        "borrowing": {"maxGPUsBorrowed": borrow},
    }
    if namespaces:
        spec["namespaces"] = namespaces
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "VirtualCluster",
        "metadata": {"name": name},
        "spec": spec,
    }


def make_training_job(
    name: str,
    vc: str,
    *,
    replicas: int = 2,
    max_replicas: int = 4,
    gpus: int = 2,
    **spec: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "virtualCluster": vc,
        "resources": {"gpus": gpus, "cpu": "2", "memory": "8Gi"},
        "elasticity": {"minReplicas": replicas, "maxReplicas": max_replicas, "policy": "fixed"},
        "optimization": {"steps": 100, "globalBatch": 48, "microBatch": 4},
        "checkpoint": {"volume": "ckpt", "path": "/checkpoints"},
        "env": [{"name": "EXTRA", "value": "1"}],
    }
    body.update(spec)
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": body,
    }


def make_rl_job(name: str, vc: str, **spec: Any) -> dict[str, Any]:
    """Four GPUs, in Ray workers of two, for a trainer and a rollout worker of two GPUs each."""
    body: dict[str, Any] = {
        "virtualCluster": vc, "gpus": 4,
        "resources": {"gpus": 2, "cpu": "6", "memory": "8Gi"},
        "roles": {"actorTrain": {"replicas": 1, "gpusPerReplica": 2},
                  "rollout": {"replicas": 1, "gpusPerReplica": 2}},
        "checkpoint": {"volume": "rl-ckpt", "path": "/checkpoints", "intervalSteps": 5},
        "steps": 20,
    }
    body.update(spec)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "RLJob", "metadata": {"name": name}, "spec": body}


class Kube:
    """The calls tests make, through the official client, against the emulator or a real cluster."""

    def __init__(self, api: kubernetes.client.ApiClient) -> None:
        self.api = api
        self.core = kubernetes.client.CoreV1Api(api)
        self.custom = kubernetes.client.CustomObjectsApi(api)

    def create_node(self, body: dict[str, Any]) -> None:
        self.core.create_node(body)

    def create_vc(self, body: dict[str, Any]) -> None:
        self.custom.create_cluster_custom_object(GROUP, VERSION, "virtualclusters", body)

    def get_vc(self, name: str) -> dict[str, Any]:
        return self.custom.get_cluster_custom_object(GROUP, VERSION, "virtualclusters", name)

    def create_job(self, ns: str, body: dict[str, Any], plural: str = "trainingjobs") -> None:
        self.custom.create_namespaced_custom_object(GROUP, VERSION, ns, plural, body)

    def get_job(self, ns: str, name: str, plural: str = "trainingjobs") -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, ns, plural, name)

    def job_status(self, ns: str, name: str, plural: str = "trainingjobs") -> dict[str, Any]:
        return self.get_job(ns, name, plural).get("status") or {}

    def condition(self, ns: str, name: str, kind: str, plural: str = "trainingjobs") -> dict[str, Any]:
        conds = self.job_status(ns, name, plural).get("conditions") or []
        return next((c for c in conds if c["type"] == kind), {})

    def delete_job(self, ns: str, name: str) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, ns, "trainingjobs", name)

    def job_exists(self, ns: str, name: str, plural: str = "trainingjobs") -> bool:
        try:
            self.get_job(ns, name, plural)
            return True
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return False
            raise

    def scale(self, ns: str, name: str, replicas: int) -> dict[str, Any]:
        return self.custom.patch_namespaced_custom_object_scale(
            GROUP, VERSION, ns, "trainingjobs", name, {"spec": {"replicas": replicas}}
        )

    def pods(self, ns: str, job: str, vertex: str | None = None) -> list[Any]:
        """Pods of a job, filtered here: the emulator ignores label selectors."""
        out = []
        for pod in self.core.list_namespaced_pod(ns).items:
            labels = pod.metadata.labels or {}
            if labels.get("huorn.io/job") == job and (
                vertex is None or labels.get("huorn.io/vertex") == vertex
            ):
                out.append(pod)
        return sorted(out, key=lambda p: p.metadata.name)

    def children(self, ns: str, job: str) -> dict[str, list[str]]:
        def named(items: list[Any]) -> list[str]:
            return sorted(
                i.metadata.name for i in items if (i.metadata.labels or {}).get("huorn.io/job") == job
            )

        return {
            "pods": named(self.core.list_namespaced_pod(ns).items),
            "services": named(self.core.list_namespaced_service(ns).items),
            "configmaps": named(self.core.list_namespaced_config_map(ns).items),
        }

    def set_pod_phase(self, ns: str, name: str, phase: str, exit_code: int | None = None) -> None:
        status: dict[str, Any] = {"phase": phase}
        if exit_code is not None:
            status["containerStatuses"] = [
                {
                    "name": "trainer",
                    "ready": False,
                    "restartCount": 0,
                    "image": "x",
                    "imageID": "x",
                    "state": {"terminated": {"exitCode": exit_code, "reason": "Error"}},
                }
            ]
        # NB: the test plays the kubelet, which retries its status updates; errors injected for
        # the operator (e.g. the first two pod PATCHes answer 409) may land on this patch too.
        for attempt in range(6):
            try:
                self.core.patch_namespaced_pod_status(name, ns, {"status": status})
                return
            except kubernetes.client.ApiException as error:
                if error.status not in (409, 429, 500, 503) or attempt == 5:
                    raise

    def run_all_pods(self, ns: str, job: str) -> int:
        count = 0
        for pod in self.pods(ns, job):
            if (pod.status.phase if pod.status else None) != "Running":
                self.set_pod_phase(ns, pod.metadata.name, "Running")
                count += 1
        return count

    def events(self, ns: str, name: str) -> list[Any]:
        return [
            e
            for e in self.core.list_namespaced_event(ns).items
            if e.involved_object is not None and e.involved_object.name == name
        ]

    def has_event(self, ns: str, name: str, reason: str, contains: str = "", kind: str = "") -> bool:
        """For `wait_for`: kopf posts events from a queue of its own, after the status patch that
        a test usually waits for, so an event is read only once it has arrived."""
        return any(e.reason == reason and contains in (e.message or "") and kind in (e.type or "")
                   for e in self.events(ns, name))
