"""Fail-slow detection for pipelined jobs (DP × PP), on synthetic per-rank telemetry shaped like
the pipeline trainer's: a rank slow in compute is named with its replica and stage, and the
longer waits it causes (its neighbour stages' receives, the other replicas' all-reduce) are not
reported as a slow network; a slow link, or a slow data-parallel all-reduce, still is.

The model of one step (rank = replica × stages + stage, M micro-batches, 1F1B): a replica's
pipeline runs at its slowest stage's pace plus one micro-batch of fill and drain through its
other stages, plus what its links add; a stage idles (receive wait) for the rest of that time;
every replica then waits in the all-reduce for the slowest replica."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from remediation_support import Seen

import huorn.graph.jobs  # noqa: F401  (registers the TrainingJob compiler)
from huorn.api.common import MitigationLevel, Remediation
from huorn.graph import compiler
from huorn.scheduler.remediation import failslow, ladder, policy

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"
STEPS, ONSET, M, MB = 120, 50, 4, 0.01  # MB: a healthy stage's seconds per micro-batch


@dataclass
class Fault:
    """What changes at step ONSET: compute factors by (replica, stage), seconds a step added by
    slow links by replica, seconds added to every all-reduce."""

    compute: dict[tuple[int, int], float] = field(default_factory=dict)
    link: dict[int, float] = field(default_factory=dict)
    allreduce: float = 0.0


def records(fault: Fault, stages: int = 2, replicas: int = 2, seed: int = 0,
            split: bool = True) -> dict[int, list[dict[str, Any]]]:
    """Every rank's step records, as `/telemetry` serves them, under the model in the docstring."""
    rng = np.random.default_rng(seed)
    out: dict[int, list[dict[str, Any]]] = {r: [] for r in range(stages * replicas)}
    for step in range(STEPS):
        slow = step >= ONSET
        mb = {(r, s): MB * float(np.exp(rng.normal(0, 0.02)))
              * (fault.compute.get((r, s), 1.0) if slow else 1.0)
              for r in range(replicas) for s in range(stages)}
        pipe = {}
        for r in range(replicas):
            per_stage = [mb[r, s] for s in range(stages)]
            pipe[r] = M * max(per_stage) + sum(per_stage) - max(per_stage) + 0.002 * stages \
                + (fault.link.get(r, 0.0) if slow else 0.0)
        allreduce = 0.002 + (fault.allreduce if slow else 0.0)
        step_seconds = max(pipe.values()) + allreduce + 0.003
        for r in range(replicas):
            for s in range(stages):
                own = M * mb[r, s]
                recv = max(0.0, pipe[r] - own) * float(np.exp(rng.normal(0, 0.03)))
                reduce = max(pipe.values()) - pipe[r] + allreduce * float(np.exp(rng.normal(0, 0.03)))
                comm = recv + reduce + 0.001
                record = {"step": step, "step_seconds": step_seconds, "compute_seconds": step_seconds - comm,
                          "comm_seconds": comm, "microbatch_seconds": mb[r, s]}
                if split:
                    record |= {"recv_wait_seconds": recv, "reduce_wait_seconds": reduce}
                out[r * stages + s].append(record)
    return out


def table(fault: Fault, stages: int = 2, replicas: int = 2, seed: int = 0,
          split: bool = True) -> failslow.PipelineTable:
    built = failslow.build_pipeline_table(*as_records(records(fault, stages, replicas, seed, split), stages))
    assert built is not None
    return built


def as_records(by_rank: dict[int, list[dict[str, Any]]], stages: int
               ) -> tuple[dict[str, list[tuple[int, dict[str, Any]]]], dict[str, failslow.PipelineRank]]:
    """Step records per rank, as the remediation policy holds them, and the ranks' places."""
    records = {str(rank): [(r["step"], r) for r in recs] for rank, recs in by_rank.items()}
    ranks = {str(rank): failslow.PipelineRank(f"trainer-{rank // stages}", rank, *divmod(rank, stages))
             for rank in by_rank}
    return records, ranks


def slowdowns(found: list[failslow.SlowFinding]) -> list[failslow.SlowFinding]:
    return [f for f in found if f.factor > 1]


@pytest.mark.parametrize("seed", range(3))
def test_a_rank_slow_in_compute_is_named_and_its_neighbours_are_not_blamed(seed: int) -> None:
    pipeline = table(Fault(compute={(1, 0): 3.0}), seed=seed)
    found = slowdowns(failslow.detect_pipeline_fail_slow(pipeline))
    assert [(f.kind, f.rank, f.replica, f.stage, f.worker) for f in found] == \
        [("compute", 2, 1, 0, "trainer-1")], found
    assert abs(found[0].onset_iteration - ONSET) <= 3 and found[0].factor > 2
    # the waits it causes did grow: the neighbour stage's receive wait, the other replica's
    # all-reduce wait; the detector saw them as effects, not as a slow link
    before = slice(10, ONSET)
    after = slice(ONSET + 5, STEPS)
    assert pipeline.recv_wait is not None and pipeline.reduce_wait is not None
    assert np.median(pipeline.recv_wait["3"][after]) > 2 * np.median(pipeline.recv_wait["3"][before])
    assert np.median(pipeline.reduce_wait["0"][after]) > 10 * np.median(pipeline.reduce_wait["0"][before])
    assert "rank 2: pipeline replica 1, stage 0" in found[0].where()


def test_a_slow_middle_stage_is_named_and_neither_link_is_blamed() -> None:
    found = slowdowns(failslow.detect_pipeline_fail_slow(table(Fault(compute={(1, 1): 3.0}), stages=3)))
    assert [(f.kind, f.rank, f.replica, f.stage) for f in found] == [("compute", 4, 1, 1)], found


def test_a_replica_slow_as_a_whole_is_named_and_its_own_waits_are_explained() -> None:
    pipeline = table(Fault(compute={(1, 0): 3.0, (1, 1): 3.0}))
    found = slowdowns(failslow.detect_pipeline_fail_slow(pipeline))
    # half the ranks, but one replica of two: named, not merged into a job-wide finding
    assert [(f.kind, f.rank, f.replica) for f in found] == [("compute", 2, 1), ("compute", 3, 1)], found
    # its stages wait longer for each other (the fill and drain grow with them), which alone
    # would read as a slow link: the explanation rule is what keeps it out
    waits = slowdowns(failslow._pipeline_network(pipeline, failslow.bocd.BocdConfig(), 0.1))
    assert [(f.link, f.replica) for f in waits] == [(True, 1)], waits


def test_a_slow_link_is_reported_as_communication_of_that_replica() -> None:
    found = slowdowns(failslow.detect_pipeline_fail_slow(table(Fault(link={1: 0.04}))))
    assert [(f.kind, f.link, f.replica, f.stage, f.rank) for f in found] == \
        [("communication", True, 1, 0, None)], found
    assert found[0].worker == failslow.JOB_WIDE
    assert found[0].where() == "the link from stage 0 to stage 1 of pipeline replica 1"


def test_a_slow_link_in_a_longer_pipeline_names_its_replica() -> None:
    found = slowdowns(failslow.detect_pipeline_fail_slow(table(Fault(link={0: 0.04}), stages=3)))
    assert [(f.kind, f.link, f.replica) for f in found] == [("communication", True, 0)], found
    assert found[0].where() == "the links between the stages of pipeline replica 0"


def test_a_slow_link_in_a_longer_pipeline_names_its_replica_when_one_link_shifts_alone() -> None:
    # behind a slow link the far links' waits grow less (the delay fills slack their stages had),
    # and under load they may not validate at all: the link whose waits did is not thereby the
    # slow one (a local run with replica 1's backward link from stage 2 to stage 1 slowed saw only
    # the link from stage 0 to stage 1 validate), so with three stages the waits still name only
    # the replica
    pipeline = table(Fault(link={0: 0.04}), stages=3)
    assert pipeline.recv_wait is not None
    far = pipeline.recv_wait["2"]  # replica 0's last stage: the far link's end that waits least
    far[ONSET:] = np.resize(far[10:ONSET], STEPS - ONSET)  # its waits as before the fault

    def shifts(ends: list[str]) -> list[tuple[int, int, float]]:
        assert pipeline.recv_wait is not None
        series = failslow._per_iteration(pipeline.steps, pipeline.recv_wait, ends, min)
        return [c for c in failslow._changes(*series, failslow.bocd.BocdConfig()) if c[2] > 1]

    assert len(shifts(["0", "1"])) == 1 and shifts(["1", "2"]) == []  # one link's waits shifted
    found = slowdowns(failslow.detect_pipeline_fail_slow(pipeline))
    assert [(f.kind, f.link, f.replica, f.stage) for f in found] == [("communication", True, 0, None)], found
    assert found[0].where() == "the links between the stages of pipeline replica 0"


def test_a_slow_all_reduce_is_reported_per_stage() -> None:
    found = slowdowns(failslow.detect_pipeline_fail_slow(table(Fault(allreduce=0.04))))
    assert [(f.kind, f.link, f.replica, f.stage) for f in found] == \
        [("communication", False, None, 0), ("communication", False, None, 1)], found


def test_a_stage_slow_in_every_replica_is_that_stages() -> None:
    found = slowdowns(failslow.detect_pipeline_fail_slow(table(Fault(compute={(0, 1): 3.0, (1, 1): 3.0}))))
    assert [(f.worker, f.kind, f.stage, f.replica) for f in found] == \
        [(failslow.JOB_WIDE, "compute", 1, None)], found
    assert found[0].where() == "stage 1 of every pipeline replica"


def test_without_the_waits_apart_a_slow_rank_is_still_named_and_a_slow_link_is_job_wide() -> None:
    found = slowdowns(failslow.detect_pipeline_fail_slow(table(Fault(compute={(1, 0): 3.0, (1, 1): 3.0}),
                                                               split=False)))
    assert [(f.kind, f.rank) for f in found] == [("compute", 2), ("compute", 3)], found
    found = slowdowns(failslow.detect_pipeline_fail_slow(table(Fault(link={1: 0.04}), split=False)))
    assert [(f.worker, f.kind, f.link) for f in found] == [(failslow.JOB_WIDE, "communication", False)]


def test_ddp_findings_print_as_before() -> None:
    assert failslow.SlowFinding("rank-1", "compute", 40, 50, 2.0).to_dict() == {
        "worker": "rank-1", "kind": "compute", "onset_iteration": 40, "detected_iteration": 50, "factor": 2.0}


# -- the policy: two stages per pod, as on the local backend and in a cluster ---------------------

def test_the_policy_names_the_slow_replica_from_pods_holding_two_stages() -> None:
    manifest = yaml.safe_load(QUICKSTART.read_text())
    manifest["spec"]["model"]["layers"] = 4
    manifest["spec"]["elasticity"].update(minReplicas=2, maxReplicas=2)
    manifest["spec"]["parallelism"] = {"pipelineStages": 2, "schedule": "1f1b"}
    graph = compiler.compile(manifest)
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s", max_mitigation="rebalance"),
                                   ladder.LadderCosts(rebalance=0.5))
    by_rank = records(Fault(compute={(1, 0): 3.0}))
    for step in range(0, STEPS, 4):  # a tick every 4 steps, as a monitor polls
        # the keys are the endpoint files' (`<pod>-<local rank>`); both ranks of a pod say the
        # pod's name, which is what made the old per-pod history interleave two stages
        seen = Seen(float(step), {
            f"trainer-{rank // 2}-{rank % 2}": {
                "rank": rank, "world_size": 4, "replica": f"trainer-{rank // 2}",
                "collective": {"entered": step, "completed": step, "in_flight": []},
                "heartbeat": float(step),
                "parameters": {"pipeline": {"stages": 2, "replicas": 2, "stage_layers": [2, 2]},
                               "micro_batches": {"total": 2 * M, "mine": M}},
                "steps": recs[max(0, step - 255):step + 1]}
            for rank, recs in by_rank.items()})
        pol.decide(graph, seen)
    first = pol.decisions[0]
    assert first.level is MitigationLevel.OBSERVE and first.ranks == (2,), pol.decisions
    assert "fail-slow (compute) on trainer-1 (rank 2: pipeline replica 1, stage 0)" in first.reason
    # and S2 moves micro-batches away from that replica
    s2 = [d for d in pol.decisions if d.action == "rebalance-microbatches"]
    assert s2 and s2[0].ranks == (2,) and "detected on pipeline replica 1" in s2[0].reason, pol.decisions
    counts = s2[0].plan["microbatches"]
    assert counts[1] < counts[0], counts  # type: ignore[index]
