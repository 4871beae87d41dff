"""Which link of a pipeline is slow, on synthetic per-rank telemetry with 3 stages shaped like the
pipeline trainer's: the 1F1B model of test_remediation_failslow_pipeline.py (a slow link adds
to its replica's step, and every stage of that replica waits for it), plus what the runtime
publishes on each rank's outgoing links, seconds per message and messages per step. Only the
slow link's own messages take longer; the waits alone name the replica but not the link."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_remediation_failslow_pipeline as pipeline
import yaml
from remediation_support import Seen

from huorn.api.common import MitigationLevel, Remediation
from huorn.graph import compiler
from huorn.scheduler.remediation import failslow, ladder, policy

STAGES, MESSAGE_S = 3, 0.0005  # a healthy link's seconds per message
Link = tuple[int, int, str]  # replica, the stage before the link, direction


def records(slow: dict[Link, float], compute: dict[tuple[int, int], float] | None = None,
            stages: int = STAGES, replicas: int = 2, seed: int = 0,
            late_receiver: bool = False) -> dict[int, list[dict[str, Any]]]:
    """Every rank's step records with its outgoing links. `slow` adds seconds to every message of
    a link from step ONSET; its replica's pipeline then takes that many seconds longer per
    micro-batch. `late_receiver`: a slow stage also makes the link into it longer, as a send on
    NCCL waits for its receive to be posted."""
    added: dict[int, float] = {}
    for (replica, _, _), seconds in slow.items():
        added[replica] = added.get(replica, 0.0) + pipeline.M * seconds
    by_rank = pipeline.records(pipeline.Fault(compute=compute or {}, link=added), stages, replicas, seed)
    rng = np.random.default_rng(seed + 100)
    for rank, recs in by_rank.items():
        replica, stage = divmod(rank, stages)
        for record in recs:
            after = record["step"] >= pipeline.ONSET
            for name, direction, peer, present in (("send_link", "forward", stage + 1, stage < stages - 1),
                                                   ("grad_link", "backward", stage - 1, stage > 0)):
                if not present:
                    continue
                before = min(stage, peer)
                seconds = MESSAGE_S * float(np.exp(rng.normal(0, 0.1)))
                if after:
                    seconds += slow.get((replica, before, direction), 0.0)
                    factor = (compute or {}).get((replica, peer), 1.0)
                    if late_receiver and factor > 1:
                        seconds += pipeline.MB * (factor - 1)
                record[f"{name}_seconds_per_message"] = seconds
                record[f"{name}_messages"] = pipeline.M
    return by_rank


def table(by_rank: dict[int, list[dict[str, Any]]], stages: int = STAGES) -> failslow.PipelineTable:
    built = failslow.build_pipeline_table(*pipeline.as_records(by_rank, stages))
    assert built is not None
    return built


def slowdowns(built: failslow.PipelineTable) -> list[failslow.SlowFinding]:
    return [f for f in failslow.detect_pipeline_fail_slow(built) if f.factor > 1]


EVERY_LINK = [(replica, stage, direction) for replica in (0, 1) for stage in (0, 1)
              for direction in ("forward", "backward")]


@pytest.mark.parametrize("link", EVERY_LINK, ids=lambda link: "r{}-s{}-{}".format(*link))
def test_the_slow_link_of_three_stages_is_named_with_its_direction(link: Link) -> None:
    replica, stage, direction = link
    built = table(records({link: 0.01}))
    found = slowdowns(built)
    assert [(f.kind, f.link, f.replica, f.stage, f.direction, f.rank) for f in found] == \
        [("communication", True, replica, stage, direction, None)], found
    assert abs(found[0].onset_iteration - pipeline.ONSET) <= 3 and found[0].factor > 5
    # the waits grew along the whole pipeline, far from the link too: without the links'
    # figures the same telemetry names the replica and no link
    built.send_link.clear()
    built.grad_link.clear()
    assert [(f.link, f.replica, f.stage) for f in slowdowns(built)] == [(True, replica, None)]


def test_the_named_link_reads_as_an_operator_would_say_it() -> None:
    found = slowdowns(table(records({(0, 1, "forward"): 0.01})))
    assert found[0].where() == "the forward link (activations) from stage 1 to stage 2 of pipeline replica 0"
    assert found[0].to_dict()["direction"] == "forward"
    found = slowdowns(table(records({(1, 0, "backward"): 0.01})))
    assert found[0].where() == "the backward link (gradients) from stage 1 to stage 0 of pipeline replica 1"


def test_both_directions_of_one_link_are_one_finding() -> None:
    found = slowdowns(table(records({(1, 1, "forward"): 0.01, (1, 1, "backward"): 0.01})))
    assert [(f.replica, f.stage, f.direction) for f in found] == [(1, 1, "both")], found
    assert found[0].where() == "both directions of the link between stage 1 and stage 2 of pipeline replica 1"


def test_two_slow_links_of_two_replicas_are_both_named() -> None:
    found = slowdowns(table(records({(0, 0, "forward"): 0.01, (1, 1, "backward"): 0.01})))
    assert sorted((f.replica, f.stage, f.direction) for f in found) == [(0, 0, "forward"), (1, 1, "backward")]


def test_a_slow_middle_stage_is_compute_even_when_its_incoming_link_looks_longer() -> None:
    # on NCCL a send waits for its receive to be posted, so the link into a slow stage takes
    # longer too: that shift is the slow stage's effect, as its neighbours' waits are
    built = table(records({}, compute={(1, 1): 3.0}, late_receiver=True))
    found = slowdowns(built)
    assert [(f.kind, f.rank, f.replica, f.stage) for f in found] == [("compute", 4, 1, 1)], found
    # both links into stage 1 did shift: the explanation rule is what keeps them out
    links = [f for f in failslow._pipeline_network(built, failslow.bocd.BocdConfig(), 0.1) if f.factor > 1]
    assert [(f.replica, f.stage, f.direction) for f in links] == \
        [(1, 0, "forward"), (1, 1, "backward")], links


def test_healthy_links_change_nothing_else() -> None:
    assert slowdowns(table(records({}))) == []
    by_rank = records({})
    allreduce = pipeline.records(pipeline.Fault(allreduce=0.04), STAGES, 2, 0)
    for rank, recs in by_rank.items():  # the same links, with a slow all-reduce
        for mine, other in zip(recs, allreduce[rank], strict=True):
            other.update({k: v for k, v in mine.items() if "_link_" in k})
    found = slowdowns(table(allreduce))
    assert [(f.kind, f.link, f.replica, f.stage) for f in found] == \
        [("communication", False, None, s) for s in range(STAGES)], found


# -- the policy: link figures from the step records, as `/telemetry` serves them ------------------

def test_the_policy_reads_the_links_and_its_decision_names_the_slow_one() -> None:
    manifest = yaml.safe_load(pipeline.QUICKSTART.read_text())
    manifest["spec"]["model"]["layers"] = 6
    manifest["spec"]["elasticity"].update(minReplicas=2, maxReplicas=2)
    manifest["spec"]["parallelism"] = {"pipelineStages": STAGES, "schedule": "1f1b"}
    graph = compiler.compile(manifest)
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s", max_mitigation="observe"),
                                   ladder.LadderCosts(rebalance=0.5))
    by_rank = records({(1, 1, "forward"): 0.01})
    for step in range(0, pipeline.STEPS, 4):
        seen = Seen(float(step), {
            f"trainer-{rank // STAGES}-{rank % STAGES}": {
                "rank": rank, "world_size": 2 * STAGES, "replica": f"trainer-{rank // STAGES}",
                "collective": {"entered": step, "completed": step, "in_flight": []},
                "heartbeat": float(step),
                "parameters": {"pipeline": {"stages": STAGES, "replicas": 2, "stage_layers": [2, 2, 2]},
                               "micro_batches": {"total": 2 * pipeline.M, "mine": pipeline.M}},
                "steps": recs[max(0, step - 255):step + 1]}
            for rank, recs in by_rank.items()})
        pol.decide(graph, seen)
    built = pol.build_pipeline_table()
    assert built is not None
    rank = {w: p.rank for w, p in built.ranks.items()}  # a history is its pod's and rank's
    assert sorted(rank[w] for w in built.send_link) == [0, 1, 3, 4]
    assert sorted(rank[w] for w in built.grad_link) == [1, 2, 4, 5]
    assert [d.level for d in pol.decisions] == [MitigationLevel.OBSERVE], pol.decisions
    assert "fail-slow (communication) on the forward link (activations) from stage 1 to stage 2 of " \
           "pipeline replica 1" in pol.decisions[0].reason, pol.decisions[0]


def test_a_rank_whose_records_lack_the_links_is_read_without_them() -> None:
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s", max_mitigation="observe"),
                                   ladder.LadderCosts(rebalance=0.5))
    by_rank = records({})
    for rank, recs in by_rank.items():
        pol.positions[str(rank)] = failslow.PipelineRank(f"trainer-{rank // STAGES}", rank,
                                                         rank // STAGES, rank % STAGES)
        pol.history[str(rank)] = {r["step"]: r for r in recs}
    del pol.history["1"][60]["send_link_seconds_per_message"]  # one record of an older runtime
    built = pol.build_pipeline_table()
    assert built is not None
    assert sorted(built.send_link) == ["0", "3", "4"] and sorted(built.grad_link) == ["1", "2", "4", "5"]


def test_with_the_links_figures_waits_that_no_link_shows_are_not_a_slow_link() -> None:
    # the replica's waits grow as behind a slow link, but no link's own messages take longer
    # (a wait that validated before the link's own shift, on a real run): the links' figures
    # decide, and the waits alone are read only where they are missing
    by_rank = records({})
    waits = pipeline.records(pipeline.Fault(link={0: pipeline.M * 0.01}), STAGES, 2, 0)
    for rank, recs in by_rank.items():
        for mine, other in zip(recs, waits[rank], strict=True):
            other.update({k: v for k, v in mine.items() if "_link_" in k})
    built = table(waits)
    assert slowdowns(built) == []
    built.send_link.clear()
    built.grad_link.clear()
    assert [(f.link, f.replica, f.stage) for f in slowdowns(built)] == [(True, 0, None)]


@pytest.mark.parametrize("effect", [(0, 0, "backward"), (0, 1, "backward")],
                         ids=["into-stage-0", "into-stage-1"])
def test_links_that_wait_for_receivers_behind_a_slow_link_are_not_named(effect: Link) -> None:
    """Behind a slow forward link the replica's backward links take longer too: each send waits
    for its receiver, who waited for the slow link first (on a loaded CPU 1-3 ms a message,
    against the slow link's 20; here 10 ms against 50, enough to move the step by 10 % on its
    own). Only the slow link is named; a cable slow both ways (both directions alike) stays one
    finding with direction "both"."""
    slow = (0, 1, "forward")
    found = slowdowns(table(records({slow: 0.05, effect: 0.01})))
    assert [(f.replica, f.stage, f.direction) for f in found] == [slow], found
    both = slowdowns(table(records({slow: 0.02, (0, 1, "backward"): 0.02})))
    assert [(f.replica, f.stage, f.direction) for f in both] == [(0, 1, "both")], both


def test_a_real_shift_is_not_absorbed_by_jitter_near_zero_at_the_warmup_end() -> None:
    """Recorded from tests/test_remediation_failslow_link_local.py (the backward link of replica
    1 slowed by 20 ms a message from step 13) in a run that named nothing: before the fault the
    link took 0.07-0.16 ms a message with spikes of 0.5-5 ms, a 30× swing in log space. Two
    spikes at steps 10 and 11, merged by the median-of-three into a plateau that began inside
    the warm-up, started a run that absorbed the 20 ms shift for good. Floored at half of
    min_shift of the step, the jitter is gone and the link is named."""
    found = failslow.detect_pipeline_fail_slow(recorded_table("slow_link_warmup_plateau.json"))
    assert [(f.kind, f.link, f.replica, f.stage, f.direction, f.onset_iteration) for f in found] == [
        ("communication", True, 1, 1, "backward", 13)], found


def recorded_table(name: str, last_step: int | None = None) -> failslow.PipelineTable:
    """A recorded run of the local slow-link test (3 stages; rank → history of step records)."""
    recorded = json.loads((Path(__file__).parent / "data" / name).read_text())
    ranks = {w: failslow.PipelineRank(f"replica-{int(w) // 3}", int(w), int(w) // 3, int(w) % 3)
             for w in recorded}
    built = failslow.build_pipeline_table(
        {w: sorted((int(s), r) for s, r in steps.items() if last_step is None or int(s) <= last_step)
         for w, steps in recorded.items()}, ranks)
    assert built is not None
    return built


@pytest.mark.parametrize("last_step", [30, 49])
def test_a_link_is_not_explained_by_its_sender_or_by_a_later_slowdown(last_step: int) -> None:
    """Recorded from tests/test_remediation_failslow_link_local.py (full suite, 2026-12-03): the
    backward link from stage 2 to stage 1 of replica 1 slowed by 40 ms a message from step 13,
    and the host's load then made rank 5 (that link's sender) compute 3.6× slower from step 19,
    and every rank from 17-18 when read to the run's end. Either shift took the link's finding
    away as its explanation. Neither can be: a sender computes before it sends, so its compute
    does not lengthen its own messages, and a slowdown that began 4 steps or more after the
    link's cannot have caused it. The compute shifts are reported as well, as what they are:
    read to step 49, rank 5's return from ~300 ms to ~90 ms at step 28 too, a recovery (measured
    against the steps since its slowdown began, not the 100 before its onset, most of them
    healthy: failslow._rise)."""
    found = failslow.detect_pipeline_fail_slow(recorded_table("slow_link_sender_slows_later.json", last_step))
    link = [(f.kind, f.replica, f.stage, f.direction, f.onset_iteration) for f in found if f.link]
    assert link == [("communication", 1, 1, "backward", 13)], found
    rest = [(f.kind, f.rank, f.factor < 1) for f in found if not f.link]
    assert rest == ([("compute", 5, False)] if last_step == 30
                    else [("job-wide", None, False), ("compute", 5, True)]), found


def test_a_slow_receiver_still_explains_its_incoming_link() -> None:
    """The other half of the rule: the stage that receives on a link, slowed at the link's onset,
    explains the link's longer messages (on NCCL a send waits for its receive to be posted)."""
    receiver = failslow.SlowFinding("r1", "compute", 12, 22, 2.0, rank=4, replica=1, stage=1)
    sender = dataclasses.replace(receiver, rank=5, stage=2)
    link = failslow.SlowFinding(failslow.JOB_WIDE, "communication", 12, 22, 3.0, replica=1, stage=1,
                                link=True, direction="backward")
    assert failslow._explained(link, [receiver])
    assert not failslow._explained(link, [sender])
    assert not failslow._explained(link, [dataclasses.replace(receiver, onset_iteration=16)])
    assert failslow._explained(dataclasses.replace(link, direction=None), [sender])  # from waits


@pytest.mark.parametrize("healthy_from", [80, 90])
def test_a_slow_links_recovery_is_named_as_the_link_its_slowdown_was(healthy_from: int) -> None:
    """The forward link (0, 1) is 50 ms slow a message from step 50 (its late receiver 10 ms), then
    healthy again. The recovery was validated against the steps since the slowdown began, but the
    rises that tell a late receiver from its link were still taken across it (both near 0), so
    the receiver's drop was kept and merged with the link's into `both` directions, which is not
    where the ladder's slowdown is: its incident never ended."""
    slow, receiver = (0, 1, "forward"), (0, 1, "backward")
    bad, good = records({slow: 0.05, receiver: 0.01}), records({})
    spliced = {rank: [b if b["step"] < healthy_from else g
                      for b, g in zip(bad[rank], good[rank], strict=True)] for rank in bad}
    found = [f for f in failslow.detect_pipeline_fail_slow(table(spliced)) if f.link]
    assert [(f.direction, f.factor > 1) for f in found] == [("forward", True), ("forward", False)], found
    lad = ladder.MitigationLadder(MitigationLevel.RESTART)
    lad.on_fail_slow(found[0], ())
    over = lad.on_recovery(found[1], [f.onset_iteration for f in found if f.where() == found[1].where()])
    assert over is not None and over.action == "recovered" and lad.level is None
