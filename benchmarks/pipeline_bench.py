"""Shared body of benchmarks/pipeline_cpu.py and benchmarks/pipeline_gpu.py: the same decoder,
split into the same stages, trained by Huorn's executor (1F1B, each fixed k, adaptive k) and by
torch.distributed.pipelining's Schedule1F1B and ScheduleGPipe, at each contention level, in
one run, with throughput ratios. Configurations run interleaved in rounds, in an order that
rotates every round, every step starts after a barrier (ours through `before_step`, torch's
directly), and step times are medians (a shared machine's hiccups land on single steps).

Contention is the send-path throttle of huorn.runtime.pipeline.contention, applied to torch's
schedules too so that both run on the same emulated link: on CPU their sends go through the
same link threads (`_batch_p2p` is wrapped for the run); on GPU the same delay is a
`torch.cuda._sleep` on a side stream ahead of each of torch's batched send/recv calls (NCCL
needs its grouped calls kept whole), which delays the batch's receive along with its send.
At level 0 torch runs unpatched. The burst length is set from the measured compute time,
`burst_fraction` × (forward + backward of one micro-batch on the slowest stage), so the same
levels mean the same relative preemption on any machine."""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from huorn import models
from huorn.runtime.pipeline import contention, executor, split, training
from huorn.runtime.pipeline import planner as pipeline_planner
from huorn.runtime.pipeline import topology as pp_topology


@dataclass(frozen=True)
class BenchConfig:
    backend: str
    stages: int
    model: models.ModelConfig
    micro_batch: int
    microbatches: int
    levels: tuple[float, ...] = (0.0, 0.4, 0.8)
    fixed_k: tuple[int, ...] = (1, 2, 3, 4)
    warmup: int = 2
    steps: int = 5
    replan_every: int = 2  # timed steps per round of each configuration; adaptive k decides once a round
    switch_warmup: int = 1  # untimed steps each configuration runs first in every round
    burst_fraction: float = 0.15
    dtype: str = "float32"
    machine: str = ""
    partial_path: str = ""  # rank 0 rewrites this JSON after each level, in case a later one hangs
    level_budget_s: float = 0.0  # stop a level's rounds once it ran this long (0: run every round)
    hang_dump_s: float = 0.0  # print every thread's stack after this long, to show where a hang sits
    p2p_max_ctas: int | None = None  # NCCL thread blocks of our edge communicators (build_groups)
    p2p_high_priority: bool = False
    lockstep: bool = False  # also run 1F1B in lockstep
    adaptive_comm: str = "overlap"  # "auto": adaptive k also measures lockstep against overlap
    cuda_graphs: bool = False  # our stages replay CUDA graphs (GPU); adds "huorn 1F1B eager" to compare


@dataclass
class LevelResult:
    level: float
    tokens_per_s: dict[str, float] = field(default_factory=dict)
    step_s: dict[str, float] = field(default_factory=dict)
    adaptive_k: list[int] = field(default_factory=list)
    adaptive_comm: list[str] = field(default_factory=list)  # overlap or lockstep, per adaptive step
    decisions: list[dict] = field(default_factory=list)
    peak_bytes: dict[str, tuple[int, int]] = field(default_factory=dict)  # k -> (predicted, measured)
    torch_throttled_batches: int = 0
    measured_rounds: int = 0
    round_s: dict[str, list[float]] = field(default_factory=dict)  # mean step per measured round


def bench_worker(rank: int, world: int, config: BenchConfig) -> dict | None:
    if config.hang_dump_s > 0:
        faulthandler.dump_traceback_later(config.hang_dump_s, exit=False)
    throttle = contention.Throttle()
    setup = build_stage(config, rank, throttle)
    device, topo, stage, runner = setup.device, setup.topo, setup.stage, setup.runner
    tokens, targets = setup.tokens, setup.targets
    optimizer = torch.optim.SGD(stage.parameters(), lr=1e-4)

    def batches(step: int) -> training.Batch:
        return setup.inputs, setup.labels

    TORCH_BATCH[:] = [(tokens, targets)]

    def run_ours(plan: training.PipelinePlan, steps: int) -> list[training.StepReport]:
        planner = pipeline_planner.AdaptiveKPlanner() if plan.schedule == "auto" else None
        return training.run_pipeline_training(stage=runner, optimizer=optimizer, batches=batches, steps=steps,
                                              plan=plan, planner=planner)

    # calibrate the burst length from measured compute (1F1B, no contention)
    run_ours(training.PipelinePlan(microbatches=config.microbatches, schedule="1f1b"), config.warmup)
    one_f_one_b = training.schedules.build_schedule("1f1b", config.stages, config.microbatches)
    samples = [runner.run_step(one_f_one_b, *batches(0)) for _ in range(2)]
    compute = torch.tensor([sum(s.forward_s + s.backward_s for s in samples) / len(samples)],
                           dtype=torch.float64, device=device)
    dist.all_reduce(compute, op=dist.ReduceOp.MAX)
    throttle.burst_s = config.burst_fraction * float(compute[0])
    tokens_per_step = config.micro_batch * config.microbatches * config.model.context
    results = []
    planner = pipeline_planner.AdaptiveKPlanner(lockstep=config.adaptive_comm == "auto")
    adaptive_k, adaptive_comm = 1, "overlap"
    torch_schedules = {name: build_torch_schedule(name, stage, topo, config, device)
                       for name in ("Schedule1F1B", "ScheduleGPipe")}

    def aligned(step: int) -> None:
        synchronize(device)
        dist.barrier()

    def warm_up(k: int, comm: str = "overlap") -> None:
        """Untimed steps after a switch: the first step of a configuration after another one
        ran slower by up to 10% on the H200s (allocator, other communicators), and with two
        timed steps per round such a step moved the median between two modes."""
        if config.switch_warmup:
            plan = training.PipelinePlan(microbatches=config.microbatches, schedule="kfkb", k=k, comm=comm)
            training.run_pipeline_training(stage=runner, optimizer=optimizer, batches=batches,
                                           steps=config.switch_warmup, plan=plan, before_step=aligned)

    def run_fixed(k: int, comm: str = "overlap", eager: bool = False) -> tuple[str, list[float]]:
        runner.cuda_graphs = config.cuda_graphs and not eager
        try:
            warm_up(k, comm)
            plan = training.PipelinePlan(microbatches=config.microbatches, schedule="kfkb", k=k, comm=comm)
            reports = training.run_pipeline_training(stage=runner, optimizer=optimizer, batches=batches,
                                                     steps=config.replan_every, plan=plan,
                                                     before_step=aligned)
        finally:
            runner.cuda_graphs = config.cuda_graphs
        result.peak_bytes[str(k)] = (reports[-1].predicted_peak_bytes, reports[-1].peak_saved_bytes)
        name = "huorn 1F1B" if k == 1 else f"huorn k={k}"
        if eager:
            return f"{name} eager", [r.seconds for r in reports]
        return (f"{name} lockstep" if comm == "lockstep" else name), [r.seconds for r in reports]

    def run_adaptive() -> tuple[str, list[float]]:
        nonlocal adaptive_k, adaptive_comm
        warm_up(adaptive_k, adaptive_comm)
        plan = training.PipelinePlan(microbatches=config.microbatches, schedule="auto", k=adaptive_k,
                                     replan_every=config.replan_every,
                                     comm=config.adaptive_comm)
        loop = training.PipelineTraining(stage=runner, optimizer=optimizer, batches=batches, plan=plan,
                                         planner=planner, before_step=aligned)
        loop.comm = adaptive_comm  # the mode carries over from the previous round, as k does
        reports = [loop.run_step(step) for step in range(config.replan_every)]
        decision = reports[-1].decision
        adaptive_k = broadcast_int(int(decision["k"]) if decision else adaptive_k, device)
        adaptive_comm = ("overlap", "lockstep")[broadcast_int(int(loop.comm == "lockstep"), device)]
        result.adaptive_comm += [r.comm for r in reports]
        result.adaptive_k += [r.k for r in reports]
        if decision:
            result.decisions.append(decision)
        return "huorn adaptive", [r.seconds for r in reports]

    def run_torch(name: str) -> tuple[str, list[float]]:
        times = time_torch_steps(torch_schedules[name], stage, topo, device,
                                 config.switch_warmup + config.replan_every, throttle)
        return f"torch {name}", times[config.switch_warmup:]

    def describe(done: list[LevelResult]) -> dict:
        return {"config": asdict(config), "burst_s": throttle.burst_s, "compute_fb_s": float(compute[0]),
                "torch_version": torch.__version__, "levels": [asdict(r) for r in done]}

    for level in config.levels:
        throttle.set_level(level)
        result = LevelResult(level=level)
        samples: dict[str, list[float]] = {}
        level_started = time.perf_counter()
        # Rounds interleave every configuration, so the shared machine's load drifts over all
        # of them alike; round 0 is warm-up. Adaptive k keeps its planner and its k across
        # rounds and levels, as a real run would, and decides once per round.
        for round_ in range(config.steps + 1):
            runs = [functools.partial(run_fixed, k) for k in config.fixed_k] + [run_adaptive]
            if config.lockstep:
                runs.append(functools.partial(run_fixed, 1, "lockstep"))
            if config.cuda_graphs:
                runs.append(functools.partial(run_fixed, 1, eager=True))
            runs += [functools.partial(run_torch, name) for name in torch_schedules]
            shift = round_ % len(runs)  # rotate the order, so no configuration always follows another
            for run in runs[shift:] + runs[:shift]:
                name, seconds = run()
                if round_:
                    samples.setdefault(name, []).extend(seconds)
                    result.round_s.setdefault(name, []).append(statistics.fmean(seconds))
            result.measured_rounds = round_
            # a slow machine or link gets fewer rounds rather than no result: rank 0 decides
            # for both, so that every rank leaves the level at the same round
            over = config.level_budget_s > 0 and time.perf_counter() - level_started > config.level_budget_s
            if round_ >= 2 and broadcast_int(int(over), device):
                break
        result.step_s = {name: statistics.median(values) for name, values in samples.items()}
        result.torch_throttled_batches, THROTTLED_BATCHES[0] = THROTTLED_BATCHES[0], 0
        result.tokens_per_s = {name: tokens_per_step / s for name, s in result.step_s.items()}
        results.append(result)
        if rank == 0 and config.partial_path:
            Path(config.partial_path).write_text(json.dumps(describe(results), indent=2, default=str))
    runner.close()
    faulthandler.cancel_dump_traceback_later()
    if rank != 0:
        return None
    return describe(results)


def build_torch_schedule(name: str, stage_module: torch.nn.Module, topo: pp_topology.PipelineTopology,
                         config: BenchConfig, device: torch.device) -> object:
    from torch.distributed import pipelining

    stage = pipelining.PipelineStage(stage_module, topo.stage, topo.stages, device)
    schedule = getattr(pipelining, name)(stage, n_microbatches=config.microbatches,
                                         loss_fn=lambda out, y: split.compute_decoder_loss((out,), y))
    return schedule


def diagnosis_config(tiny: bool) -> BenchConfig:
    """The profile's and the trace's configuration: benchmarks/pipeline_gpu.py's model on two
    GPUs, or a small one on gloo for a CPU dry run. NVLink multicast is kept off, as there."""
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[name] = value
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    if tiny:
        return BenchConfig(backend="gloo", stages=2, micro_batch=2, microbatches=8,
                           model=models.ModelConfig(layers=2, width=32, heads=2, vocabulary=64, context=8))
    gpu_model = models.ModelConfig(layers=8, width=2048, heads=16, vocabulary=32768, context=1024)
    return BenchConfig(backend="nccl", stages=2, micro_batch=2, microbatches=16, dtype="bfloat16",
                       model=gpu_model)


@dataclass
class StageSetup:
    """One rank's stage of the benchmark model, its executor and one step's batch, as every
    pipeline benchmark builds them (same seeds, so all compare the same work)."""

    device: torch.device
    topo: pp_topology.PipelineTopology
    groups: pp_topology.PipelineGroups
    stage: torch.nn.Module
    runner: executor.StageExecutor
    tokens: torch.Tensor
    targets: torch.Tensor
    inputs: list[list[torch.Tensor]]  # the micro-batches of tokens, as stage 0 takes them
    labels: list[torch.Tensor]  # the micro-batches of targets, as the last stage takes them


def build_stage(config: BenchConfig, rank: int, throttle: contention.Throttle | None = None) -> StageSetup:
    on_gpu = config.backend == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    torch.manual_seed(0)
    decoder = models.build_model(config.model).to(device=device, dtype=getattr(torch, config.dtype))
    topo = pp_topology.PipelineTopology(stages=config.stages, replicas=1, rank=rank)
    groups = pp_topology.build_groups(topo, p2p_max_ctas=config.p2p_max_ctas,
                                      p2p_high_priority=config.p2p_high_priority)
    stage = split.split_decoder(decoder, config.stages)[topo.stage]
    runner = executor.StageExecutor(stage, topo, groups, split.compute_decoder_loss, device, throttle,
                                    cuda_graphs=config.cuda_graphs)
    generator = torch.Generator().manual_seed(1)
    shape = (config.micro_batch * config.microbatches, config.model.context)
    tokens = torch.randint(0, config.model.vocabulary, shape, generator=generator).to(device)
    targets = torch.randint(0, config.model.vocabulary, shape, generator=generator).to(device)
    inputs = [[t] for t in tokens.chunk(config.microbatches)]
    return StageSetup(device, topo, groups, stage, runner, tokens, targets, inputs,
                      list(targets.chunk(config.microbatches)))


def torch_stepper(schedule: object, topo: pp_topology.PipelineTopology, tokens: torch.Tensor,
                  targets: torch.Tensor) -> Callable[[], None]:
    """One step of a torch.distributed.pipelining schedule, called as each stage must call it."""
    def step() -> None:
        if topo.is_first:
            schedule.step(tokens)  # type: ignore[attr-defined]
        elif topo.is_last:
            schedule.step(target=targets, losses=[])  # type: ignore[attr-defined]
        else:
            schedule.step()  # type: ignore[attr-defined]
    return step


def time_torch_steps(schedule: object, stage_module: torch.nn.Module, topo: pp_topology.PipelineTopology,
                     device: torch.device, steps: int, throttle: contention.Throttle) -> list[float]:
    step = torch_stepper(schedule, topo, *TORCH_BATCH[0])
    times = []
    patch = throttled_torch_p2p(throttle, device) if throttle.level > 0 else contextlib.nullcontext()
    with patch:
        for _ in range(steps):
            synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            step()
            synchronize(device)
            dist.barrier()
            times.append(time.perf_counter() - start)
            stage_module.zero_grad(set_to_none=True)
    return times


def broadcast_int(value: int, device: torch.device) -> int:
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(tensor, src=0)
    return int(tensor[0])


TORCH_BATCH: list[tuple[torch.Tensor, torch.Tensor]] = []  # the whole batch, for torch's step()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


THROTTLED_BATCHES = [0]  # torch p2p batches that went through the throttle (proof it was applied)


class _DeliveredWork:
    """What torch's schedule waits on for a send that our link thread delivers."""

    def __init__(self, done: threading.Event) -> None:
        self.done = done

    def wait(self, timeout: object = None) -> bool:
        self.done.wait()
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


@contextlib.contextmanager
def throttled_torch_p2p(throttle: contention.Throttle, device: torch.device) -> Iterator[None]:
    """Route torch.distributed.pipelining's sends through the same throttle for one run."""
    from torch.distributed.pipelining import schedules as torch_schedules

    if not hasattr(torch_schedules, "_batch_p2p"):
        raise RuntimeError("this torch has no pipelining.schedules._batch_p2p; the throttle cannot reach "
                           "torch's sends, so a contended comparison would be unfair: update the patch")
    original = torch_schedules._batch_p2p
    links: dict[tuple[int, int], contention.LinkSender] = {}
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    cycles_per_s = contention.gpu_sleep_rate(device) if side is not None else 0.0

    def on_cpu(p2p_ops: list, desc: str | None = None) -> list:
        THROTTLED_BATCHES[0] += 1
        works = []
        for op in p2p_ops:
            if op.op is dist.isend:
                key = (op.peer, id(op.group))
                if key not in links:
                    group = op.group or dist.group.WORLD
                    links[key] = contention.LinkSender(op.peer, group, throttle, device)
                done = threading.Event()
                links[key].send(op.tensor, tag=op.tag, done=done)
                works.append(_DeliveredWork(done))
            else:
                works.append(dist.irecv(op.tensor, src=op.peer, group=op.group, tag=op.tag))
        return works

    def on_gpu(p2p_ops: list, desc: str | None = None) -> list:
        THROTTLED_BATCHES[0] += 1
        nbytes = sum(op.tensor.numel() * op.tensor.element_size() for op in p2p_ops if op.op is dist.isend)
        delay = throttle.delay_s(nbytes) if nbytes else 0.0
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            if delay > 0:
                torch.cuda._sleep(int(delay * cycles_per_s))
            return original(p2p_ops, desc)

    torch_schedules._batch_p2p = on_gpu if side is not None else on_cpu
    try:
        yield
    finally:
        torch_schedules._batch_p2p = original
        for link in links.values():
            link.drain()
            link.close()


def round_ratio_spread(level: dict, name: str, baseline: str) -> tuple[float, float, float] | None:
    """Quartiles of `name`'s speed over `baseline`'s, round by round (the two ran minutes apart
    at most, so a drift of the machine cancels), or None for a result without rounds."""
    rounds = level.get("round_s") or {}
    if name not in rounds or baseline not in rounds:
        return None
    ratios = sorted(b / a for a, b in zip(rounds[name], rounds[baseline], strict=True))
    if len(ratios) < 2:
        return None
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return q1, median, q3


def summarise(result: dict) -> str:
    """The markdown table and ratios for docs/benchmarks.md."""
    lines = ["| contention | huorn 1F1B | best fixed k | huorn adaptive (k chosen) | torch Schedule1F1B | "
             "torch ScheduleGPipe | adaptive / 1F1B | adaptive / torch 1F1B |",
             "|---|---|---|---|---|---|---|---|"]
    for level in result["levels"]:
        tps = level["tokens_per_s"]
        fixed = {n: v for n, v in tps.items() if n.startswith("huorn") and "adaptive" not in n}
        best = max(fixed, key=fixed.get)
        chosen = f"k={level['adaptive_k'][-1]}"
        comms = level.get("adaptive_comm") or []
        if "lockstep" in comms:
            chosen += f", lockstep {comms.count('lockstep') / len(comms):.0%} of steps"
        best_label = best.removeprefix("huorn ")
        lines.append(
            f"| {level['level']:.0%} | {tps['huorn 1F1B']:.0f} | {fixed[best]:.0f} ({best_label}) "
            f"| {tps['huorn adaptive']:.0f} ({chosen}) | {tps['torch Schedule1F1B']:.0f} | "
            f"{tps['torch ScheduleGPipe']:.0f} | {tps['huorn adaptive'] / tps['huorn 1F1B']:.2f}× | "
            f"{tps['huorn adaptive'] / tps['torch Schedule1F1B']:.2f}× |")
    spreads = []
    for level in result["levels"]:
        pairs = [("huorn adaptive", "huorn 1F1B"), ("huorn adaptive", "torch Schedule1F1B"),
                 ("huorn 1F1B lockstep", "torch Schedule1F1B"), ("huorn 1F1B lockstep", "huorn 1F1B"),
                 ("huorn 1F1B", "torch Schedule1F1B"), ("huorn 1F1B eager", "torch Schedule1F1B"),
                 ("huorn 1F1B", "huorn 1F1B eager")]
        for name, baseline in pairs:
            spread = round_ratio_spread(level, name, baseline)
            if spread is not None:
                spreads.append(f"{level['level']:.0%} {name.removeprefix('huorn ')} / "
                               f"{baseline.removeprefix('huorn ')}: "
                               f"median {spread[1]:.2f}× (quartiles {spread[0]:.2f}–{spread[2]:.2f}×)")
    if spreads:
        lines += ["", "Round by round (paired ratios):", *[f"- {line}" for line in spreads]]
    return "\n".join(lines)


def plot(result: dict, path: Path, title: str) -> None:
    """Throughput per configuration and level (left) and the k adaptive ran, step by step (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["huorn 1F1B", "huorn k=2", "huorn k=3", "huorn k=4", "huorn adaptive", "torch Schedule1F1B",
             "torch ScheduleGPipe"]
    levels = result["levels"]
    for extra in ("huorn 1F1B lockstep", "huorn 1F1B eager"):
        if any(extra in lv["tokens_per_s"] for lv in levels):
            names.insert(1, extra)
    figure, (bars, ks) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [3, 1.3]})
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [lv["tokens_per_s"].get(name, 0.0) for lv in levels]
        bars.bar([j + i * width for j in range(len(levels))], values, width, label=name)
    bars.set_xticks([j + 0.4 - width / 2 for j in range(len(levels))],
                    [f"contention {lv['level']:.0%}" for lv in levels])
    bars.set_ylabel("tokens / s (median step)")
    bars.set_title(title, fontsize=10)
    bars.legend(fontsize=7, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    start = 0
    for lv in levels:
        steps = range(start, start + len(lv["adaptive_k"]))
        ks.step(list(steps), lv["adaptive_k"], where="post", label=f"{lv['level']:.0%}")
        start += len(lv["adaptive_k"])
    ks.set_xlabel("adaptive run's step")
    ks.set_ylabel("k")
    ks.set_yticks(range(1, max(max(lv["adaptive_k"]) for lv in levels) + 1))
    ks.set_title("k chosen by the planner", fontsize=10)
    ks.legend(title="contention", fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_outputs(result: dict, out: Path, name: str, title: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))
    table = summarise(result)
    (out / f"{name}.md").write_text(table + "\n")
    plot(result, out / f"{name}.png", title)
    return table
