"""The elastic trainer: `python -m huorn.runtime.train --config FILE`, usually under torchrun.

Every (re)start of a worker is the same path: join the gang torchrun formed, load the latest
complete checkpoint at whatever world size this round has, and continue from its step. The data
of step s is a pure function of (seed, s, micro-batch index) and the micro-batches of a step are
dealt round-robin to whatever ranks exist, so a resize changes who computes what, never what is
computed.

Stopping is agreed, not unilateral: SIGTERM only sets a flag, and the flag rides on the per-step
statistics all-reduce, so every rank learns at the same step boundary that some rank must leave.
All ranks then take the checkpoint together (DCP is collective). The rank that got SIGTERM exits
0; the others exit with RESTART_EXIT so that their torchrun agents re-rendezvous without it
(an agent whose worker exits 0 believes the job is finished).

A job with `parallelism.pipelineStages > 1` runs the same loop through
`huorn.runtime.pipeline.job.PipelineTrainer`, which swaps DDP for the pipeline executor and
keeps everything else (data, checkpoints, stop agreement, telemetry). Remediation S2 arrives
through the run directory's control file (`huorn.runtime.microbatches`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousClosedError
from torch.nn.parallel import DistributedDataParallel

from huorn import models
from huorn.api import training
from huorn.models import decay
from huorn.runtime import (
    batch_control,
    batching,
    checkpoint,
    comm,
    distill,
    faults,
    init_weights,
    launcher,
    membership,
    microbatches,
    mixture_plan,
    noise_scale,
    solo_noise,
    steplog,
    telemetry,
)
from huorn.runtime import config as run_config
from huorn.runtime.data import sampler
from huorn.runtime.peer_watch import PeerLostError, PeerWatch

RESTART_EXIT = 3
# An in-place replica that left on SIGTERM, as a shell reports a process SIGTERM ended: not 0, so
# that a pod evicted by someone else than the operator ends Failed and is replaced.
LEFT_EXIT = 143

_terminated = False  # a SIGTERM reached this process's trainer (signals are the process's)


def terminated() -> bool:
    """Whether this process was told to stop by SIGTERM. A worker forked by huorn.runtime.agent
    exits at once then: torch's worker wrapper would wait for its agent to collect a result, and an
    agent that is stopping its workers never does (it kills them 30 s later)."""
    return _terminated


_STATS = ("loss_sum", "small_sq", "contributors", "stop", "checkpoint_due", "plan_changed", "joiners")
STORE_RECONNECT = -1  # count_joiners, on rank 0 alone: the summed flag stays below 0
# While the store does not answer, rank 0 probes it (the gang waiting in its all-reduce) at most
# once in STORE_PROBE_S, for STORE_PROBE_TIMEOUT_S: about 3 % of the time, for as long as it is down.
STORE_PROBE_S = 30.0
STORE_PROBE_TIMEOUT_S = 1.0
# A step that fails this many times in a row with the same gang is a bug, not a lost peer.
_MAX_RETRIES_PER_STEP = 3


class Trainer:
    def __init__(self, cfg: run_config.RunConfig, gang: membership.Membership | None = None) -> None:
        """`gang`: resize in place (huorn.runtime.membership) instead of under torchrun's agent."""
        self.cfg = cfg
        self.spec = cfg.spec
        self.gang = gang
        use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        self.backend = "nccl" if use_cuda else "gloo"
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if use_cuda:
            torch.cuda.set_device(self.local_rank)
        self.device = torch.device(f"cuda:{self.local_rank}" if use_cuda else "cpu")
        self.replica = os.environ.get("HUORN_REPLICA")
        self.restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.run_dir = Path(cfg.run_dir)
        self.control_dir = Path(cfg.control_dir) if cfg.control_dir is not None else self.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.stop_requested = False

        # The model is built before joining the gang: it depends only on the seed, and a replica
        # that resizes in place does this slow part while the gang still trains.
        torch.manual_seed(self.spec.data.seed)
        self.model_cfg = run_config.build_model_config(self.spec.model)
        self.model = models.build_model(self.model_cfg).to(self.model_device())
        # Distillation's teacher is read before the gang forms too: alone, DCP needs no other
        # process, so an in-place replica joining a running gang loads it without them.
        teacher = self.spec.task.teacher
        self.teacher = (distill.load_teacher(teacher.checkpoint, self.spec.model, self.device).model
                        if teacher is not None else None)
        # checked here, where a ValueError ends the process with 2 and the field's name; only for
        # a run that has no checkpoint of its own yet: one that has resumes from it and never
        # reads the base weights again (the base run may have pruned them since)
        start = self.spec.task.init_checkpoint
        fresh = bool(start) and checkpoint.find_latest(cfg.checkpoint_root) is None
        self.init_source = init_weights.starting_checkpoint(start, self.spec.model) if fresh else None
        self.has_state = False  # in-place mode: this process holds the gang's training state
        self.watch: PeerWatch | None = None  # in place: the heartbeats of this round's members
        self.peer_lost: list[int] | None = None  # ranks the watch found dead; the groups are aborted
        if gang is not None and self.backend == "nccl":
            # A dead peer is found by the heartbeats (huorn.runtime.peer_watch), which abort the
            # groups; the watchdog must neither kill this process for that abort nor on a
            # collective's timeout, or the survivors restart from a checkpoint.
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
        if gang is None:
            self.rank, self.world, self.local_rank = comm.init_process_group(
                self.backend, cfg.collective_timeout_s)
        else:
            # NB: before the gang forms, a pod is told to go by SIGTERM too; holding no state yet,
            # this process just goes (_request_stop). Without a handler, Python as a pod's PID 1
            # would ignore it until the grace period ends.
            signal.signal(signal.SIGTERM, self._request_stop)
            self.rank, self.world = self.join_round()
        self.pending_save: str | None = None  # a checkpoint due at this step boundary, not yet taken
        # when the last checkpoint was written (monotonic), which decides a time-based one; None
        # until the loop starts. A joiner takes its gang's (share_state): rank 0 decides, and a
        # joiner that became rank 0 had started the interval over at each join
        self.last_checkpoint_time: float | None = None
        # the gang's size before this round formed: set only by a regroup, or with the state a
        # member hands a joiner (share_state), so a process that joined a running gang has it
        self.world_before_round: int | None = None
        self.round_reason = "join"  # why the gang's members formed this round (a regroup's reason)
        self.store_unreachable = False
        self.store_probed_at = -math.inf
        self.state_module: torch.nn.Module = self.model  # what checkpoints hold
        self.flat_checkpoint = False  # see checkpoint.build_state
        # batchRule goodput: the allocator's global batch in force (batch_control), and the stamp
        # of the control file it came from; None: the spec's globalBatch
        self.chosen_batch: int | None = None
        self.batch_stamp = 0
        self.batch_version = -1  # the set-param version of the batch in force (older files are stale)
        self.last_noise: float | None = None  # the newest gradient noise scale (AdaScale's gain)
        self.plan = batching.plan_batch(self.spec.optimization, self.spec.elasticity.min_replicas,
                                        self.replicas(), self.chosen_batch)
        self.microbatch_counts: tuple[int, ...] | None = None  # S2 plan; None: even round-robin
        # a world of one's small batch (solo_noise): squared norm, sequences, how it was read
        self.solo_reading: tuple[float, float, str] | None = None
        self.noise_reading: str | None = None  # how the last step read the noise scale (telemetry)
        self.microbatch_seconds: float | None = None  # last step's compute per micro-batch (S2's input)
        self.step_waits: dict[str, float] = {}  # last step's waits by kind (a pipeline's receive, reduce)
        self.step_links: dict[str, float] = {}  # last step's pipeline link figures (telemetry.record_step)
        self.control_stamp = 0
        self.plan_rejected = False  # the control file's last plan did not fit (share_state)
        # steps, or tokens: the global batch (a step's tokens) may change with the world and at a
        # restart on an edited spec, so a token budget counts the tokens trained (self.tokens)
        self.budget = batching.Budget.of(self.spec, cfg.step_limit)
        self.tokens = 0  # tokens trained by this process's state: it travels with the step
        auto = self.spec.data.mixture == "auto"  # DDK sets the weights; every listed source takes part
        weights = [1.0 if auto else s.weight for s in self.spec.data.sources]
        # D-CPT probes before the first step (or a plan an earlier start made); every rank draws
        # with the weights rank 0 wrote.
        self.mixture_plan = (mixture_plan.plan_mixture(cfg, self.rank, self.world, self.device, self._say)
                             if self.spec.data.plan is not None else None)
        if self.mixture_plan is not None:
            weights = self.mixture_plan.weights
            if not self.mixture_plan.choice["within_tolerance"]:
                self._say(f"D-CPT: no domain share keeps the general loss within spec.data.plan."
                          f"generalTolerance; training at {self.mixture_plan.share:g}, the share "
                          "nearest to it")
        self.mixture = sampler.build_mixture(
            [(s.name, w, s.path) for s, w in zip(self.spec.data.sources, weights, strict=True)],
            self.spec.data.seed, self.spec.model.context, cfg.data_dir)
        self.validation_mixture = self.mixture  # fixed, so validation losses compare across reweightings
        self.ddk = (distill.DomainReweighting(teacher.reweight_steps, teacher.reweight_smoothing)
                    if auto and teacher is not None else None)
        self.teacher_losses: list[float] | None = None  # per source; the teacher is frozen

        self.telemetry = telemetry.Telemetry(cfg.job_name, self.rank, self.world, self.replica,
                                             cfg.telemetry_history)
        if self.mixture_plan is not None:
            self.telemetry.set_parameter("mixture", {s.name: w for s, w in zip(
                self.spec.data.sources, self.mixture_plan.weights, strict=True)})
        self.injector = faults.FaultInjector(cfg.faults, self.run_dir, self.rank, self.replica)
        for layer in self.model.layers:  # a pipeline stage runs its share of these same modules
            layer.register_forward_pre_hook(lambda *_: self.injector.before_layer())
        self.hook_state = comm.HookState(self.telemetry, self.injector)
        self.noise = noise_scale.NoiseScale()
        # bf16 autocast on GPU; CPU runs stay fp32 so they can be compared exactly with a reference.
        self.autocast = (
            (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if use_cuda else contextlib.nullcontext)
        self.build_parallel(use_cuda)

    def model_device(self) -> torch.device:
        """Where the whole decoder is built: this rank's device under DDP, which trains all of it
        (a pipeline builds it on the host and moves only its stage)."""
        return self.device

    def data_parallel_size(self) -> int:
        """Ranks that split the batch (all of them under DDP; a pipeline divides by its stages)."""
        return self.world

    def replicas(self) -> int:
        """Replicas in the gang, the unit of elasticity.minReplicas: torchrun runs
        LOCAL_WORLD_SIZE ranks per replica (in place, a replica is this one process)."""
        return batching.replicas_in(self.world, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))

    def build_parallel(self, use_cuda: bool) -> None:
        opt = self.spec.optimization
        self.optimizer = decay.adamw(self.model, opt.learning_rate, opt.weight_decay)
        if self.gang is None:  # in place, DDP comes after the state is shared (run, regroup)
            self.wrap_data_parallel()

    def wrap_data_parallel(self) -> None:
        """DDP over the current process group (again after every in-place regroup). Collective:
        DDP broadcasts rank 0's parameters and buffers."""
        self.ddp = DistributedDataParallel(
            self.model, device_ids=[self.local_rank] if self.device.type == "cuda" else None,
            find_unused_parameters=self.model_cfg.moe is not None)
        self.ddp.register_comm_hook(self.hook_state, comm.allreduce_hook)

    # -- in-place resizing -----------------------------------------------------------------------
    def join_round(self) -> tuple[int, int]:
        """Block until the gang's next rendezvous round forms, and make its process group."""
        assert self.gang is not None
        self.gang, round_ = membership.join_next_round(self.gang, STORE_PROBE_TIMEOUT_S)
        membership.init_round_process_group(self.backend, round_, self.cfg.collective_timeout_s)
        if self.backend == "nccl":  # gloo raises on a lost peer itself (and cannot abort a wait)
            self.watch = self.gang.watch(round_, self._peer_lost, self.cfg.peer_timeout_s)
        return round_.rank, round_.world

    def _peer_lost(self, ranks: list[int]) -> None:
        """The watch's thread: a member stopped beating. An NCCL collective waiting on it would
        spin until its timeout, so the groups are aborted (ncclCommAbort), and the loop regroups
        before it applies the step (_raise_if_peer_lost)."""
        self.peer_lost = ranks
        print(f"huorn: rank(s) {ranks} stopped beating for {self.cfg.peer_timeout_s:g} s; aborting the "
              "process group to regroup without them", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):  # a group being destroyed by the main thread already
            dist.distributed_c10d._abort_process_group()

    def _raise_if_peer_lost(self) -> None:
        if self.peer_lost is not None:
            raise PeerLostError(f"rank(s) {self.peer_lost} of the gang stopped beating")

    def regroup(self, step: int, reason: str) -> int:
        """Leave this process group, form the next round with whoever is there now, and continue
        from the newest state any member holds. Returns the step to continue from."""
        started = time.monotonic()
        old_world = self.world
        self.world_before_round, self.round_reason = old_world, reason
        self._release_group_holders()  # a late alarm must not abort the next round's group
        with contextlib.suppress(Exception):  # a group with a dead peer may refuse to close cleanly
            dist.destroy_process_group()
        # A step cut short by a lost peer may have left half-accumulated gradients behind.
        self.optimizer.zero_grad(set_to_none=True)
        self.peer_lost = None
        self.rank, self.world = self.join_round()
        self.telemetry.rejoin(self.rank, self.world)
        self.injector.rank = self.rank
        step = self.share_state(step)
        self.wrap_data_parallel()
        self.microbatch_counts = None  # a plan written for the old gang does not fit the new one
        self.write_endpoint()
        event = {"event": "regroup", "reason": reason, "resumed_from": step, "from_world_size": old_world,
                 "world_size": self.world, "global_batch": self.plan.global_batch,
                 "seconds": time.monotonic() - started}
        self.log(event)
        if self.rank == 0 and steplog.missed_join(event):
            print(f"huorn: the joining replica missed round at world size {self.world}; it joins at "
                  "the next step boundary", file=sys.stderr, flush=True)
        self.take_pending_save(step)
        return step

    def share_state(self, step: int) -> int:
        """Collective, after a round forms: the member with the newest state (the most steps; the
        lowest rank among equals) broadcasts the model, the optimizer and the loop's own state to
        every rank. When no rank holds state (the gang's first round), it comes from the last
        checkpoint instead."""
        held = [None] * self.world
        dist.all_gather_object(held, step if self.has_state else None)
        steps = [(s, -r) for r, s in enumerate(held) if s is not None]
        if not steps:
            step = self.resume()
            # no member's batch either: rank 0 reads batch.json again at the first boundary, so
            # every rank takes the same one (a process that lost its state may hold an older one)
            self.chosen_batch, self.batch_stamp, self.batch_version = None, 0, -1
        else:
            best, negative_rank = max(steps)
            source = -negative_rank
            if held[self.rank] != best:
                # The broadcast writes into this process's live tensors. Cut short (the source
                # lost), they hold a mix of two steps, which must never be handed on as this
                # step's state: the next round takes it from another member or the checkpoint.
                # A member already at `best` receives the bytes it holds (the all-reduce gave
                # every rank the same), so it keeps its claim.
                self.has_state = False
            _, dcp_state = checkpoint.dcp_modules()  # on first use: a fresh gang never pays for it
            model_state, optim_state = dcp_state.get_state_dict(self.model, self.optimizer)
            tensors = [model_state[k] for k in sorted(model_state)]
            tensors += [value for _, value in _flatten_optimizer_state(optim_state)]
            for tensor in tensors:
                comm.broadcast_tensor(tensor, source, self.device)
            loop = comm.broadcast_object(
                {"noise": dataclasses.asdict(self.noise), "control_stamp": self.control_stamp,
                 "plan_rejected": self.plan_rejected, "tokens": self.tokens, "budget": self.budget.meta(),
                 "param_groups": optim_state["param_groups"], "pending_save": self.pending_save,
                 "ddk": self.ddk.state() if self.ddk is not None else None,
                 "checkpoint_age": None if self.last_checkpoint_time is None
                 else time.monotonic() - self.last_checkpoint_time,
                 "world_before": self.world_before_round, "round_reason": self.round_reason,
                 "chosen_batch": self.chosen_batch, "batch_stamp": self.batch_stamp,
                 "batch_version": self.batch_version, "last_noise": self.last_noise}
                if self.rank == source else None, self.hook_state, src=source)
            self._raise_if_peer_lost()  # a member lost mid-broadcast: what arrived may be partial
            self.pending_save = loop["pending_save"]  # type: ignore[index]
            optim_state["param_groups"] = loop["param_groups"]  # type: ignore[index]
            dcp_state.set_state_dict(self.model, self.optimizer, model_state_dict=model_state,
                                     optim_state_dict=optim_state)
            self.noise = noise_scale.NoiseScale(**loop["noise"])  # type: ignore[index]
            self.control_stamp = loop["control_stamp"]  # type: ignore[index]
            self.plan_rejected = loop["plan_rejected"]  # type: ignore[index]
            self.tokens = loop["tokens"]  # type: ignore[index]
            # a joiner's spec may carry another globalBatch (goodput, an edit): the gang keeps
            # the schedule's unit of the run's first start
            self.budget = self.budget.resumed(loop["budget"])  # type: ignore[index]
            self.restore_mixture(loop["ddk"])  # type: ignore[index]
            if loop.get("checkpoint_age") is not None:  # type: ignore[union-attr]
                self.last_checkpoint_time = time.monotonic() - loop["checkpoint_age"]  # type: ignore[index]
            self.world_before_round = loop.get("world_before")  # type: ignore[union-attr]
            self.round_reason = loop.get("round_reason", "join")  # type: ignore[union-attr]
            # the gang's batch (goodput): a joiner trains the same step as its members
            self.chosen_batch = loop.get("chosen_batch")  # type: ignore[union-attr]
            self.batch_stamp = loop.get("batch_stamp", 0)  # type: ignore[union-attr]
            self.batch_version = loop.get("batch_version", -1)  # type: ignore[union-attr]
            self.last_noise = loop.get("last_noise")  # type: ignore[union-attr]
            step = best
        self.has_state = True
        # Every rank plans the step from the gang's batch: a joiner built its plan at start, for
        # globalBatch, and trained it beside members at the allocator's (other micro-batches,
        # other weights, another progress count: it reached the budget later, and the gang hung
        # on its last collective until the timeout).
        self.plan = batching.plan_batch(self.spec.optimization, self.spec.elasticity.min_replicas,
                                        self.replicas(), self.chosen_batch)
        if self.plan_rejected:
            # A plan the old gang rejected just before the regroup was most often written for
            # this very gang (the operator writes it for the gang it grows): read it again at the
            # first step. A plan in force is not: its counts were fitted to ranks that a new round
            # may have renumbered, so it waits for the operator's next plan.
            self.control_stamp, self.plan_rejected = 0, False
        return step

    # -- bookkeeping ---------------------------------------------------------------------------
    def _say(self, message: str) -> None:
        """Progress before the first step (D-CPT probes), on stderr: the pod's log."""
        print(f"huorn: rank {self.rank}: {message}", file=sys.stderr, flush=True)

    def log(self, record: dict) -> None:
        """Rank 0 appends one JSON line per event; a single write() keeps lines whole."""
        if self.rank != 0:
            return
        line = json.dumps({"time": time.time(), **record}) + "\n"
        with open(self.run_dir / run_config.STEPS_FILE, "a") as handle:
            handle.write(line)

    def start_telemetry(self) -> int:
        port = self.cfg.telemetry_port + self.local_rank if self.cfg.telemetry_port else 0
        self.telemetry_port = self.telemetry.serve(self.cfg.telemetry_host, port)
        self.write_endpoint()
        return self.telemetry_port

    def write_endpoint(self) -> None:
        telemetry.write_endpoint_file(self.run_dir, self.replica, self.local_rank, {
            "port": self.telemetry_port, "host": self.cfg.telemetry_host, "rank": self.rank,
            "local_rank": self.local_rank, "world_size": self.world, "replica": self.replica,
            "pid": os.getpid(), "restart_count": self.restart_count})

    # -- checkpoints ---------------------------------------------------------------------------
    def resume(self) -> int:
        root = self.cfg.checkpoint_root
        if self.rank == 0:
            checkpoint.remove_stale_temporaries(root)
        latest = checkpoint.find_latest(root) if self.rank == 0 else None
        latest = comm.broadcast_object(str(latest) if latest else None, self.hook_state)
        if latest is not None:
            meta = checkpoint.load_checkpoint(Path(latest), self.state_module, self.optimizer,
                                              self.flat_checkpoint)
            self.restore_mixture(meta.get("ddk"))
            self.tokens = tokens_in(meta, self.spec)
            # the schedule's unit the run's first start fixed, not the (maybe edited) spec's
            self.budget = batching.Budget.of(self.spec, self.cfg.step_limit).resumed(meta)
            return int(meta["step"])
        if self.spec.task.init_checkpoint:
            # Continual pre-training starts from another run's weights, with a fresh optimizer
            # and step 0; once this run has its own checkpoint, that one wins on restart.
            source = self.init_source or init_weights.starting_checkpoint(self.spec.task.init_checkpoint,
                                                                          self.spec.model)
            checkpoint.load_checkpoint(source, self.state_module, None)
        self.tokens = 0
        self.budget = batching.Budget.of(self.spec, self.cfg.step_limit)  # the run's first start
        return 0

    def save(self, step: int, reason: str) -> None:
        started = time.monotonic()
        path = checkpoint.save_checkpoint(
            self.cfg.checkpoint_root, step, self.state_module, self.optimizer,
            {"world_size": self.world, "job": self.cfg.job_name, "seed": self.spec.data.seed,
             "global_batch": self.plan.global_batch, "tokens": self.tokens, **self.budget.meta(),
             "model": self.spec.model.to_wire(),
             **({"ddk": self.ddk.state()} if self.ddk is not None else {}),
             **({mixture_plan.CHECKPOINT_KEY:
                 mixture_plan.checkpoint_record(self.mixture_plan, self.spec.data)}
                if self.mixture_plan is not None else {})},
            self.rank, lambda: comm.barrier(self.hook_state), keep=self.cfg.keep_checkpoints,
            flat=self.flat_checkpoint)
        self.last_checkpoint_time = time.monotonic()
        self.log({"event": "checkpoint", "step": step, "reason": reason, "path": str(path),
                  "seconds": time.monotonic() - started})
        # the operator copies it to status.lastCheckpoint; the tokens tell it the final one of a
        # budget in tokens (huorn.operator.evaluation.is_final)
        self.telemetry.set_parameter("checkpoint", {
            "step": step, "path": str(path), "tokens": self.tokens,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})

    # -- one step --------------------------------------------------------------------------------
    def compute_step(self, step: int) -> tuple[float, float, int]:
        """Forward/backward of this rank's micro-batches of `step`; returns (summed loss, squared
        norm of this rank's own mean gradient, micro-batches computed)."""
        mine = microbatches.assign(self.microbatch_counts, self.plan.micro_batches, self.world, self.rank)
        # NB: a rank with no micro-batch still runs one backward with weight 0, because DDP's
        # all-reduce needs every rank to contribute a bucket.
        work = mine or [0]
        self.telemetry.set_parameter("micro_batches", {"total": self.plan.micro_batches, "mine": len(mine)})
        weight = 1.0 / self.plan.micro_batches if mine else 0.0
        loss_sum = 0.0
        # A world of one has no per-rank gradient to set against the reduced one; its micro-batches
        # give the small batches instead (solo_noise).
        solo = (solo_noise.SoloReading(len(mine), self.plan.micro_batch, self.room_for_gradients())
                if self.world == 1 and len(mine) >= 2 else None)
        loop_started, comm_before = time.perf_counter(), self.telemetry.comm_seconds_so_far()
        for i, index in enumerate(work):
            if mine:
                self.injector.before_micro_batch()
            batch_started, batch_comm = time.perf_counter(), self.telemetry.comm_seconds_so_far()
            tokens, targets = self.mixture.micro_batch(step, index, self.plan.micro_batch)
            tokens, targets = tokens.to(self.device), targets.to(self.device)
            sync = contextlib.nullcontext() if i == len(work) - 1 else self.ddp.no_sync()
            with sync:
                with self.autocast():
                    logits, loss = self.ddp(tokens, targets)
                    if self.teacher is not None:
                        loss = loss + self.distillation_term(tokens, logits)
                (loss * weight).backward()
            if solo is not None:
                solo.after_backward(i + 1, self.gradients())
            loss_sum += float(loss.detach()) if mine else 0.0
            if mine:
                self.injector.after_micro_batch(time.perf_counter() - batch_started
                                                - (self.telemetry.comm_seconds_so_far() - batch_comm))
        loop_comm = self.telemetry.comm_seconds_so_far() - comm_before
        self.microbatch_seconds = (max(0.0, time.perf_counter() - loop_started - loop_comm) / len(mine)
                                   if mine else None)
        local_sq, self.global_sq = self.hook_state.norms.take()
        reading = solo.reading(self.gradients()) if solo is not None else None
        self.solo_reading = (*reading, solo.mode) if solo is not None and reading is not None else None
        # The bucket held (n/M)·g_local; rescale to the squared norm of this rank's mean gradient.
        small_sq = local_sq * (self.plan.micro_batches / len(mine)) ** 2 if mine else 0.0
        return loss_sum, small_sq, len(mine)

    def distillation_term(self, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """γ·KL(student ‖ teacher) of one micro-batch (DDK's loss is CE plus this)."""
        assert self.teacher is not None and self.spec.task.teacher is not None
        teacher = self.spec.task.teacher
        with torch.no_grad():
            teacher_logits, _ = self.teacher(tokens)
        return teacher.kl_weight * distill.kl_divergence(logits, teacher_logits, teacher.temperature)

    def reweight(self, step: int) -> None:
        """DDK at a step boundary: rank 0 measures each source's gap to the teacher and every rank
        takes the same ratios, so the weights, and the batches drawn with them, agree."""
        assert self.ddk is not None and self.teacher is not None
        started = time.monotonic()
        measured = None
        if self.rank == 0:
            batches, sequences = self.cfg.validation_batches, self.plan.micro_batch
            if self.teacher_losses is None:
                self.teacher_losses = distill.source_losses(self.teacher, self.validation_mixture, batches,
                                                            sequences, self.device, part="steer")
            student = distill.source_losses(self.model, self.validation_mixture, batches, sequences,
                                            self.device, part="steer")
            measured = {"student_losses": student, "teacher_losses": self.teacher_losses,
                        "ratios": [s / t for s, t in zip(student, self.teacher_losses, strict=True)]}
        measured = comm.broadcast_object(measured, self.hook_state)
        self._raise_if_peer_lost()
        assert isinstance(measured, dict)
        weights = self.ddk.advance(step, measured["ratios"])
        self.restore_mixture(self.ddk.state())
        names = [s.name for s in self.mixture.sources]
        self.telemetry.set_parameter("mixture", dict(zip(names, weights, strict=True)))
        self.log({"event": "ddk", "step": step, "sources": names, "weights": weights, **measured,
                  "seconds": time.monotonic() - started})

    def restore_mixture(self, state: dict | None) -> None:
        """DDK's weights from a checkpoint, a member's hand-over or a reweighting."""
        if self.ddk is None or not state:
            return
        self.ddk.restore(state)
        self.mixture = self.validation_mixture.with_probabilities(self.ddk.weights)

    def gradients(self) -> list[torch.Tensor | None]:
        return [p.grad for p in self.model.parameters()]

    def room_for_gradients(self) -> bool:
        """Whether a copy of the gradients fits: always in host memory; on a GPU with as much
        again to spare, so that the copy never costs the step its memory. Free counts what torch's
        allocator holds unused (the last step's copy, once released), which the driver does not,
        so that a job does not pass at its first step and fail at every later one."""
        if self.device.type != "cuda":
            return True
        free = (torch.cuda.mem_get_info(self.device)[0] + torch.cuda.memory_reserved(self.device)
                - torch.cuda.memory_allocated(self.device))
        return free >= 2 * solo_noise.gradient_bytes(self.model.parameters())

    def update_noise_scale(self, small_sq_sum: float, contributors: int) -> float | None:
        """B_noise from this step's small-batch and global-batch gradient norms. The small batch is a
        rank's share where two or more ranks computed; in a world of one it comes from two or more
        micro-batches (solo_noise), so a job trained by one replica (the common start) tells the
        goodput policy its noise scale, which prices larger batches at 0 until it reads one. With
        a single micro-batch there is no second size and the value stays as it was."""
        if contributors >= 2:
            self.noise_reading = "ranks"
            b_small = self.plan.global_batch / contributors
            return self.noise.update(small_sq_sum / contributors, self.global_sq, b_small,
                                     self.plan.global_batch)
        if self.solo_reading is not None:
            small_sq, b_small, self.noise_reading = self.solo_reading
            return self.noise.update(small_sq, self.global_sq, b_small, self.plan.global_batch)
        self.noise_reading = None
        return self.noise.value

    def validate(self) -> float:
        self.model.eval()
        total = 0.0
        with torch.no_grad(), self.autocast():
            for index in range(self.cfg.validation_batches):
                tokens, targets = self.validation_mixture.validation_batch(index, self.plan.micro_batch)
                total += float(self.model(tokens.to(self.device), targets.to(self.device))[1])
        self.model.train()
        return total / self.cfg.validation_batches

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> int:
        port = self.start_telemetry()
        if self.gang is None:
            step = self.resume()
        else:
            step = self.share_state(0)
            self.wrap_data_parallel()
            self.take_pending_save(step)  # a joiner takes part in the save its gang had due
        self.state_step = step  # optimizer steps applied to this process's state
        # process_started lets a harness split a recovery into "until the new worker exists" and
        # "worker start-up, rendezvous of the process group and checkpoint load".
        self.log({"event": "start", "resumed_from": step, "world_size": self.world, "global_batch":
                  self.plan.global_batch, "restart_count": self.restart_count, "telemetry_port": port,
                  "process_started": psutil.Process().create_time(), "in_place": self.gang is not None})
        if self.mixture_plan is not None:
            plan = self.mixture_plan
            self.log({"event": "dcpt", "share": plan.share, "weights": plan.weights,
                      "sources": [s.name for s in self.spec.data.sources], "tokens": plan.tokens,
                      "choice": plan.choice, "domain_r2": plan.domain_r2, "general_r2": plan.general_r2,
                      "probes": len(plan.probes), "seconds": plan.seconds})
        if self.gang is not None and self.world_before_round is not None:
            # the gang's members log nothing of a join when the joiner is rank 0 (c10d numbers
            # ranks by address, and a replacement often sorts first): it logs the regroup for them
            # the members' reason: a replacement joining a round its peers formed for a lost peer
            # logs that round's "peer-lost", not a join (which a reader may take for a missed one)
            self.log({"event": "regroup", "reason": self.round_reason, "resumed_from": step,
                      "from_world_size": self.world_before_round, "world_size": self.world,
                      "global_batch": self.plan.global_batch})
        signal.signal(signal.SIGTERM, self._request_stop)
        if self.last_checkpoint_time is None:  # a joiner keeps its gang's clock
            self.last_checkpoint_time = time.monotonic()
        failures: tuple[int, int] = (-1, 0)  # (step, failures in a row at it)
        while not self.budget.reached(step, self.tokens):
            if self.gang is None:
                step, code = self.advance(step)
            else:
                try:
                    step, code = self.advance(step)
                except Exception as error:  # gloo reports a lost peer as a plain RuntimeError
                    if not isinstance(error, RuntimeError) and self.peer_lost is None:
                        raise
                    # An aborted group may also hand a collective garbage (an object all-gather
                    # that does not unpickle), hence any error once the watch has fired.
                    failures = (self.state_step, failures[1] + 1 if failures[0] == self.state_step else 1)
                    if failures[1] > _MAX_RETRIES_PER_STEP:
                        raise
                    step, code = self.recover(error), None
            if code is not None:
                return code
        self.log({"event": "done", "step": step, "tokens": self.tokens})
        if self.watch is not None:
            self.watch.stop()
        if self.gang is not None and self.rank == 0:
            # A replica still waiting to join would otherwise wait out join_timeout and fail.
            with contextlib.suppress(Exception):
                self.gang.close()
        return 0

    def advance(self, step: int) -> tuple[int, int | None]:
        """One step, its log line and whatever the gang agreed on at its boundary (stop,
        checkpoint, new plan, regroup). Returns (next step, exit code or None to go on)."""
        if self.ddk is not None and self.ddk.due(step):
            self.reweight(step)  # outside the step's time: a measurement, not training
        started = time.perf_counter()
        self.injector.step = step
        self.injector.refresh()
        self.telemetry.take_comm_seconds()
        self.injector.before_compute()
        lr = self.budget.learning_rate(step, self.tokens, self.plan.learning_rate, self.spec.optimization)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        interval_s = self.cfg.checkpoint_interval_s()
        due = interval_s is not None and time.monotonic() - self.last_checkpoint_time >= interval_s
        joiners = float(self.count_joiners()) if self.gang is not None and self.rank == 0 else 0.0
        flags = [float(self.stop_requested), float(due and self.rank == 0), self.poll_control_file(),
                 joiners]
        loss, noise, extra, flags = self.train_step(step, flags)
        stats_by_name = dict(zip(_STATS[3:], flags, strict=True))
        step += 1
        step_tokens = self.plan.global_batch * self.spec.model.context
        self.last_noise = noise if noise is not None else self.last_noise
        progress = batching.progress_tokens(self.spec.optimization, self.spec.model.context,
                                            self.plan.global_batch, self.last_noise)
        self.state_step, self.tokens = step, self.tokens + progress
        finished = self.budget.reached(step, self.tokens)
        elapsed = time.perf_counter() - started
        tokens_per_s = step_tokens / elapsed
        comm_s = self.telemetry.take_comm_seconds()
        self.injector.after_step(elapsed - comm_s)
        self.telemetry.record_step(step, elapsed, comm_s, loss, tokens_per_s, noise,
                                   microbatch_seconds=self.microbatch_seconds, waits=self.step_waits,
                                   links=self.step_links, global_batch=self.plan.global_batch,
                                   learning_rate=lr, tokens=self.tokens, noise_reading=self.noise_reading)
        record = {"event": "step", "step": step, "loss": loss, "world_size": self.world, "lr": lr,
                  "global_batch": self.plan.global_batch, "tokens": self.tokens,
                  "tokens_per_second": tokens_per_s, "step_seconds": elapsed, "comm_seconds": comm_s,
                  "gradient_noise_scale": noise, **extra}
        if self.microbatch_counts is not None:
            record["microbatches"] = list(self.microbatch_counts)
        if self.microbatch_seconds is not None:
            record["microbatch_seconds"] = self.microbatch_seconds
        if self.noise_reading is not None:
            record["gradient_noise_reading"] = self.noise_reading
        if self.cfg.validation_interval and step % self.cfg.validation_interval == 0:
            record["validation_loss"] = self.validate()
        if stats_by_name["plan_changed"] > 0:
            self.apply_control_file(step)
        self.log(record)
        leaving = int(stats_by_name["stop"])
        if leaving:
            # Everyone checkpoints while the leavers are still here. In place the ranks that stay
            # hold the state anyway, but their own SIGTERMs may be a step behind (a whole job
            # being stopped), and fewer than minReplicas of them can form no gang to save it.
            self.save(step, "sigterm" if self.stop_requested else "peer-stop")
            if self.stop_requested:
                return step, 0 if self.gang is None else LEFT_EXIT
            if self.gang is None:
                return step, RESTART_EXIT
            if not finished:
                return self.regroup(step, "leave"), None
        interval_steps = self.spec.checkpoint.interval_steps
        if finished or (interval_steps and step % interval_steps == 0) \
                or stats_by_name["checkpoint_due"] > 0:
            self.pending_save = "final" if finished else "periodic"
        if self.gang is not None and not finished and stats_by_name["joiners"] < 0:
            self.gang, self.store_unreachable = self.gang.reconnected(), False
            return self.regroup(step, "store reconnected"), None
        if self.gang is not None and not finished and stats_by_name["joiners"] > 0:
            # The save waits for the new gang: a joiner learns of it with the state
            # (share_state), so every rank of the new gang takes it together.
            return self.regroup(step, "join"), None
        self.take_pending_save(step)
        return step, None

    def count_joiners(self) -> int:
        """Replicas waiting to join; STORE_RECONNECT when this gang's connection to the store broke
        while the store answers a new one. A store that does not answer means none: the gang
        trains on, and a lost store shows where it matters, at the next regroup or the operator's
        look.

        A store restarted in place (its container, behind the same Service) answers new
        connections, empty, but never the old ones again (c10d's client does not reconnect). A
        replica that joined it then formed a gang of its own beside this one, and two gangs wrote
        and pruned one checkpoint directory. This gang re-forms on it at once instead
        (reconnect), so that a joiner meets it there."""
        assert self.gang is not None
        try:
            return self.gang.waiting()
        except Exception as error:  # RendezvousError, DistStoreError, timeouts
            # a probe of a store that is down waits for its time-out: one every STORE_PROBE_S
            probe = time.monotonic() - self.store_probed_at >= STORE_PROBE_S
            if probe:
                self.store_probed_at = time.monotonic()
            if probe and membership.store_answers(self.gang.settings.rdzv_endpoint,
                                                  timeout_s=STORE_PROBE_TIMEOUT_S):
                print(f"huorn: the rendezvous store dropped this gang's connection ({error}) but "
                      "answers a new one (it restarted?): the gang re-forms on it", file=sys.stderr,
                      flush=True)
                return STORE_RECONNECT
            if not self.store_unreachable:
                print(f"huorn: the rendezvous store does not answer ({error}); no resize until it does",
                      file=sys.stderr, flush=True)
            self.store_unreachable = True
            return 0

    def take_pending_save(self, step: int) -> None:
        """The save its gang had due, cleared once written: a peer lost inside it leaves it due,
        and the next round takes it (share_state hands it on). Cleared first, a lost peer had
        dropped it, the final one too, and the survivors ended with an older checkpoint, exit 0."""
        if self.pending_save is not None:
            self.save(step, self.pending_save)
            self.pending_save = None

    def recover(self, error: Exception) -> int:
        """A collective failed: a peer died or hung. Form the next round with the ranks still
        alive; the newest state any of them holds goes on (often no step is lost at all)."""
        print(f"huorn: collective failed at step {self.state_step} ({error}); regrouping", file=sys.stderr,
              flush=True)
        for _ in range(_MAX_RETRIES_PER_STEP):
            try:
                return self.regroup(self.state_step, f"peer-lost: {type(error).__name__}")
            except Exception as again:  # a member of the new round died before it formed
                if not isinstance(again, RuntimeError) and self.peer_lost is None:
                    raise
                error = again
        raise error

    def train_step(self, step: int, flags: list[float]) -> tuple[float, float | None, dict, list[float]]:
        """One optimizer step; `flags` (stop, checkpoint due, control file changed) are summed over
        the ranks in the step's one explicit collective. Returns (loss, noise scale, extra step-log
        fields, reduced flags)."""
        loss_sum, small_sq, computed = self.compute_step(step)
        # Loss, noise-scale inputs and the flags travel together, so every rank acts on them at
        # the same boundary.
        stats = torch.tensor([loss_sum, small_sq, float(computed > 0), *flags],
                             dtype=torch.float64, device=self.device)
        comm.all_reduce(stats, self.hook_state, op="stats")
        values = stats.tolist()  # NB: waits for the step's collectives, aborted or not
        self._raise_if_peer_lost()  # an aborted step's sums are garbage: nothing may apply them
        noise = self.update_noise_scale(values[1], int(values[2]))
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return values[0] / self.plan.micro_batches, noise, {}, values[3:]

    # -- remediation S2 --------------------------------------------------------------------------
    # batchRule goodput: the allocator's batch arrives through the same boundary (batch_control);
    # a pipelined gang keeps its batch (its schedules are built for its micro-batches), and the
    # allocator prices it so
    takes_batch_choice = True

    def poll_control_file(self) -> float:
        """1.0 on rank 0 when a control file (S2's counts, goodput's batch) changed since it was
        last applied."""
        if self.rank != 0:
            return 0.0
        _, stamp = microbatches.read_control_file(self.control_dir)
        return float((stamp > 0 and stamp != self.control_stamp) or self.batch_changed())

    def batch_changed(self) -> bool:
        if not self.takes_batch_choice or self.spec.optimization.batch_rule != training.BatchRule.GOODPUT:
            return False
        choice, stamp = batch_control.read_control_file(self.control_dir)
        # by version too: each pod's mounted copy of the ConfigMap updates on its own schedule, and
        # a new rank 0 whose copy lags would take the older batch back
        return (choice is not None and stamp != self.batch_stamp
                and choice.version >= self.batch_version)

    def apply_control_file(self, step: int) -> None:
        """Collective: rank 0's reading of the files reaches every rank, which switch together
        from the next step on: the batch first, then S2's counts, which must fit its micro-batches."""
        batch = (batch_control.read_control_file(self.control_dir) if self.rank == 0 and self.batch_changed()
                 else (None, 0))
        reading = microbatches.read_control_file(self.control_dir) if self.rank == 0 else (None, 0)
        (choice, batch_stamp), (plan, stamp) = comm.broadcast_object(  # type: ignore[misc]
            (batch, reading), self.hook_state)
        if choice is not None:
            self.use_batch_choice(step, choice, batch_stamp)
        if stamp == self.control_stamp:
            return  # S2's counts unchanged: only the batch was
        self.control_stamp = stamp
        if plan is None:
            return
        problem = self.check_microbatch_plan(plan)
        if problem is not None:
            self.reject_microbatch_plan(step, plan, problem)
            return
        self.use_microbatch_counts(plan.counts)
        self.telemetry.set_parameter("microbatches", {
            "counts": list(plan.counts), "reason": plan.reason, "version": plan.version,
            "from_step": step + 1})
        self.log({"event": "microbatch-plan", "step": step, "from_step": step + 1,
                  "counts": list(plan.counts), "reason": plan.reason, "version": plan.version})

    def use_batch_choice(self, step: int, choice: batch_control.BatchChoice, stamp: int) -> None:
        """The allocator's global batch from the next step on, and the square-root rule's rate
        (batching.plan_batch); an S2 plan written for the old batch no longer fits its
        micro-batches, and the even split applies until the next."""
        self.batch_stamp, self.batch_version = stamp, choice.version
        before = self.plan.global_batch
        self.chosen_batch = choice.global_batch
        self.plan = batching.plan_batch(self.spec.optimization, self.spec.elasticity.min_replicas,
                                        self.replicas(), self.chosen_batch)
        if self.plan.global_batch != before:
            self.microbatch_counts = None
        self.telemetry.set_parameter("batch", {
            "global_batch": self.plan.global_batch, "reason": choice.reason, "version": choice.version,
            "from_step": step + 1})
        self.log({"event": "batch", "step": step, "from_step": step + 1, "from_global_batch": before,
                  "global_batch": self.plan.global_batch, "asked": choice.global_batch,
                  "peak_learning_rate": self.plan.learning_rate, "reason": choice.reason,
                  "version": choice.version})

    def check_microbatch_plan(self, plan: microbatches.MicroBatchPlan) -> str | None:
        """Why `plan` does not fit this gang (one count per data-parallel rank), or None."""
        return microbatches.check_plan(plan, self.world, self.plan.micro_batches)

    def reject_microbatch_plan(self, step: int, plan: microbatches.MicroBatchPlan, problem: str) -> None:
        """A DDP gang falls back to the even split: a plan that does not fit is most often one
        written for the gang before a resize."""
        self.microbatch_counts = None
        self.plan_rejected = True
        self.log({"event": "microbatch-plan-rejected", "step": step, "counts": list(plan.counts),
                  "reason": problem})

    def use_microbatch_counts(self, counts: tuple[int, ...]) -> None:
        self.microbatch_counts = counts
        self.plan_rejected = False

    def _request_stop(self, signum: int, frame: object) -> None:
        global _terminated
        _terminated = True
        self.stop_requested = True
        if self.gang is not None and not self.has_state:
            raise SystemExit(LEFT_EXIT)  # a joiner with nothing to hand over leaves at once

    def _release_group_holders(self) -> None:
        """Stop what still uses the process group, before it is destroyed: the peer watch (whose
        alarm aborts the group) and DDP, whose reducer holds the group past destroy_process_group."""
        if self.watch is not None:
            self.watch.stop()
            self.watch = None
        self.ddp = None  # type: ignore[assignment]

    def close(self) -> None:
        """Release the gang as regroup() does. NB: a replica that leaves returns with its peer
        watch still beating and DDP still holding the group, whose gloo threads then lived on into
        interpreter shutdown, where a leaver of the in-place test died of SIGABRT ("terminate
        called without an active exception") instead of exiting LEFT_EXIT (once, with the suite's
        parallel part on 3 workers of a 2-core box, 2026-12-03)."""
        self._release_group_holders()
        if self.gang is not None:
            self.gang.leave()  # no heartbeat thread may be inside the store's client at exit
        self.telemetry.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def tokens_in(meta: dict, spec: training.TrainingJobSpec) -> int:
    """Tokens trained by a checkpoint's state. One saved before they were recorded counts its
    steps at the global batch it was saved with: exact unless the batch changed before it."""
    if meta.get("tokens") is not None:
        return int(meta["tokens"])
    batch = int(meta.get("global_batch") or spec.optimization.global_batch)
    return int(meta["step"]) * batch * spec.model.context


def _flatten_optimizer_state(optim_state: dict) -> list[tuple[str, torch.Tensor]]:
    """The optimizer's per-parameter tensors in one order every rank agrees on (by parameter
    name, then by state key), so a broadcast can send them one by one without their names."""
    return [(f"{name}.{key}", value)
            for name in sorted(optim_state["state"])
            for key, value in sorted(optim_state["state"][name].items())
            if isinstance(value, torch.Tensor)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m huorn.runtime.train",
                                     description="Huorn's elastic trainer.")
    parser.add_argument("--config", type=Path, required=True,
                        help="run config (JSON or YAML), see docs/runtime.md")
    rendezvous = parser.add_argument_group(
        "in-place resizing", "take part in the c10d rendezvous directly instead of under torchrun, "
        "so that a resize keeps this process (huorn.runtime.membership)")
    rendezvous.add_argument("--in-place", action="store_true", help="resize in place")
    rendezvous.add_argument("--nnodes", default="1:1", help="MIN:MAX replicas, as torchrun's")
    rendezvous.add_argument("--rdzv-endpoint", help="HOST:PORT of the stand-alone rendezvous store")
    rendezvous.add_argument("--rdzv-id", default="huorn", help="the gang's rendezvous id")
    rendezvous.add_argument("--local-addr", default=None, help="this replica's address")
    rendezvous.add_argument("--rdzv-conf", default="",
                            help="KEY=VALUE,... overriding launcher.ElasticSettings' timeouts")
    args = parser.parse_args(argv)
    try:
        cfg = run_config.load_run_config(args.config)
        run_config.build_model_config(cfg.spec.model)
        settings = launcher.parse_in_place_arguments(
            args.nnodes, args.rdzv_endpoint, args.rdzv_id, args.local_addr, args.rdzv_conf) \
            if args.in_place else None
        if settings is not None and cfg.spec.parallelism.pipeline_stages > 1:
            raise ValueError("spec.parallelism.pipelineStages > 1 cannot resize in place (a stage "
                             "holds only its own layers); launch it under torchrun")
        gang = membership.Membership(settings) if settings is not None else None
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        if cfg.spec.parallelism.pipeline_stages > 1:
            # NB: imported here: the pipeline trainer subclasses Trainer (an import cycle otherwise).
            from huorn.runtime.pipeline import job as pipeline_job
            from huorn.runtime.pipeline import topology as pp_topology

            pp_topology.prefer_eager_module_loading()
            trainer: Trainer = pipeline_job.PipelineTrainer(cfg)
        else:
            trainer = Trainer(cfg, gang)
    except RendezvousClosedError:
        print("huorn: the gang finished training before this replica could join", file=sys.stderr)
        return 0
    except ValueError as error:  # a gang that does not fit the job, e.g. world size vs. stages
        print(f"error: {error}", file=sys.stderr)
        if gang is not None:
            gang.leave()
        if dist.is_initialized():
            dist.destroy_process_group()
        return 2
    except BaseException:  # a joiner told to stop before it holds state leaves at once (SystemExit)
        if gang is not None:
            gang.leave()  # no heartbeat thread inside the store's client at exit (Membership.leave)
        raise
    try:
        return trainer.run()
    finally:
        trainer.close()


if __name__ == "__main__":
    sys.exit(main())

