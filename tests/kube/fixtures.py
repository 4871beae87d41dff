"""pytest fixtures: an emulated cluster with two pools of GPU nodes, and the operator on it.

Import them into a test module with `from kube.fixtures import cluster, kube, operator`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kube import builders
from kube import cluster as cluster_mod
from kube import operator as operator_mod


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[cluster_mod.EmulatedCluster]:
    with cluster_mod.EmulatedCluster(tmp_path) as c:
        yield c


@pytest.fixture()
def kube(cluster: cluster_mod.EmulatedCluster) -> builders.Kube:
    """Pool a: nodes a0, a1 with 4 GPUs each (VC "train", lends 4); pool b: b0 with 8 (VC "serve")."""
    k = builders.Kube(cluster.api_client())
    k.create_node(builders.make_node("a0", 4, pool="a"))
    k.create_node(builders.make_node("a1", 4, pool="a"))
    k.create_node(builders.make_node("b0", 8, pool="b"))
    k.create_vc(builders.make_virtual_cluster("train", pool="a", borrow=4))
    k.create_vc(builders.make_virtual_cluster("serve", pool="b", lend=4))
    return k


@pytest.fixture()
def operator(
    cluster: cluster_mod.EmulatedCluster, kube: builders.Kube
) -> Iterator[operator_mod.OperatorThread]:
    with operator_mod.OperatorThread(cluster.api_client()) as op:
        yield op
