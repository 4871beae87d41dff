"""The training loop over the pipeline executor, with adaptive k: the entry point the trainer
calls for a TrainingJob with `pipelineStages > 1`.

Every step runs one whole table (all M micro-batches of the step's batch), and k changes only
between steps, after every link has drained: a switch can neither lose nor repeat a
micro-batch, and gradients are exactly those of the step's batch whatever the table.

Every `replan_every` steps each rank contributes its window's median step (stage compute times,
seconds per message on its outgoing links, step time) to one all-gather; rank 0 asks the
planner and broadcasts the chosen k (and, with `comm="auto"`, how messages move: overlap or
lockstep, see the planner), so all ranks switch together. The planner arrives by
injection (`KPlanner`, implemented by `huorn.runtime.pipeline.planner.AdaptiveKPlanner`), so
benchmarks and tests can swap in a planner with other thresholds.

Remediation S2 gives the replicas unequal shares of the step (`set_counts`): replica r runs a
table of its own N_r micro-batches, every micro-batch's gradient weighs 1/M of the whole step
(executor docstring), its mean loss weighs N_r / M, and k stays one k for the job. The planner
then sees the critical replica, the one with the most work per step (N_r × its slowest
stage's F+B), with its own table; a replica with fewer micro-batches finishes its table
earlier and waits in the gradient sum, so it cannot set the step time. Memory is each
replica's own table, worst replica per stage."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from huorn.runtime import comm
from huorn.runtime.pipeline import contention, executor, memory, schedules

Batch = tuple[Sequence[Sequence[torch.Tensor]] | None, Sequence[torch.Tensor] | None]


class KPlanner(Protocol):
    """`memory_limits` is passed only by a loop with a `memory_budget`."""

    def decide(self, *, step: int, current_k: int, forward_s: Sequence[float], backward_s: Sequence[float],
               link_forward_s: Sequence[float], link_backward_s: Sequence[float], measured_step_s: float,
               candidates: Mapping[int, Any], peak_bytes: Mapping[int, Sequence[int]],
               comm: str = ..., lockstep_ok: Mapping[int, bool] | None = ...,
               memory_limits: Sequence[int | None] | None = ...) -> Any: ...


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
    graphed: bool = False  # this rank's forwards and backwards replayed CUDA graphs
    microbatches: int = 0  # this replica's micro-batches in the step
    microbatch_s: float = 0.0  # this stage's forward + backward seconds for one micro-batch (S2's input)
    reduce_wait_s: float = 0.0  # this rank, in the data-parallel gradient all-reduce
    send_wait_s: float = 0.0  # this rank, until its outgoing links had delivered the step's messages
    # this rank's outgoing links (None where the stage has none): what each message held its
    # link, and how many it sent. Waits grow along the whole pipeline behind a slow link; these
    # are measured on the link itself, so the detector can say which link is slow.
    send_link: contention.LinkStats | None = None  # activations to the next stage
    grad_link: contention.LinkStats | None = None  # gradients to the previous stage


class PipelineTraining:
    """The step-by-step form of the loop, for a caller that owns the loop itself (the trainer
    sets the learning rate, clips gradients, checkpoints and agrees on stopping between steps).
    `before_update()` runs after the step's backward passes and before `optimizer.step()`.

    `memory_budget(saved_peak_bytes)`, when given, says how many bytes of saved activations
    this rank has room for at a step's peak, from the peak the last step measured
    (`memory.activation_budget` reads the device). Every rank asks it at each replan and the
    planner gets one limit per stage (the tightest replica's), so adaptive k never picks a table
    whose predicted peak a stage's device cannot hold. Without it the planner knows only its
    own `memory_limit_bytes`."""

    def __init__(self, *, stage: executor.StageExecutor, optimizer: torch.optim.Optimizer,
                 batches: Callable[[int], Batch], plan: PipelinePlan, planner: KPlanner | None = None,
                 contention_level: Callable[[int], float] | None = None,
                 before_step: Callable[[int], None] | None = None,
                 before_update: Callable[[], None] | None = None,
                 memory_budget: Callable[[int], int | None] | None = None) -> None:
        if plan.schedule == "auto" and planner is None:
            raise ValueError("schedule 'auto' needs a planner: pass "
                             "huorn.runtime.pipeline.planner.AdaptiveKPlanner()")
        self.runner, self.optimizer, self.batches, self.plan = stage, optimizer, batches, plan
        self.planner, self.contention_level = planner, contention_level
        self.before_step, self.before_update = before_step, before_update
        self.memory_budget = memory_budget
        self.k = plan.k if plan.schedule in ("kfkb", "auto") else 1
        self.comm = "lockstep" if plan.comm == "lockstep" else "overlap"
        self.window: list[executor.StepStats] = []
        self.steps_done = 0
        self.counts: tuple[int, ...] | None = None  # micro-batches per replica (S2); None: even

    @property
    def total_microbatches(self) -> int:
        return self.plan.microbatches * self.runner.topology.replicas

    def microbatches_of(self, replica: int) -> int:
        return self.counts[replica] if self.counts is not None else self.plan.microbatches

    def set_counts(self, counts: Sequence[int] | None) -> None:
        """Micro-batches per replica from the next step on (None: the even split). Raises
        ValueError naming `counts` and changes nothing when they do not fit the step. Equal
        counts are stored as None, so the way back to the even split is exactly the plain path."""
        if counts is not None:
            problem = check_counts(counts, self.runner.topology.replicas, self.total_microbatches)
            if problem is not None:
                raise ValueError(problem)
        self.counts = None if counts is None or len(set(counts)) == 1 else tuple(int(c) for c in counts)

    def run_step(self, step: int) -> StepReport:
        runner, plan = self.runner, self.plan
        topo = runner.topology
        mine = self.microbatches_of(topo.replica)
        weight = mine / self.total_microbatches if self.counts is not None else None
        inputs, targets = self.batches(step)
        if not runner.negotiated:
            runner.negotiate_shapes(inputs[0] if topo.is_first and inputs else None,
                                    targets[0] if topo.is_last and targets else None)
        if self.contention_level is not None:
            runner.throttle.set_level(self.contention_level(step))
        schedule = schedules.build_schedule(plan.schedule if plan.schedule != "auto" else "kfkb",
                                             topo.stages, mine, self.k)
        self.optimizer.zero_grad(set_to_none=True)
        if self.before_step is not None:
            self.before_step(step)
        total = self.total_microbatches if self.counts is not None else None
        stats = runner.run_step(schedule, inputs, targets, comm=self.comm, total_microbatches=total)
        if self.before_update is not None:
            self.before_update()
        self.optimizer.step()
        loss, slowest = _reduce_step(stats, runner.device, topo.replicas, weight, runner.ledger)
        if plan.schedule == "auto":  # only a replan reads (and clears) the window
            self.window.append(stats)
        stats.seconds = slowest
        report = StepReport(
            step=step, schedule=schedule.name, k=schedule.k, loss=loss, seconds=slowest,
            contention=runner.throttle.level, peak_saved_bytes=stats.peak_saved_bytes,
            predicted_peak_bytes=memory.predict_peak_bytes(
                schedule, [runner.microbatch_bytes] * topo.stages)[topo.stage],
            executed=stats.executed, recv_wait_s=stats.recv_wait_s, comm=stats.comm, graphed=stats.graphed,
            microbatches=mine, microbatch_s=stats.forward_s + stats.backward_s,
            reduce_wait_s=stats.reduce_wait_s, send_wait_s=stats.send_wait_s,
            send_link=stats.send_link, grad_link=stats.grad_link,
        )
        self.steps_done += 1
        if plan.schedule == "auto" and self.steps_done % plan.replan_every == 0:
            self.k, self.comm, report.decision = _replan(runner, self.planner, self.window, step,  # type: ignore[arg-type]
                                                         self.k, self.comm, plan, mine, self.memory_budget)
            self.window = []
        return report


def run_pipeline_training(
    *, stage: executor.StageExecutor, optimizer: torch.optim.Optimizer, batches: Callable[[int], Batch],
    steps: int, plan: PipelinePlan, planner: KPlanner | None = None,
    contention_level: Callable[[int], float] | None = None,
    on_step: Callable[[StepReport], None] | None = None, start_step: int = 0,
    before_step: Callable[[int], None] | None = None,
    memory_budget: Callable[[int], int | None] | None = None,
) -> list[StepReport]:
    """Train `steps` steps. `batches(step)` gives (micro-batch inputs, micro-batch targets):
    inputs are read on stage 0 and targets on the last stage (others may return None).
    With schedule `auto` a planner is required. `before_step(step)` runs on every rank before
    each step's clock starts (a barrier there makes step times start together, as the
    benchmarks do). `memory_budget` as in PipelineTraining. Returns this rank's reports."""
    loop = PipelineTraining(stage=stage, optimizer=optimizer, batches=batches, plan=plan, planner=planner,
                            contention_level=contention_level, before_step=before_step,
                            memory_budget=memory_budget)
    reports = []
    for step in range(start_step, start_step + steps):
        report = loop.run_step(step)
        reports.append(report)
        if on_step is not None:
            on_step(report)
    return reports


def check_counts(counts: Sequence[int], replicas: int, total: int) -> str | None:
    """Why per-replica micro-batch `counts` cannot run a step of `total`, or None."""
    if len(counts) != replicas:
        return (f"counts has {len(counts)} entries but the job has {replicas} pipeline replicas; "
                "give one count per pipeline replica")
    if any(int(c) < 1 for c in counts):
        return f"counts {list(counts)}: every pipeline replica needs at least one micro-batch"
    if sum(int(c) for c in counts) != total:
        return f"counts sum to {sum(int(c) for c in counts)} but a step has {total} micro-batches"
    return None


def _reduce_step(stats: executor.StepStats, device: torch.device, replicas: int,
                 weight: float | None = None, ledger: comm.StepLedger | None = None) -> tuple[float, float]:
    """The step's loss and the slowest rank's step time, in two one-number all-reduces. A
    last stage's loss is its replica's mean; the step's is the mean over all micro-batches: the
    replicas' average for equal counts, else each weighted by its share (`weight`). Every stage
    adds its MoE balancing losses (`StepStats.aux_loss`), as the non-pipelined trainer's loss
    includes them. Both count on the rank's telemetry through `ledger`, as every collective does."""
    ledger = ledger or comm.StepLedger(None)
    loss = torch.tensor([(stats.loss or 0.0) + stats.aux_loss], dtype=torch.float64, device=device)
    if weight is not None:
        loss *= weight
    seconds = torch.tensor([stats.seconds], dtype=torch.float64, device=device)
    ledger.once("step-loss", None, lambda: dist.all_reduce(loss))
    ledger.once("step-seconds", None, lambda: dist.all_reduce(seconds, op=dist.ReduceOp.MAX))
    return float(loss[0]) / (replicas if weight is None else 1.0), float(seconds[0])


def _replan(runner: executor.StageExecutor, planner: KPlanner, window: list[executor.StepStats], step: int,
            k: int, comm: str, plan: PipelinePlan, own_microbatches: int | None = None,
            memory_budget: Callable[[int], int | None] | None = None) -> tuple[int, str, dict | None]:
    """Gather window averages from every rank, let rank 0 decide, broadcast k and the mode.
    `own_microbatches` is this replica's table length (module docstring for unequal counts);
    `memory_budget` gives this rank's room for saved activations (PipelineTraining)."""
    topo = runner.topology

    def typical(values: list[float]) -> float:
        # The median step, not the mean: one odd step (the first of a run, whose first messages
        # wait for a peer still starting; a GC pause) would otherwise move k for a whole window.
        return statistics.median(values) if values else 0.0

    budget = memory_budget(window[-1].peak_saved_bytes) if memory_budget is not None and window else None
    # a first step of a table is metered (slower, executor docstring): its time speaks for no k
    timed = [s for s in window if not s.metered] or window
    mine = torch.tensor([
        float(topo.stage),
        typical([s.forward_s for s in window]), typical([s.backward_s for s in window]),
        typical([s.send_link.typical_s for s in window if s.send_link]),
        typical([s.grad_link.typical_s for s in window if s.grad_link]),
        typical([s.seconds for s in timed]), float(runner.microbatch_bytes),
        float(plan.microbatches if own_microbatches is None else own_microbatches),
        -1.0 if budget is None else float(budget),
    ], dtype=torch.float64, device=runner.device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    runner.ledger.once("replan-gather", None, lambda: dist.all_gather(gathered, mine))
    rows = [g.tolist() for g in gathered]
    stages = topo.stages
    counts = [int(rows[r * stages][7]) for r in range(topo.replicas)]  # replica-major ranks
    even = len(set(counts)) == 1
    longest = plan.microbatches
    # each stage's room, the tightest replica's (every replica runs the stage's share of memory)
    limits: list[int | None] = [None] * stages
    for row in rows:
        stage = int(row[0])
        if row[8] >= 0:
            limits[stage] = int(row[8]) if limits[stage] is None else min(limits[stage], int(row[8]))
    if not even:  # the critical replica's rows only (module docstring)
        critical = max(range(topo.replicas), key=lambda r: counts[r] * max(
            row[1] + row[2] for row in rows[r * stages:(r + 1) * stages]))
        rows, longest = rows[critical * stages:(critical + 1) * stages], counts[critical]
    worst = [[0.0] * 6 for _ in range(stages)]  # slowest replica per stage
    for row in rows:
        stage = int(row[0])
        worst[stage] = [max(a, b) for a, b in zip(worst[stage], row[1:7], strict=True)]
    decision = None
    modes = ("overlap", "lockstep")
    chosen = torch.tensor([k, modes.index(comm)], dtype=torch.int64, device=runner.device)
    if dist.get_rank() == 0:
        tables = schedules.build_candidates(stages, longest, plan.candidates)
        # the k the critical table runs (k above its micro-batches runs as one group), which must
        # be a candidate: else the planner can neither price it nor hold it against hysteresis
        current = min(k, longest)
        if current not in tables:
            tables[current] = schedules.build_schedule("kfkb", stages, longest, current)
        bytes_per_stage = [int(w[5]) for w in worst]
        peak_bytes = {c: memory.predict_peak_bytes(t, bytes_per_stage) for c, t in tables.items()}
        if not even:  # each replica's own table; the worst replica per stage
            peak_bytes = {c: tuple(max(per) for per in zip(*(
                memory.predict_peak_bytes(schedules.build_schedule("kfkb", stages, m, c), bytes_per_stage)
                for m in set(counts)), strict=True)) for c in tables}
        budgeted = {"memory_limits": limits} if memory_budget is not None else {}
        result = planner.decide(
            step=step, current_k=current, forward_s=[w[0] for w in worst], backward_s=[w[1] for w in worst],
            link_forward_s=[worst[s][2] for s in range(stages - 1)],
            link_backward_s=[worst[s + 1][3] for s in range(stages - 1)],
            measured_step_s=max(w[4] for w in worst),
            candidates={c: t.to_plain() for c, t in tables.items()},
            peak_bytes=peak_bytes,
            comm=comm,
            lockstep_ok={c: _has_lockstep(t) for c, t in tables.items()} if plan.comm == "auto" else {},
            **budgeted,
        )
        chosen[0] = int(result.k) if result.k != current else k
        chosen[1] = modes.index(result.comm)
        decision = result.to_dict()
    runner.ledger.once("replan-broadcast", 0, lambda: dist.broadcast(chosen, src=0))
    return int(chosen[0]), modes[int(chosen[1])], decision


def _has_lockstep(table: schedules.Schedule) -> bool:
    try:
        schedules.lockstep_exchanges(table)
    except schedules.ScheduleError:
        return False
    return True
