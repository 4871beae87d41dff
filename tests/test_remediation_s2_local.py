"""End to end on the local backend: a rank made slower per micro-batch (a `slow-compute` fault with
perMicroBatch) is detected from its /telemetry, the ladder climbs to S2, the decision becomes a
set-param mutation with its reason, the backend writes the control file, and the trainer applies
the unequal split, after which steps get faster again."""

from __future__ import annotations

import statistics
from pathlib import Path

import job_support
import pytest
import remediation_support

from huorn.api.common import MitigationLevel
from huorn.backends.local import report
from huorn.scheduler.remediation import ladder

# Measures wall-clock behaviour of real processes: runs alone (scripts/test's serial part).
pytestmark = pytest.mark.serial

# From step 25, past the start-up's slower first steps on a loaded host (their easing is a change
# of its own, and the slowdown must begin a few steps after it to be told apart), rank 1 computes
# 4× slower than it measures itself: a fixed delay was a smaller slowdown the slower the host.
STEPS, SLOW_FROM, SLOW_FACTOR = 80, 25, 4.0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_slow_rank_leads_to_an_applied_s2_plan(tmp_path: Path) -> None:
    manifest = job_support.tiny_job(replicas=2, steps=STEPS, micro_batch=1,
                                    remediation={"hangTimeout": "60s", "maxMitigation": "rebalance"})
    run = remediation_support.run_with_faults(
        manifest, [{"kind": "slow-compute", "factor": SLOW_FACTOR, "perMicroBatch": True,
                    "fromStep": SLOW_FROM, "replica": "trainer-1"}],
        ladder.LadderCosts(rebalance=1.0), tmp_path / "run", STEPS)
    g, remediation, run_dir, actions = run.graph, run.remediation, run.run_dir, run.actions
    assert run.finished, actions[-3000:]
    s2 = [d for d in remediation.decisions if d.level is MitigationLevel.REBALANCE]
    assert len(s2) == 1, remediation.decisions
    counts = s2[0].plan["microbatches"]
    assert sum(counts) == 8 and counts[1] < counts[0]  # work moves away from the slow rank 1
    mutations = [m for m in g.log if m.action == "set-param" and m.detail["key"] == "microbatches"]
    assert len(mutations) == 1 and mutations[0].detail["new"] == counts
    assert mutations[0].reason.startswith("remediation S2 (rebalance-microbatches)")
    assert "wrote micro-batch counts" in actions
    records = report.read_records(run_dir)
    applied = [r for r in records if r.get("event") == "microbatch-plan"]
    assert applied and applied[0]["counts"] == counts and applied[0]["reason"] == mutations[0].reason
    steps = {r["step"]: r for r in records if r.get("event") == "step"}
    assert report.summarise_steps(list(steps.values())).last == STEPS
    start = applied[0]["from_step"]
    slow = [steps[s]["step_seconds"] for s in steps if SLOW_FROM + 2 < s < start]
    fixed = [steps[s]["step_seconds"] for s in steps if s > start + 1]
    assert slow and fixed and all(steps[s].get("microbatches") == counts for s in steps if s >= start)
    # even split: rank 1 takes 4 × 4 micro-batch times a step; rebalanced ([7, 1]: 7 × 1 against
    # 1 × 4), less than half of that, with the step's fixed costs on both (0.62 measured)
    assert statistics.median(fixed) < 0.8 * statistics.median(slow), (slow, fixed)
