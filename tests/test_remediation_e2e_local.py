"""End to end on the local backend: a hang injected into the real runtime trainer is detected
from its /telemetry, ends in S4 (the culprit replica is replaced), and the job completes from
its checkpoint with no more steps recomputed than one checkpoint interval."""

from __future__ import annotations

from pathlib import Path

import job_support
import pytest

import huorn.graph.jobs  # noqa: F401  (registers the TrainingJob compiler)
from huorn.api.common import MitigationLevel, Remediation
from huorn.backends.local import report
from huorn.graph import compiler
from huorn.scheduler.remediation import policy

# Measures wall-clock behaviour of real processes: runs alone (scripts/test's serial part).
pytestmark = pytest.mark.serial

STEPS, INTERVAL, HANG_AT = 30, 5, 12


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_injected_hang_ends_in_s4_and_the_job_completes_from_its_checkpoint(tmp_path: Path) -> None:
    manifest = job_support.tiny_job(replicas=2, steps=STEPS, micro_batch=2, interval=INTERVAL,
                                    remediation={"hangTimeout": "5s", "maxMitigation": "restart"})
    spec = manifest["spec"]
    g = compiler.compile(manifest)
    run_dir = tmp_path / "run"
    remediation = policy.RemediationPolicy(Remediation.model_validate(spec["remediation"]))
    # Only the first generation of trainer-1 hangs: its replacement must run normally.
    result = job_support.run_local(g, run_dir, [{"kind": "hang-compute", "fromStep": HANG_AT,
                                                 "replica": "trainer-1"}], [remediation], STEPS, budget_s=780)
    assert result.observation.finished, (run_dir / "actions.jsonl").read_text()[-3000:]
    restarts = [d for d in remediation.decisions if d.level is MitigationLevel.RESTART]
    assert len(restarts) == 1 and "non-communication" in restarts[0].reason
    replaced = [m for m in g.log if m.action == "replace" and "remediation S4" in m.reason]
    assert [m.detail for m in replaced] == [{"old": "trainer-1", "new": "trainer-1-g1"}]
    steps = [r for r in report.read_records(run_dir) if r.get("event") == "step"]
    summary = report.summarise_steps(steps)
    assert summary.last == STEPS and summary.missing == []
    assert summary.repeated <= INTERVAL  # only the steps since the last checkpoint are redone
