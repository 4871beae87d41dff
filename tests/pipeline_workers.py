"""Worker functions for the pipeline tests. They live in a plain module (not a test file) so
that spawned processes can import them by name."""

from __future__ import annotations

import datetime
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from huorn import models
from huorn.runtime.pipeline import contention, executor, memory, schedules, split, training
from huorn.runtime.pipeline import topology as pp_topology


def build_decoder(cfg: models.ModelConfig, seed: int = 0) -> models.Decoder:
    torch.manual_seed(seed)
    return models.build_model(cfg).double()


def make_decoder_batch(cfg: models.ModelConfig, microbatches: int, size: int, seed: int
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    # micro-batches as views of one batch, as a data loader hands them out: the memory model
    # must still count each micro-batch's own bytes
    shape = (size * microbatches, cfg.context)
    tokens = torch.randint(0, cfg.vocabulary, shape, generator=generator)
    targets = torch.randint(0, cfg.vocabulary, shape, generator=generator)
    return list(tokens.chunk(microbatches)), list(targets.chunk(microbatches))


def single_process_reference(cfg: models.ModelConfig, microbatches: int
                             ) -> tuple[float, dict[str, torch.Tensor]]:
    """The step every pipelined case must reproduce: gradient accumulation over the same
    micro-batches (seed 7, 2 sequences each) in one process. Returns the mean loss and every
    parameter's gradient by name."""
    decoder = build_decoder(cfg)
    tokens, targets = make_decoder_batch(cfg, microbatches, 2, seed=7)
    total = 0.0
    for x, y in zip(tokens, targets, strict=True):
        _, loss = decoder(x, y)
        (loss / microbatches).backward()
        total += loss.item() / microbatches
    return total, {n: p.grad for n, p in decoder.named_parameters()}


def decoder_case_worker(rank: int, world: int, jobs: list[tuple[str, models.ModelConfig, int, list, int]]
                        ) -> dict:
    """For each job (label, config, stages, [(schedule, k), ...], micro-batches per replica):
    one step of every case from the same initial weights. Returns this rank's losses and
    gradients keyed by the decoder's parameter names, per job label and case."""
    results: dict = {}
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    device = device or torch.device("cpu")
    for label, cfg, stages, cases, microbatches in jobs:
        topo = pp_topology.PipelineTopology(stages=stages, replicas=world // stages, rank=rank)
        groups = pp_topology.build_groups(topo)
        tokens, targets = make_decoder_batch(cfg, microbatches * topo.replicas, 2, seed=7)
        mine = slice(topo.replica * microbatches, (topo.replica + 1) * microbatches)
        for name, k in cases:
            decoder = build_decoder(cfg).to(device)
            names = {id(p): n for n, p in decoder.named_parameters()}
            stage = split.split_decoder(decoder, stages)[topo.stage]
            graphed = label.endswith("-graphs")
            runner = executor.StageExecutor(stage, topo, groups, split.compute_decoder_loss, device,
                                            cuda_graphs=graphed)
            if label.endswith("-jit"):  # receives posted when needed, as on NCCL
                runner.post_receives_ahead = False
            runner.negotiate_shapes([tokens[0]] if topo.is_first else None, targets[0])
            schedule = schedules.build_schedule(name, stages, microbatches, k)
            comm = "lockstep" if label.endswith("-lockstep") else "overlap"
            batch = ([[t] for t in tokens[mine]], targets[mine])
            if graphed:  # a table's first step meters eagerly; graphs replay from the second
                for _ in range(2):
                    runner.run_step(schedule, *batch, comm=comm)
                    stage.zero_grad(set_to_none=True)
            stats = runner.run_step(schedule, *batch, comm=comm)
            runner.close()
            grads = {names[id(p)]: p.grad.cpu() for p in stage.parameters() if p.grad is not None}
            results[(label, name, k)] = {
                "loss": stats.loss, "grads": grads, "executed": stats.executed, "stage": topo.stage,
                "comm": stats.comm, "graphed": stats.graphed, "graph_note": runner.graph_note,
                "peak": stats.peak_saved_bytes, "microbatch_bytes": runner.microbatch_bytes,
                "predicted": memory.predict_peak_bytes(
                    schedule, [runner.microbatch_bytes] * stages)[topo.stage],
            }
    return results


def build_mlp_stages(stages: int, width: int, depth: int, seed: int = 0) -> list[nn.Sequential]:
    torch.manual_seed(seed)
    return [nn.Sequential(*[layer for _ in range(depth) for layer in (nn.Linear(width, width), nn.Tanh())])
            for _ in range(stages)]


def make_mlp_batch(step: int, microbatches: int, size: int, width: int
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1000 + step)
    inputs = [torch.randn(size, width, generator=generator) for _ in range(microbatches)]
    targets = [torch.randn(size, width, generator=generator) for _ in range(microbatches)]
    return inputs, targets


def mse_loss(outputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(outputs[0], target)


def adaptive_worker(rank: int, world: int, stages: int, width: int, depth: int, microbatches: int,
                    size: int, levels: list[float], burst_s: float, replan_every: int,
                    comm: str = "overlap", planner_options: dict | None = None,
                    delay_per_microbatch: float | None = None) -> dict:
    """Adaptive-k training of an MLP pipeline while the contention level follows `levels`
    (one per step); returns reports, the final weights of this rank's stage, and the burst used.

    With `delay_per_microbatch` the burst is not `burst_s` but set when contention starts, from
    the calm steps' measured F+B of one micro-batch (the slowest rank's median), so that a
    contended message waits that many micro-batches' F+B. What kFkB gains depends on that ratio,
    and a fixed burst left it to the host's load: the same 2.5 ms burst was 15 % faster on an idle
    2-core box and 7 % beside another test, whose load made the F+B 1.7× longer."""
    from huorn.runtime.pipeline import planner as pipeline_planner

    topo = pp_topology.PipelineTopology(stages=stages, replicas=1, rank=rank)
    groups = pp_topology.build_groups(topo)
    module = build_mlp_stages(stages, width, depth)[topo.stage]
    throttle = contention.Throttle(level=0.0, burst_s=burst_s)
    runner = executor.StageExecutor(module, topo, groups, mse_loss, torch.device("cpu"), throttle)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    plan = training.PipelinePlan(microbatches=microbatches, schedule="auto", k=1, replan_every=replan_every,
                                 comm=comm)

    def batches(step: int) -> training.Batch:
        inputs, targets = make_mlp_batch(step, microbatches, size, width)
        return [[x] for x in inputs], targets

    measured: list[training.StepReport] = []

    def calibrate(step: int) -> None:
        contended = levels[step] > 0 and not any(levels[:step])
        if delay_per_microbatch is None or not contended:
            return
        calm = [r.microbatch_s for r in measured[1:]] or [r.microbatch_s for r in measured]
        if not calm:
            raise ValueError("delay_per_microbatch needs a calm step before the first contended one")
        slowest = torch.tensor([statistics.median(calm)])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # every rank calls this at the same step
        level = levels[step]
        throttle.burst_s = delay_per_microbatch * float(slowest) * (1 - level) / level

    reports = training.run_pipeline_training(
        stage=runner, optimizer=optimizer, batches=batches, steps=len(levels), plan=plan,
        planner=pipeline_planner.AdaptiveKPlanner(**(planner_options or {"min_gain": 0.08})),
        contention_level=lambda step: levels[step], on_step=measured.append, before_step=calibrate,
    )
    runner.close()
    return {"reports": reports, "state": {n: p.detach().clone() for n, p in module.state_dict().items()},
            "burst_s": throttle.burst_s}


def link_worker(rank: int, world: int, level: float, burst_s: float, messages: int,
                extra_s: float = 0.0) -> dict:
    """Rank 0 sends `messages` tensors through the device's link at `level`, each held back
    `extra_s` more (a slow-link fault); rank 1 receives them in order. Returns rank 0's link
    stats and, on rank 1, the received values."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    group = dist.new_group([0, 1])
    # NCCL makes a group's communicator on its first message; doing that here keeps its set-up
    # (host-side, hundreds of milliseconds) out of the first timed message
    probe = torch.zeros(1, device=device)
    if rank == 0:
        dist.send(probe, dst=1, group=group)
    else:
        dist.recv(probe, src=0, group=group)
    dist.barrier()
    if rank == 0:
        link = contention.make_link(1, group, contention.Throttle(level=level, burst_s=burst_s), device)
        link.extra_s = extra_s
        for m in range(messages):
            link.send(torch.full((1024,), float(m), device=device), tag=m)
        link.drain()
        stats = link.take_stats()
        link.close()
        return {"kind": type(link).__name__, "messages": stats.messages, "nbytes": stats.nbytes,
                "seconds_per_message": stats.seconds_per_message, "host_timed": stats.host_timed}
    # every receive posted before the first send can start, so the sender never waits for us
    # and its seconds per message are its own delay and transfer
    buffers = [torch.empty(1024, device=device) for _ in range(messages)]
    works = [dist.irecv(b, src=0, group=group, tag=m) for m, b in enumerate(buffers)]
    for work in works:
        work.wait()
    received = [b.cpu() for b in buffers]
    return {"received": [float(t[0]) for t in received],
            "uniform": all(bool((t == t[0]).all()) for t in received)}


def check_link_run(ranks: list[dict], kind: str, delay_s: float, messages: int) -> None:
    """What link_worker's two ranks must show: the device's link kind, every message whole and
    in order, and seconds per message that include the delay each message was held back (the
    throttle's: one burst at 50%; a fault's extra)."""
    sender, receiver = ranks
    assert sender["kind"] == kind
    assert receiver["received"] == [float(m) for m in range(messages)] and receiver["uniform"]
    assert sender["messages"] == messages and sender["nbytes"] == messages * 1024 * 4
    assert delay_s * 0.9 <= sender["seconds_per_message"] < delay_s * 5, sender


def unequal_counts_worker(rank: int, world: int, cfg: models.ModelConfig, stages: int,
                          cases: list[tuple[str, tuple[int, ...] | None, str, int]]) -> dict:
    """For each case (label, per-replica counts, schedule, k): one training-loop step of the
    float64 decoder from the same initial weights (SGD at lr 0, so the gradients stay readable),
    with the replicas running the counts S2 gives them. Every case also runs `auto` and refusal
    checks where its label says so. Returns the reports and this rank's gradients by case."""
    from huorn.runtime import microbatches
    from huorn.runtime.pipeline import planner as pipeline_planner

    topo = pp_topology.PipelineTopology(stages=stages, replicas=world // stages, rank=rank)
    groups = pp_topology.build_groups(topo)
    results: dict = {}
    for label, counts, name, k in cases:
        total = sum(counts) if counts is not None else 2 * topo.replicas
        tokens, targets = make_decoder_batch(cfg, total, 2, seed=7)
        decoder = build_decoder(cfg)
        names = {id(p): n for n, p in decoder.named_parameters()}
        stage = split.split_decoder(decoder, stages)[topo.stage]
        runner = executor.StageExecutor(stage, topo, groups, split.compute_decoder_loss, torch.device("cpu"))
        plan = training.PipelinePlan(microbatches=total // topo.replicas, schedule=name, k=k, replan_every=1)
        # the batches callback reads the loop's counts, so it is attached once the loop exists
        loop = training.PipelineTraining(
            stage=runner, optimizer=torch.optim.SGD(stage.parameters(), lr=0.0),
            batches=lambda step: ([], []), plan=plan,
            planner=pipeline_planner.AdaptiveKPlanner() if name == "auto" else None)

        def batches(step: int, loop: training.PipelineTraining = loop, total: int = total,
                    tokens: list[torch.Tensor] = tokens, targets: list[torch.Tensor] = targets
                    ) -> training.Batch:
            mine = microbatches.assign(loop.counts, total, topo.replicas, topo.replica)
            return [[tokens[i]] for i in mine], [targets[i] for i in mine]

        loop.batches = batches
        loop.set_counts(counts)
        refusals = []
        if label.endswith("-refuse"):
            for bad in ((1, 1, 2), (4, 0), (3, 2)):  # wrong length, an empty replica, wrong sum
                try:
                    loop.set_counts(bad)
                except ValueError as error:
                    refusals.append(str(error))
            refusals.append(loop.counts)  # what stays in force
        reports = [loop.run_step(step) for step in range(2 if name == "auto" else 1)]
        runner.close()
        results[label] = {
            "reports": reports, "refusals": refusals, "stage": topo.stage, "replica": topo.replica,
            "grads": {names[id(p)]: p.grad.clone() for p in stage.parameters() if p.grad is not None},
        }
    return results


def silent_peer_worker(rank: int, world: int, timeout_s: float, silent_s: float) -> tuple[str, float]:
    """Two stages: the last waits for an activation the first never sends (a hung stage). Returns
    how the wait ended and how long it took, on the receiving rank."""
    topo = pp_topology.PipelineTopology(stages=2, replicas=1, rank=rank)
    groups = pp_topology.build_groups(topo, timeout=datetime.timedelta(seconds=timeout_s))
    if rank == 0:
        time.sleep(silent_s)
        return "silent", 0.0
    started = time.monotonic()
    try:
        dist.recv(torch.zeros(4), src=0, group=groups.from_previous)
    except RuntimeError as error:
        return f"raised: {error}"[:200], time.monotonic() - started
    return "received", time.monotonic() - started
