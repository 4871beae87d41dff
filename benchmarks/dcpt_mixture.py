"""D-CPT mixture planning on CPU, side by side in one run: continual pre-training of one base model
on a new domain (math) at the share Huorn's plan picks, at the share the listed weights give
(the baseline: no planning), and at a sweep of fixed shares that shows what each share really
yields. Every run is the real trainer process (`python -m huorn.runtime.train`), the planned one
included (it probes, fits and trains), and every score is the real evaluator's per-source
validation loss (huorn.runtime.evaluate).

    .venv/bin/python benchmarks/dcpt_mixture.py                    # ~6 min on the 2-core VM
    .venv/bin/python benchmarks/dcpt_mixture.py --base-steps 60 --cpt-steps 60 --probe-steps 12  # smoke

The plan's task: the lowest domain loss whose general loss (general and code, 2:1) stays within
(1 + T) of continual pre-training on the general corpus alone. The sweep says which fixed share
would have been best under that rule (the oracle), so the report gives the plan's regret against
the oracle and its ratios against the baseline, with the law's predictions against what the runs
measured (docs/figures/dcpt_mixture.png).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import matplotlib
import numpy as np
import trainer_runs
from rich.progress import Progress

from huorn.runtime import checkpoint, evaluate, mixture_plan
from huorn.runtime import config as run_config

matplotlib.use("Agg")
from matplotlib import pyplot  # after choosing the headless backend

ROOT = Path(__file__).resolve().parents[1]
GENERAL = {"general": 2.0, "code": 1.0}  # the general corpus and its proportions
DOMAIN = "math"
MODEL = {"layers": 4, "width": 64, "heads": 4, "context": 64}


def spec(args: argparse.Namespace, *, steps: int, weights: dict[str, float], init: Path | None,
         plan: bool = False) -> dict:
    sources = [{"name": name, "weight": weight} for name, weight in weights.items()]
    data: dict = {"sources": sources, "seed": args.seed}
    if plan:
        data |= {"mixture": "auto", "plan": {"domain": DOMAIN, "generalTolerance": args.tolerance,
                                             "probeSteps": args.probe_steps, "probeEvaluations": 4}}
    return {
        "task": {"kind": "cpt", "initCheckpoint": str(init)} if init else {"kind": "pretrain"},
        "virtualCluster": "bench",
        "model": MODEL,
        "data": data,
        "optimization": {"globalBatch": args.batch, "microBatch": args.batch, "learningRate": args.lr,
                         "warmupSteps": max(1, steps // 20), "steps": steps},
        "checkpoint": {"path": "/checkpoints", "intervalSteps": steps},
    }


def training_seconds(config: run_config.RunConfig) -> float:
    """From the trainer's start record to its done record: the run without its plan."""
    lines = (Path(config.run_dir) / run_config.STEPS_FILE).read_text().splitlines()
    events = [json.loads(line) for line in lines]
    times = {e["event"]: e["time"] for e in events if e.get("event") in ("start", "done")}
    return times["done"] - times["start"]


def score(config: run_config.RunConfig, batches: int) -> dict[str, float]:
    latest = checkpoint.find_latest(config.checkpoint_root)
    assert latest is not None
    # Every source scored, also one the run did not train on (a share of 0).
    body = config.spec.to_wire()
    every = [{"name": s, "weight": 1} for s in [*GENERAL, DOMAIN]]
    body["data"] = {"sources": every, "seed": body["data"]["seed"]}
    scored = config.model_copy(update={"spec": type(config.spec).model_validate(body)})
    sources = evaluate.evaluate(scored, latest, batches)["sources"]
    general = sum(w * sources[s] for s, w in GENERAL.items()) / sum(GENERAL.values())
    # each source's own loss under its own key, and "general" the 2:1 mix of the general corpora:
    # spread last, the general corpus's own loss once overwrote the mix every figure reads
    return {**{f"source/{s}": loss for s, loss in sources.items()}, "domain": sources[DOMAIN],
            "general": general}


def plot(sweep: dict[float, dict], planned: dict, baseline: dict, plan: mixture_plan.Plan,
         reference: float, tolerance: float, path: Path, title: str) -> None:
    shares = sorted(sweep)
    grid = np.linspace(0.01, 0.95, 95)
    domain_law = mixture_plan.Law(**plan.domain_law)
    general_law = mixture_plan.Law(**plan.general_law)
    figure, (left, right) = pyplot.subplots(1, 2, figsize=(11, 4.2))
    for axis, key, law, share_of in ((left, "domain", domain_law, lambda r: r),
                                     (right, "general", general_law, lambda r: 1 - r)):
        axis.plot(shares, [sweep[r][key] for r in shares], "o-", label="fixed share (measured)")
        axis.plot(grid, law.predict(plan.tokens, share_of(grid)), "--", color="grey",
                  label="D-CPT law from the probes")
        axis.plot([planned["share"]], [planned[key]], "*", markersize=14, color="C2", label="Huorn's plan")
        axis.plot([baseline["share"]], [baseline[key]], "s", markersize=8, color="C3", label="listed weights")
        axis.set_xlabel(f"{DOMAIN} share of the continual pre-training mix")
        axis.grid(alpha=0.3)
    right.axhline((1 + tolerance) * reference, color="C1", linestyle=":",
                  label=f"(1 + T) × general-only (T = {tolerance:g})")
    left.set_ylabel(f"{DOMAIN} validation loss")
    right.set_ylabel("general validation loss (general:code 2:1)")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    trainer_runs.save_figure(figure, title, path)


def parse_args() -> argparse.Namespace:
    parser = trainer_runs.argument_parser(__doc__, "dcpt_mixture")
    parser.add_argument("--base-steps", type=int, default=400, help="pre-training of the base model")
    parser.add_argument("--cpt-steps", type=int, default=400, help="each continual pre-training run")
    parser.add_argument("--probe-steps", type=int, default=40, help="each of the plan's five probes")
    parser.add_argument("--shares", default="0,0.05,0.1,0.2,0.35,0.5,0.7", help="the fixed-share sweep")
    parser.add_argument("--tolerance", type=float, default=0.02, help="T: allowed rise of the general loss")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--parallel", type=int, default=2, help="trainers at a time (one thread each)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    data_dir = trainer_runs.build_corpora(args.work)
    shares = [float(s) for s in args.shares.split(",")]
    general_total = sum(GENERAL.values())

    def mix(share: float) -> dict[str, float]:
        return {**{s: (1 - share) * w / general_total for s, w in GENERAL.items()}, DOMAIN: share}

    listed = {**GENERAL, DOMAIN: 1.0}  # the baseline: the sources as a user lists them, no planning
    with Progress() as progress:
        base = trainer_runs.run_all({"base": spec(args, steps=args.base_steps, weights=GENERAL, init=None)},
                       args.work, data_dir, progress, 1)["base"]
        init = base.checkpoint_root
        jobs = {"planned": spec(args, steps=args.cpt_steps, weights=listed, init=init, plan=True),
                "listed": spec(args, steps=args.cpt_steps, weights=listed, init=init)}
        jobs |= {f"share-{s:g}": spec(args, steps=args.cpt_steps, weights=mix(s), init=init) for s in shares}
        configs = trainer_runs.run_all(jobs, args.work, data_dir, progress, args.parallel)
    scores = {name: score(config, args.eval_batches) for name, config in configs.items()}
    plan_file = next(mixture_plan.plan_directory(configs["planned"]).glob("plan-*.json"))
    plan = mixture_plan.Plan.read(plan_file)
    sweep = {s: scores[f"share-{s:g}"] for s in shares}
    reference = sweep[0.0]["general"] if 0.0 in sweep else float("nan")
    bound = (1 + args.tolerance) * reference
    feasible = {s: r for s, r in sweep.items() if r["general"] <= bound}
    oracle_share = min(feasible, key=lambda s: feasible[s]["domain"])
    # Each probe: its trunk, plus a cool-down branch at each of its four validation points.
    marks = [args.probe_steps * k // 4 for k in range(1, 5)]
    cooldowns = sum(max(1, round(mixture_plan.COOLDOWN_FRACTION * mark)) for mark in marks)
    probe_steps = (args.probe_steps + cooldowns) * len(plan.probes)
    planned = {"share": plan.share, **scores["planned"]}
    baseline = {"share": listed[DOMAIN] / sum(listed.values()), **scores["listed"]}
    report = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": MODEL,
        "plan": {"share": plan.share, "weights": plan.weights, "predicted": plan.choice,
                 "domain_r2": round(plan.domain_r2, 4), "general_r2": round(plan.general_r2, 4),
                 "seconds": round(plan.seconds, 1),
                 "probe_steps_over_run_steps": round(probe_steps / args.cpt_steps, 3),
                 "plan_seconds_over_training_seconds":
                     round(plan.seconds / training_seconds(configs["planned"]), 3)},
        "general_only_loss": round(reference, 4), "general_bound": round(bound, 4),
        "sweep": {f"{s:g}": {k: round(v, 4) for k, v in r.items()} for s, r in sweep.items()},
        "planned": {k: round(v, 4) for k, v in planned.items()},
        "listed": {k: round(v, 4) for k, v in baseline.items()},
        "oracle": {"share": oracle_share, "domain": round(feasible[oracle_share]["domain"], 4)},
        "ratios": {
            "planned/listed domain": round(planned["domain"] / baseline["domain"], 4),
            "planned/listed general": round(planned["general"] / baseline["general"], 4),
            "planned/oracle domain": round(planned["domain"] / feasible[oracle_share]["domain"], 4),
            "planned general/general-only": round(planned["general"] / reference, 4),
            "listed general/general-only": round(baseline["general"] / reference, 4),
            "predicted/measured domain": round(plan.choice["domain_loss"] / planned["domain"], 4),
            "predicted/measured general": round(plan.choice["general_loss"] / planned["general"], 4),
        },
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(sweep, planned, baseline, plan, reference, args.tolerance, args.png,
         f"{MODEL['layers']}x{MODEL['width']} base ({args.base_steps} steps), continual pre-training "
         f"{args.cpt_steps} steps; probes 5 x {args.probe_steps} steps; seed {args.seed}")
    print(f"{'run':12}{'share':>8}{'domain':>10}{'general':>10}")
    for name, row in [("planned", planned), ("listed", baseline),
                      *((f"share {s:g}", {"share": s, **r}) for s, r in sweep.items())]:
        print(f"{name:12}{row['share']:8.3f}{row['domain']:10.4f}{row['general']:10.4f}")
    print(json.dumps(report["ratios"]))
    print(f"wrote {args.out} and {args.png} in {report['seconds']} s")


if __name__ == "__main__":
    main()
