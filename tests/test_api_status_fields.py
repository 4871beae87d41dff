"""The status fields the operator writes for evals and S3 rolls are typed in the API, so that
`kubectl explain` and a structural CRD describe them: what huorn.operator.evaluation builds
validates against TrainingJobStatus, field names included, and the CRD carries the schema."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from huorn.api.training import TrainingJobStatus
from huorn.api.virtualcluster import VirtualClusterStatus
from huorn.operator import context, evaluation, index, virtualclusters


def entry(step: int, phase: str = "Succeeded", **extra: object) -> dict:
    base = {"pod": f"job-eval-0-s{step}", "phase": phase, "step": step, "checkpoint": f"/ckpt/step-{step}",
            "time": "2026-11-30T14:00:00Z"}
    return base | extra


def test_what_the_operator_writes_validates_against_the_status_model() -> None:
    results = [entry(8, loss=2.5, sources={"code": 2.25, "math": 2.75}, perplexity=12.18, sourcesOmitted=3),
               entry(16, "Failed", message="OOMKilled")]
    status = evaluation.build_status({"evaluations": [{"step": 4, "phase": "Succeeded", "loss": 2.9}]},
                                     results)
    status |= {"resplitVersion": 12, "resplitReplacements": 4}
    parsed = TrainingJobStatus.model_validate(status)
    assert parsed.last_evaluation is not None and parsed.last_evaluation.phase == "Failed"
    assert parsed.last_evaluation.message == "OOMKilled"
    assert [e.step for e in parsed.evaluations] == [4, 8, 16]
    assert parsed.evaluations[1].loss == 2.5
    assert (parsed.resplit_version, parsed.resplit_replacements) == (12, 4)
    first = TrainingJobStatus.model_validate(evaluation.build_status({}, results[:1]))
    assert first.last_evaluation.sources_omitted == 3 and first.last_evaluation.sources["math"] == 2.75


def test_a_malformed_eval_result_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError, match=r"lastEvaluation\.phase"):
        TrainingJobStatus.model_validate({"lastEvaluation": entry(8, "Maybe")})


def test_the_crd_describes_the_new_status_fields() -> None:
    crd = yaml.safe_load(Path("crds/trainingjobs.huorn.io.yaml").read_text())
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert {"lastEvaluation", "evaluations", "resplitVersion", "resplitReplacements"} <= set(status)
    assert {"progressPercent", "estimatedRemainingSeconds", "estimatedRemaining"} <= set(status)
    columns = {c["name"]: c["jsonPath"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns["Progress"] == ".status.progressPercent" and columns["ETA"] == ".status.estimatedRemaining"
    last = status["lastEvaluation"]["properties"]
    assert last["phase"]["enum"] == ["Succeeded", "Failed"]
    assert status["evaluations"]["maxItems"] == evaluation.HISTORY


def test_every_virtual_cluster_status_key_the_operator_writes_is_declared_in_the_crd() -> None:
    """The operator wrote `waitingGPUs` while the model (so the CRD and `kubectl explain`) named
    it `waitingGpus`: a cluster stored both, the declared one always 0. Every key the
    VirtualCluster reconcile writes must be a declared status property."""
    ctx = context.Context(client=None, post_event=lambda *_: None)  # type: ignore[arg-type]
    ctx.index.nodes["a0"] = index.NodeRecord("a0", 8, {"pool": "a"})
    ctx.index.vcs["train"] = {"members": {"nodeSelector": {"matchLabels": {"pool": "a"}}}}
    usage = virtualclusters.compute_usage(ctx, "train")
    crd = yaml.safe_load(Path("crds/virtualclusters.huorn.io.yaml").read_text())
    declared = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert set(usage) <= set(declared), sorted(set(usage) - set(declared))
    parsed = VirtualClusterStatus.model_validate(usage | {"waitingGPUs": 6})
    assert parsed.waiting_gpus == 6 and not parsed.model_extra


class _Recorder:
    """The client calls a VirtualCluster's reconcile makes: its status patches, recorded."""

    def __init__(self) -> None:
        self.patches: list[dict] = []

    async def patch_status(self, plural: str, namespace: str | None, name: str, status: dict) -> dict:
        self.patches.append(status)
        return {}


def test_a_crd_that_prunes_the_line_does_not_make_every_tick_write() -> None:
    """Found by the final review: with the operator upgraded before its CRDs, the old CRD prunes
    status.line, the stored status never has it, and every tick wrote the status again."""
    import asyncio

    client = _Recorder()
    ctx = context.Context(client=client, post_event=lambda *_: None)  # type: ignore[arg-type]
    ctx.index.nodes["a0"] = index.NodeRecord("a0", 8, {"pool": "a"})
    body = {"metadata": {"name": "train", "generation": 1},
            "spec": {"members": {"nodeSelector": {"matchLabels": {"pool": "a"}}}}}
    asyncio.run(virtualclusters.reconcile(ctx, body))
    assert len(client.patches) == 1 and client.patches[0]["line"] == []
    stored = {k: v for k, v in client.patches[0].items() if k != "line"}  # what the old CRD keeps
    asyncio.run(virtualclusters.reconcile(ctx, {**body, "status": stored}))
    assert len(client.patches) == 1, client.patches[1:]
    # with the new CRD the line is stored, and compared as any other field
    asyncio.run(virtualclusters.reconcile(ctx, {**body, "status": client.patches[0]}))
    assert len(client.patches) == 1
