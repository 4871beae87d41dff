"""A real slow link between pipeline stages, detected and named (local backend, 3 stages, 1 or 2
pipeline replicas of one torchrun agent each). From step 12, every message one rank sends on
one of its links is held back by fault injection's `slow-link`, in the executor's send path:
the forward link of rank 1 (stage 1's activations to stage 2, one replica, 20 ms a message), or
the backward link of rank 5 (replica 1's last stage, its gradients to stage 1, 40 ms). Either
way the link carries 160 ms more a step: a replica of two runs half the micro-batches, so 20 ms
there added 80 ms, which FALCON's validation (the step must move by 10 %) passed or not as the
shared host's load made the step 0.6 s or 1 s long. Behind a slow link
every stage of the replica may wait longer, stage 0 too (by how much depends on the host's load),
so the receive waits alone could name the replica at most, never the link; the link's own seconds
per message name it, in its direction. Nobody's
compute may be blamed for it, the sender's included: a last stage whose gradient link is slow
waits for it to drain at the end of the step (34 ms a step here), which counted as compute would
have named its GPU. With two replicas the other replica waits in the all-reduce, which is not
blamed either. The ladder is capped at `observe`."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import job_support
import pytest
import remediation_support

from huorn.api.common import MitigationLevel
from huorn.scheduler.remediation import failslow, ladder, policy

# Measures wall-clock behaviour of real processes: runs alone (scripts/test's serial part).
pytestmark = pytest.mark.serial

STEPS, SLOW_FROM = 50, 12


# Alone: three and six ranks fill both cores, and beside another serial test the neighbour's load
# was once found first, as a compute fail-slow of the slowed rank from the step before the fault
# (the full suite of 2026-12-05, evening; it passed alone three times and in the serial part again).
@pytest.mark.alone
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("replicas", "rank", "direction", "slow_ms", "where", "quiet"), [
    (1, 1, "forward", 20, "the forward link (activations) from stage 1 to stage 2 of pipeline replica 0",
     ("0", "send_link")),
    (2, 5, "backward", 40, "the backward link (gradients) from stage 2 to stage 1 of pipeline replica 1",
     ("4", "grad_link")),
], ids=["forward-one-replica", "backward-two-replicas"])
def test_a_slow_link_of_a_three_stage_pipeline_is_named(
        tmp_path: Path, replicas: int, rank: int, direction: str, slow_ms: int, where: str,
        quiet: tuple[str, str]) -> None:
    manifest = job_support.tiny_job(replicas=replicas, steps=STEPS, micro_batch=1, layers=6,
                                    parallelism={"pipelineStages": 3, "schedule": "1f1b"},
                                    remediation={"hangTimeout": "60s", "maxMitigation": "observe"})
    run = remediation_support.run_with_faults(
        manifest,
        [{"kind": "slow-link", "ms": slow_ms, "direction": direction, "fromStep": SLOW_FROM, "rank": rank}],
        ladder.LadderCosts(rebalance=1.0), tmp_path / "run", STEPS)
    assert run.finished, run.actions[-3000:]
    decisions = run.remediation.decisions
    if [d.level for d in decisions] != [MitigationLevel.OBSERVE]:
        pytest.fail(f"decisions: {decisions}\n{explain(run, rank, tmp_path)}", pytrace=False)
    assert f"fail-slow (communication) on {where} " in decisions[0].reason, decisions[0].reason
    assert decisions[0].ranks == (), decisions[0]
    # the runtime's figures: the slowed link's seconds per message grew by the delay, and the same
    # direction's link of the next stage did not. NB: by the delay, not by a ratio. What a stage
    # beyond the slowed link waits for is not asserted: before the fault it waits for the other
    # stages' compute, which on a shared CPU grows with the machine's load (0.014 to 0.056 s a step
    # over 35 runs on a 2-core box), so its growth ranged from 0.071 s to -0.075 s (a loaded host,
    # the suite's parallel part at 780 s instead of 550) behind the same 20 ms link.
    history = by_rank(run.remediation)

    def median(rank: str, key: str, after: bool) -> float:
        return statistics.median(r[key] for s, r in history[rank].items()
                                 if (s > SLOW_FROM + 3 if after else 2 < s < SLOW_FROM))

    slowed = "send_link" if direction == "forward" else "grad_link"
    per_message = f"{slowed}_seconds_per_message"
    assert median(str(rank), per_message, True) > median(str(rank), per_message, False) + 0.8 * slow_ms / 1000
    assert median(quiet[0], f"{quiet[1]}_seconds_per_message", True) < slow_ms / 2000
    table = run.remediation.build_pipeline_table()
    assert table is not None
    first = [w for w, p in table.ranks.items() if p.stage == 0]
    last = [w for w, p in table.ranks.items() if p.stage == 2]
    assert sorted(table.send_link) == sorted(set(table.ranks) - set(last))
    assert sorted(table.grad_link) == sorted(set(table.ranks) - set(first))

    def caused(found: list[failslow.SlowFinding]) -> list[failslow.SlowFinding]:
        """The slowdowns that start with the fault. What it could wrongly blame (the sender's
        drain, the other replica's all-reduce wait) starts with it too. NB: a rank's compute
        may also slow down later in the run by 10% of the step or more when the shared CPU's
        load changes, which the detector rightly reports: rank 0's, 1.6 to 2× from 6 steps after
        the fault's start, in 2 runs of 16 on a 2-core box that other jobs were using."""
        return [f for f in found if f.factor > 1 and abs(f.onset_iteration - SLOW_FROM) <= 3]

    # Every finding of the detector on the steps it had seen when it named the link (and the few
    # after the detected one that the policy's table also had): the link, and nobody's compute.
    # NB: not over the whole run: with one replica any compute shift of any rank near the fault's
    # onset explains the link's wait away, and over the whole run the host's load has more time to
    # make one (the full suite's serial part, 1 run in 2 on 2026-12-03, in runs whose decisions had
    # named the link).
    named = run.remediation.ladder.finding
    assert named is not None and (named.kind, named.where()) == ("communication", where), named
    early = failslow.build_pipeline_table(
        {w: sorted((s, r) for s, r in h.items() if s <= named.detected_iteration + 8)
         for w, h in run.remediation.history.items()},
        run.remediation.positions)
    assert early is not None
    found = failslow.detect_pipeline_fail_slow(early)  # the link's onset is within 3 steps too
    # NB: a compute shift that starts with the link's may be reported beside it, never instead of
    # it (the decision above is the link's). Three ranks share two cores here, and a slow link
    # changes which stages compute at the same time: once (full serial part, 2026-12-03) the
    # sender's compute went from 0.10 to 0.15 s a step at the link's onset and back to 0.08 s
    # 17 steps later, with the other ranks' at the same step, while its link stayed slow.
    links = [(f.kind, f.where()) for f in caused(found) if f.link]
    if links != [("communication", where)]:
        pytest.fail(f"offline findings {found}\n{explain(run, rank, tmp_path)}", pytrace=False)
    # NB: the same run without the links' figures is not asserted here. Its finding rests on the
    # waits behind the link, which the host's load moves as described above: CI's run of 2026-12-03
    # found nothing in them (the link's own figures named it in the same run). Reading waits alone
    # is tested on built tables, tests/test_remediation_failslow_pipeline_links.py.


def by_rank(remediation: policy.RemediationPolicy) -> dict[str, dict[int, dict]]:
    """Each rank's history by its rank (the policy keys them `<pod>/<rank>`)."""
    return {str(p.rank): remediation.history[w] for w, p in remediation.positions.items()
            if w in remediation.history}


def explain(run: remediation_support.RemediatedRun, rank: int, tmp_path: Path) -> str:
    """What a failure needs to be diagnosed after the fact: the run is gone by then, and this test
    fails rarely (about 1 run in 10-25 of the full suite on a 2-core box), so the offline verdict
    on the whole run, the steps each rank's history lacks, and the slowed rank's link series go
    into the failure message (pytest.fail does not shorten it), and every rank's history into a
    JSON file beside the run."""
    history = by_rank(run.remediation)
    dump = tmp_path / "history.json"
    steps = {w: {str(s): r for s, r in h.items()} for w, h in history.items()}
    dump.write_text(json.dumps(steps, default=str))
    lines = [f"every rank's history: {dump}"]
    table = run.remediation.build_pipeline_table()
    if table is not None:
        lines.append(f"offline findings: {failslow.detect_pipeline_fail_slow(table)}")
    for worker, steps in sorted(history.items()):
        missing = sorted(set(range(1, max(steps, default=0) + 1)) - set(steps))
        lines.append(f"rank {worker}: steps {min(steps, default=None)}..{max(steps, default=None)}, "
                     f"missing {missing}")
    for key in ("send_link_seconds_per_message", "grad_link_seconds_per_message", "compute_seconds",
                "recv_wait_seconds"):
        series = {s: r[key] for s, r in sorted(history.get(str(rank), {}).items()) if key in r}
        if series:
            lines.append(f"rank {rank} {key} (ms): "
                         + " ".join(f"{s}:{1000 * v:.0f}" for s, v in series.items()))
    return "\n".join(lines)
