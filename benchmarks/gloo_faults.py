"""Fault-injection harness: real torch.distributed (gloo) data-parallel jobs with injected faults.

Each rank is its own process (`python benchmarks/gloo_faults.py --rank R ...`), as under
torchrun, and trains a small MLP with per-rank micro-batch counts. Telemetry mirrors the
runtime's `/telemetry` view (collective sequence numbers entered/completed, heartbeat, per-step
compute and communication seconds) but is published as a JSON file per rank, written by a
background thread every 0.1 s, so a detector can read it while the training thread is stuck.

Micro-batch "GPU time" is a sleep of --base-ms on top of the real CPU forward/backward: on a
GPU the kernel time does not occupy the host CPU either, and it keeps the timing meaningful on
a loaded 2-core machine. Faults (C4's four classes), from --faults JSON:
  slow-compute {rank, from_step, factor}: micro-batch time × factor (a slow GPU)
  hang-compute {rank, from_step}: blocks before compute, heartbeat alive
  hang-collective {rank, from_step}: blocks after entering the first gradient bucket's all-reduce
  slow-comm {rank, from_step, ms, peer?}: delays every send (or only those to `peer`) by ms
Gradients go through two all-reduce buckets launched asynchronously, as DDP does, and are
weighted by micro-batch counts, so any micro-batch plan gives the single-process gradient.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

PROBE_REPEATS = 3


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))


def microbatch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of global micro-batch `index` of `step`: the same whichever rank computes it."""
    g = torch.Generator().manual_seed(step * 100_003 + index)
    x = torch.randn(16, 64, generator=g)
    return x, x[:, :1] * 0.5 + 0.1


def reference_params(steps: int, total: int, lr: float) -> list[torch.Tensor]:
    """Single-process SGD over the same micro-batches: what every plan must reproduce."""
    model = build_model()
    for step in range(steps):
        model.zero_grad()
        for index in range(total):
            x, y = microbatch(step, index)
            (torch.nn.functional.mse_loss(model(x), y) / total).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return [p.detach().clone() for p in model.parameters()]


class FileTelemetry:
    """Counters under a lock, published by a daemon thread; the training thread never writes files."""

    def __init__(self, run_dir: Path, rank: int, enabled: bool) -> None:
        self.path = run_dir / f"telemetry-{rank}.json"
        self.rank, self.enabled = rank, enabled
        self.lock = threading.Lock()
        self.entered = self.completed = 0
        self.steps: list[dict] = []
        self.links: list[list[float]] | None = None
        self.stopped = threading.Event()
        if enabled:
            threading.Thread(target=self._publish_forever, daemon=True).start()

    def enter(self) -> int:
        if not self.enabled:
            return 0
        with self.lock:
            self.entered += 1
            return self.entered

    def complete(self, seq: int) -> None:
        if self.enabled:
            with self.lock:
                self.completed = max(self.completed, seq)

    def record(self, **step: float) -> None:
        if self.enabled:
            with self.lock:
                self.steps = [*self.steps[-255:], step]  # the runtime keeps 256 too

    def _publish_forever(self) -> None:
        scratch = self.path.with_suffix(".tmp")
        while True:
            with self.lock:
                body = {"rank": self.rank, "heartbeat": time.time(), "pid": os.getpid(),
                        "collective": {"entered": self.entered, "completed": self.completed},
                        "steps": list(self.steps), "links": self.links}
            scratch.write_text(json.dumps(body))
            os.replace(scratch, self.path)
            if self.stopped.wait(0.1):
                return


class Faults:
    def __init__(self, specs: list[dict], rank: int) -> None:
        self.specs = [f for f in specs if f.get("rank") == rank]

    def active(self, kind: str, step: int) -> dict | None:
        return next((f for f in self.specs if f["kind"] == kind and step >= f.get("from_step", 0)
                     and step < f.get("until_step", 1 << 60)), None)


def send_delay(faults: Faults, step: int, peer: int | None) -> float:
    slow = faults.active("slow-comm", step)
    if slow is None or (slow.get("peer") is not None and peer is not None and slow["peer"] != peer):
        return 0.0
    return slow["ms"] / 1000.0


def probe_links(world: int, rank: int, faults: Faults, step: int) -> list[list[float]]:
    """Ping-pong every pair (round-robin schedule) and all-gather the RTT matrix (C4's matrix)."""
    row = torch.full((world,), float("nan"))
    ranks = list(range(world)) + ([-1] if world % 2 else [])
    n = len(ranks)
    buf = torch.zeros(256)
    for _ in range(n - 1):
        for i in range(n // 2):
            a, b = ranks[i], ranks[n - 1 - i]
            if rank not in (a, b) or -1 in (a, b):
                continue
            peer = b if rank == a else a
            samples = []
            for _ in range(PROBE_REPEATS):
                start = time.perf_counter()
                if rank == min(a, b):
                    time.sleep(send_delay(faults, step, peer))
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    time.sleep(send_delay(faults, step, peer))
                    dist.send(buf, peer)
                samples.append(time.perf_counter() - start)
            row[peer] = min(samples)
        ranks = [ranks[0], ranks[-1], *ranks[1:-1]]
    gathered = [torch.zeros(world) for _ in range(world)]
    dist.all_gather(gathered, row)
    matrix = torch.stack(gathered)
    # The initiator's RTT is the reliable one; mirror it so both cells of a pair agree.
    sym = torch.where(torch.isnan(matrix), matrix.T, torch.fmin(matrix, matrix.T))
    return sym.tolist()


def exit_when_orphaned() -> None:
    """A hung rank never ends by itself: leave when the controller that started us is gone."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(3)


def run(args: argparse.Namespace) -> None:
    run_dir = Path(args.run_dir)
    threading.Thread(target=exit_when_orphaned, daemon=True).start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=__import__("datetime").timedelta(seconds=600))
    telemetry = FileTelemetry(run_dir, args.rank, not args.no_telemetry)
    faults = Faults(json.loads(args.faults), args.rank)
    model = build_model()
    params = list(model.parameters())
    counts = [args.microbatches] * args.world
    plan_path = run_dir / "plan.json"
    plan_version = 0
    step_seconds: list[float] = []  # kept with telemetry off too, for the overhead benchmark
    for step in range(args.steps):
        started = time.perf_counter()
        # Rank 0 reads the controller's plan and broadcasts it, so all ranks switch at one step.
        plan = torch.tensor([plan_version, *counts], dtype=torch.int64)
        if args.rank == 0 and plan_path.exists():
            with contextlib.suppress(ValueError, OSError):
                data = json.loads(plan_path.read_text())
                plan = torch.tensor([data["version"], *data["microbatches"]], dtype=torch.int64)
        seq = telemetry.enter()
        comm_started = time.perf_counter()
        dist.broadcast(plan, 0)
        comm = time.perf_counter() - comm_started
        telemetry.complete(seq)
        plan_version, counts = int(plan[0]), [int(c) for c in plan[1:]]
        if faults.active("hang-compute", step):
            while True:
                time.sleep(1)
        compute_started = time.perf_counter()
        first = sum(counts[: args.rank])
        slow = faults.active("slow-compute", step)
        factor = slow["factor"] if slow else 1.0
        model.zero_grad()
        total = sum(counts)
        for index in range(first, first + counts[args.rank]):
            x, y = microbatch(step, index)
            (torch.nn.functional.mse_loss(model(x), y) / total).backward()
            time.sleep(args.base_ms / 1000.0 * factor)
        compute = time.perf_counter() - compute_started
        comm_started = time.perf_counter()
        buckets = [torch.cat([p.grad.flatten() for p in params[:2]]),
                   torch.cat([p.grad.flatten() for p in params[2:]])]
        works, seqs = [], []
        for b, bucket in enumerate(buckets):
            seqs.append(telemetry.enter())
            if b == 0 and faults.active("hang-collective", step):
                while True:
                    time.sleep(1)
            time.sleep(send_delay(faults, step, None))
            works.append(dist.all_reduce(bucket, async_op=True))
        for work, s in zip(works, seqs, strict=True):
            work.wait()
            telemetry.complete(s)
        comm += time.perf_counter() - comm_started
        with torch.no_grad():
            offset = 0
            flat = torch.cat(buckets)
            for p in params:
                p -= args.lr * flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        if args.probe_every and step % args.probe_every == args.probe_every - 1:
            links = probe_links(args.world, args.rank, faults, step)
            with telemetry.lock:
                telemetry.links = links
        step_seconds.append(time.perf_counter() - started)
        telemetry.record(step=step, time=step_seconds[-1], compute=compute, comm=comm,
                         microbatches=counts[args.rank], plan=plan_version, wall=time.time())
    if args.rank == 0:
        torch.save([p.detach() for p in params], run_dir / "final.pt")
        (run_dir / "summary.json").write_text(json.dumps({"step_seconds": step_seconds}))
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.3)  # let the publisher write the last steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--microbatches", type=int, default=8, help="Per rank, until a plan says otherwise.")
    parser.add_argument("--base-ms", type=float, default=5.0, help="Simulated device time per micro-batch.")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--faults", default="[]", help="JSON list of faults (see the module docstring).")
    parser.add_argument("--probe-every", type=int, default=0, help="Link latency probe every N steps.")
    parser.add_argument("--no-telemetry", action="store_true")
    torch.set_num_threads(1)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
