"""Which image a job's pods run (huorn.operator.images): real kopf against KMock.

A job that names no image runs the operator's job image (the chart's own, so a registry mirror
serves the jobs too), pinned in status.image before its first pod; an operator upgrade to a new
job image starts new jobs on it and leaves the running ones, their replacement pods included, on
the image they started with.
"""

from __future__ import annotations

import dataclasses

import pytest
from kube import builders, serving
from kube import operator as operator_mod
from kube.cluster import EmulatedCluster, wait_for
from typer.testing import CliRunner

from huorn.api import common
from huorn.cli.main import app
from huorn.operator import context, images

pytest_plugins = ["kube.fixtures"]

NS = "team"
IJ = "inferencejobs"
FIRST, SECOND = "mirror.example/huorn:1", "mirror.example/huorn:2"


def _settings(job_image: str) -> context.OperatorSettings:
    return dataclasses.replace(operator_mod.FAST, job_image=job_image)


def _live(kube: builders.Kube, job: str, vertex: str | None = None) -> dict:
    """The job's pods that are neither being deleted nor failed, by name."""
    return {p.metadata.name: p for p in kube.pods(NS, job, vertex)
            if not p.metadata.deletion_timestamp and (p.status is None or p.status.phase != "Failed")}


def _images(pods: dict) -> set[str]:
    return {c.image for p in pods.values() for c in p.spec.containers}


def test_a_job_without_an_image_keeps_the_one_it_started_with_across_an_operator_upgrade(
        cluster: EmulatedCluster, kube: builders.Kube) -> None:
    with operator_mod.OperatorThread(cluster.api_client(), _settings(FIRST)):
        kube.create_job(NS, builders.make_training_job("old", "train", replicas=2, max_replicas=2))
        kube.create_job(NS, builders.make_training_job("named", "train", replicas=1, max_replicas=1,
                                                       image="team.example/own:7"))
        wait_for(lambda: len(_live(kube, "old", "trainer")) == 2 and _live(kube, "named", "trainer"),
                 what="both jobs' trainer pods")
        kube.run_all_pods(NS, "old")
        wait_for(lambda: kube.job_status(NS, "old").get("phase") == "Running", what="old Running")
        # the rendezvous store too: every pod of the job
        assert _images(_live(kube, "old")) == {FIRST} and len(_live(kube, "old")) == 3
        assert kube.job_status(NS, "old")["image"] == FIRST
        assert _images(_live(kube, "named")) == {"team.example/own:7"}
        assert kube.job_status(NS, "named")["image"] == "team.example/own:7"
        assert "image" not in kube.get_job(NS, "old")["spec"], "the spec is the user's: never written"

    with operator_mod.OperatorThread(cluster.api_client(), _settings(SECOND)):  # the upgrade
        kube.set_pod_phase(NS, "old-trainer-0", "Failed", exit_code=1)
        replaced = wait_for(lambda: (now := _live(kube, "old", "trainer")) and "old-trainer-0" not in now
                            and len(now) == 2 and now, what="old-trainer-0's replacement")
        assert _images(replaced) == {FIRST}, "a replacement runs its gang's image, not the new one"
        kube.create_job(NS, builders.make_training_job("new", "train", replicas=1, max_replicas=1))
        wait_for(lambda: _live(kube, "new", "trainer"), what="new's trainer pod")
        assert _images(_live(kube, "new")) == {SECOND} and kube.job_status(NS, "new")["image"] == SECOND
        assert kube.job_status(NS, "old")["image"] == FIRST
        reasons = [d["reason"] for d in kube.job_status(NS, "old")["decisions"]]
        assert not any("spec changed" in r for r in reasons), reasons

        # Naming an image moves a job on purpose: its gang restarts on it.
        kube.custom.patch_namespaced_custom_object(
            builders.GROUP, builders.VERSION, NS, "trainingjobs", "old", {"spec": {"image": SECOND}})
        wait_for(lambda: kube.job_status(NS, "old").get("image") == SECOND, what="status.image moved")
        moved = wait_for(lambda: (now := _live(kube, "old", "trainer")) and _images(now) == {SECOND}
                         and len(now) == 2 and now, what="old's gang on the named image")
        assert _images(moved) == {SECOND}


def test_an_operator_upgrade_rolls_no_inference_replica(
        cluster: EmulatedCluster, kube: builders.Kube) -> None:
    """The replicas' template hash holds the image: had the upgrade's image reached the spec the
    reconcile works from, every replica of every service would have been rolled."""
    with operator_mod.OperatorThread(cluster.api_client(), _settings(FIRST)):
        kube.create_job(NS, serving.make_inference_job("chat", "serve"), plural=IJ)
        first = wait_for(lambda: _live(kube, "chat", "server"), what="a replica")
        assert _images(first) == {FIRST}
    with operator_mod.OperatorThread(cluster.api_client(), _settings(SECOND)):
        # a change that rolls nothing, to know the new operator has reconciled the job
        kube.custom.patch_namespaced_custom_object(
            builders.GROUP, builders.VERSION, NS, IJ, "chat", {"spec": {"autoscaling": {"maxReplicas": 2}}})
        wait_for(lambda: kube.job_status(NS, "chat", IJ).get("observedGeneration") == 2,
                 what="the new operator's reconcile")
        assert sorted(_live(kube, "chat", "server")) == sorted(first)
        assert _images(_live(kube, "chat")) == {FIRST} and kube.job_status(NS, "chat", IJ)["image"] == FIRST


@pytest.mark.parametrize(("spec", "status", "want"), [
    ({}, {}, "operator:1"),
    ({}, {"image": "pinned:1"}, "pinned:1"),
    ({"image": "named:1"}, {"image": "pinned:1"}, "named:1"),
    ({"image": ""}, {"image": "pinned:1"}, ""),  # left for validation to refuse, naming spec.image
    # placed by an operator from before pinning (created between the new CRDs and the new
    # operator): it runs, and keeps, that operator's default, not the new --job-image
    ({}, {"graph": {"version": 3}}, common.DEFAULT_IMAGE),
])
def test_the_spec_wins_then_the_pinned_image_then_the_operators(spec: dict, status: dict, want: str) -> None:
    assert images.resolve({"spec": spec, "status": status}, "operator:1") == want


@pytest.mark.parametrize("bad", ["", "mirror.example/huorn 1"])
def test_a_job_image_that_is_no_image_reference_is_refused_naming_the_flag(bad: str) -> None:
    result = CliRunner().invoke(app, ["operator", "--job-image", bad, "--kubeconfig", "/nonexistent"])
    assert result.exit_code == 2
    assert "--job-image must be an image reference" in result.output and repr(bad) in result.output
    with pytest.raises(ValueError, match="job_image"):
        context.OperatorSettings(job_image=bad)
