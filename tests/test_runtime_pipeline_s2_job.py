"""S2 on a real pipelined trainer: torchrun, 2 stages × 2 replicas (4 gloo processes), the run
directory's control file with one count per pipeline replica. The step losses stay those of a
world-of-one, non-pipelined run of the same seed; a plan of the wrong length written while the
job runs is refused with a reason naming `counts`, and the counts in force stay."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import runtime_harness as harness

from huorn.runtime import microbatches

pytestmark = pytest.mark.timeout(400)
STEPS = 16


def build_spec(**parallelism: object) -> dict:
    spec = harness.build_spec(steps=STEPS, interval_steps=None, global_batch=8, micro_batch=2, max_replicas=4)
    if parallelism:
        spec["parallelism"] = parallelism
    return spec


def losses(run_dir: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in harness.steps_of(harness.read_events(run_dir))}


def test_per_replica_counts_keep_the_loss_and_a_wrong_length_plan_is_refused(tmp_path: Path) -> None:
    data_dir = harness.shared_data_dir()
    reference_config = harness.write_config(tmp_path / "ref", data_dir, build_spec(), device="cpu")
    reference = subprocess.run(harness.trainer_command(reference_config, 1), cwd=harness.REPO,
                               env=harness.child_env(), capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    want = losses(tmp_path / "ref" / "run")

    run_dir = tmp_path / "pp" / "run"
    run_dir.mkdir(parents=True)
    # a steady 200 ms a step on every rank leaves time to write the second plan mid-run
    (run_dir / "faults.json").write_text(json.dumps({"faults": [{"kind": "slow-compute", "ms": 200}]}))
    microbatches.write_control_file(run_dir, [3, 1], "S2 test: replica 1 is slower", version=1)
    config = harness.write_config(tmp_path / "pp", data_dir, build_spec(pipelineStages=2, schedule="1f1b"),
                                  device="cpu")
    log = tmp_path / "pp.log"
    with open(log, "w") as out:
        job = subprocess.Popen(harness.trainer_command(config, 4), cwd=harness.REPO, env=harness.child_env(),
                               stdout=out, stderr=subprocess.STDOUT)
    try:
        harness.wait_for(lambda: any(e["event"] == "microbatch-plan" for e in harness.read_events(run_dir)),
                         240, "the first plan to be applied")
        time.sleep(0.05)  # a new modification stamp
        microbatches.write_control_file(run_dir, [1, 1, 2], "one count per rank, not per replica", version=2)
        assert job.wait(timeout=240) == 0, log.read_text()[-4000:]
    finally:
        if job.poll() is None:
            job.kill()
    events = harness.read_events(run_dir)
    applied = [e for e in events if e["event"] == "microbatch-plan"]
    assert len(applied) == 1 and applied[0]["counts"] == [3, 1]
    rejected = [e for e in events if e["event"] == "microbatch-plan-rejected"]
    assert len(rejected) == 1, log.read_text()[-3000:]
    assert rejected[0]["counts"] == [1, 1, 2] and rejected[0]["kept"] == [3, 1]
    assert rejected[0]["reason"] == ("counts has 3 entries but the gang has 2 pipeline replicas; "
                                     "write one count per pipeline replica")
    assert rejected[0]["step"] < STEPS - 1, "the refusal must be followed by steps that show the kept counts"
    steps = {e["step"]: e for e in harness.steps_of(events)}
    assert sorted(steps) == list(range(1, STEPS + 1))
    for step, record in steps.items():
        # same samples, same global batch, replicas at 3 and 1 micro-batches: the reference's loss
        assert record["loss"] == pytest.approx(want[step], rel=1e-4, abs=1e-5), step
        assert record.get("microbatches") == ([3, 1] if step >= applied[0]["from_step"] else None), step
        assert record["microbatch_seconds"] > 0  # this stage's F+B per micro-batch, S2's input
