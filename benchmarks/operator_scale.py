"""How fast the operator turns N TrainingJobs into pods, against the KMock API emulator.

Two operators run one after another in one invocation, each on a fresh emulated cluster with
the same nodes and the same burst of N jobs:
- baseline: a stateless reconcile that lists every Huorn pod from the API before each placement
  (`--no-mirror`), the usual shape of an operator without an informer cache;
- huorn: the watch-fed mirror of nodes and pods (huorn/operator/index.py).
Each operator is a child process (`python -m huorn.cli.operator`), so its peak memory (VmHWM)
is its own. Reported: p50/p99 seconds from a job's create request to all of its trainer pods
existing, reconciles per second (from the operator's own Prometheus counter), and peak RSS.

    .venv/bin/python benchmarks/operator_scale.py --jobs 1000 --output benchmarks/results/operator_scale
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kube import builders, cluster, emulator

NS = "bench"
GPUS_PER_NODE = 8


@attrs.define(kw_only=True)
class TimedEmulator(emulator.HuornEmulator):
    """Notes when each pod is created (perf_counter), which the API's 1-second timestamps cannot."""

    created: dict[str, float] = attrs.field(factory=dict, init=False)

    def _stamp_create(self, request):  # type: ignore[no-untyped-def]
        request = super()._stamp_create(request)
        if request.resource is not None and request.resource.plural == "pods":
            self.created[request.data["metadata"]["name"]] = time.perf_counter()
        return request


class TimedCluster(cluster.EmulatedCluster):
    async def _start(self) -> None:  # same as the base, with the timed emulator
        import kmock

        self.kmock = TimedEmulator()
        await self.kmock.__aenter__()
        self.kmock.declare_resources()
        self._server = kmock.Server(self.kmock)
        await self._server.__aenter__()
        self.url = str(self._server.url).rstrip("/")
        self.kubeconfig = cluster.write_kubeconfig(self.workdir / "kubeconfig", self.url)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def _metrics_up(port: int) -> bool:
    try:
        _scrape(port, "huorn_reconcile_total")
        return True
    except OSError:
        return False


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_one(mode: str, jobs: int, replicas: int, timeout: float, workdir: Path) -> dict:
    nodes = max(1, (jobs * replicas + GPUS_PER_NODE - 1) // GPUS_PER_NODE)
    with TimedCluster(workdir) as c:
        kube = builders.Kube(c.api_client())
        for i in range(nodes):
            kube.create_node(builders.make_node(f"n{i}", GPUS_PER_NODE, pool="a"))
        kube.create_vc(builders.make_virtual_cluster("train", pool="a"))
        # The emulator's own speed on this machine, for scale: sequential GETs of one object.
        probe = time.perf_counter()
        for _ in range(50):
            kube.get_vc("train")
        emulator_rps = 50 / (time.perf_counter() - probe)
        port = _free_port()
        args = [
            sys.executable,
            "-m",
            "huorn.cli.operator",
            "--kubeconfig",
            str(c.kubeconfig),
            "-A",
            "--metrics-port",
            str(port),
            "--resync-seconds",
            "60",
        ]
        if mode == "baseline":
            args.append("--no-mirror")
        log = (workdir / f"{mode}.log").open("wb")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        try:
            cluster.wait_for(lambda: _metrics_up(port), 120, "metrics up")
            # NB: submit only once the watches run (the VirtualCluster's status is the operator's
            # first write). KMock's watch does not resume from the list's resourceVersion: jobs
            # created while kopf lists and starts watching came twice, the second copy's
            # finalizer patch conflicted, and kopf waited for an event that had already passed,
            # so those jobs waited for the 60 s resync timer (p50 60.5 s for 6 jobs, 1 run in 3).
            cluster.wait_for(lambda: kube.get_vc("train").get("status"), 120, "the first VC status")
            created: dict[str, float] = {}

            def submit(i: int) -> None:
                body = builders.make_training_job(f"j{i}", "train", replicas=replicas, gpus=1)
                created[f"j{i}"] = time.perf_counter()
                kube.create_job(NS, body)

            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                list(pool.map(submit, range(jobs)))
            em = c.kmock
            assert isinstance(em, TimedEmulator)

            finished = watch_pods(em, jobs, replicas, timeout, f"{mode}: trainer pods")
            end = time.perf_counter()
            if finished < jobs:
                # A run that runs out of time still says how far it got, and over which jobs.
                return partial_result(mode, jobs, replicas, nodes, em, created, start, end, finished,
                                      emulator_rps, _peak_rss_mib(proc.pid))

            def reported() -> bool:
                items = kube.custom.list_namespaced_custom_object("huorn.io", "v1alpha1", NS, "trainingjobs")[
                    "items"
                ]
                return sum((i.get("status") or {}).get("replicas") == replicas for i in items) == jobs

            # Reconciles per second over the whole burst: until every job reports its pods in status.
            cluster.wait_for(reported, timeout, f"{mode}: status of {jobs} jobs")
            settled = time.perf_counter()
            reconciles = _scrape(port, "huorn_reconcile_total")
            peak = _peak_rss_mib(proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
            log.close()
    latencies = sorted(
        max(em.created[f"j{i}-trainer-{r}"] for r in range(replicas)) - created[f"j{i}"] for i in range(jobs)
    )
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return {
        "mode": mode,
        "jobs": jobs,
        "replicas": replicas,
        "nodes": nodes,
        "wall_s": end - start,
        "p50_s": statistics.median(latencies),
        "p99_s": q[98],
        "reconciles": reconciles,
        "reconciles_per_s": reconciles / (settled - start),
        "emulator_gets_per_s": emulator_rps,
        "settled_s": settled - start,
        "peak_rss_mib": peak,
    }


def complete_jobs(em: TimedEmulator, jobs: int, replicas: int) -> list[str]:
    return [f"j{i}" for i in range(jobs)
            if all(f"j{i}-trainer-{r}" in em.created for r in range(replicas))]


def watch_pods(em: TimedEmulator, jobs: int, replicas: int, timeout: float, what: str) -> int:
    """Wait, with a progress bar, until every job has all its trainer pods or time runs out;
    returns the number of jobs that got them."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    deadline = time.monotonic() + timeout
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), transient=False) as bar:
        task = bar.add_task(what, total=jobs * replicas)
        while True:
            pods = sum(name.startswith("j") and "-trainer-" in name for name in list(em.created))
            bar.update(task, completed=pods)
            if pods >= jobs * replicas or time.monotonic() > deadline:
                return len(complete_jobs(em, jobs, replicas))
            time.sleep(0.5)


def partial_result(mode: str, jobs: int, replicas: int, nodes: int, em: TimedEmulator,
                   created: dict[str, float], start: float, end: float, finished: int,
                   emulator_rps: float, peak: float) -> dict:
    done = complete_jobs(em, jobs, replicas)
    latencies = sorted(max(em.created[f"{j}-trainer-{r}"] for r in range(replicas)) - created[j]
                       for j in done)
    return {"mode": mode, "jobs": jobs, "replicas": replicas, "nodes": nodes, "timed_out": True,
            "jobs_with_pods": finished, "wall_s": end - start,
            "p50_s_of_finished": statistics.median(latencies) if latencies else None,
            "emulator_gets_per_s": emulator_rps, "peak_rss_mib": peak}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--replicas", type=int, default=2, help="trainer pods per job (1 GPU each)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--output", type=Path, default=None, help="directory for results.json and a PNG")
    parser.add_argument("--modes", default="baseline,huorn")
    args = parser.parse_args()
    if args.jobs < 1 or args.replicas < 1:
        parser.error("--jobs and --replicas must be ≥ 1")
    results = []
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(run_one(mode, args.jobs, args.replicas, args.timeout, Path(tmp)))
        r = results[-1]
        if args.output:  # after every mode, so a later mode that never ends loses nothing
            args.output.mkdir(parents=True, exist_ok=True)
            (args.output / "results.json").write_text(json.dumps(results, indent=2))
        if r.get("timed_out"):
            print(f"{mode:9s} jobs={r['jobs']}: timed out after {r['wall_s']:.0f}s with "
                  f"{r['jobs_with_pods']} jobs placed (p50 of those {r['p50_s_of_finished']}s)", flush=True)
            continue
        print(
            f"{mode:9s} jobs={r['jobs']} p50={r['p50_s']:.2f}s p99={r['p99_s']:.2f}s "
            f"reconciles/s={r['reconciles_per_s']:.1f} peak={r['peak_rss_mib']:.0f}MiB "
            f"wall={r['wall_s']:.1f}s emulator={r['emulator_gets_per_s']:.0f} GET/s",
            flush=True,
        )
    if len(results) == 2 and not any(r.get("timed_out") for r in results):
        base, huorn = results
        print(
            f"ratios baseline/huorn: p50 {base['p50_s'] / huorn['p50_s']:.2f}x, "
            f"p99 {base['p99_s'] / huorn['p99_s']:.2f}x,"
            f" wall {base['wall_s'] / huorn['wall_s']:.2f}x; peak RSS huorn/baseline "
            f"{huorn['peak_rss_mib'] / base['peak_rss_mib']:.2f}x"
        )
    if args.output and not any(r.get("timed_out") for r in results):
        _plot(results, args.output / "operator_scale.png")
    return 0


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    names = [r["mode"] for r in results]
    axes[0].bar(names, [r["p50_s"] for r in results], label="p50")
    axes[0].bar(
        names,
        [r["p99_s"] - r["p50_s"] for r in results],
        bottom=[r["p50_s"] for r in results],
        label="p99",
        alpha=0.5,
    )
    axes[0].set_ylabel("create → pods (s)")
    axes[0].legend()
    axes[1].bar(names, [r["reconciles_per_s"] for r in results])
    axes[1].set_ylabel("reconciles / s")
    axes[2].bar(names, [r["peak_rss_mib"] for r in results])
    axes[2].set_ylabel("operator peak RSS (MiB)")
    fig.suptitle(f"{results[0]['jobs']} TrainingJobs × {results[0]['replicas']} pods against KMock")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
