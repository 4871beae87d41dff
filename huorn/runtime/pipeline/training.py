"""The training loop over the pipeline executor, with adaptive k: the entry point the trainer
calls for a TrainingJob with `pipelineStages > 1`.

Every step runs one whole table (all M micro-batches of the step's batch), and k changes only
between steps, after every link has drained: a switch can neither lose nor repeat a
micro-batch, and gradients are exactly those of the step's batch whatever the table.

Every `replan_every` steps each rank contributes its window averages (stage compute times,
seconds per message on its outgoing links, step time) to one all-gather; rank 0 asks the
planner and broadcasts the chosen k (and, with `comm="auto"`, how messages move: overlap or
lockstep, see the planner), so all ranks switch together. The planner arrives by
injection (`KPlanner`, implemented by `huorn.runtime.pipeline.planner.AdaptiveKPlanner`), so
benchmarks and tests can swap in a planner with other thresholds."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from huorn.runtime.pipeline import executor, memory, schedules

Batch = tuple[Sequence[Sequence[torch.Tensor]] | None, Sequence[torch.Tensor] | None]


class KPlanner(Protocol):
    def decide(self, *, step: int, current_k: int, forward_s: Sequence[float], backward_s: Sequence[float],
               link_forward_s: Sequence[float], link_backward_s: Sequence[float], measured_step_s: float,
               candidates: Mapping[int, Any], peak_bytes: Mapping[int, Sequence[int]],
               comm: str = ..., lockstep_ok: Mapping[int, bool] | None = ...) -> Any: ...


@dataclass(frozen=True)
class PipelinePlan:
    microbatches: int
    schedule: str = "auto"  # gpipe | 1f1b | kfkb | auto (kFkB with adaptive k)
    k: int = 1  # kfkb's k, and the starting k of auto
    candidates: tuple[int, ...] = (1, 2, 3, 4)
    replan_every: int = 5
    comm: str = "overlap"  # overlap | lockstep | auto (the planner measures both; needs schedule auto)

    def __post_init__(self) -> None:
        if self.comm not in ("overlap", "lockstep", "auto"):
            raise ValueError(f"comm must be overlap, lockstep or auto, got {self.comm!r}")
        if self.comm == "auto" and self.schedule != "auto":
            raise ValueError("comm 'auto' is chosen by the adaptive planner: it needs schedule 'auto'")
        if self.schedule not in (*schedules.SCHEDULE_NAMES, "auto"):
            raise ValueError(f"schedule must be gpipe, 1f1b, kfkb or auto, got {self.schedule!r}")
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        if self.k < 1 or any(c < 1 for c in self.candidates) or not self.candidates:
            raise ValueError(f"k and candidates must be >= 1, got k={self.k}, candidates={self.candidates}")
        if self.replan_every < 1:
            raise ValueError(f"replan_every must be >= 1, got {self.replan_every}")


@dataclass
class StepReport:
    step: int
    schedule: str
    k: int
    loss: float
    seconds: float  # slowest rank's step time
    contention: float
    peak_saved_bytes: int  # this rank
    predicted_peak_bytes: int  # this rank, from the memory model
    executed: list[str] = field(default_factory=list)
    decision: dict | None = None  # rank 0 only, on steps where the planner ran
    recv_wait_s: float = 0.0  # this rank, blocked on the neighbour stages' activations/gradients
    comm: str = "overlap"  # how this step's messages moved


class PipelineTraining:
    """The step-by-step form of the loop, for a caller that owns the loop itself (the trainer
    sets the learning rate, clips gradients, checkpoints and agrees on stopping between steps).
    `before_update()` runs after the step's backward passes and before `optimizer.step()`."""

    def __init__(self, *, stage: executor.StageExecutor, optimizer: torch.optim.Optimizer,
                 batches: Callable[[int], Batch], plan: PipelinePlan, planner: KPlanner | None = None,
                 contention_level: Callable[[int], float] | None = None,
                 before_step: Callable[[int], None] | None = None,
                 before_update: Callable[[], None] | None = None) -> None:
        if plan.schedule == "auto" and planner is None:
            raise ValueError("schedule 'auto' needs a planner: pass "
                             "huorn.runtime.pipeline.planner.AdaptiveKPlanner()")
        self.runner, self.optimizer, self.batches, self.plan = stage, optimizer, batches, plan
        self.planner, self.contention_level = planner, contention_level
        self.before_step, self.before_update = before_step, before_update
        self.k = plan.k if plan.schedule in ("kfkb", "auto") else 1
        self.comm = "lockstep" if plan.comm == "lockstep" else "overlap"
        self.window: list[executor.StepStats] = []
        self.steps_done = 0

    def run_step(self, step: int) -> StepReport:
        runner, plan = self.runner, self.plan
        topo = runner.topology
        inputs, targets = self.batches(step)
        if not runner.negotiated:
            runner.negotiate_shapes(inputs[0] if topo.is_first and inputs else None,
                                    targets[0] if topo.is_last and targets else None)
        if self.contention_level is not None:
            runner.throttle.set_level(self.contention_level(step))
        schedule = schedules.build_schedule(plan.schedule if plan.schedule != "auto" else "kfkb",
                                             topo.stages, plan.microbatches, self.k)
        self.optimizer.zero_grad(set_to_none=True)
        if self.before_step is not None:
            self.before_step(step)
        stats = runner.run_step(schedule, inputs, targets, comm=self.comm)
        if self.before_update is not None:
            self.before_update()
        self.optimizer.step()
        loss, slowest = _reduce_step(stats, runner.device, topo.replicas)
        self.window.append(stats)
        stats.seconds = slowest
        report = StepReport(
            step=step, schedule=schedule.name, k=schedule.k, loss=loss, seconds=slowest,
            contention=runner.throttle.level, peak_saved_bytes=stats.peak_saved_bytes,
            predicted_peak_bytes=memory.predict_peak_bytes(
                schedule, [runner.microbatch_bytes] * topo.stages)[topo.stage],
            executed=stats.executed, recv_wait_s=stats.recv_wait_s, comm=stats.comm,
        )
        self.steps_done += 1
        if plan.schedule == "auto" and self.steps_done % plan.replan_every == 0:
            self.k, self.comm, report.decision = _replan(runner, self.planner, self.window, step,  # type: ignore[arg-type]
                                                         self.k, self.comm, plan)
            self.window = []
        return report


def run_pipeline_training(
    *, stage: executor.StageExecutor, optimizer: torch.optim.Optimizer, batches: Callable[[int], Batch],
    steps: int, plan: PipelinePlan, planner: KPlanner | None = None,
    contention_level: Callable[[int], float] | None = None,
    on_step: Callable[[StepReport], None] | None = None, start_step: int = 0,
    before_step: Callable[[int], None] | None = None,
) -> list[StepReport]:
    """Train `steps` steps. `batches(step)` gives (micro-batch inputs, micro-batch targets):
    inputs are read on stage 0 and targets on the last stage (others may return None).
    With schedule `auto` a planner is required. `before_step(step)` runs on every rank before
    each step's clock starts (a barrier there makes step times start together, as the
    benchmarks do). Returns this rank's reports."""
    loop = PipelineTraining(stage=stage, optimizer=optimizer, batches=batches, plan=plan, planner=planner,
                            contention_level=contention_level, before_step=before_step)
    reports = []
    for step in range(start_step, start_step + steps):
        report = loop.run_step(step)
        reports.append(report)
        if on_step is not None:
            on_step(report)
    return reports


def _reduce_step(stats: executor.StepStats, device: torch.device, replicas: int) -> tuple[float, float]:
    """The step's loss (summed over the last stages, averaged over replicas) and the slowest
    rank's step time, in two one-number all-reduces."""
    loss = torch.tensor([stats.loss or 0.0], dtype=torch.float64, device=device)
    seconds = torch.tensor([stats.seconds], dtype=torch.float64, device=device)
    dist.all_reduce(loss)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(loss[0]) / replicas, float(seconds[0])


def _replan(runner: executor.StageExecutor, planner: KPlanner, window: list[executor.StepStats], step: int,
            k: int, comm: str, plan: PipelinePlan) -> tuple[int, str, dict | None]:
    """Gather window averages from every rank, let rank 0 decide, broadcast k and the mode."""
    topo = runner.topology
    n = len(window)

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    mine = torch.tensor([
        float(topo.stage),
        mean([s.forward_s for s in window]), mean([s.backward_s for s in window]),
        mean([s.send_link.seconds_per_message for s in window if s.send_link]),
        mean([s.grad_link.seconds_per_message for s in window if s.grad_link]),
        sum(s.seconds for s in window) / n, float(runner.microbatch_bytes),
    ], dtype=torch.float64, device=runner.device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    rows = [g.tolist() for g in gathered]
    stages = topo.stages
    worst = [[0.0] * 6 for _ in range(stages)]  # slowest replica per stage
    for row in rows:
        stage = int(row[0])
        worst[stage] = [max(a, b) for a, b in zip(worst[stage], row[1:], strict=True)]
    decision = None
    modes = ("overlap", "lockstep")
    chosen = torch.tensor([k, modes.index(comm)], dtype=torch.int64, device=runner.device)
    if dist.get_rank() == 0:
        tables = schedules.build_candidates(stages, plan.microbatches, plan.candidates)
        bytes_per_stage = [int(w[5]) for w in worst]
        result = planner.decide(
            step=step, current_k=k, forward_s=[w[0] for w in worst], backward_s=[w[1] for w in worst],
            link_forward_s=[worst[s][2] for s in range(stages - 1)],
            link_backward_s=[worst[s + 1][3] for s in range(stages - 1)],
            measured_step_s=max(w[4] for w in worst),
            candidates={c: t.to_plain() for c, t in tables.items()},
            peak_bytes={c: memory.predict_peak_bytes(t, bytes_per_stage) for c, t in tables.items()},
            comm=comm,
            lockstep_ok={c: _has_lockstep(t) for c, t in tables.items()} if plan.comm == "auto" else {},
        )
        chosen[0] = int(result.k)
        chosen[1] = modes.index(result.comm)
        decision = result.to_dict()
    dist.broadcast(chosen, src=0)
    return int(chosen[0]), modes[int(chosen[1])], decision


def _has_lockstep(table: schedules.Schedule) -> bool:
    try:
        schedules.lockstep_exchanges(table)
    except schedules.ScheduleError:
        return False
    return True
