"""How much saturated-window goodput any policy could reach: the bound against the 1.8× FIFO goal.

Two bounds (huorn/sim/bounds.py) against static FIFO's measured goodput over the same window:
every job at its best configuration from its arrival with capacity ignored, and the same jobs
sharing the GPUs a policy may use (a linear programme over time slots). Where a bound is below
1.8× FIFO, no scheduler meets the goal under the workload rules' elastic caps.

    .venv/bin/python benchmarks/scheduling_goodput_bound.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from huorn.sim import bounds, engine, run, shared_data

DATA = shared_data.shared_data_dir()
CASES = "1024:0:0.8,1024:0:1.5,128:0:0.8,128:1:0.8,128:2:0.8,128:3:0.8,128:4:0.8,128:0:1.5"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=CASES, help="gpus:seed:load, comma-separated")
    parser.add_argument("--output", type=Path,
                        default=Path("benchmarks/results/scheduling_sim/goodput_bound.json"))
    args = parser.parse_args()
    trace = (DATA / "openb_pod_list_default.csv", DATA / "openb_node_list_gpu_node.csv",
             DATA / "genai_qps.csv")
    rows = []
    for case in args.cases.split(","):
        gpus, seed, load = case.split(":")
        config = engine.SimConfig(gpus=int(gpus), seed=int(seed), load=float(load))
        results, sims = run.run_policies(*trace, ["fifo"], config)
        fifo = results["fifo"]["goodput_saturated_gpu_equiv"]
        bound = bounds.saturated_goodput_bound(sims["fifo"])
        shared = bounds.capacity_goodput_bound(sims["fifo"], slots=48 if int(gpus) <= 256 else 24)
        row = {"gpus": int(gpus), "seed": int(seed), "load": float(load),
               "saturated_window_h": results["fifo"]["saturated_window_s"] / 3600,
               "fifo_gpu_equiv": fifo, "bound_gpu_equiv": bound, "bound_vs_fifo": bound / fifo,
               "capacity_bound_gpu_equiv": shared, "capacity_bound_vs_fifo": shared / fifo}
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
