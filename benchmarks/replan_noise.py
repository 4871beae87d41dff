"""S2 re-planning under measurement noise: a fixed 10 % margin (the baseline, Huorn's rule until
2026-12-04) against plans compared beyond the measured noise (`rebalance.worst_case_ratio` with
the policy's own `median_uncertainty`), judged on one 5-step window at a time (Huorn's rule on
2026-12-04) and on the steps pooled since the plan settled (`policy.EVIDENCE_WINDOW`, the rule
since), side by side on the same simulated runs.

Each run is 2 ranks and 8 micro-batches a step for 600 steps; rank 1 is 3x slower from step
150 to 400 (found at step 155, as the detector would), and every rank's measured seconds per
micro-batch carry host-load noise: log-normal, correlated from step to step (AR(1), rho 0.8, as
a busy neighbour lasts), of sigma 0.05 to 0.4. The real ladder (`huorn.scheduler.remediation.
ladder`) decides from each rank's recent steps through the real policy's median and uncertainty, handed a
new shape every 5 steps (a monitor tick), the way `RemediationPolicy` feeds it; its plans apply
from the next step. The baseline is the same ladder
with the comparison swapped for the fixed margin, nothing else. Reported per noise level, over
20 seeds: re-plans (each a pause costing the rung's price in a real job), the rung's price
paid for them, the job's seconds against an oracle that knows the true speeds, and the ratios.

    .venv/bin/python benchmarks/replan_noise.py            # ~1 min on the 2-core VM
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import matplotlib  # noqa: E402
from rich.progress import Progress  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from huorn.api.common import MitigationLevel  # noqa: E402
from huorn.scheduler.remediation import failslow, ladder, policy, rebalance  # noqa: E402

STEPS, SLOW_FROM, SLOW_UNTIL, FOUND_AT, FACTOR = 600, 150, 400, 155, 3.0
TICK = 5  # steps between the shapes handed to the ladder
MICROBATCHES, RUNG_SECONDS, MICROBATCH_SECONDS = 8, 2.0, 0.1


class FixedMarginLadder(ladder.MitigationLadder):
    """The baseline: a plan is faster when it beats the other by 10 % on the measured speeds."""

    MARGIN = 0.1

    def _faster(self, new: Sequence[float], old: Sequence[float]) -> bool:
        return max(new) * (1.0 + self.MARGIN) < max(old)


def true_seconds(step: int) -> list[float]:
    slow = SLOW_FROM <= step < SLOW_UNTIL
    return [MICROBATCH_SECONDS, MICROBATCH_SECONDS * (FACTOR if slow else 1.0)]


_ORACLE: dict[tuple[float, ...], float] = {}


def _oracle(truth: tuple[float, ...]) -> float:
    """The best plan's step seconds for the true speeds (two of them in a run: cached)."""
    if truth not in _ORACLE:
        _ORACLE[truth] = rebalance.rebalance_microbatches(list(truth), MICROBATCHES).makespan
    return _ORACLE[truth]


def run(kind: type[ladder.MitigationLadder], pooled: bool, sigma: float, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    lad = kind(MitigationLevel.REBALANCE, ladder.LadderCosts(rebalance=RUNG_SECONDS))
    counts = rebalance.even_split(MICROBATCHES, 2)
    noise = [0.0, 0.0]
    seen: list[list[float]] = [[], []]
    seconds = oracle = paid = 0.0
    plans = 0
    healthy = rebalance.step_seconds(counts, true_seconds(0))
    for step in range(STEPS):
        truth = true_seconds(step)
        took = rebalance.step_seconds(counts, truth)
        seconds += took
        oracle += _oracle(tuple(truth))
        for rank in range(2):  # what the rank measures: the truth under correlated host load
            noise[rank] = 0.8 * noise[rank] + math.sqrt(1 - 0.8 ** 2) * rng.gauss(0.0, sigma)
            seen[rank] = [*seen[rank], truth[rank] * math.exp(noise[rank])][-policy.EVIDENCE_WINDOW:]
        if len(seen[0]) >= policy.SHAPE_WINDOW and step % TICK == 0:
            # the policy's window: the steps since the plan settled, within its bounds
            window = (min(policy.EVIDENCE_WINDOW, max(policy.SHAPE_WINDOW, lad.settled_steps()))
                      if pooled else policy.SHAPE_WINDOW)
            recent = [s[-window:] for s in seen]
            lad.shape = ladder.JobShape(
                microbatch_seconds=[statistics.median(s) for s in recent], total_microbatches=MICROBATCHES,
                noise=max(policy.median_uncertainty(s) for s in recent))
        if step == FOUND_AT:
            lad.on_fail_slow(failslow.SlowFinding("trainer-1", "compute", SLOW_FROM, FOUND_AT, FACTOR), [1])
        decision = lad.on_step(took, healthy)
        if decision is not None and "microbatches" in decision.plan:
            counts = list(decision.plan["microbatches"])  # type: ignore[call-overload]
            if decision.action in ("replan-microbatches", "restore-even"):
                plans += 1
                paid += RUNG_SECONDS
    return {"seconds": seconds, "oracle": oracle, "replans": plans, "paid": paid,
            "restored": float(counts == rebalance.even_split(MICROBATCHES, 2))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--sigmas", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "replan_noise.json")
    parser.add_argument("--png", type=Path, default=REPO / "docs" / "figures" / "replan_noise.png")
    args = parser.parse_args()
    policies = {"fixed 10 % margin": (FixedMarginLadder, False),
                "beyond noise, 5-step windows": (ladder.MitigationLadder, False),
                "beyond noise, pooled": (ladder.MitigationLadder, True)}
    rows: dict[str, dict[str, dict[str, float]]] = {}
    with Progress() as progress:
        task = progress.add_task("simulated runs", total=len(args.sigmas) * len(policies) * args.seeds)
        for sigma in args.sigmas:
            rows[str(sigma)] = {}
            for name, (kind, pooled) in policies.items():
                runs = []
                for seed in range(args.seeds):
                    runs.append(run(kind, pooled, sigma, seed))
                    progress.advance(task)
                total = statistics.mean(r["seconds"] + r["paid"] for r in runs)
                oracle = statistics.mean(r["oracle"] for r in runs)
                rows[str(sigma)][name] = {
                    "replans": statistics.mean(r["replans"] for r in runs),
                    "seconds_with_replans": round(total, 2), "oracle_seconds": round(oracle, 2),
                    "over_oracle": round(total / oracle - 1.0, 4),
                    "ended_even": statistics.mean(r["restored"] for r in runs)}
            fixed, windowed, pooled = rows[str(sigma)].values()
            plans, seconds = pooled["replans"], pooled["seconds_with_replans"]
            rows[str(sigma)]["ratios"] = {
                "replans fixed/pooled": round(fixed["replans"] / plans, 2) if plans else None,
                "replans windowed/pooled": round(windowed["replans"] / plans, 2) if plans else None,
                "seconds pooled/fixed": round(seconds / fixed["seconds_with_replans"], 4),
                "seconds pooled/windowed": round(seconds / windowed["seconds_with_replans"], 4)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": rows},
                                   indent=2) + "\n")
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in policies:
        left.plot(args.sigmas, [rows[str(s)][name]["replans"] for s in args.sigmas], marker="o", label=name)
        right.plot(args.sigmas, [100 * rows[str(s)][name]["over_oracle"] for s in args.sigmas], marker="o",
                   label=name)
    left.set_ylabel("re-plans per run (mean of seeds)")
    right.set_ylabel("% seconds over the oracle (re-plans priced in)")
    for axis in (left, right):
        axis.set_xlabel("sigma of the measured speeds' noise (log-normal, AR(1) rho 0.8)")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(f"S2 re-planning, 2 ranks, rank 1 {FACTOR:.0f}x slow for steps {SLOW_FROM}-{SLOW_UNTIL} "
                    f"of {STEPS}; rung {RUNG_SECONDS:.0f} s; {args.seeds} seeds", fontsize=9)
    figure.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.png, dpi=120)
    for sigma in args.sigmas:
        row = rows[str(sigma)]
        parts = [f"{name}: {r['replans']:.1f} re-plans, {100 * r['over_oracle']:.1f} % over the oracle, "
                 f"ended even {100 * r['ended_even']:.0f} %" for name, r in row.items() if name != "ratios"]
        print(f"sigma {sigma}: " + "; ".join(parts) + f"; {row['ratios']}")
    print(f"wrote {args.out} and {args.png}")


if __name__ == "__main__":
    main()
