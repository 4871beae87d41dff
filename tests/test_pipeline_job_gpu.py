"""A pipelined TrainingJob on two GPUs, end to end: torchrun, NCCL, and CUDA-graphed stages.

Why: the executor's graphs were measured through the benchmark's own training loop
(benchmarks/pipeline_gpu.py); this runs the real trainer (`huorn.runtime.train`) from a run
config, as a pod does, and checks that its steps replayed graphs and trained what an
unpipelined run of the same seed trains. NB: the DDP run computes under bf16 autocast and the
pipelined one in fp32 (docs/pipeline.md, "Limits and decisions"), so the tolerance covers bf16's
difference from fp32 on a tiny model, not two bf16 runs.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
import runtime_harness as harness
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]
STEPS = 8


def _spec(**parallelism: object) -> dict:
    spec = harness.build_spec(steps=STEPS, interval_steps=4, global_batch=8, micro_batch=2, max_replicas=2)
    spec["model"] = {"layers": 4, "width": 64, "heads": 2, "context": 32}
    if parallelism:
        spec["parallelism"] = parallelism
    return spec


def _run(tmp: Path, spec: dict, nproc: int) -> list[dict]:
    config = harness.write_config(tmp, harness.shared_data_dir(), spec, device="cuda")
    done = subprocess.run(harness.trainer_command(config, nproc), cwd=harness.REPO, env=harness.child_env(),
                          capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return harness.steps_of(harness.read_events(tmp / "run"))


@pytest.mark.parametrize("schedule", ["1f1b", "kfkb"])
def test_a_pipelined_training_job_replays_graphs_and_trains_like_one_gpu(
        tmp_path: Path, schedule: str) -> None:
    parallelism: dict[str, object] = {"pipelineStages": 2, "schedule": schedule}
    if schedule == "kfkb":
        parallelism["k"] = 2
    piped = _run(tmp_path / "piped", _spec(**parallelism), nproc=2)
    alone = _run(tmp_path / "alone", _spec(), nproc=1)
    assert [e["step"] for e in piped] == [e["step"] for e in alone] and len(piped) == STEPS
    notes = [e["graph_note"] for e in piped if "graph_note" in e]
    assert not notes, notes
    graphed = [e["step"] for e in piped if e.get("cuda_graphs")]
    assert len(graphed) >= STEPS - 1, [(e["step"], e.get("cuda_graphs")) for e in piped]
    for p, a in zip(piped, alone, strict=True):
        assert math.isfinite(p["loss"])
        assert p["loss"] == pytest.approx(a["loss"], rel=3e-2), (p["step"], p["loss"], a["loss"])
    assert piped[-1]["loss"] < piped[0]["loss"]
