"""S2 end to end for a pipelined job on the local backend: 2 stages × 2 replicas (two torchrun
agents of two ranks each). The ranks of agent trainer-1 are made slower per layer forward from
step 12, so its whole pipeline replica runs slower per micro-batch. The policy reads every rank's
/telemetry, takes the replica's speed from its slowest stage, the ladder (capped at `rebalance`)
climbs to S2, the decision becomes a `microbatches` set-param with one count per pipeline
replica, the backend writes the control file, and the trainers run the unequal tables from a
step boundary on, with no restart and no step lost or repeated. The fail-slow detector names
that replica (its ranks, with their stages) rather than a job-wide communication slowdown."""

from __future__ import annotations

import json
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

STEPS, SLOW_FROM, SLOW_MS = 70, 12, 25


# four ranks that fill the machine: beside another serial test, a neighbour's load read as the
# slow rank (both failed in the serial part on 2026-12-05, twice in two runs; alone, both pass)
@pytest.mark.alone
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_slow_pipeline_replica_gets_fewer_micro_batches(tmp_path: Path) -> None:
    manifest = job_support.tiny_job(replicas=2, steps=STEPS, micro_batch=1, layers=4,
                                    parallelism={"pipelineStages": 2, "schedule": "1f1b"},
                                    remediation={"hangTimeout": "60s", "maxMitigation": "rebalance"})
    run = remediation_support.run_with_faults(
        manifest, [{"kind": "slow-compute", "ms": SLOW_MS, "perLayer": True, "fromStep": SLOW_FROM,
                    "replica": "trainer-1"}],
        ladder.LadderCosts(rebalance=1.0), tmp_path / "run", STEPS)
    g, remediation, run_dir, actions = run.graph, run.remediation, run.run_dir, run.actions
    assert run.finished, actions[-3000:]
    s2 = [d for d in remediation.decisions
          if d.level is MitigationLevel.REBALANCE and "microbatches" in d.plan]
    assert s2 and s2[0].action == "rebalance-microbatches", remediation.decisions
    counts = s2[0].plan["microbatches"]
    # which pipeline replica agent trainer-1 became depends on the rendezvous order
    endpoints = [json.loads(p.read_text()) for p in (run_dir / "endpoints").glob("*.json")]
    slow_replica = {e["rank"] // 2 for e in endpoints if e["replica"] == "trainer-1"}
    assert len(slow_replica) == 1 and len(endpoints) == 4, endpoints
    slow = slow_replica.pop()
    # the detector named that replica, not a job-wide communication slowdown (its neighbours' and
    # the other replica's waits grew too). Both its ranks are slowed; the first decision carries
    # those whose change point has validated by then: both in most runs, but once (of many
    # full-suite runs) only stage 1's, stage 0's validating a poll later.
    first = remediation.decisions[0]
    assert first.level is MitigationLevel.OBSERVE and "(compute)" in first.reason, first
    assert f"pipeline replica {slow}," in first.reason, first
    assert first.ranks and set(first.ranks) <= {2 * slow, 2 * slow + 1}, first
    assert f"detected on pipeline replica {slow}" in s2[0].reason, s2[0]
    assert len(counts) == 2 and sum(counts) == 8 and counts[slow] < counts[1 - slow], counts
    mutations = [m for m in g.log if m.action == "set-param" and m.detail["key"] == "microbatches"]
    assert mutations and mutations[0].detail["new"] == counts
    assert mutations[0].reason.startswith("remediation S2 (rebalance-microbatches)")
    assert "wrote micro-batch counts" in actions
    records = report.read_records(run_dir)
    applied = [r for r in records if r.get("event") == "microbatch-plan"]
    assert applied and applied[0]["counts"] == counts, applied
    assert not [r for r in records if r.get("event") == "microbatch-plan-rejected"]
    steps = {r["step"]: r for r in records if r.get("event") == "step"}
    summary = report.summarise_steps(list(steps.values()))
    assert summary.last == STEPS and not summary.missing and summary.repeated == 0, summary
    start = applied[0]["from_step"]
    until = applied[1]["from_step"] if len(applied) > 1 else STEPS + 1
    assert all(steps[s].get("microbatches") == counts for s in steps if start <= s < until)
    before = [steps[s]["step_seconds"] for s in steps if SLOW_FROM + 2 < s < start]
    after = [steps[s]["step_seconds"] for s in steps if start + 1 < s < until]
    print(f"counts {counts} from step {start}: median step {statistics.median(before):.3f}s -> "
          f"{statistics.median(after):.3f}s")
    # even: the slow replica runs 4 micro-batches through 2 slowed layers per stage; after S2, fewer
    assert statistics.median(after) < statistics.median(before) - 0.05
