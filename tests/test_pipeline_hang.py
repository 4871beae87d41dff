"""Hang detection on a pipelined job: a stage's receives, link drains and data-parallel gradient
all-reduce count on its telemetry (comm.StepLedger), so ranks blocked on a hung rank show a wait in
flight, naming the neighbour where there is one, and the hang detector can tell who stopped the job.

Before, those waits bypassed the accounting: with `hang-compute` on one rank of 2 stages × 2
replicas every rank sat at entered == completed, and no hang was ever found (a DDP job's was in
~5 s)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import job_support
import pipeline_workers as workers
import pytest
import torch

import huorn.graph.jobs  # noqa: F401  (registers the TrainingJob compiler)
from huorn.api.common import Remediation
from huorn.backends import monitor
from huorn.backends.local import backend as local_backend
from huorn.graph import compiler
from huorn.runtime import comm, microbatches, telemetry
from huorn.runtime.pipeline import executor, launch, training
from huorn.runtime.pipeline import topology as pp_topology
from huorn.scheduler.remediation import hang, policy

WIDTH, SIZE = 8, 2
# (label, counts per replica or None, schedule, k, comm): a middle stage receives from both sides
# and an end stage from one, S2 gives replicas unequal tables, lockstep batches the messages
CASES = [("even", None, "1f1b", 1, "overlap"), ("1-3", (1, 3), "kfkb", 2, "overlap"),
         ("3-1", (3, 1), "gpipe", 1, "lockstep"), ("even-lockstep", None, "gpipe", 1, "lockstep")]


def ledger_worker(rank: int, world: int, stages: int) -> list[tuple[str, int, int]]:
    """Runs every case on a rank whose executor counts on a Telemetry; returns, after each step,
    (case, entered, completed)."""
    topo = pp_topology.PipelineTopology(stages=stages, replicas=world // stages, rank=rank)
    groups = pp_topology.build_groups(topo)
    tel = telemetry.Telemetry("job", rank, world, None)
    seen = []
    for label, counts, name, k, mode in CASES:
        total = 2 * topo.replicas if counts is None else sum(counts)
        module = workers.build_mlp_stages(stages, WIDTH, 1)[topo.stage]
        runner = executor.StageExecutor(module, topo, groups, workers.mse_loss, torch.device("cpu"),
                                        ledger=comm.StepLedger(tel))
        plan = training.PipelinePlan(microbatches=total // topo.replicas, schedule=name, k=k, comm=mode)
        loop = training.PipelineTraining(stage=runner, optimizer=torch.optim.SGD(module.parameters(), lr=0.0),
                                         batches=lambda step: ([], []), plan=plan)

        def batches(step: int, loop: training.PipelineTraining = loop, total: int = total) -> training.Batch:
            inputs, targets = workers.make_mlp_batch(step, total, SIZE, WIDTH)
            mine = microbatches.assign(loop.counts, total, topo.replicas, topo.replica)
            return [[inputs[i]] for i in mine], [targets[i] for i in mine]

        loop.batches = batches
        loop.set_counts(counts)
        for step in range(2):
            loop.run_step(step)
            view = tel.snapshot()["collective"]
            seen.append((label, view["entered"], view["completed"]))
        runner.close()
    return seen


def test_every_stage_and_replica_counts_the_same_operations_per_step() -> None:
    """The hang detector compares sequence numbers across ranks: stages that receive from one
    side or both, and replicas with unequal tables, must still agree at every step's end."""
    ranks = launch.run_workers(ledger_worker, 6, "gloo", (3,))
    assert all(rank == ranks[0] for rank in ranks), ranks
    positions = [entered for _, entered, completed in ranks[0]]
    assert all(entered == completed for _, entered, completed in ranks[0]), ranks[0]
    assert all(b > a for a, b in zip([0, *positions], positions, strict=False)), positions


class _Recorder:
    """A monitor policy that decides nothing and keeps every tick's time and /telemetry views."""

    def __init__(self) -> None:
        self.ticks: list[tuple[float, dict[int, dict[str, Any]]]] = []

    def decide(self, graph: Any, observation: Any) -> list:
        views = {int(v["rank"]): v for v in observation.telemetry.values() if "collective" in v}
        self.ticks.append((observation.time, views))
        return []


HUNG, HANG_FROM = 2, 12  # stage 0 of pipeline replica 1


@pytest.mark.serial
@pytest.mark.timeout(300)
def test_a_rank_hung_in_compute_leaves_its_pipeline_peers_waiting_in_flight_and_is_named(
        tmp_path: Path) -> None:
    """2 stages × 2 replicas on the local backend (gloo, four real ranks), `hang-compute` on rank 2
    from step 12. Its neighbour stage (rank 3) blocks receiving its activations, and the other
    replica's ranks in the gradient all-reduce: within a couple of polls each shows an operation
    in flight (entered > completed), rank 3's naming rank 2, while rank 2 sits between operations.
    The hang detector then names rank 2 and S4 replaces its pod, as for a DDP job."""
    manifest = job_support.tiny_job(replicas=2, steps=40, micro_batch=1, layers=4,
                                    parallelism={"pipelineStages": 2, "schedule": "1f1b"},
                                    remediation={"hangTimeout": "5s", "maxMitigation": "restart"})
    graph = compiler.compile(manifest)
    remediation = policy.RemediationPolicy(Remediation.model_validate(manifest["spec"]["remediation"]))
    recorder = _Recorder()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "faults.json").write_text(json.dumps(
        {"faults": [{"kind": "hang-compute", "fromStep": HANG_FROM, "rank": HUNG}]}))
    backend = local_backend.LocalBackend(graph, run_dir, local_backend.LocalSettings(step_limit=40))
    loop = monitor.Monitor(graph, backend, [recorder, remediation])
    deadline = time.monotonic() + 120
    try:
        loop.start()
        loop.run(interval=0.5,
                 should_stop=lambda _: bool(remediation.decisions) or time.monotonic() > deadline)
    finally:
        backend.stop(graceful=False)

    def inside(view: dict[str, Any]) -> bool:
        return view["collective"]["entered"] > view["collective"]["completed"]

    # the first tick at which every rank but the hung one waits inside an operation
    blocked = next(((t, views) for t, views in recorder.ticks if len(views) == 4 and not inside(views[HUNG])
                    and views[HUNG]["steps"] and views[HUNG]["steps"][-1]["step"] >= HANG_FROM
                    and all(inside(views[r]) for r in views if r != HUNG)), None)
    last = recorder.ticks[-1][1] if recorder.ticks else {}
    assert blocked is not None, {r: v["collective"] for r, v in last.items()}
    seen_at, views = blocked
    hung_since = views[HUNG]["collective"]["changed"]  # when rank 2 last entered or completed one
    assert seen_at - hung_since < 5.0, (seen_at, hung_since)
    neighbour = views[HUNG + 1]["collective"]
    assert neighbour["waiting_on"] == HUNG, neighbour
    assert [f["op"] for f in neighbour["in_flight"]] == ["recv-activations"], neighbour
    others = [f["op"] for r in (0, 1) for f in views[r]["collective"]["in_flight"]]
    assert others == ["grad-allreduce"] * 2, views
    pod = views[HUNG]["replica"]
    assert remediation.decisions, "no hang was found"
    found = remediation.decisions[0]
    assert f"rank(s) [{HUNG}] never entered" in found.reason, found
    assert found.replaced == (pod,), found


def stalled_stage_worker(rank: int, world: int, hung: int) -> tuple[int, int, int | None, float]:
    """GPipe over 2 stages; in step 1 the last stage sleeps in its third loss (a compute hang).
    Returns the rank's (entered, completed, waiting_on) two seconds into that step, and its clock."""
    topo = pp_topology.PipelineTopology(stages=2, replicas=1, rank=rank)
    groups = pp_topology.build_groups(topo)
    tel = telemetry.Telemetry("job", rank, world, None)
    module = workers.build_mlp_stages(2, WIDTH, 1)[topo.stage]
    calls = {"n": 0, "step": 0}

    def loss(outputs: Any, target: Any) -> Any:
        calls["n"] += 1
        if rank == hung and calls["step"] == 1 and calls["n"] == 3:
            time.sleep(4.0)
        return workers.mse_loss(outputs, target)

    runner = executor.StageExecutor(module, topo, groups, loss, torch.device("cpu"),
                                    ledger=comm.StepLedger(tel))
    plan = training.PipelinePlan(microbatches=4, schedule="gpipe", k=1, comm="overlap")

    def batches(step: int) -> training.Batch:
        inputs, targets = workers.make_mlp_batch(step, 4, SIZE, WIDTH)
        return [[x] for x in inputs], list(targets)

    loop = training.PipelineTraining(stage=runner, optimizer=torch.optim.SGD(module.parameters(), lr=0.0),
                                     batches=batches, plan=plan)
    loop.run_step(0)
    seen: dict[str, Any] = {}
    calls["step"], calls["n"] = 1, 0
    timer = threading.Timer(2.0, lambda: seen.setdefault("view", tel.snapshot()["collective"]))
    timer.start()
    loop.run_step(1)
    timer.join()
    runner.close()
    view = seen["view"]
    return view["entered"], view["completed"], view["waiting_on"], time.time()


@pytest.mark.timeout(120)
def test_a_gpipe_stage_hung_in_compute_mid_step_is_named_though_its_count_is_ahead() -> None:
    """Mid-step GPipe stages have counted different numbers of operations: the hung last stage
    has run all its forwards' receives ahead of stage 0, which waits on it for gradients. The
    detector must follow stage 0's wait-for edge to the hung stage, not blame the lower count."""
    out = launch.run_workers(stalled_stage_worker, 2, "gloo", (1,))
    now = max(o[3] for o in out)
    samples = [hang.RankSample(rank=r, seq_entered=e, seq_completed=c, heartbeat=now, waiting_on=w)
               for r, (e, c, w, _) in enumerate(out)]
    assert samples[0].seq_entered < samples[1].seq_entered, samples
    found = hang.classify_stall(samples, 30.0, now, 15.0)
    assert (found.kind, found.culprits) == (hang.NON_COMMUNICATION, (1,)), (found, samples)


@pytest.mark.timeout(120)
def test_a_stage_waiting_on_a_hung_peer_gives_up_at_the_collective_timeout() -> None:
    """The pipeline's groups took torch's default timeout (30 minutes on gloo, 10 on NCCL), not
    the trainer's collectiveTimeoutS: a hung stage held its neighbours that long, where a DDP
    job failed in 120 s. Here 2 s, the peer silent for 12 (its exit would end the wait too)."""
    ranks = launch.run_workers(workers.silent_peer_worker, 2, "gloo", (2.0, 12.0), timeout_s=60.0)
    outcome, waited = ranks[1]
    assert outcome.startswith("raised") and waited < 8, ranks[1]
