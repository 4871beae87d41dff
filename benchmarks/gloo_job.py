"""The controller side of the fault-injection harness: start a gloo job, read its telemetry the way
the operator's monitor does, hand decisions back (micro-batch plans), and stop it.

Used by tests/test_remediation_gloo.py and benchmarks/remediation.py, so that the benchmark's
numbers and the acceptance tests come from the same code.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from huorn.scheduler.remediation import hang, steptable

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("gloo_faults.py")


def pick_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GlooJob:
    """A world of `world` ranks, each a process in its own session (like a pod)."""

    def __init__(self, run_dir: Path, world: int = 3, steps: int = 100, microbatches: int = 8,
                 base_ms: float = 5.0, faults: list[dict] | None = None, probe_every: int = 0,
                 telemetry: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.world = world
        port = pick_free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.procs: list[subprocess.Popen] = []
        for rank in range(world):
            command = [sys.executable, str(WORKER), "--rank", str(rank), "--world", str(world),
                       "--port", str(port), "--run-dir", str(self.run_dir), "--steps", str(steps),
                       "--microbatches", str(microbatches), "--base-ms", str(base_ms),
                       "--faults", json.dumps(faults or []), "--probe-every", str(probe_every)]
            if not telemetry:
                command.append("--no-telemetry")
            with open(self.run_dir / f"rank-{rank}.log", "ab") as log:
                self.procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=log,
                                                   stderr=subprocess.STDOUT, start_new_session=True))
        self.plan_version = 0

    # -- telemetry ---------------------------------------------------------------------------
    def read_telemetry(self) -> dict[int, dict]:
        snapshots = {}
        for rank in range(self.world):
            try:
                snapshots[rank] = json.loads((self.run_dir / f"telemetry-{rank}.json").read_text())
            except (FileNotFoundError, ValueError):
                continue
        return snapshots

    def rank_samples(self) -> list[hang.RankSample]:
        now = time.time()
        snapshots = self.read_telemetry()
        return [hang.parse_runtime_telemetry(s, now, node=f"node-{r}") for r, s in snapshots.items()]

    def step_table(self, snapshots: dict[int, dict] | None = None) -> steptable.StepTable | None:
        """Per-rank busy time per step (compute and comm split), as the detector's generic table."""
        snapshots = snapshots if snapshots is not None else self.read_telemetry()
        rows = [{"iteration": s["step"], "worker": str(r), "time": s["compute"] + s["comm"],
                 "compute": s["compute"], "comm": s["comm"]}
                for r, snap in snapshots.items() for s in snap["steps"]]
        if not rows:
            return None
        return steptable.build_table(rows, (*steptable.REQUIRED, *steptable.OPTIONAL))

    def last_step(self) -> int:
        steps = [snap["steps"][-1]["step"] for snap in self.read_telemetry().values() if snap["steps"]]
        return min(steps) if len(steps) == self.world else -1

    def wait_for_step(self, step: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.last_step() < step:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the job did not reach step {step} in {timeout}s; see {self.run_dir}")
            if any(p.poll() not in (None, 0) for p in self.procs):
                raise RuntimeError(f"a rank died; see the logs in {self.run_dir}")
            time.sleep(0.1)

    def microbatch_seconds(self, first: int, last: int) -> list[float]:
        """Measured device time per micro-batch of each rank over steps [first, last]."""
        out = []
        for rank in range(self.world):
            steps = [s for s in self.read_telemetry()[rank]["steps"] if first <= s["step"] <= last]
            out.append(float(np.median([s["compute"] / s["microbatches"] for s in steps])))
        return out

    # -- control -----------------------------------------------------------------------------
    def write_plan(self, counts: list[int]) -> None:
        self.plan_version += 1
        scratch = self.run_dir / "plan.json.tmp"
        scratch.write_text(json.dumps({"version": self.plan_version, "microbatches": counts}))
        os.replace(scratch, self.run_dir / "plan.json")

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        if any(p.returncode != 0 for p in self.procs):
            raise RuntimeError(f"a rank failed; see the logs in {self.run_dir}")

    def stop(self) -> None:
        """Kill every rank we started (by its own session), e.g. after a hang was detected."""
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait(timeout=30)

    def __enter__(self) -> GlooJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_straggler_scenario(run_dir: Path, world: int = 4, per_rank: int = 12, steps: int = 130,
                           onset: int = 30, observe_steps: int = 25, startup_s: float = 300,
                           base_ms: float = 10.0) -> dict:
    """Healthy → compute straggler (rank world-1 at 2×) → S2 plan, all in one gloo job.

    The plan is applied `observe_steps` after the onset (not at detection) so the unmitigated
    phase is long enough to measure on a loaded machine; throughput is compared by medians.
    10 ms of device time per micro-batch keeps the host's CPU jitter a small part of a step.
    """
    from huorn.api.common import MitigationLevel
    from huorn.scheduler.remediation import failslow, ladder

    total = per_rank * world
    slow_rank = world - 1
    faults = [{"kind": "slow-compute", "rank": slow_rank, "from_step": onset, "factor": 2.0}]
    with GlooJob(run_dir, world=world, steps=steps, microbatches=per_rank, faults=faults,
                 base_ms=base_ms) as job:
        job.wait_for_step(1, startup_s)
        finding, detected_step = None, -1
        deadline = time.monotonic() + 300
        while finding is None and time.monotonic() < deadline:
            time.sleep(0.3)
            table = job.step_table()
            found = [f for f in failslow.detect_fail_slow(table) if f.factor > 1] if table else []
            finding, detected_step = (found[0], job.last_step()) if found else (None, -1)
        if finding is None:
            raise AssertionError("the straggler was not detected")
        job.wait_for_step(onset + observe_steps, 300)
        measured = job.microbatch_seconds(finding.onset_iteration + 1, job.last_step())
        lad = ladder.MitigationLadder(MitigationLevel.REBALANCE, ladder.LadderCosts(rebalance=0.0),
                                      ladder.JobShape(measured, total))
        lad.on_fail_slow(finding, [int(finding.worker)] if finding.worker.isdigit() else [])
        decision = lad.on_step(1.0, 0.0)
        assert decision is not None
        counts = list(decision.plan["microbatches"])  # type: ignore[call-overload]
        job.write_plan(counts)
        job.wait(600)
        records = {s["step"]: s for s in job.read_telemetry()[0]["steps"]}
    switched = min(s for s, r in records.items() if r["plan"] > 0)

    def throughput(first: int, last: int) -> float:
        return total / float(np.median([records[i]["time"] for i in range(first, last) if i in records]))

    healthy, straggling = throughput(5, onset), throughput(onset + 2, switched)
    mitigated = throughput(switched + 2, steps)
    return {"world": world, "total_microbatches": total, "onset": onset, "slow_rank": slow_rank,
            "finding": finding, "detected_at_step": detected_step, "plan": counts,
            "decision": decision, "switched_at": switched, "throughput_healthy": healthy,
            "throughput_straggler": straggling, "throughput_s2": mitigated,
            "recovered_fraction": (mitigated - straggling) / (healthy - straggling),
            "series": [records[i]["time"] for i in sorted(records)], "steps": steps}
