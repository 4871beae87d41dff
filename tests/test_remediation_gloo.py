"""Acceptance on real torch.distributed (gloo) jobs with injected faults: hangs named in ≤ 10 s,
a compute straggler detected and mitigated by S2 in the same run, a slow NIC located."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from huorn.api.common import MitigationLevel
from huorn.scheduler.remediation import hang, ladder, linkmatrix

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gloo_faults
import gloo_job

# Measures wall-clock behaviour of real processes: runs alone (scripts/test's serial part).
pytestmark = pytest.mark.serial

STARTUP_S = 180  # three fresh Python + torch processes on a loaded 2-core machine


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("fault", "kind"),
    [("hang-compute", hang.NON_COMMUNICATION), ("hang-collective", hang.COMMUNICATION)],
)
def test_hung_rank_is_named_and_classified_within_ten_seconds(tmp_path: Path, fault: str, kind: str) -> None:
    faults = [{"kind": fault, "rank": 1, "from_step": 25}]
    with gloo_job.GlooJob(tmp_path, world=3, steps=10_000, faults=faults) as job:
        job.wait_for_step(3, STARTUP_S)
        detector = hang.HangDetector(timeout=3.0)
        deadline = time.monotonic() + 120
        finding = None
        while finding is None and time.monotonic() < deadline:
            finding = detector.observe(job.rank_samples(), time.time())
            time.sleep(0.2)
        detected_at = time.time()
        stuck_since = job.read_telemetry()[1]["steps"][-1]["wall"]  # the culprit's last finished step
    assert finding is not None, "no hang was reported"
    assert (finding.kind, finding.culprits, finding.nodes) == (kind, (1,), ("node-1",))
    assert detected_at - stuck_since <= 10.0  # torch's watchdog: 600 s, and it names nobody
    decision = ladder.MitigationLadder(MitigationLevel.RESTART).on_hang(finding)
    assert decision.level is MitigationLevel.RESTART and decision.ranks == (1,)


@pytest.mark.slow
@pytest.mark.timeout(900)
# four ranks on two cores: beside another serial test, rank 0's neighbour-made slowdown was found
# as the straggler (CI, 2026-12-05); alone it takes 27 s
@pytest.mark.alone
def test_compute_straggler_is_detected_and_s2_recovers_most_of_the_loss(tmp_path: Path) -> None:
    result = gloo_job.run_straggler_scenario(tmp_path, startup_s=STARTUP_S)
    finding = result["finding"]
    assert (finding.worker, finding.kind) == (str(result["slow_rank"]), "compute")
    assert abs(finding.onset_iteration - result["onset"]) <= 20
    assert result["decision"].level is MitigationLevel.REBALANCE
    counts = result["plan"]
    assert sum(counts) == result["total_microbatches"] and counts[result["slow_rank"]] < min(counts[:-1])
    assert result["switched_at"] < result["steps"] - 30, "the plan came too late to measure"
    # S2 wins back more than half of the throughput lost (FALCON: 58.9-60.1 %). The plan's own
    # bound is 0.71; measured 0.68-0.80 beside two busy loops, but once 0.536 in the serial part on
    # a far slower host, where the neighbour test's load differs between the phases compared
    assert result["recovered_fraction"] >= 0.5, result
    # Uneven micro-batch counts still give the single-process gradient (weighted all-reduce).
    final = torch.load(tmp_path / "final.pt")
    reference = gloo_faults.reference_params(result["steps"], result["total_microbatches"], lr=0.05)
    for got, want in zip(final, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_delayed_sends_of_one_rank_show_as_a_bad_node_in_the_link_matrix(tmp_path: Path) -> None:
    faults = [{"kind": "slow-comm", "rank": 3, "from_step": 0, "ms": 20.0}]
    with gloo_job.GlooJob(tmp_path, world=4, steps=6, microbatches=1, base_ms=1.0, faults=faults,
                          probe_every=5) as job:
        job.wait(STARTUP_S)
        matrix = job.read_telemetry()[0]["links"]
    found = linkmatrix.locate_bad_links(np.array(matrix, dtype=float), ratio=2.0)
    assert [(f.kind, f.ranks) for f in found] == [("node", (3,))]
