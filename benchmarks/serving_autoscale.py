"""Serving to an SLO on a real request-rate trace: Huorn's autoscaler against static provisioning.

A stretch of the GenAI QPS trace (`../shared/data/genai_qps.csv`, 5-minute bins, each replayed in
`--bin-seconds`) is offered open-loop (Poisson arrivals, real completions over HTTP) to a fleet of
real serving replicas (`python -m huorn.runtime.serve`, one process and one CPU thread each,
standing in for one GPU each), spread round-robin over the ready ones as a Service would. Three
policies, one after the other, on the same arrivals:

- `static-mean`: replicas for the trace's mean rate at the target utilisation;
- `static-peak`: replicas for its peak, the whole time;
- `huorn`: from one replica, the operator's autoscaler (`huorn.scheduler.autoscale`, fed by the
  replicas' own /metrics read with `huorn.operator.replica_metrics.parse_metrics`), between 1 and the
  static-peak count. A replica it adds is a new process, which loads the model before it serves.
- `huorn-predictive`: the same rule with `autoscaling.forecast`'s floor (autoscale.ForecastFloor):
  the prediction board (huorn.scheduler.forecast, the operator's model and quantile) forecasts the
  next two bins' peak from the bins before the current one, and ⌈peak / (a replica's probed
  capacity × the target utilisation)⌉ replicas are kept. The board is fitted on the trace's bins
  after the replayed stretch (held out: neither the stretch nor its warm-up is in the fit); the
  operator fits on the last 24 h, which a 22-hour trace does not have before the stretch.

A probe first measures one replica under a closed loop of 64 clients: its capacity (the trace is
scaled so its peak is `--peak-load` × the static-peak fleet's capacity) and its mean latency
there (the SLO on p99 is `--slo-factor` × that). Reported per policy: the share of requests
within the SLO, the share of one-second windows whose p99 is within it, latency percentiles,
and replica-seconds over the measured stretch (a replica counts from its start, loading included,
to its stop; not the drain of the requests still in flight after the last bin); and
Huorn's ratios to both baselines.

A stretch that begins in the busy period starts every policy there cold unless told otherwise:
the static ones at their full count, the elastic ones at one replica under hundreds of requests a
second, whose backlog times out while the others load and then spoils the windows of the whole
start. That measures a cold start, which a fleet that has been serving all day never has.
`--warmup-bins N` replays the N bins before the stretch first (same scale, same open-loop
arrivals) and runs on into it without a pause, so each policy meets the stretch with the fleet,
the autoscaler's window and the requests in flight that the load before it left; only what
arrives from the stretch's start counts, and replica-seconds from that instant. 0 (the default)
is the cold start of the recorded runs.

    .venv/bin/python benchmarks/serving_autoscale.py [--bins 40:132] [--bin-seconds 1.5] [--max-replicas N]
        [--warmup-bins N]
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
from matplotlib.figure import Figure
from rich.progress import Progress
from trainer_runs import ROOT, argument_parser, save_figure

from huorn.api import training
from huorn.backends import replica_metrics
from huorn.runtime import launcher, serve
from huorn.scheduler import autoscale, forecast
from huorn.sim import shared_data

DATA = shared_data.shared_data_dir()
ARCHITECTURE = {"layers": 4, "width": 64, "heads": 4, "context": 128}
MAX_BATCH = 16
CLIENTS = 64  # the probe's closed loop: four prompt lengths × a full batch each
PROMPTS = [f"Q: {'what is ' * n}1+1?\nA:" for n in (1, 2, 3, 4)]  # four lengths: batches form per length


@dataclass
class Replica:
    name: str
    process: subprocess.Popen
    run_dir: Path
    started: float
    port: int | None = None


@dataclass
class Fleet:
    """Serving processes started and stopped on demand; replica-seconds counted as they live."""

    work: Path
    config: dict
    replicas: list[Replica] = field(default_factory=list)
    counter: int = 0
    replica_seconds: float = 0.0
    last: float = field(default_factory=time.monotonic)
    # Replica-seconds outside [counted_from, counted_until] are not counted: the warm-up's fleet
    # and the drain of the requests in flight after the last bin (up to the timeout) are not the
    # measured stretch's cost. A tick that straddles either end counts only its part inside.
    counted_from: float = -math.inf
    counted_until: float = math.inf

    def start(self) -> None:
        name = f"serve-{self.counter}"
        self.counter += 1
        run_dir = self.work / name
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "serve.json").unlink(missing_ok=True)
        path = run_dir / "config.json"
        path.write_text(json.dumps({**self.config, "runDir": str(run_dir)}))
        path_before = os.environ.get("PYTHONPATH")
        python_path = str(ROOT) + (os.pathsep + path_before if path_before else "")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": python_path}
        log = open(run_dir / "serve.log", "wb")  # noqa: SIM115 - handed to the process
        process = subprocess.Popen(launcher.build_serve_command(path), cwd=ROOT, env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
        log.close()
        self.replicas.append(Replica(name, process, run_dir, time.monotonic()))

    def stop(self, replica: Replica) -> None:
        self.replicas.remove(replica)
        replica.process.send_signal(signal.SIGTERM)

    def scale_to(self, count: int) -> None:
        while len(self.replicas) < count:
            self.start()
        while len(self.replicas) > count:
            # the newest first, and one still loading before any that serves
            self.stop(min(self.replicas, key=lambda r: (r.port is not None, -r.started)))

    def tick(self) -> None:
        now = time.monotonic()
        inside = min(now, self.counted_until) - max(self.last, self.counted_from)
        self.replica_seconds += len(self.replicas) * max(0.0, inside)
        self.last = now
        for r in self.replicas:
            if r.port is None and (r.run_dir / "serve.json").exists():
                r.port = int(json.loads((r.run_dir / "serve.json").read_text())["port"])
            if r.process.poll() is not None:
                raise SystemExit(f"{r.name} exited; see {r.run_dir / 'serve.log'}")

    def ready(self) -> list[str]:
        return [f"http://127.0.0.1:{r.port}" for r in self.replicas if r.port is not None]

    async def wait_ready(self) -> None:
        while len(self.ready()) < len(self.replicas):
            self.tick()
            await asyncio.sleep(0.1)
        self.last = time.monotonic()
        self.replica_seconds = 0.0

    def close(self) -> None:
        for r in list(self.replicas):
            self.stop(r)
            r.process.wait(30)


async def ask(session: aiohttp.ClientSession, url: str, prompt: str, timeout: float) -> float:
    started = time.monotonic()
    request = {"prompt": prompt, "max_tokens": 16, "temperature": 0}  # greedy, as recorded runs decoded
    async with session.post(f"{url}/v1/completions", json=request,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}")
    return time.monotonic() - started


async def probe(fleet: Fleet, seconds: float) -> dict:
    """One replica: p50 latency alone, and requests/s and mean latency under CLIENTS closed-loop
    clients (full batches of each prompt length)."""
    fleet.scale_to(1)
    await fleet.wait_ready()
    (url,) = fleet.ready()
    async with aiohttp.ClientSession() as session:
        alone = [await ask(session, url, PROMPTS[i % 4], 30) for i in range(40)]
        done = 0
        deadline = time.monotonic() + seconds

        async def client(i: int) -> None:
            nonlocal done
            while time.monotonic() < deadline:
                await ask(session, url, PROMPTS[i % 4], 30)
                done += 1

        started = time.monotonic()
        await asyncio.gather(*(client(i) for i in range(CLIENTS)))
        capacity = done / (time.monotonic() - started)
    fleet.close()
    return {"p50_alone_s": float(np.median(alone)), "capacity_rps": capacity,
            "batch_latency_s": CLIENTS / capacity}


async def run_policy(policy: str, fleet: Fleet, rates: list[float], bin_seconds: float, slo_s: float,
                     static: int, high: int, args, progress: Progress,
                     floors: list[autoscale.ForecastFloor] | None = None, warmup: int = 0) -> dict:
    """`rates` (and `floors`) run over the warm-up's `warmup` bins, then the measured stretch's.
    Times in the result are from the measured start, so the warm-up's are negative."""
    rng = random.Random(args.seed)
    rule = autoscale.ScalingRule(min_replicas=1, max_replicas=high, slots_per_replica=MAX_BATCH,
                                 target_utilization=args.target,
                                 p99_seconds=slo_s, scale_down_delay_seconds=args.scale_down_delay)
    scaler = autoscale.Autoscaler(rule)
    elastic = policy.startswith("huorn")
    fleet.scale_to(static if not elastic else 1)
    await fleet.wait_ready()
    latencies: list[tuple[float, float | None]] = []  # (arrival, latency or None for a failure), measured
    timeline: list[tuple[float, int, int, float]] = []
    pending: set[asyncio.Task] = set()
    turn = 0
    start = time.monotonic()
    measured_start = start + warmup * bin_seconds
    fleet.counted_from, fleet.counted_until = measured_start, start + len(rates) * bin_seconds
    task = progress.add_task(policy, total=len(rates))
    stop = asyncio.Event()

    async def one(session: aiohttp.ClientSession, url: str, prompt: str, at: float, measured: bool) -> None:
        try:
            latency: float | None = await ask(session, url, prompt, args.timeout)
        except (TimeoutError, aiohttp.ClientError, RuntimeError):
            latency = None
        if measured:  # a warm-up request still loads the fleet, but is not the stretch's to count
            latencies.append((at, latency))

    async def control(session: aiohttp.ClientSession) -> None:
        last: dict[str, autoscale.ReplicaSample] = {}
        while not stop.is_set():
            await asyncio.sleep(args.period)
            now = time.monotonic()
            samples = {}
            for url in fleet.ready():
                try:
                    async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        sample = replica_metrics.parse_metrics(await r.text(), now)
                except (TimeoutError, aiohttp.ClientError):
                    continue
                if sample is not None:
                    samples[url] = sample
            reading = autoscale.read_load(last, samples)
            last = samples
            floor = floors[min(current_bin, len(floors) - 1)] if floors else None
            fleet.scale_to(scaler.recommend(now, len(fleet.replicas), reading, floor).replicas)

    async def watch() -> None:
        while not stop.is_set():
            fleet.tick()
            timeline.append((time.monotonic() - measured_start, len(fleet.replicas), len(fleet.ready()),
                             current))
            await asyncio.sleep(0.2)

    current, current_bin = 0.0, 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        helpers = [asyncio.create_task(watch())]
        if elastic:
            helpers.append(asyncio.create_task(control(session)))
        for b, rate in enumerate(rates):
            current, current_bin = rate, b
            measured = b >= warmup  # by bin, not by time: a timer may wake a little before it is due
            bin_end = start + (b + 1) * bin_seconds
            t = time.monotonic()
            while rate > 0:
                t += rng.expovariate(rate)
                if t >= bin_end:
                    break
                await asyncio.sleep(max(0.0, t - time.monotonic()))
                urls = fleet.ready()
                if not urls:
                    if measured:
                        latencies.append((t - measured_start, None))
                    continue
                turn += 1
                job = asyncio.create_task(one(session, urls[turn % len(urls)], PROMPTS[rng.randrange(4)],
                                              t - measured_start, measured))
                pending.add(job)
                job.add_done_callback(pending.discard)
            await asyncio.sleep(max(0.0, bin_end - time.monotonic()))
            progress.update(task, completed=b + 1)
        if pending:
            await asyncio.wait(list(pending), timeout=args.timeout + 5)
        stop.set()
        await asyncio.gather(*helpers)
    fleet.tick()
    used = fleet.replica_seconds
    fleet.close()
    return summarise(policy, latencies, timeline, used, slo_s, (len(rates) - warmup) * bin_seconds)


def forecast_floors(times: np.ndarray, series: np.ndarray, lo: int, hi: int, scale: float,
                    per_replica: float, warmup: int = 0) -> tuple[list[autoscale.ForecastFloor], dict]:
    """The board's floor for each replayed bin b, the warm-up's (lo - warmup ..) included: the
    peak of bins b..b+1 forecast at the end of bin b-1 (what is known when b starts), in the
    replay's requests/s. Fitted on bins [hi:], after every replayed one; coverage is the stretch's."""
    config = forecast.ForecastConfig(quantile=forecast.HUORN_QUANTILE)
    if len(series) - hi < forecast.min_history_bins(config):
        raise SystemExit(f"--bins ends at {hi}: the board is fitted on the bins after the stretch and needs "
                         f"{forecast.min_history_bins(config)} of them; end the stretch earlier")
    model = forecast.LoadForecaster(config).fit(times[hi:], series[hi:])
    peaks = model.predict_series(times, series) * scale
    floors = []
    first = lo - warmup
    for b in range(hi - first):
        # bin 0 has no bin before it: its own rate stands in
        peak = float(peaks[first + b - 1]) if first + b >= 1 else float(series[first] * scale)
        replicas = max(1, math.ceil(peak / per_replica - 1e-9))
        floors.append(autoscale.ForecastFloor(replicas, peak, per_replica))
    coming = [max(series[lo + b: lo + b + 2]) * scale for b in range(hi - lo)]
    covered = float(np.mean([f.peak_requests_per_second >= c
                             for f, c in zip(floors[warmup:], coming, strict=True)]))
    return floors, {"board_coverage": covered, "board_fit_bins": len(series) - hi}


def summarise(policy: str, latencies: list[tuple[float, float | None]], timeline: list, used: float,
              slo_s: float, span: float) -> dict:
    ok = np.array([lat for _, lat in latencies if lat is not None])
    met = sum(1 for _, lat in latencies if lat is not None and lat <= slo_s)
    windows: dict[int, list[float]] = {}
    for at, lat in latencies:
        windows.setdefault(int(at), []).append(lat if lat is not None else math.inf)
    good = sum(1 for w in windows.values() if np.percentile(w, 99) <= slo_s)
    return {
        "policy": policy,
        "requests": len(latencies),
        "failed": sum(1 for _, lat in latencies if lat is None),
        "slo_attainment_requests": met / max(1, len(latencies)),
        "slo_attainment_windows": good / max(1, len(windows)),
        "p50_s": float(np.percentile(ok, 50)) if len(ok) else None,
        "p99_s": float(np.percentile(ok, 99)) if len(ok) else None,
        "replica_seconds": used,
        "mean_replicas": used / span,
        "timeline": timeline,
        "latency_values": sorted(float(x) for x in ok),
    }


def plot(results: dict, meta: dict, path: Path) -> None:
    figure = Figure(figsize=(10, 6))
    top, bottom = figure.add_subplot(2, 1, 1), figure.add_subplot(2, 1, 2)
    for policy, r in results.items():
        t = [p[0] for p in r["timeline"]]
        top.plot(t, [p[1] for p in r["timeline"]], label=f"{policy} replicas")
    twin = top.twinx()
    first = next(iter(results.values()))
    twin.plot([p[0] for p in first["timeline"]], [p[3] for p in first["timeline"]], color="grey", alpha=0.5)
    twin.set_ylabel("offered requests/s (grey)")
    top.set_ylabel("replicas")
    if meta.get("warmup_bins"):
        top.axvline(0.0, color="black", linestyle=":", label="measured start")
        top.set_xlabel(f"seconds from the measured start (the {meta['warmup_bins']} warm-up bins before 0)")
    else:
        top.set_xlabel("seconds into the replay")
    top.legend(fontsize=7, loc="upper left")
    for policy, r in results.items():
        lat = r["latency_values"]
        if lat:
            bottom.plot(lat, np.linspace(0, 1, len(lat)), label=policy)
    bottom.axvline(meta["slo_s"], color="red", linestyle="--", label="SLO")
    bottom.set_xscale("log")
    bottom.set_xlabel("request latency (s)")
    bottom.set_ylabel("CDF")
    bottom.legend(fontsize=7)
    save_figure(figure, "Serving the GenAI QPS trace: replicas over time and latency", path)


def main() -> int:
    parser = argument_parser(__doc__, "serving_autoscale")
    parser.add_argument("--qps", type=Path, default=DATA / "genai_qps.csv")
    parser.add_argument("--bins", default="40:132", help="5-minute bins of the trace to replay, start:end")
    parser.add_argument("--bin-seconds", type=float, default=1.5)
    parser.add_argument("--warmup-bins", type=int, default=0,
                        help="replay this many bins before --bins first, unmeasured, so that every "
                             "policy meets the stretch warm rather than at its starting count (an "
                             "elastic one at 1 replica in the busy period); 0: a cold start")
    parser.add_argument("--max-replicas", type=int, default=max(2, min(6, (os.cpu_count() or 2) // 2)))
    parser.add_argument("--peak-load", type=float, default=0.6,
                        help="the trace's peak as a share of the static-peak fleet's capacity")
    parser.add_argument("--target", type=float, default=0.7, help="target utilisation (the default)")
    parser.add_argument("--slo-factor", type=float, default=2.0,
                        help="SLO (p99) = this × one replica's mean latency in the probe's closed loop")
    parser.add_argument("--period", type=float, default=0.5, help="autoscaler period (s)")
    parser.add_argument("--scale-down-delay", type=float, default=12.0)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default="static-mean,static-peak,huorn,huorn-predictive",
                        help="comma-separated, run in this order on the same arrivals")
    args = parser.parse_args()
    unknown = set(args.policies.split(",")) - {"static-mean", "static-peak", "huorn", "huorn-predictive"}
    if unknown or "static-peak" not in args.policies.split(","):
        parser.error(f"--policies: {sorted(unknown) or 'static-peak is missing'}; choose among static-mean, "
                     "static-peak, huorn, huorn-predictive, with static-peak (the ratios' baseline)")
    lo, hi = (int(x) for x in args.bins.split(":"))
    if args.warmup_bins < 0:
        parser.error(f"--warmup-bins {args.warmup_bins}: a count of bins, 0 or more")
    if lo - args.warmup_bins < 0:
        parser.error(f"--warmup-bins {args.warmup_bins}: the warm-up would replay bins "
                     f"{lo - args.warmup_bins}..{lo - 1}, and the trace starts at bin 0; with --bins "
                     f"{args.bins} at most {max(0, lo)}")
    times, series = forecast.load_qps_series(args.qps)
    trace = series[lo:hi]
    if not len(trace) or trace.max() <= 0:
        parser.error(f"--bins {args.bins}: no load in that stretch of {args.qps}")
    checkpoint_dir = args.work / "ckpt"
    serve.save_untrained(checkpoint_dir, training.ModelSpec.model_validate(ARCHITECTURE))
    config = {"jobName": "bench", "host": "127.0.0.1", "port": 0, "device": "cpu",
              "spec": {"virtualCluster": "serve", "model": {"checkpoint": str(checkpoint_dir),
                                                            "architecture": ARCHITECTURE},
                       "serving": {"maxBatch": MAX_BATCH, "maxTokens": 128}}}
    out: dict = {"bins": args.bins, "warmup_bins": args.warmup_bins, "bin_seconds": args.bin_seconds,
                 "max_replicas": args.max_replicas, "cpu_count": os.cpu_count()}

    async def everything() -> dict:
        measured = await probe(Fleet(args.work / "probe", config), 4.0)
        capacity = measured["capacity_rps"]
        static_peak = args.max_replicas
        peak_rps = args.peak_load * capacity * static_peak
        rates = [float(r) / float(trace.max()) * peak_rps for r in trace]
        # the same scale as the stretch: a warm-up above its peak loads past --peak-load
        warm = [float(r) / float(trace.max()) * peak_rps for r in series[lo - args.warmup_bins: lo]]
        static_mean = max(1, math.ceil(np.mean(rates) / (capacity * args.target)))
        slo_s = args.slo_factor * measured["batch_latency_s"]
        out.update(measured, slo_s=slo_s, peak_rps=peak_rps, mean_rps=float(np.mean(rates)),
                   static_mean=static_mean, static_peak=static_peak)
        if warm:
            out.update(warmup_peak_rps=max(warm), warmup_mean_rps=float(np.mean(warm)))
        floors, board = forecast_floors(times, series, lo, hi, peak_rps / float(trace.max()),
                                        capacity * args.target, args.warmup_bins)
        out.update(board)
        results = {}
        counts = {"static-mean": static_mean, "static-peak": static_peak, "huorn": 1, "huorn-predictive": 1}
        with Progress() as progress:
            for policy in args.policies.split(","):
                fleet = Fleet(args.work / policy, config)
                results[policy] = await run_policy(
                    policy, fleet, warm + rates, args.bin_seconds, slo_s, counts[policy], static_peak, args,
                    progress, floors if policy == "huorn-predictive" else None, args.warmup_bins)
        return results

    results = asyncio.run(everything())
    out["ratios"] = {}
    for name in ("huorn", "huorn-predictive"):
        for base in ("static-peak", "static-mean"):
            if name in results and base in results:
                h, b = results[name], results[base]
                key = name.replace("-", "_")
                out["ratios"][f"{key}_replica_seconds_vs_{base.replace('-', '_')}"] = (
                    h["replica_seconds"] / b["replica_seconds"])
                out["ratios"][f"{key}_slo_windows_minus_{base.replace('-', '_')}"] = (
                    h["slo_attainment_windows"] - b["slo_attainment_windows"])
    plot(results, out, args.png)
    out["policies"] = {k: {m: v for m, v in r.items() if m not in ("timeline", "latency_values")}
                       for k, r in results.items()}
    out["timelines"] = {k: [[round(x, 2) for x in p] for p in r["timeline"]] for k, r in results.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"{'policy':16} {'reqs':>6} {'fail':>5} {'SLO req':>8} {'SLO win':>8} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'replica-s':>9} {'mean rep':>8}")
    for name, r in out["policies"].items():
        p50 = f"{r['p50_s'] * 1000:.0f}" if r["p50_s"] is not None else "-"
        p99 = f"{r['p99_s'] * 1000:.0f}" if r["p99_s"] is not None else "-"
        print(f"{name:16} {r['requests']:6d} {r['failed']:5d} {r['slo_attainment_requests']:8.2%} "
              f"{r['slo_attainment_windows']:8.2%} {p50:>7} {p99:>7} {r['replica_seconds']:9.0f} "
              f"{r['mean_replicas']:8.2f}")
    print(json.dumps({k: round(v, 3) for k, v in out["ratios"].items()}))
    print(f"SLO {out['slo_s'] * 1000:.0f} ms; one replica {out['capacity_rps']:.1f} req/s; peak "
          f"{out['peak_rps']:.1f} req/s; wrote {args.out} and {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
