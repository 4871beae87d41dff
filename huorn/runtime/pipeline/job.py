"""The trainer of a TrainingJob with `parallelism.pipelineStages > 1`: DP × PP over the gang.

World = stages × replicas, laid out replica-major (`topology`). Every rank builds the whole
decoder from the job's seed (so every stage starts from exactly the weights a single process
would) and keeps its own stage's modules. The step's M micro-batches are dealt round-robin to
the replicas, so a replica's pipeline runs M / replicas of them; each micro-batch weighs 1/M
through the executor's 1/count scaling and the data-parallel average, which makes the step's
gradient the non-pipelined one.

Remediation S2 reaches a pipelined job through the same control file as a DDP gang
(`huorn.runtime.microbatches`), with one count per pipeline replica rather than per rank: a
replica's stages form one pipeline and must run one table, so the replica is the unit that can
take fewer micro-batches. Under a plan replica r runs the contiguous block of indices
`microbatches.assign` gives it, and the executor weighs each micro-batch 1/M and sums over
replicas, so the step's gradient is still the non-pipelined one. A plan that does not fit is
refused and the counts in force stay: within one process lifetime the replicas cannot change,
so those counts still fit.

Gradient clipping needs the whole model's norm: every rank contributes its stage's squared norm
to one all-reduce and the sum is divided by the replicas (which hold identical averaged
gradients), the same clip torch.nn.utils.clip_grad_norm_ applies to the undivided model.

Checkpoints name every tensor by its fully qualified name in the undivided decoder
(`embed.weight`, `layers.5.attn...`), so each stage writes disjoint keys through DCP, replicas
de-duplicate, and a checkpoint loads at any stage count, including none.

Elastic rule: the world size must be a multiple of the stages; a resize adds or removes whole
pipeline replicas (multiples of `stages` ranks), and M must stay divisible by the replicas.
"""

from __future__ import annotations

import datetime
import functools
import math
from collections.abc import Callable

import torch
from torch import nn

from huorn import models
from huorn.api import base
from huorn.models import decay
from huorn.runtime import comm, microbatches, train
from huorn.runtime.pipeline import executor, memory, planner, split, topology, training


class StageState(nn.Module):
    """A stage's modules under the undivided decoder's names, for checkpoints only."""

    def __init__(self, stage: split.DecoderStage) -> None:
        super().__init__()
        if stage.embed is not None:
            self.embed = stage.embed
        self.layers = nn.ModuleDict({str(stage.start + i): b for i, b in enumerate(stage.blocks)})
        if stage.norm is not None:
            self.norm = stage.norm
            self.head = stage.head


class PipelineTrainer(train.Trainer):
    # its kFkB schedules are built for its micro-batches: batchRule goodput keeps globalBatch here,
    # and the allocator prices a pipelined job so (backends.goodput.batch_rule_priced)
    takes_batch_choice = False

    def model_device(self) -> torch.device:
        """The host: only this rank's stage goes to its device (build_parallel). Built on the GPU,
        every stage held the whole decoder's weights there, (S − 1)/S of them for nothing, and a
        model that needs a pipeline to fit could not start."""
        return torch.device("cpu")

    def data_parallel_size(self) -> int:
        stages = self.spec.parallelism.pipeline_stages
        if self.world % stages:
            raise ValueError(f"world size {self.world} is not a multiple of parallelism.pipelineStages "
                             f"({stages}); run stages × replicas ranks")
        return self.world // stages

    def build_parallel(self, use_cuda: bool) -> None:
        par = self.spec.parallelism
        replicas = self.data_parallel_size()
        if self.plan.micro_batches % replicas:
            raise ValueError(f"a step's {self.plan.micro_batches} micro-batches do not split evenly over "
                             f"{replicas} pipeline replicas; make globalBatch / microBatch a multiple of "
                             "the replicas")
        self.topology = topology.PipelineTopology(par.pipeline_stages, replicas, self.rank)
        groups = topology.build_groups(self.topology,
                                       timeout=datetime.timedelta(seconds=self.cfg.collective_timeout_s))
        stages = split.split_decoder(self.model, par.pipeline_stages, self.cfg.stage_layers)
        self.stage = stages[self.topology.stage]
        release_other_stages(self.model, self.stage)
        self.stage.to(self.device)
        self.state_module = StageState(self.stage)
        self.flat_checkpoint = True
        # on GPUs the stages replay CUDA graphs: eager stages were bound by the host launching
        # kernels (docs/pipeline.md); an MoE stage, or one that fails to capture, runs eagerly
        # its receives, link drains and gradient all-reduce count on this rank's telemetry, so
        # a stage blocked on a hung neighbour shows a wait in flight that names the neighbour
        self.stage_executor = executor.StageExecutor(self.stage, self.topology, groups,
                                                     split.compute_decoder_loss, self.device,
                                                     cuda_graphs=use_cuda,
                                                     ledger=comm.StepLedger(self.telemetry))
        opt = self.spec.optimization
        self.optimizer = decay.adamw(self.stage, opt.learning_rate, opt.weight_decay)
        schedule = par.schedule.value
        # NB: messages move over overlapped links. Lockstep exchanges (comm "lockstep"/"auto")
        # measured 0.98–0.99× overlap on 2×H200, and probing them cost adaptive k up to 8% at
        # 0–40% contention there (docs/benchmarks.md), so a TrainingJob does not turn them on.
        messages = "overlap"
        self.pipeline_plan = training.PipelinePlan(
            microbatches=self.plan.micro_batches // replicas, schedule=schedule,
            k=par.k if schedule == "kfkb" else 1, replan_every=self.cfg.pipeline_replan_every, comm=messages)
        self.loop = build_loop(self.stage_executor, self.optimizer, self.build_batches, self.pipeline_plan,
                               self.clip_gradients, self.spec.resources.memory)
        self.last_k_decision: dict | None = None
        self.stage_layers = [end - start for start, end in ((s.start, s.end) for s in stages)]
        self.telemetry.set_parameter("pipeline", {
            "stages": par.pipeline_stages, "replicas": replicas, "schedule": schedule, "k": self.loop.k,
            "stage_layers": self.stage_layers})

    def build_batches(self, step: int) -> training.Batch:
        """This replica's micro-batches of `step`: inputs on the first stage, targets on the last."""
        mine = batching_indices(self.plan.micro_batches, self.topology, self.loop.counts)
        self.telemetry.set_parameter("micro_batches", {"total": self.plan.micro_batches, "mine": len(mine)})
        pairs = [self.mixture.micro_batch(step, i, self.plan.micro_batch) for i in mine]
        inputs = [[tokens.to(self.device)] for tokens, _ in pairs] if self.topology.is_first else None
        targets = [t.to(self.device) for _, t in pairs] if self.topology.is_last else None
        return inputs, targets

    def clip_gradients(self, max_norm: float = 1.0) -> None:
        grads = [p.grad for p in self.stage.parameters() if p.grad is not None]
        local = torch.stack([g.double().pow(2).sum() for g in grads]).sum() if grads else \
            torch.zeros((), dtype=torch.float64)
        total = local.reshape(1).to(self.device)
        comm.all_reduce(total, self.hook_state, op="grad-norm")
        norm = math.sqrt(float(total[0]) / self.topology.replicas)
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)

    def compute_step(self, step: int) -> tuple[float, float, int]:
        raise ValueError("a pipeline job computes through train_step; compute_step is DDP's")

    def validate(self) -> float:
        raise ValueError("validationInterval is not supported with pipelineStages > 1; set it to 0")

    def train_step(self, step: int, flags: list[float]) -> tuple[float, float | None, dict, list[float]]:
        # fault injection's slow-link acts in the links' send path, which only the executor owns
        self.stage_executor.set_link_delays(*self.injector.link_delays())
        report = self.loop.run_step(step)
        # waits for the neighbour stages, for this stage's own links to deliver and, with
        # replicas, for the slowest replica in the gradient all-reduce: a healthy replica's
        # compute must not grow with a slow replica's, nor a sender's with its slow link
        self.telemetry.add_comm_seconds(report.recv_wait_s + report.reduce_wait_s + report.send_wait_s)
        # apart as well: the detector tells a slow link (receive waits that no compute slowdown
        # explains) from a rank that is slow and makes its neighbours wait (docs/remediation.md)
        self.step_waits = {"recv_wait_seconds": report.recv_wait_s,
                           "reduce_wait_seconds": report.reduce_wait_s,
                           "send_wait_seconds": report.send_wait_s}
        # and each outgoing link's own seconds per message: behind a slow link every stage waits,
        # but only that link's messages take longer, which is how the detector names it
        self.step_links = {}
        for name, stats in (("send_link", report.send_link), ("grad_link", report.grad_link)):
            if stats is not None and stats.messages:
                self.step_links[f"{name}_seconds_per_message"] = stats.seconds_per_message
                self.step_links[f"{name}_messages"] = stats.messages
        # this stage's own compute per micro-batch, waits excluded: S2 takes a replica's speed
        # from its slowest stage's figure
        self.microbatch_seconds = report.microbatch_s
        reduced = torch.tensor(flags, dtype=torch.float64, device=self.device)
        comm.all_reduce(reduced, self.hook_state, op="stats")
        extra: dict = {"schedule": report.schedule, "k": report.k, "stage_layers": self.stage_layers,
                       "cuda_graphs": report.graphed}
        if self.stage_executor.graph_note:  # why this stage runs eagerly although graphs were asked for
            extra["graph_note"] = self.stage_executor.graph_note
        decision = report.decision  # rank 0 only; the other ranks learn k through the broadcast
        if decision is not None:
            self.last_k_decision = {"step": step + 1, "k": decision["k"], "reason": decision["reason"],
                                    "previous_k": decision["previous_k"], "changed": decision["changed"]}
            extra["k_decision"] = self.last_k_decision
        if self.pipeline_plan.schedule == "auto":
            self.telemetry.set_parameter("pipeline", {
                "stages": self.topology.stages, "replicas": self.topology.replicas,
                "schedule": "auto", "k": self.loop.k, "stage_layers": self.stage_layers,
                **({"decision": self.last_k_decision} if self.last_k_decision else {})})
        return report.loss, None, extra, reduced.tolist()

    # -- remediation S2 --------------------------------------------------------------------------
    def check_microbatch_plan(self, plan: microbatches.MicroBatchPlan) -> str | None:
        """One count per pipeline replica (module docstring), not one per rank."""
        return microbatches.check_plan(plan, self.topology.replicas, self.plan.micro_batches,
                                       unit="pipeline replica")

    def reject_microbatch_plan(self, step: int, plan: microbatches.MicroBatchPlan, problem: str) -> None:
        kept = list(self.loop.counts) if self.loop.counts is not None else None
        self.log({"event": "microbatch-plan-rejected", "step": step, "counts": list(plan.counts),
                  "reason": problem, "kept": kept})

    def use_microbatch_counts(self, counts: tuple[int, ...]) -> None:
        self.loop.set_counts(counts)  # checked above: cannot raise here, so nothing is half-applied
        self.microbatch_counts = counts

    def close(self) -> None:
        self.stage_executor.close()
        super().close()


def build_loop(stage: executor.StageExecutor, optimizer: torch.optim.Optimizer,
               batches: Callable[[int], training.Batch], plan: training.PipelinePlan,
               before_update: Callable[[], None], pod_memory: str) -> training.PipelineTraining:
    """The trainer's loop. With `schedule: auto` the planner's memory limit is each stage's
    device (`memory.activation_budget`, asked at every replan; `pod_memory` is the replica's
    `resources.memory`, the pod's limit on CPU): without one, every candidate k fitted, even
    where 4× 1F1B's activations could not."""
    auto = plan.schedule == "auto"
    budget = functools.partial(memory.activation_budget, device=stage.device,
                               pod_memory_bytes=base.parse_quantity(pod_memory))
    return training.PipelineTraining(stage=stage, optimizer=optimizer, batches=batches, plan=plan,
                                     planner=planner.AdaptiveKPlanner() if auto else None,
                                     memory_budget=budget if auto else None, before_update=before_update)


def release_other_stages(decoder: models.Decoder, mine: split.DecoderStage) -> None:
    """Free the weights of the decoder's modules this rank's stage does not run (to the meta
    device: shapes kept, storage gone). The rank keeps only its own stage's; the others' hosts
    hold theirs, and a checkpoint holds each stage's apart (StageState)."""
    for index, layer in enumerate(decoder.layers):
        if not mine.start <= index < mine.end:
            layer.to("meta")
    if not mine.first:
        decoder.embed.to("meta")
    if not mine.last:
        decoder.norm.to("meta")
        decoder.head.to("meta")


def batching_indices(micro_batches: int, topo: topology.PipelineTopology,
                     counts: tuple[int, ...] | None = None) -> list[int]:
    """The step's micro-batch indices that replica `topo.replica` runs: round-robin over replicas,
    or the replica's contiguous block under an S2 plan (the DDP trainer's rule, per replica)."""
    return microbatches.assign(counts, micro_batches, topo.replicas, topo.replica)

