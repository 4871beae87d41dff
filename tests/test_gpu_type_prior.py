"""A GPU job's performance-model prior is scaled to the GPUs it runs on: the operator reads them
from its VirtualCluster's nodes (GPU feature discovery's product label), `huorn run` from CUDA.

Before, every GPU job started from the H200 prior, whatever its nodes: on slower GPUs compute
weighs more against the gradient exchange, so the prior's shape (how far the job scales), not only
its level, was wrong until measurements at several sizes corrected it.
"""

from __future__ import annotations

from typing import Any

import pytest
from kube import builders

from huorn.api import kinds, training
from huorn.backends import goodput
from huorn.cli import run as run_cli
from huorn.graph import compile as compile_graph
from huorn.operator import context, index, monitoring
from huorn.scheduler import perfmodel

pytest_plugins = ["kube.fixtures"]


@pytest.mark.parametrize(("product", "kind"), [
    ("NVIDIA-H100-80GB-HBM3", "H100"),         # GPU feature discovery's label
    ("NVIDIA H100 80GB HBM3", "H100"),         # torch.cuda.get_device_name
    ("NVIDIA-H200", "H200"),
    ("NVIDIA-GH200-480GB", "H200"),
    ("NVIDIA-A100-SXM4-80GB", "A100"),
    ("NVIDIA A100-SXM4-40GB", "A100"),
    ("NVIDIA-A10", "A10"),                      # a whole word: not the A100's prefix
    ("NVIDIA-A10G", "A10"),
    ("Tesla-V100-SXM2-16GB", "V100"),
    ("Tesla-T4", "T4"),
    ("NVIDIA-L40S", "L40S"),
    ("NVIDIA-L4", "L4"),
    ("NVIDIA-B200", "B200"),
    ("NVIDIA-GeForce-RTX-4090", ""),            # no prior knows it: the H200's is assumed
    ("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", ""),   # a MIG slice is not an A100's speed
    ("NVIDIA-H100-80GB-HBM3-SHARED", ""),       # nor a time-shared replica an H100's
    ("", ""),
])
def test_product_names_map_to_the_priors_gpu_types(product: str, kind: str) -> None:
    assert perfmodel.gpu_type_of(product) == kind
    assert kind in perfmodel.GPU_SPEED


def _node(name: str, gpus: int, product: str | None) -> dict[str, Any]:
    labels = {"pool": "a", **({index.GPU_PRODUCT_LABEL: product} if product else {})}
    return builders.make_node(name, gpus, **labels)


def test_a_clusters_gpu_type_is_that_of_most_of_its_gpus() -> None:
    idx = index.ClusterIndex()
    idx.observe_vc(builders.make_virtual_cluster("train", pool="a"))
    for name, gpus, product in (("a0", 8, "NVIDIA-A100-SXM4-80GB"), ("a1", 8, "NVIDIA-A100-SXM4-80GB"),
                                ("h0", 8, "NVIDIA-H100-80GB-HBM3"), ("x0", 0, "NVIDIA-H100-80GB-HBM3"),
                                ("u0", 8, None)):
        idx.observe_node(_node(name, gpus, product))
    assert idx.gpu_type("train") == "A100"  # 16 A100s against 8 H100s; unlabelled nodes name none
    assert idx.gpu_type("elsewhere") == ""
    # a job that selects the H100s is priced at them, whatever most of its cluster's GPUs are
    assert idx.gpu_type("train", {index.GPU_PRODUCT_LABEL: "NVIDIA-H100-80GB-HBM3"}) == "H100"
    assert idx.gpu_type("train", {"pool": "a"}) == "A100"
    bare = index.ClusterIndex()
    bare.observe_vc(builders.make_virtual_cluster("train", pool="a"))
    bare.observe_node(_node("u0", 8, None))
    assert bare.gpu_type("train") == ""


def _job(gpus: int) -> Any:
    body = {
        "apiVersion": "huorn.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "llm", "namespace": "t", "uid": "u1", "generation": 1},
        "spec": {"virtualCluster": "train",
                 "resources": {"gpus": gpus},
                 "elasticity": {"minReplicas": 1, "maxReplicas": 8, "policy": "goodput"},
                 "model": {"layers": 32, "width": 4096, "heads": 32, "context": 2048},
                 "optimization": {"globalBatch": 256, "microBatch": 4, "steps": 1000}},
    }
    return body, kinds.RESOURCE_MODELS["TrainingJob"].model_validate(body)


def test_the_operators_goodput_policy_starts_from_its_clusters_gpus() -> None:
    ctx = context.Context(client=None, post_event=lambda *_: None)  # type: ignore[arg-type]
    ctx.index.observe_vc(builders.make_virtual_cluster("train", pool="a"))
    for name in ("a0", "a1"):
        ctx.index.observe_node(_node(name, 8, "NVIDIA-A100-SXM4-80GB"))
    body, job = _job(gpus=1)
    state = monitoring._policies_for(ctx, body, job, compile_graph(body))
    assert state.goodput is not None
    size = training.approximate_parameters(job.spec.model) / 1e9
    assert state.goodput.perf.prior == perfmodel.scale_prior("transformer", size, "A100")
    assert state.goodput.perf.prior != perfmodel.scale_prior("transformer", size, "H200")
    # on A100s the prior's compute weighs more: the job is priced to scale further
    on_a100 = state.goodput.perf.predict_many(8, 1, 4.0) / state.goodput.perf.predict_many(1, 1, 4.0)
    on_h200 = goodput_prior(job, "").predict_many(8, 1, 4.0) / goodput_prior(job, "").predict_many(1, 1, 4.0)
    assert on_a100 > on_h200


def goodput_prior(job: Any, gpu_type: str) -> perfmodel.PerfModel:
    return goodput.prior_model(job.spec, gpu_type)


def test_a_job_of_no_gpus_keeps_the_cpu_prior_whatever_its_nodes() -> None:
    _, job = _job(gpus=0)
    assert goodput_prior(job, "A100").prior == perfmodel.FAMILY_PRIORS["transformer-tiny"]


def test_huorn_run_scales_a_gpu_jobs_prior_to_the_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    body, job = _job(gpus=1)
    graph = compile_graph(body)
    size = training.approximate_parameters(job.spec.model) / 1e9
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (policy,) = run_cli.build_policies(graph, [], "goodput", 4)
    assert policy.perf.prior == perfmodel.scale_prior("transformer", size, "H200")  # no CUDA: assumed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA A100-SXM4-80GB")
    (policy,) = run_cli.build_policies(graph, [], "goodput", 4)
    assert policy.perf.prior == perfmodel.scale_prior("transformer", size, "A100")
