"""From a hung rank to its replacement pod: how long the operator's monitor takes, end to end.

Real kopf (in a thread) against the KMock emulator, real `/telemetry` servers (the runtime's own
`Telemetry` class) on 127.0.0.2/3 patched in as pod IPs. Each trial runs a 2-replica job, lets
both ranks make progress, then stops rank 1 outside a collective while rank 0 waits inside the
next one (the non-communication hang of C4). Measured from the injection, in real time:
detection (the S4 decision in status), cordon (node unschedulable), replacement (the new pod
exists). The part beyond `hangTimeout` is what the monitor period and the API add.

Side by side, the baseline is what Kubernetes alone offers: a liveness probe on the runtime's
`/healthz`. The probe is asked during the hang; it answers 200 (the telemetry thread is alive),
so the kubelet would never restart the pod.

    .venv/bin/python benchmarks/operator_remediation.py --trials 3 \
        --output benchmarks/results/operator_remediation
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kube import builders, cluster
from kube import operator as operator_mod

from huorn.runtime import telemetry as runtime_telemetry

NS = "bench"
IPS = {"trainer-0": "127.0.0.2", "trainer-1": "127.0.0.3"}
HANG_TIMEOUT = 2.0


def poll(predicate, timeout: float = 60.0) -> float:
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if predicate():
            return time.perf_counter()
        time.sleep(0.02)
    raise TimeoutError("condition not reached")


def run_trial(period: float) -> dict[str, float | bool]:
    ranks = [runtime_telemetry.Telemetry("llm", r, 2, f"trainer-{r}") for r in (0, 1)]
    port = ranks[0].serve(IPS["trainer-0"], 0)
    ranks[1].serve(IPS["trainer-1"], port)
    settings = dataclasses.replace(operator_mod.FAST, monitor_seconds=period, telemetry_port=port,
                                   telemetry_timeout_seconds=1.0)
    try:
        with tempfile.TemporaryDirectory() as tmp, cluster.EmulatedCluster(Path(tmp)) as c:
            kube = builders.Kube(c.api_client())
            kube.create_node(builders.make_node("a0", 4, pool="a"))
            kube.create_node(builders.make_node("a1", 4, pool="a"))
            kube.create_vc(builders.make_virtual_cluster("train", pool="a"))
            with operator_mod.OperatorThread(c.api_client(), settings):
                kube.create_job(NS, builders.make_training_job(
                    "llm", "train", replicas=2, max_replicas=2, gpus=2, remediation={"hangTimeout": "2s"}))
                poll(lambda: len(kube.pods(NS, "llm", "trainer")) == 2)
                for pod in kube.pods(NS, "llm"):
                    ip = IPS.get(pod.metadata.labels["huorn.io/instance"], "127.0.0.9")
                    kube.core.patch_namespaced_pod_status(
                        pod.metadata.name, NS, {"status": {"phase": "Running", "podIP": ip}})
                poll(lambda: kube.job_status(NS, "llm").get("phase") == "Running")
                culprit = kube.core.read_namespaced_pod("llm-trainer-1", NS)
                node = culprit.metadata.annotations["huorn.io/node"]
                for _ in range(20):  # both ranks progress for a while, as in training
                    for t in ranks:
                        t.complete_collective(t.enter_collective("allreduce"))
                    time.sleep(0.05)
                start = time.perf_counter()
                ranks[0].enter_collective("allreduce")  # rank 0 waits; rank 1 never comes
                with urllib.request.urlopen(f"http://{IPS['trainer-1']}:{port}/healthz", timeout=5) as r:
                    liveness_ok = r.status == 200
                decided = poll(lambda: any(d["action"] == "replace"
                                           for d in kube.job_status(NS, "llm").get("decisions") or []))
                cordoned = poll(lambda: bool((n := kube.core.read_node(node)).spec and n.spec.unschedulable))
                replaced = poll(lambda: any(p.metadata.name == "llm-trainer-1-g1"
                                            for p in kube.pods(NS, "llm", "trainer")))
    finally:
        for t in ranks:
            t.close()
    return {"period": period, "detect": decided - start, "cordon": cordoned - start,
            "replace": replaced - start, "liveness_probe_ok_during_hang": liveness_ok}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    periods = sorted({r["period"] for r in results})
    fig, ax = plt.subplots(figsize=(9, 2.8))
    for y, period in enumerate(periods):
        rows = [r for r in results if r["period"] == period]
        detect = statistics.median(r["detect"] for r in rows)
        replace = statistics.median(r["replace"] for r in rows)
        ax.barh(y, HANG_TIMEOUT, color="#bbbbbb", label="hangTimeout" if y == 0 else None)
        ax.barh(y, detect - HANG_TIMEOUT, left=HANG_TIMEOUT, color="#e6873c",
                label="detection beyond the timeout" if y == 0 else None)
        ax.barh(y, replace - detect, left=detect, color="#3c78b4",
                label="decision → cordon → new pod" if y == 0 else None)
        ax.text(replace + 0.05, y, f"{replace:.2f} s", va="center")
    ax.set_yticks(range(len(periods)), [f"monitor every {p:g} s" for p in periods])
    ax.set_xlabel("seconds from the hang (median of trials); a liveness probe never fires")
    ax.set_xlim(0, max(r["replace"] for r in results) * 1.25)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.set_title("Hung rank → replacement pod (KMock, 2-core VM)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--periods", type=float, nargs="+", default=[0.3, 1.0])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/operator_remediation"))
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    results = []
    for period in args.periods:
        for trial in range(args.trials):
            r = run_trial(period)
            results.append(r)
            print(f"period {period:g}s trial {trial}: detect {r['detect']:.2f}s cordon {r['cordon']:.2f}s "
                  f"replace {r['replace']:.2f}s; liveness probe answered 200 during the hang: "
                  f"{r['liveness_probe_ok_during_hang']}", flush=True)
    summary = {
        str(p): {k: statistics.median(r[k] for r in results if r["period"] == p)
                 for k in ("detect", "cordon", "replace")}
        for p in args.periods
    }
    (args.output / "results.json").write_text(json.dumps({"trials": results, "median": summary}, indent=1))
    plot(results, args.output / "detection_to_replacement.png")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
