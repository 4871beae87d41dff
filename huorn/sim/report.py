"""Metrics of a simulated run, the comparison across policies, and the plots a person looks at.

Goodput is Pollux's: throughput × statistical efficiency, in the job's own progress units
(base-batch-equivalent samples per second; one sample at batch M is worth E(M) of a sample at the
base batch, which is also the AdaScale gain per step). To add jobs of different models, each job's
goodput is divided by its goodput as the trace ran it (its requested GPUs at its base batch, which
static FIFO reproduces exactly) and weighted by its requested GPUs: cluster goodput G(t) is then
"trace GPU-seconds of work done per second", in GPU equivalents, and static FIFO with every GPU busy
scores the number of training GPUs. Restart pauses count as zero. It is reported over two windows:

- the arrival window (`goodput_gpu_equiv`, the original measure): a policy that runs every job at
  its requested size (FIFO, Kueue) cannot exceed the offered load there; an elastic one can, by
  running the jobs that have arrived faster than the trace ran them, but only that far, so when
  FIFO keeps up with arrivals no policy beats it by much. A window shorter than
  MIN_WINDOW_TICKS ticks gives null and a reason (`goodput_gpu_equiv_null_reason`), and no
  `goodput_vs_fifo`: the work series is sampled once a tick, so over so short a window the
  figure was an interpolation between samples (0.33 against 11.3 GPU-equivalents in 8 seconds);
- the saturated window (`goodput_saturated_gpu_equiv`): from the first arrival for T* = total trace
  work ÷ training GPUs, the time a perfectly packed static cluster would need for the whole trace:
  one fixed window, the same for every policy, over which each one's progress is measured. It is
  not saturated for the static baselines: FIFO and Kueue leave GPUs idle in it, while jobs wait
  (a gang no free block holds, head-of-line blocking) and while none waits (128 GPUs, seed 0:
  FIFO held 51.5 of the 96 training GPUs on average over it; seed 1: 22.3, with no job waiting
  for 79 % of it). So it measures progress per cluster over a fixed time, which includes how much
  of the cluster a policy keeps busy, not how fast GPUs in use turn into progress. That is
  `goodput_saturated_per_gpu_in_use`: the same goodput divided by the mean GPUs the policy's
  running jobs held over the window (borrowed ones and restart pauses included).

Per job (Pollux's per-job view, relative to the trace run, so 1.0 is "as fast as the trace at the
requested size"): `job_goodput_vs_trace` is trace duration / (finish − first start), the speed while
holding GPUs; `job_goodput_with_wait_vs_trace` is trace duration / JCT, which also counts queueing.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from huorn.api import files
from huorn.sim import bounds, engine, policies

ORDER = ("fifo", "kueue", *policies.POLLUX_FORMS, "huorn")
COLOURS = {"fifo": "#888888", "kueue": "#66aa99", "pollux": "#6699cc", "pollux-p-1": "#3355aa",
           "pollux-p-1-fair": "#223377", "pollux-arrival": "#88aadd", "pollux-p-1-arrival": "#5577bb",
           "pollux-p-1-fair-arrival": "#445599", "huorn": "#dd6633"}


# The causes gpu_hours_lost_total adds up, bottom to top in the plot's stacked bar
LOST_PARTS = ("gpu_hours_lost", "gpu_hours_starting", "gpu_hours_restarting", "gpu_hours_reclaim_held")

# The shortest arrival window, in ticks, that goodput_gpu_equiv is measured over. On the shipped
# trace the shortest is 4.5 ticks (128 GPUs, load 1.5, seeds 0-29; 5.2 at 1,024 GPUs).
MIN_WINDOW_TICKS = 3


def _arrival_window_goodput(sim: engine.Simulation, last_arrival: float) -> dict:
    """goodput_gpu_equiv, or None and the reason where the arrival window is too short to read."""
    shortest = MIN_WINDOW_TICKS * sim.config.tick_seconds
    if last_arrival < shortest:
        return {"goodput_gpu_equiv": None, "goodput_gpu_equiv_null_reason": (
            f"the arrival window ({last_arrival:.3g} s) is shorter than {MIN_WINDOW_TICKS} ticks "
            f"({shortest:g} s), and the work series is sampled once a tick: read "
            "goodput_saturated_gpu_equiv (a lower load or a longer trace gives a longer window)")}
    window = max(last_arrival, 1.0)
    return {"goodput_gpu_equiv": _work_done_by(sim, window) / window}


def summarise(sim: engine.Simulation, wall_seconds: float) -> dict:
    jobs = sim.jobs
    jct = np.array([js.finished - js.job.arrival for js in jobs])
    last_arrival = max(js.job.arrival for js in jobs)
    makespan = max(js.finished for js in jobs) - min(js.job.arrival for js in jobs)
    start, saturated = bounds.saturated_window(sim)
    t = sim.totals
    saturated_goodput = _work_done_by(sim, start + saturated) / saturated
    return {
        "jobs": len(jobs),
        "jobs_left_out": len(sim.left_out),  # no training node of this cluster holds their pods
        "gpus": sim.config.gpus,
        "training_gpus": sim.train_gpus,
        "inference_gpus": sim.infer_gpus,
        "jct_mean_s": float(jct.mean()),
        "jct_p50_s": float(np.percentile(jct, 50)),
        "jct_p99_s": float(np.percentile(jct, 99)),
        "makespan_s": float(makespan),
        **_arrival_window_goodput(sim, last_arrival),
        "goodput_saturated_gpu_equiv": saturated_goodput,
        **_saturated_per_gpu_in_use(sim, start, saturated, saturated_goodput),
        "saturated_window_s": saturated,
        "job_goodput_with_wait_vs_trace": float(np.mean([
            js.job.duration / max(js.finished - js.job.arrival, 1e-9) for js in jobs])),
        "job_goodput_vs_trace": float(np.mean([js.job.duration / max(js.finished - js.started, 1e-9)
                                               for js in jobs])),
        "gpu_utilisation": (t.train_gpu_seconds + t.infer_gpu_seconds) / (sim.config.gpus * makespan),
        "inference_slo_attainment": t.slo_served / t.slo_requests if t.slo_requests else 1.0,
        "preemptions": t.preemptions,
        # GPU-hours that made no progress kept, by cause (docs/scheduling.md, "Metrics"): work
        # rolled back to a checkpoint (evictions, ungraceful reclaims), restart pauses (first
        # starts apart from every later one) and a reclaim victim's GPUs held until it has gone.
        # gpu_hours_lost is the first only; the total is what the table and the plot show.
        "gpu_hours_lost": t.lost_gpu_seconds / 3600,
        "gpu_hours_starting": sum(js.start_gpu_seconds for js in jobs) / 3600,
        "gpu_hours_restarting": sum(js.restart_gpu_seconds for js in jobs) / 3600,
        "gpu_hours_reclaim_held": t.reclaim_held_gpu_seconds / 3600,
        "gpu_hours_lost_total": (t.lost_gpu_seconds + t.reclaim_held_gpu_seconds
                                 + sum(js.start_gpu_seconds + js.restart_gpu_seconds for js in jobs)) / 3600,
        "restarts": int(sum(js.restarts for js in jobs)),
        "wall_seconds": wall_seconds,
    }


def _saturated_per_gpu_in_use(sim: engine.Simulation, start: float, window: float, goodput: float) -> dict:
    """Saturated-window goodput per GPU in use, and the mean GPUs in use over the window: a policy
    that leaves GPUs idle (FIFO behind a gang that does not fit) scores low per cluster but not
    per GPU it runs. The GPUs are the running jobs' (borrowed ones included), read from the same
    per-tick series as the work; `goodput` is the window's; None where no GPU was in use."""
    held = _series_at(sim.totals.series_gpu_seconds, start + window) - _series_at(
        sim.totals.series_gpu_seconds, start)
    gpus = held / window
    return {"saturated_mean_gpus_in_use": gpus,
            "goodput_saturated_per_gpu_in_use": goodput / gpus if gpus > 0 else None}


def _series_at(series: list[tuple[float, float]], when: float) -> float:
    """A cumulative per-tick series at `when`, interpolated (its last value past its end)."""
    if not series:
        return 0.0
    return float(np.interp(when, [s[0] for s in series], [s[1] for s in series]))


def _work_done_by(sim: engine.Simulation, when: float) -> float:
    """Trace GPU-seconds of work done by `when`, interpolated from the per-tick series."""
    return _series_at(sim.totals.series_work, when)


def best_pollux(results: dict[str, dict], key: str = "jct_mean_s", suffix: str = "") -> str:
    """The Pollux form (of policies.POLLUX_FORMS, each name with `suffix`, for a study's variants
    of them) with the least `key`: the baseline Huorn is measured against. Every form must be in
    `results`: a benchmark that ran fewer would take its "best Pollux" over fewer forms and flatter
    Huorn, as the three plain forms did before AdaptDL's admission on arrival was modelled."""
    names = [f"{form}{suffix}" for form in policies.POLLUX_FORMS]
    missing = [n for n in names if n not in results]
    if missing:
        raise KeyError(f"the best Pollux is taken over all {len(names)} forms; missing {missing}")
    return min(names, key=lambda n: results[n][key])


def compare(results: dict[str, dict]) -> dict:
    """Huorn against the best baseline and against static FIFO, the issue's three goals."""
    if "huorn" not in results:
        return {}
    h = results["huorn"]
    baselines = {k: v for k, v in results.items() if k != "huorn"}
    out: dict = {}
    if baselines:
        best = min(baselines, key=lambda k: baselines[k]["jct_mean_s"])
        out["best_baseline_by_mean_jct"] = best
        out["mean_jct_reduction_vs_best"] = 1 - h["jct_mean_s"] / baselines[best]["jct_mean_s"]
    if "fifo" in results:
        # each ratio where its own two figures exist: FIFO's arrival-window goodput of 0 used to
        # drop the per-job and saturated ratios with it
        f = results["fifo"]
        if f["goodput_gpu_equiv"] and h["goodput_gpu_equiv"] is not None:
            out["goodput_vs_fifo"] = h["goodput_gpu_equiv"] / f["goodput_gpu_equiv"]
        if f.get("job_goodput_vs_trace"):
            out["job_goodput_vs_fifo"] = h["job_goodput_vs_trace"] / f["job_goodput_vs_trace"]
        if f.get("goodput_saturated_gpu_equiv"):
            out["saturated_goodput_vs_fifo"] = (h["goodput_saturated_gpu_equiv"]
                                                / f["goodput_saturated_gpu_equiv"])
        if f.get("job_goodput_with_wait_vs_trace"):
            out["job_goodput_with_wait_vs_fifo"] = (h["job_goodput_with_wait_vs_trace"]
                                                    / f["job_goodput_with_wait_vs_trace"])
    saturated = {k: v["goodput_saturated_gpu_equiv"] for k, v in baselines.items()
                 if v.get("goodput_saturated_gpu_equiv")}
    if saturated and h.get("goodput_saturated_gpu_equiv"):
        # The paper's 1.8× is against elastic schemes, not static FIFO: the best baseline here
        # (a Pollux, as a rule) is the comparison it makes
        best = max(saturated, key=lambda k: saturated[k])
        out["best_baseline_by_saturated_goodput"] = best
        out["saturated_goodput_vs_best"] = h["goodput_saturated_gpu_equiv"] / saturated[best]
    out["inference_slo_attainment"] = h["inference_slo_attainment"]
    return out


def write_report(out_dir: Path, results: dict[str, dict], sims: dict[str, engine.Simulation],
                 inputs: dict | None = None) -> Path:
    """report.json and the plots. `inputs` joins the settings under `config`: what the trace
    became (huorn simulate: the offered load really simulated and the compression factor, since
    `load` is only what was asked and a small trace cannot offer it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"policies": results, "huorn_vs_baselines": compare(results)}
    if sims:  # the settings the figures came from: a report must say what it measured
        report["config"] = dataclasses.asdict(next(iter(sims.values())).config)
    if inputs:
        report.setdefault("config", {}).update(inputs)
    path = out_dir / "report.json"
    # whole or not at all: a simulation cut short must not truncate the previous report
    files.write_text_atomically(path, json.dumps(report, indent=2, sort_keys=True))
    _plot(out_dir, results, sims)
    return path


def plot_metrics(out_dir: Path, results: dict[str, dict]) -> Path:
    """Bar charts of the headline metrics; needs only the numbers, so it can be redrawn from JSON."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    names = sorted(results, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER))
    keys = ("jct_mean_s", "jct_p99_s", "goodput_gpu_equiv", "inference_slo_attainment",
            "gpu_hours_lost_total")
    labels = ("mean JCT (s)", "p99 JCT (s)", "goodput (GPU-equiv.)", "inference SLO",
              "GPU-hours lost (stacked: rolled back,\nstarting, restarting, reclaim held)")
    # Horizontal bars, one row per policy: with nine policies, upright bars' names and values
    # overlapped one another (the six Pollux forms' p99 labels ran together).
    fig, axes = plt.subplots(1, len(keys), figsize=(20, 1.2 + 0.32 * len(names)), sharey=True)
    rows = np.arange(len(names))
    colours = [COLOURS.get(n, "#444") for n in names]
    for ax, key, label in zip(axes, keys, labels, strict=True):
        values = [results[n][key] for n in names]
        if key == "goodput_gpu_equiv":  # null where the arrival window was too short to measure
            shown = [_compact(v) if v is not None else "n/a" for v in values]
            values = [v if v is not None else 0.0 for v in values]
        elif key == "inference_slo_attainment":
            shown = [f"{100 * v:.3f} %" for v in values]
        else:
            shown = [_compact(v) for v in values]
        if key == "gpu_hours_lost_total":
            # stacked by cause, so that no cause hides: rolled-back work alone showed Huorn at 0
            left = np.zeros(len(names))
            for part, shade in zip(LOST_PARTS, (1.0, 0.35, 0.7, 0.5), strict=True):
                widths = np.array([results[n][part] for n in names])
                ax.barh(rows, widths, left=left, color=colours, alpha=shade, edgecolor="black", linewidth=0.3)
                left += widths
            bars = ax.barh(rows, [0.0] * len(names), left=left)
        else:
            bars = ax.barh(rows, values, color=colours)
        ax.bar_label(bars, labels=shown, fontsize=7, padding=2)
        if key == "inference_slo_attainment":
            # The interesting differences are in the third decimal; a 0..1 axis would hide them.
            ax.set_xlim(min(0.99, min(values) - 0.001), 1.0012)
        else:
            ax.set_xlim(0, max(max(values) * 1.3, 1e-9))  # room for the values' labels
        ax.set_title(label, fontsize=9 if "\n" in label else None)
        ax.tick_params(axis="x", labelsize=7)
    axes[0].set_yticks(rows, names)
    axes[0].invert_yaxis()  # the first policy on top, as the legend and tables list them
    fig.tight_layout()
    path = out_dir / "metrics.png"
    with files.replacing(path) as scratch:
        fig.savefig(scratch, dpi=110, format="png")
    plt.close(fig)
    return path


def _compact(value: float) -> str:
    """A bar's value as a label short enough to sit beside it: thousands with separators, not
    in scientific notation (a p99 JCT of 73,047 s read "7.305e+04")."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _plot(out_dir: Path, results: dict[str, dict], sims: dict[str, engine.Simulation]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    names = list(results)
    plot_metrics(out_dir, results)

    fig, axes = plt.subplots(len(names), 1, figsize=(12, 2.4 * len(names)), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        s = np.array(sims[name].totals.series, dtype=float)
        if s.size == 0:
            continue
        hours = s[:, 0] / 3600
        ax.plot(hours, s[:, 1], label="training GPUs in use", lw=0.8)
        ax.plot(hours, s[:, 2], label="inference GPUs lent", lw=0.8)
        ax.plot(hours, s[:, 3], label="inference need", lw=0.8)
        ax.set_ylabel(name)
        ax.legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("hours")
    fig.tight_layout()
    with files.replacing(out_dir / "timeline.png") as scratch:
        fig.savefig(scratch, dpi=110, format="png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in names:
        jct = np.sort([js.finished - js.job.arrival for js in sims[name].jobs])
        # the share of jobs done by each JCT, (1..n)/n: linspace(0, 1, n) put the first job at 0
        # and drew nothing for a single one; the markers show a lone job, the steps its jump
        ax.plot(jct, np.arange(1, len(jct) + 1) / len(jct), label=name, drawstyle="steps-post",
                marker="o", markersize=2)
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (s)")
    ax.set_ylabel("CDF")
    ax.legend()
    fig.tight_layout()
    with files.replacing(out_dir / "jct_cdf.png") as scratch:
        fig.savefig(scratch, dpi=110, format="png")
    plt.close(fig)


def plot_goodput_sensitivity(rows: list[dict], path: Path, factor: str, xlabel: str,
                             log2: bool = False) -> None:
    """Saturated-window goodput against FIFO by one study factor (elastic range, restart time),
    one panel per cluster size: the bound, Huorn and the best Pollux, with the 1.8× goal. Each
    row carries `gpus`, the factor, `bound_vs_fifo`, `huorn_saturated_goodput_vs_fifo` and
    `best_pollux_saturated_goodput_vs_fifo`."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    sizes = sorted({r["gpus"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 3.6), squeeze=False, sharey=True)
    for ax, gpus in zip(axes[0], sizes, strict=True):
        mine = sorted((r for r in rows if r["gpus"] == gpus), key=lambda r: r[factor])
        xs = [r[factor] for r in mine]
        for key, label in (("bound_vs_fifo", "bound (any policy)"),
                           ("huorn_saturated_goodput_vs_fifo", "Huorn"),
                           ("best_pollux_saturated_goodput_vs_fifo", "best Pollux")):
            ax.plot(xs, [r[key] for r in mine], marker="o", label=label)
        ax.axhline(1.8, color="grey", ls="--", lw=0.8, label="goal 1.8×")
        if log2:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"×{x:g}" for x in xs])
        ax.set_xlabel(xlabel)
        ax.set_title(f"{gpus:,} GPUs")
    axes[0, 0].set_ylabel("saturated goodput / FIFO")
    axes[0, -1].legend(fontsize=8)
    fig.tight_layout()
    with files.replacing(path) as scratch:
        fig.savefig(scratch, dpi=110, format="png")
    plt.close(fig)
