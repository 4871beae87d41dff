"""Prompt-aware routing against a Service's random spreading, on prompts that share preambles.

Many tenants' system prompts (or few-shot preambles), each request one of them plus a short
question, their popularity Zipf-distributed; together the preambles hold more tokens than one
replica's prefix cache (`serving.prefixCacheTokens`) and fewer than all the replicas' caches.
Real serving replicas (`python -m huorn.runtime.serve`, one process and one CPU thread each,
standing in for one GPU each, their caches empty at the start of every policy) answer the same
requests in the same order from a closed loop of clients. With `--turns T` every client holds
conversations instead: each turn's prompt is the preamble, the earlier turns with their answers,
and a new question, sent once the last answer is back. Policies:

- `service-no-cache`: each request to a random replica (kube-proxy's spreading), no prefix cache;
- `service`: the same spreading, each replica with its prefix cache;
- `prefix`: through Huorn's router (`python -m huorn.runtime.activator --replica ...`, the
  process an InferenceJob with `routing.policy: prefix` runs), to the same replicas.

The baselines send straight to a replica; the router costs `prefix` one more HTTP hop. Reported
per policy: requests/s, latency (mean, p50, p99), the share of prompt tokens whose K/V came from
the cache (the replicas' own `huorn_serve_prompt_tokens`), and how evenly the replicas were
loaded (the busiest replica's requests over the mean); and `prefix`'s ratios to `service`.

    .venv/bin/python benchmarks/serving_prefix_routing.py [--replicas 2] [--requests 1440] [--clients 8]
        [--turns 1] [--seed 0]
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
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
from matplotlib.figure import Figure
from prometheus_client.parser import text_string_to_metric_families
from rich.progress import Progress
from serving_autoscale import Fleet
from trainer_runs import ROOT, argument_parser, plot_latency_cdf, save_figure

from huorn.api import training
from huorn.runtime import launcher, serve

ARCHITECTURE = {"layers": 4, "width": 256, "heads": 8, "context": 1024}
WORDS = ("the", "model", "answers", "every", "question", "briefly", "and", "cites", "documents", "it",
         "was", "given", "about", "rivers", "lakes", "mountains", "tax", "forms", "invoices", "refunds",
         "travel", "policies", "shipping", "delays", "code", "reviews", "unit", "tests", "error",
         "messages", "in", "a", "polite", "careful", "tone")
POLICIES = ("service-no-cache", "service", "prefix")


@dataclass(frozen=True)
class Session:
    """One client's conversation: a preamble, then one question per turn; each turn's prompt is
    the preamble, every earlier turn with its answer, and the new question."""

    preamble: str
    questions: tuple[str, ...]


def build_sessions(args) -> list[Session]:  # type: ignore[no-untyped-def]
    """Sessions whose preamble is drawn Zipf(1) from `--preambles`, each question one of four
    lengths (so that batches of equal lengths can form, as in production traffic): `--requests`
    sessions of one turn, or with `--turns` T > 1, `--requests` / T conversations of T turns."""
    rng = random.Random(args.seed)

    def text(length: int) -> str:
        out = ""
        while len(out) < length:
            out += rng.choice(WORDS) + " "
        return out[:length]

    preambles = [f"[tenant {i}] " + text(args.preamble_tokens - 12) + "\n" for i in range(args.preambles)]
    weights = [1 / (rank + 1) for rank in range(args.preambles)]
    return [Session(rng.choices(preambles, weights)[0],
                    tuple(text(rng.choice((24, 32, 40, 48))) for _ in range(args.turns)))
            for _ in range(args.requests // args.turns)]


def start_router(work: Path, config: dict, urls: list[str]) -> tuple[subprocess.Popen, str]:
    work.mkdir(parents=True, exist_ok=True)
    (work / "activator.json").unlink(missing_ok=True)
    path = work / "config.json"
    path.write_text(json.dumps({**config, "runDir": str(work)}))
    before = os.environ.get("PYTHONPATH")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT) + (os.pathsep + before if before else "")}
    with open(work / "router.log", "wb") as log:
        process = subprocess.Popen(launcher.build_router_command(path, replicas=urls), cwd=ROOT, env=env,
                                   stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not (work / "activator.json").exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the router did not start; see {work / 'router.log'}")
        time.sleep(0.1)
    return process, f"http://127.0.0.1:{json.loads((work / 'activator.json').read_text())['port']}"


async def scrape(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(f"{url}/metrics") as r:
        text = await r.text()
    found = {"cache": 0.0, "prefill": 0.0, "requests": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "huorn_serve_prompt_tokens_total":
                found[sample.labels["source"]] += sample.value
            elif sample.name == "huorn_serve_requests_total" and sample.labels.get("outcome") == "ok":
                found["requests"] += sample.value
    return found


async def router_reasons(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Why the router chose each request's replica (huorn_router_choices by reason)."""
    async with session.get(f"{url}/metrics") as r:
        text = await r.text()
    return {sample.labels["reason"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "huorn_router_choices_total"}


async def run_policy(policy: str, sessions: list[Session], args,  # type: ignore[no-untyped-def]
                     progress: Progress) -> dict:
    cache_tokens = 0 if policy == "service-no-cache" else args.cache_tokens
    spec = {"virtualCluster": "bench", "model": {"checkpoint": str(args.work / "ckpt"),
                                                 "architecture": ARCHITECTURE},
            "serving": {"maxBatch": 8, "maxTokens": 1024, "prefixCacheTokens": cache_tokens},
            "routing": {"policy": "prefix", "loadFactor": args.load_factor}}
    config = {"jobName": "bench", "host": "127.0.0.1", "port": 0, "device": "cpu", "spec": spec}
    fleet = Fleet(args.work / policy, config)
    fleet.scale_to(args.replicas)
    await fleet.wait_ready()
    urls = fleet.ready()
    router = None
    if policy == "prefix":
        router, front = start_router(args.work / policy / "router", config, urls)
    rng = random.Random(args.seed + 1)
    latencies: list[float] = []
    requests = sum(len(c.questions) for c in sessions)
    task = progress.add_task(policy, total=requests)
    queue = list(reversed(sessions))
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            async def client() -> None:
                while queue:
                    conversation = queue.pop()
                    history = conversation.preamble
                    for question in conversation.questions:
                        prompt = f"{history}Q: {question}\nA:"
                        url = front if router is not None else rng.choice(urls)
                        started = time.monotonic()
                        async with session.post(f"{url}/v1/completions",
                                                json={"prompt": prompt, "max_tokens": args.max_tokens,
                                                      "temperature": 0}) as r:
                            body = await r.json()
                            if r.status != 200:
                                raise SystemExit(f"{policy}: HTTP {r.status}: {body}")
                        latencies.append(time.monotonic() - started)
                        history = f"{prompt}{body['text']}\n"
                        progress.advance(task)

            started = time.monotonic()
            await asyncio.gather(*(client() for _ in range(args.clients)))
            wall = time.monotonic() - started
            per_replica = [await scrape(session, u) for u in urls]
            reasons = await router_reasons(session, front) if router is not None else {}
    finally:
        if router is not None:
            router.send_signal(signal.SIGTERM)
            router.wait(30)
        fleet.close()
    cached = sum(r["cache"] for r in per_replica)
    prompt_tokens = cached + sum(r["prefill"] for r in per_replica)
    served = [r["requests"] for r in per_replica]
    lat = np.array(latencies)
    return {"policy": policy, "requests_per_second": requests / wall, "wall_seconds": wall,
            "latency_mean_s": float(lat.mean()), "latency_p50_s": float(np.percentile(lat, 50)),
            "latency_p99_s": float(np.percentile(lat, 99)), "cached_token_share": cached / prompt_tokens,
            "requests_per_replica": served, "imbalance": max(served) / (sum(served) / len(served)),
            "router_choices": reasons, "latencies_s": latencies}


def plot(results: list[dict], args) -> None:  # type: ignore[no-untyped-def]
    figure = Figure(figsize=(9, 3.4))
    cdf, bars = figure.subplots(1, 2)
    plot_latency_cdf(cdf, [(r["policy"], r["latencies_s"]) for r in results])
    names = [r["policy"] for r in results]
    bars.bar(names, [r["requests_per_second"] for r in results], color="tab:blue")
    bars.set_ylabel("requests/s", color="tab:blue")
    share = bars.twinx()
    share.plot(names, [100 * r["cached_token_share"] for r in results], "o-", color="tab:orange")
    share.set_ylabel("prompt tokens from the cache (%)", color="tab:orange")
    share.set_ylim(0, 100)
    turns = f", conversations of {args.turns} turns" if args.turns > 1 else ""
    save_figure(figure, f"{args.replicas} replicas, {args.preambles} preambles of {args.preamble_tokens} "
                f"tokens{turns}, cache {args.cache_tokens} tokens per replica, {args.clients} clients",
                args.png)


def main() -> int:
    parser = argument_parser(__doc__, "serving_prefix_routing")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--requests", type=int, default=1440)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--preambles", type=int, default=12)
    parser.add_argument("--preamble-tokens", type=int, default=384)
    parser.add_argument("--cache-tokens", type=int, default=None,
                        help="per replica; default: the preambles' tokens / replicas, rounded up to blocks")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--turns", type=int, default=1,
                        help="turns per conversation: each prompt carries the earlier turns and answers")
    parser.add_argument("--load-factor", type=float, default=1.25)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.cache_tokens is None:
        working_set = args.preambles * (args.preamble_tokens + 64)
        args.cache_tokens = 16 * math.ceil(working_set / args.replicas / 16)
    policies = args.policies.split(",")
    unknown = set(policies) - set(POLICIES)
    if unknown:
        parser.error(f"--policies: unknown {sorted(unknown)}; choose from {', '.join(POLICIES)}")
    args.work.mkdir(parents=True, exist_ok=True)
    serve.save_untrained(args.work / "ckpt", training.ModelSpec.model_validate(ARCHITECTURE))
    sessions = build_sessions(args)
    results = []
    with Progress() as progress:
        for policy in policies:
            results.append(asyncio.run(run_policy(policy, sessions, args, progress)))
    by = {r["policy"]: r for r in results}
    report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "date": time.strftime("%Y-%m-%d"), "results": results}
    if "prefix" in by and "service" in by:
        p, s = by["prefix"], by["service"]
        report["prefix_vs_service"] = {
            "throughput": p["requests_per_second"] / s["requests_per_second"],
            "latency_mean": p["latency_mean_s"] / s["latency_mean_s"],
            "latency_p99": p["latency_p99_s"] / s["latency_p99_s"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    plot(results, args)
    for r in results:
        print(f"{r['policy']:>17}: {r['requests_per_second']:6.1f} req/s, "
              f"mean {1000 * r['latency_mean_s']:6.0f} ms, p99 {1000 * r['latency_p99_s']:6.0f} ms, "
              f"cached {100 * r['cached_token_share']:5.1f} %, imbalance {r['imbalance']:.2f}"
              + (f", router {r['router_choices']}" if r["router_choices"] else ""))
    if "prefix_vs_service" in report:
        ratios = report["prefix_vs_service"]
        print(f"prefix vs service: throughput {ratios['throughput']:.2f}x, mean latency "
              f"{ratios['latency_mean']:.2f}x, p99 {ratios['latency_p99']:.2f}x")
    print(f"wrote {args.out} and {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
