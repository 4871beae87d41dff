"""The kubelet's side of a graceful pod delete, played by a test.

A finalizer on a pod makes a DELETE only mark it (deletionTimestamp), as a real graceful delete
does while the trainer checkpoints on SIGTERM; `release` ends the grace period and the pod goes.
"""

from __future__ import annotations

import kmock

from kube import builders

PODS = kmock.resource("", "v1", "pods")


class Kubelet:
    FINALIZER = "test.huorn.io/checkpointing"

    def __init__(self, kube: builders.Kube, km: kmock.KubernetesEmulator, namespace: str) -> None:
        self.kube, self.km, self.namespace = kube, km, namespace

    def hold(self, names: list[str]) -> None:
        held = {"metadata": {"finalizers": [self.FINALIZER]}}
        for name in names:
            self.kube.core.patch_namespaced_pod(name, self.namespace, held)

    def deletes(self) -> list[tuple[str, dict[str, str]]]:
        """The pod DELETEs the API received: (pod name, query parameters)."""
        return [(r.url.path.rstrip("/").split("/")[-1], dict(r.params)) for r in self.km["delete", PODS]]

    def release(self, names: list[str]) -> None:
        for name in names:
            self.kube.core.patch_namespaced_pod(name, self.namespace, {"metadata": {"finalizers": []}})
