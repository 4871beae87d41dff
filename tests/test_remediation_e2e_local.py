"""End to end on the local backend: a hang injected into the real runtime trainer is detected
from its /telemetry, ends in S4 (the culprit replica is replaced), and the job completes from
its checkpoint with no more steps recomputed than one checkpoint interval."""

from __future__ import annotations

import json
import time
from pathlib import Path

import job_support
import pytest

import huorn.graph.jobs  # noqa: F401  (registers the TrainingJob compiler)
from huorn.api.common import MitigationLevel, Remediation
from huorn.backends import monitor
from huorn.backends.local import backend as local_backend
from huorn.backends.local import report
from huorn.graph import compiler
from huorn.scheduler.remediation import policy

STEPS, INTERVAL, HANG_AT = 30, 5, 12


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_injected_hang_ends_in_s4_and_the_job_completes_from_its_checkpoint(tmp_path: Path) -> None:
    manifest = job_support.tiny_job(replicas=2, steps=STEPS, micro_batch=2, interval=INTERVAL,
                                    remediation={"hangTimeout": "5s", "maxMitigation": "restart"})
    spec = manifest["spec"]
    g = compiler.compile(manifest)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # Only the first generation of trainer-1 hangs: its replacement must run normally.
    (run_dir / "faults.json").write_text(json.dumps(
        {"faults": [{"kind": "hang-compute", "fromStep": HANG_AT, "replica": "trainer-1"}]}))
    backend = local_backend.LocalBackend(g, run_dir, local_backend.LocalSettings(step_limit=STEPS))
    remediation = policy.RemediationPolicy(Remediation.model_validate(spec["remediation"]))
    loop = monitor.Monitor(g, backend, [remediation])
    deadline = time.monotonic() + 780
    try:
        loop.start()
        result = loop.run(interval=0.5, should_stop=lambda _: time.monotonic() > deadline)
    finally:
        backend.stop(graceful=False)
    assert result.observation.finished, (run_dir / "actions.jsonl").read_text()[-3000:]
    restarts = [d for d in remediation.decisions if d.level is MitigationLevel.RESTART]
    assert len(restarts) == 1 and "non-communication" in restarts[0].reason
    replaced = [m for m in g.log if m.action == "replace" and "remediation S4" in m.reason]
    assert [m.detail for m in replaced] == [{"old": "trainer-1", "new": "trainer-1-g1"}]
    steps = [r for r in report.read_records(run_dir) if r.get("event") == "step"]
    summary = report.summarise_steps(steps)
    assert summary.last == STEPS and summary.missing == []
    assert summary.repeated <= INTERVAL  # only the steps since the last checkpoint are redone
