"""Continuous batching against static batching, on a real request trace replayed open-loop.

One real serving replica (`python -m huorn.runtime.serve`, one process and one CPU thread,
standing in for one GPU) per policy, `serving.batching` set to:

- `static`: the oldest waiting requests, up to `maxBatch`, are decoded until the longest of them
  ends, then the next batch starts (request-level batching: what a server without iteration-level
  scheduling does, and what Huorn did before, there only with prompts of one length);
- `continuous-whole`: a request joins the running batch at the next decoding step and leaves as
  its own answer ends, its prompt prefilled whole before that step (`prefillChunkTokens: 0`);
- `continuous`: the same with chunked prefill, at most 128 prompt tokens before each step
  (`prefillChunkTokens`: its default, 2,048, is sized for a GPU; on this CPU a 128-token chunk
  costs about one decoding step of 16 rows);
- `continuous-eager`: `continuous` with `cudaGraphs: false`: on a GPU its decoding steps are
  launched kernel by kernel rather than replayed as CUDA graphs (the same as `continuous` on a CPU);
- `continuous-delayed[:F]`: `continuous` with `prefillDelayFactor` F (1 by default): while answers
  decode, arrivals wait until the oldest has waited F times the last prefill's iteration, so that
  they share one prefill.

The requests are consecutive successful rows of `../shared/data/lora_request_trace.csv` (a
production GenAI service, cluster-trace-v2026-GenAI), replayed at their recorded arrival times
compressed to `--rate` requests/s on average (bursts kept). The trace's requests are text-to-image
jobs, so a documented rule maps them onto completions: the prompt is `prompt_length` × 4 bytes
(about 4 bytes a token; 8 to 512), and the answer's `max_tokens` is `exec_time_seconds` ×
`--tokens-per-second` (2; 1 to 256), which keeps the trace's long tail of service demand: median
46 tokens, a tenth over 100. The model is untrained and has no stop sequence, so every answer runs
to its `max_tokens`, the same in both policies. The prefix cache is off, so only batching differs.

Reported per policy and rate: requests/s and tokens/s completed, latency (mean, p50, p99), latency
per output token (Orca's and vLLM's normalised latency), the mean time to first token (the
replica's own histogram), the mean rows decoded a step; and each policy's ratios to `static`.
With `--stream` the answers are streamed, and the gaps between a request's events (inter-token
latency, p50 and p99) and the time to its first event as the client sees it are reported too.

    .venv/bin/python benchmarks/serving_continuous_batching.py [--rates 4,8] [--requests 400]
        [--max-batch 16] [--offset 0] [--stream] [--policies static,continuous-whole,continuous]
        [--device cpu|cuda] [--architecture layers=4,width=256,heads=8,context=1024]
        [--chunk 128] [--trace CSV]

On a GPU (`--device cuda`) the replica serves in bf16 (`serve.serving_dtype`) and its one CPU
thread only drives the GPU; a larger `--architecture` there makes a decoding step what it is in
production, bound by reading the weights and the KV cache rather than by its rows.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime
import json
import random
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
from matplotlib.figure import Figure
from prometheus_client.parser import text_string_to_metric_families
from rich.progress import Progress
from serving_autoscale import Fleet
from trainer_runs import argument_parser, plot_latency_cdf, save_figure, write_report

from huorn.api import training
from huorn.runtime import serve
from huorn.sim import shared_data

ARCHITECTURE = {"layers": 4, "width": 256, "heads": 8, "context": 1024}
TRACE = shared_data.shared_data_dir() / "lora_request_trace.csv"
# each policy's spec.serving: static batching; continuous batching with each joining prompt
# prefilled whole; continuous batching with chunked prefill (`--chunk` tokens)
POLICIES = {"static": {"batching": "static", "prefillChunkTokens": 0},
            "continuous-whole": {"batching": "continuous", "prefillChunkTokens": 0},
            "continuous": {"batching": "continuous"},
            # a GPU replica's steps without CUDA graphs (huorn.runtime.decode_graphs); on a CPU,
            # which captures none, the same as `continuous`
            "continuous-eager": {"batching": "continuous", "cudaGraphs": False},
            # arrivals held while answers decode until they share a prefill (`prefillDelayFactor`,
            # 1 unless the policy is named `continuous-delayed:F`)
            "continuous-delayed": {"batching": "continuous", "prefillDelayFactor": 1.0}}
RATIOS = (("tokens_per_second", "tokens_per_second"), ("latency_mean", "latency_mean_s"),
          ("latency_p99", "latency_p99_s"), ("latency_per_token", "latency_per_token_mean_s"),
          ("ttft_mean", "ttft_mean_s"), ("inter_token_p99", "inter_token_p99_s"),
          ("inter_token_server_p99", "inter_token_server_p99_s"))
WORDS = ("the", "model", "answers", "every", "question", "briefly", "and", "cites", "documents", "it",
         "was", "given", "about", "rivers", "lakes", "mountains", "a", "red", "fox", "at", "dawn")


def parse_architecture(text: str) -> dict[str, int]:
    """`layers=24,width=1024,...` over the default architecture's fields."""
    out = dict(ARCHITECTURE)
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name not in ARCHITECTURE or not value.isdigit():
            raise argparse.ArgumentTypeError(f"{part!r}: give name=integer, names {', '.join(ARCHITECTURE)}")
        out[name] = int(value)
    return out


def load_trace(args) -> list[tuple[float, str, int]]:  # type: ignore[no-untyped-def]
    """(arrival offset in seconds, prompt, max_tokens) for `--requests` consecutive successful
    rows from `--offset`, their arrivals compressed to a mean of `--rate` per second later."""
    if not args.trace.exists():
        raise SystemExit(f"--trace {args.trace}: the trace is not there; this benchmark replays it")
    rows = []
    with open(args.trace, newline="") as handle:
        for row in csv.DictReader(handle):
            if row["predict_status"] == "SUCCEED" and row["prompt_length"] and row["exec_time_seconds"]:
                rows.append(row)
    rows = sorted(rows, key=lambda r: r["gmt_create"])[args.offset: args.offset + args.requests]
    if len(rows) < args.requests:
        raise SystemExit(f"--offset {args.offset} --requests {args.requests}: the trace has "
                         f"{len(rows)} there")
    stamp = [datetime.datetime.fromisoformat(r["gmt_create"]).timestamp() for r in rows]
    rng = random.Random(args.offset)
    out = []
    for row, at in zip(rows, stamp, strict=True):
        length = min(512, max(8, round(float(row["prompt_length"]) * 4)))
        text = ""
        while len(text) < length:
            text += rng.choice(WORDS) + " "
        tokens = min(256, max(1, round(float(row["exec_time_seconds"]) * args.tokens_per_second)))
        # the trace's clock has whole seconds: a second's arrivals are spread over it
        out.append((at - stamp[0] + rng.random(), text[:length], tokens))
    return sorted(out)


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Prometheus's histogram_quantile: the q-quantile from cumulative (upper bound, count)
    buckets, interpolated linearly within the bucket it falls in."""
    total = buckets[-1][1]
    rank, below, low = q * total, 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return low
            return low + (upper - low) * (rank - below) / max(count - below, 1e-12)
        below, low = count, upper
    return low


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as r:
        text = await r.text()
    found: dict[str, float] = {}
    gaps: list[tuple[float, float]] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "huorn_serve_inter_token_seconds_bucket":
                gaps.append((float(sample.labels["le"]), sample.value))
            if sample.name in ("huorn_serve_time_to_first_token_seconds_sum",
                               "huorn_serve_time_to_first_token_seconds_count",
                               "huorn_serve_batch_size_sum", "huorn_serve_batch_size_count",
                               "huorn_serve_busy_seconds_total"):
                found[sample.name] = sample.value
    gaps.sort()
    found["inter_token_server_p50_s"] = histogram_quantile(gaps, 0.5)
    found["inter_token_server_p99_s"] = histogram_quantile(gaps, 0.99)
    return found


async def run_policy(policy: str, rate: float, trace: list[tuple[float, str, int]], args,  # type: ignore[no-untyped-def]
                     progress: Progress) -> dict:
    name, _, factor = policy.partition(":")
    serving = {**POLICIES[name], **({"prefillDelayFactor": float(factor)} if factor else {})}
    if name != "static" and "prefillChunkTokens" not in serving:
        serving["prefillChunkTokens"] = args.chunk
    spec = {"virtualCluster": "bench", "model": {"checkpoint": str(args.work / "ckpt"),
                                                 "architecture": args.architecture},
            "serving": {"maxBatch": args.max_batch, "maxTokens": 1024, "prefixCacheTokens": 0, **serving}}
    config = {"jobName": "bench", "host": "127.0.0.1", "port": 0, "device": args.device, "spec": spec}
    fleet = Fleet(args.work / f"{policy}-{rate}", config)
    starting = time.monotonic()
    fleet.scale_to(1)
    await fleet.wait_ready()
    # the replica's start (model load, the batch's KV cache): on a GPU machine where 4 starts and
    # 4 runs outlasted 7 minutes, unmeasured; now in every result
    ready_seconds = time.monotonic() - starting
    progress.console.print(f"{policy} at {rate:g}/s: replica ready in {ready_seconds:.1f} s")
    [url] = fleet.ready()
    span = trace[-1][0] or 1.0
    scale = (len(trace) / rate) / span  # the trace's seconds to this run's
    latencies, per_token, tokens = [], [], 0
    first_seen: list[float] = []  # streamed: seconds to the first text event, as the client sees it
    gaps: list[float] = []  # streamed: seconds between a request's consecutive events
    task = progress.add_task(f"{policy} at {rate:g}/s", total=len(trace))
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
            async def one(at: float, prompt: str, max_tokens: int, started: float) -> None:
                nonlocal tokens
                await asyncio.sleep(max(0.0, started + at * scale - time.monotonic()))
                sent = time.monotonic()
                # greedy, as every recorded run decoded: the server's default samples (OpenAI's)
                request = {"prompt": prompt, "max_tokens": max_tokens, "stream": args.stream,
                           "temperature": 0}
                async with session.post(f"{url}/v1/completions", json=request) as r:
                    if r.status != 200:
                        raise SystemExit(f"{policy}: HTTP {r.status}: {await r.text()}")
                    if args.stream:
                        body, arrivals = await read_stream(r)
                        first_seen.append(arrivals[0] - sent)
                        gaps.extend(np.diff(arrivals).tolist())
                    else:
                        body = await r.json()
                latencies.append(time.monotonic() - sent)
                per_token.append(latencies[-1] / body["tokens"])
                tokens += body["tokens"]
                progress.advance(task)

            started = time.monotonic()
            await asyncio.gather(*(one(at, p, n, started) for at, p, n in trace))
            wall = time.monotonic() - started
            metrics = await scrape(session, url)
    finally:
        fleet.close()
    lat = np.array(latencies)
    first = "huorn_serve_time_to_first_token_seconds"
    return {"policy": policy, "rate": rate, "wall_seconds": wall, "ready_seconds": ready_seconds,
            "requests_per_second": len(trace) / wall, "tokens_per_second": tokens / wall,
            "latency_mean_s": float(lat.mean()), "latency_p50_s": float(np.percentile(lat, 50)),
            "latency_p99_s": float(np.percentile(lat, 99)),
            "latency_per_token_mean_s": float(np.mean(per_token)),
            "ttft_mean_s": metrics[f"{first}_sum"] / metrics[f"{first}_count"],
            "rows_per_step": metrics["huorn_serve_batch_size_sum"] / metrics["huorn_serve_batch_size_count"],
            "busy_share": metrics["huorn_serve_busy_seconds_total"] / wall, "latencies_s": latencies,
            "inter_token_server_p50_s": metrics["inter_token_server_p50_s"],
            "inter_token_server_p99_s": metrics["inter_token_server_p99_s"],
            **({"ttft_client_mean_s": float(np.mean(first_seen)),
                "ttft_client_p99_s": float(np.percentile(first_seen, 99)),
                "inter_token_p50_s": float(np.percentile(gaps, 50)),
                "inter_token_p99_s": float(np.percentile(gaps, 99)),
                "inter_token_max_s": float(np.max(gaps))} if args.stream else {})}


async def read_stream(response: aiohttp.ClientResponse) -> tuple[dict, list[float]]:
    """A streamed answer's last event (its counts) and when each text event arrived. An event is
    sent as its bytes complete a UTF-8 character, so a gap may span two tokens now and then,
    alike for every policy."""
    arrivals, last = [], {}
    async for line in response.content:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[len(b"data: "):])
        if event.get("done"):
            last = event
        elif event.get("text"):
            arrivals.append(time.monotonic())
    return last, arrivals


def plot(results: list[dict], args) -> None:  # type: ignore[no-untyped-def]
    streamed = all("inter_token_server_p99_s" in r for r in results)
    figure = Figure(figsize=(13.5 if streamed else 9, 3.4))
    cdf, bars, *gaps = figure.subplots(1, 3 if streamed else 2)
    plot_latency_cdf(cdf, [(f"{r['policy']}, {r['rate']:g}/s", r["latencies_s"]) for r in results])
    rates = sorted({r["rate"] for r in results})
    ran = [p for p in POLICIES if any(r["policy"] == p for r in results)]
    width = 0.8 / len(ran)
    mean = bars.twinx()
    for i, policy in enumerate(ran):
        mine = [next(r for r in results if r["policy"] == policy and r["rate"] == rate) for rate in rates]
        x = np.arange(len(rates)) + (i - (len(ran) - 1) / 2) * width
        bars.bar(x, [r["tokens_per_second"] for r in mine], width, label=policy,
                 color=("tab:gray", "tab:cyan", "tab:blue", "tab:purple")[i])
        mean.plot(x, [1000 * r["latency_per_token_mean_s"] for r in mine], "o", color="tab:orange")
    bars.set_xticks(np.arange(len(rates)), [f"{rate:g} req/s" for rate in rates])
    bars.set_ylabel("output tokens/s")
    bars.legend(fontsize=8, loc="upper left")
    mean.set_ylabel("latency per output token (ms, dots)", color="tab:orange")
    mean.set_ylim(bottom=0)
    for axis in gaps:  # streamed: the gaps between an answer's tokens, at the replica
        for i, policy in enumerate(ran):
            mine = [next(r for r in results if r["policy"] == policy and r["rate"] == rate) for rate in rates]
            x = np.arange(len(rates)) + (i - (len(ran) - 1) / 2) * width
            axis.bar(x, [1000 * r["inter_token_server_p99_s"] for r in mine], width, label=policy,
                     color=("tab:gray", "tab:cyan", "tab:blue", "tab:purple")[i])
        axis.set_xticks(np.arange(len(rates)), [f"{rate:g} req/s" for rate in rates])
        axis.set_ylabel("inter-token latency p99 (ms)")
        axis.legend(fontsize=8, loc="upper left")
    shape = args.architecture
    save_figure(figure, f"one {'GPU (bf16)' if args.device == 'cuda' else 'CPU'} replica, "
                f"{shape['layers']} layers x {shape['width']}, {args.requests} requests of the GenAI "
                f"trace, maxBatch {args.max_batch}", args.png)


def main() -> int:
    parser = argument_parser(__doc__, "serving_continuous_batching")
    parser.add_argument("--rates", default="4,8", help="mean requests/s, comma-separated")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--offset", type=int, default=0,
                        help="the trace's first row (of the successful ones)")
    parser.add_argument("--tokens-per-second", type=float, default=2.0,
                        help="max_tokens per second of the trace's exec_time_seconds")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--stream", action="store_true",
                        help="stream the answers; report the gaps between their tokens (inter-token latency)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--chunk", type=int, default=128,
                        help="`continuous`'s prefillChunkTokens (on this CPU a 128-token chunk costs "
                             "about one decoding step of 16 rows)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--architecture", type=parse_architecture, default=ARCHITECTURE,
                        help="the served decoder, e.g. layers=24,width=1024,heads=16,context=1024")
    parser.add_argument("--trace", type=Path, default=TRACE)
    args = parser.parse_args()
    policies = args.policies.split(",")
    def known(policy: str) -> bool:
        name, colon, factor = policy.partition(":")
        if not colon:
            return name in POLICIES
        try:
            return name == "continuous-delayed" and float(factor) >= 0
        except ValueError:
            return False

    if "static" not in policies or not all(known(p) for p in policies):
        parser.error(f"--policies: static and any of {', '.join(p for p in POLICIES if p != 'static')} "
                     "(continuous-delayed:F sets the delay factor F)")
    begun = time.perf_counter()
    rates = [float(x) for x in args.rates.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    serve.save_untrained(args.work / "ckpt", training.ModelSpec.model_validate(args.architecture))
    trace = load_trace(args)
    demand = [n for _, _, n in trace]
    results: list[dict] = []
    ratios: dict[str, dict[str, dict[str, float]]] = {}  # policy -> rate -> metric: over static's
    with Progress() as progress:
        for rate in rates:
            for policy in policies:
                results.append(asyncio.run(run_policy(policy, rate, trace, args, progress)))
                progress.console.print(summary(results[-1], args.stream))
                if policy != "static":
                    base = next(r for r in results if r["policy"] == "static" and r["rate"] == rate)
                    ratios.setdefault(policy, {})[f"{rate:g}"] = {
                        name: results[-1][key] / base[key] for name, key in RATIOS if key in results[-1]}
                # after every run, so that a run cut short (a lease's time limit) keeps what it did
                write_report(args, begun, date=time.strftime("%Y-%m-%d"), trace=str(args.trace.name),
                             max_tokens={"mean": float(np.mean(demand)), "p50": float(np.median(demand)),
                                         "p90": float(np.percentile(demand, 90)), "max": max(demand)},
                             results=results, vs_static=ratios,
                             complete=len(results) == len(rates) * len(policies))
    plot(results, args)
    for policy, by_rate in ratios.items():
        for rate, x in by_rate.items():
            print(f"{policy} vs static at {rate}/s: " + ", ".join(f"{k} {v:.2f}x" for k, v in x.items()))
    print(f"wrote {args.out} and {args.png}", file=sys.stderr)
    return 0


def summary(r: dict, stream: bool) -> str:
    """One run's line, printed as it ends."""
    return (f"{r['policy']:>16} at {r['rate']:g}/s: {r['requests_per_second']:5.2f} req/s, "
            f"{r['tokens_per_second']:6.1f} tok/s, mean {1000 * r['latency_mean_s']:6.0f} ms, "
            f"p99 {1000 * r['latency_p99_s']:6.0f} ms, {1000 * r['latency_per_token_mean_s']:5.1f} ms/token, "
            f"TTFT {1000 * r['ttft_mean_s']:6.0f} ms, {r['rows_per_step']:.1f} rows a step, "
            f"busy {100 * r['busy_share']:.0f} %, inter-token at the server p50 "
            f"{1000 * r['inter_token_server_p50_s']:.1f} ms p99 {1000 * r['inter_token_server_p99_s']:.1f} ms"
            + (f", at the client p50 {1000 * r['inter_token_p50_s']:.1f} ms p99 "
               f"{1000 * r['inter_token_p99_s']:.1f} ms" if stream else ""))

if __name__ == "__main__":
    sys.exit(main())
