"""The run report: `runs/<name>/report.md` with loss, throughput and graph pictures.

It is written from the run directory alone (the runtime's step log, the backend's action log)
plus the final graph, so a report can be regenerated after the fact and says only what the
files prove. The step-sequence check is the acceptance criterion of elastic training: after any
resize or crash, every step from 1 to the last appears (a crash may repeat the steps since the
last checkpoint, never skip one).
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from huorn.api import files
from huorn.backends.local import backend, commands
from huorn.graph import model, render, serialise


@dataclass
class StepSummary:
    last: int = 0
    missing: list[int] = field(default_factory=list)
    repeated: int = 0  # step records that redo a step already logged (work lost to a crash)
    world_sizes: list[int] = field(default_factory=list)  # distinct, in order of appearance


def read_records(run_dir: Path, name: str = commands.STEPS_FILE) -> list[dict[str, Any]]:
    path = Path(run_dir) / name
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def replica_steps(records: list[dict[str, Any]], graph: model.Graph) -> list[dict[str, Any]]:
    """The step records, each `world_size` in replicas (backend.replica_record): the runtime logs
    the gang's ranks, and a pipelined replica runs one a stage, so a 2-stage run at 1 then 2
    replicas was reported as "Replicas over the run: 2, 4", and its throughput filed by ranks."""
    per_replica = backend.ranks_per_replica(graph)
    return [backend.replica_record(r, per_replica) for r in records if r.get("event") == "step"]


def summarise_steps(steps: list[dict[str, Any]]) -> StepSummary:
    summary = StepSummary()
    seen: set[int] = set()
    for record in steps:
        step = int(record["step"])
        summary.repeated += step in seen
        seen.add(step)
        world = int(record.get("world_size", 0))
        if world not in summary.world_sizes:
            summary.world_sizes.append(world)
    summary.last = max(seen, default=0)
    summary.missing = sorted(set(range(1, summary.last + 1)) - seen)
    return summary


def _clock(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%H:%M:%S")


def mark_mutations(ax: plt.Axes, marks: dict[float, list[model.Mutation]]) -> None:
    """A dashed line per position, labelled with every mutation there ("v4-v6 replace")."""
    for x, group in sorted(marks.items()):
        versions = f"v{group[0].version}" + (f"-v{group[-1].version}" if len(group) > 1 else "")
        actions = "/".join(dict.fromkeys(m.action for m in group))
        ax.axvline(x, color="tab:red", ls="--", lw=0.8)
        ax.annotate(
            f"{versions} {actions}",
            (x, ax.get_ylim()[1]),
            fontsize=7,
            rotation=90,
            va="top",
            ha="right",
            color="tab:red",
        )


def plot_loss(steps: list[dict[str, Any]], mutations: list[model.Mutation], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], ".-", ms=3, lw=1, label="training loss")
    # Mark mutations at the first step logged after them, one label per position.
    marks: dict[float, list[model.Mutation]] = {}
    for m in mutations:
        after = next((r["step"] for r in steps if r["time"] >= m.time), None)
        if after is not None:
            marks.setdefault(float(after), []).append(m)
    mark_mutations(ax, marks)
    ax.set_xlabel("global step")
    ax.set_ylabel("loss")
    ax.set_title("Loss by step (dashed: graph mutations)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with files.replacing(path) as scratch:
        fig.savefig(scratch, dpi=100, format="png")
    plt.close(fig)
    return path


def plot_throughput(steps: list[dict[str, Any]], mutations: list[model.Mutation], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    t0 = steps[0]["time"] if steps else 0.0
    times = [r["time"] - t0 for r in steps]
    ax.plot(times, [r["tokens_per_second"] for r in steps], ".-", ms=3, lw=1, color="tab:blue")
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel("tokens / s", color="tab:blue")
    twin = ax.twinx()
    twin.step(times, [r["world_size"] for r in steps], where="post", color="tab:green", lw=1.5)
    twin.set_ylabel("replicas", color="tab:green")
    twin.set_ylim(0, max([r["world_size"] for r in steps], default=1) + 1)
    marks = {}
    for m in mutations:
        marks.setdefault(round(m.time - t0, 0), []).append(m)
    mark_mutations(ax, marks)
    ax.set_title("Throughput and replicas over time (dashed: graph mutations)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with files.replacing(path) as scratch:
        fig.savefig(scratch, dpi=100, format="png")
    plt.close(fig)
    return path


def recovery_seconds(records: list[dict[str, Any]], mutations: list[model.Mutation]) -> dict[int, float]:
    """Per mutation version: seconds from the mutation to the first step of the re-formed gang
    (the first step logged after a worker `start`, or an in-place `regroup`, that follows the
    mutation)."""
    out = {}
    for m in mutations:
        restarted = False
        for r in records:
            if r.get("time", 0.0) <= m.time:
                continue
            restarted = restarted or r.get("event") in ("start", "regroup")
            if restarted and r.get("event") == "step":
                out[m.version] = r["time"] - m.time
                break
    return out


def write_report(run_dir: Path, graph: model.Graph, outcome: str, command: str = "") -> Path:
    """Write report.md, loss.png, throughput.png, graph.png and graph.json into `run_dir`."""
    run_dir = Path(run_dir)
    records = read_records(run_dir)
    steps = replica_steps(records, graph)
    checkpoints = [r for r in records if r.get("event") == "checkpoint"]
    actions = read_records(run_dir, "actions.jsonl")
    summary = summarise_steps(steps)
    mutations = list(graph.log)
    # Each file is swapped in whole: a report rewritten over a previous one (or cut short) never
    # leaves a half-written file where a whole one was.
    status = json.dumps(serialise.to_status(graph), indent=2) + "\n"
    files.write_text_atomically(run_dir / "graph.json", status)
    with files.replacing(run_dir / "graph.png") as scratch:
        render.render_png(graph, scratch)
    plot_loss(steps, mutations, run_dir / "loss.png")
    plot_throughput(steps, mutations, run_dir / "throughput.png")
    recovery = recovery_seconds(records, mutations)
    lines = [f"# Run report: {graph.kind} {graph.name}", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    final = steps[-1] if steps else {}
    lines += [
        f"- Outcome: **{outcome}**",
        f"- Steps: {summary.last} (last loss {final.get('loss', float('nan')):.4f})"
        if steps
        else "- Steps: none",
        f"- Replicas over the run (in order): {', '.join(map(str, summary.world_sizes)) or '-'}",
        f"- Graph version: {graph.version}, mutations: {graph.mutation_count}",
        f"- Checkpoints written: {len(checkpoints)}"
        + (f" (last at step {checkpoints[-1]['step']})" if checkpoints else ""),
        "- Step sequence: "
        + ("no gaps" if not summary.missing else f"**missing steps {summary.missing[:20]}**")
        + f"; {summary.repeated} step(s) recomputed after a rollback to a checkpoint",
        "",
        "## Mutations",
        "",
        "| version | time (UTC) | action | target | reason | detail | gang stepping again after (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in mutations:
        detail = json.dumps(m.detail)
        took = f"{recovery[m.version]:.1f}" if m.version in recovery else "-"
        lines.append(
            f"| {m.version} | {_clock(m.time)} | {m.action} | {m.target} | {m.reason.replace('|', '/')} "
            f"| `{detail}` | {took} |"
        )
    if not mutations:
        lines.append("| - | - | - | - | the graph ran as compiled | - | - |")
    replacements = [m for m in mutations if m.action == "replace"]
    lines += ["", "## Replacements", ""]
    lines += [f"- {m.detail['old']} → {m.detail['new']}: {m.reason}" for m in replacements] or ["- none"]
    evals = [r for r in records if r.get("event") == "eval"]
    if evals:
        names = sorted({name for r in evals for name in r.get("sources", {})})
        lines += ["", "## Evaluations (eval vertex)", "",
                  "| checkpoint step | loss | perplexity | " + " | ".join(names) + " | seconds |",
                  "|---|---|---|" + "---|" * len(names) + "---|"]
        for r in evals:
            per_source = " | ".join(f"{r['sources'].get(n, float('nan')):.4f}" for n in names)
            lines.append(f"| {r['step']} | {r['loss']:.4f} | {r['perplexity']:.2f} | {per_source} "
                         f"| {r['seconds']:.1f} |")
    throughput = _throughput_by_world(steps)
    lines += [
        "",
        "## Throughput by replica count",
        "",
        "| replicas | steps | mean tokens/s |",
        "|---|---|---|",
    ]
    lines += [f"| {w} | {n} | {tps:.0f} |" for w, (n, tps) in sorted(throughput.items())]
    lines += ["", "## Backend actions", ""]
    lines += [f"- {_clock(a['time'])} (graph v{a['graphVersion']}): {a['action']}" for a in actions] or [
        "- none"
    ]
    lines += [
        "",
        "## Pictures",
        "",
        "![loss](loss.png)",
        "",
        "![throughput](throughput.png)",
        "",
        "![graph](graph.png)",
        "",
        "Files: `steps.jsonl` (the runtime's step log), `actions.jsonl` (what the backend did), "
        "`graph.json` (the graph as it would appear in status), `logs/` (one log per process).",
        "",
    ]
    path = run_dir / "report.md"
    files.write_text_atomically(path, "\n".join(lines))
    return path


def _throughput_by_world(steps: list[dict[str, Any]]) -> dict[int, tuple[int, float]]:
    grouped: dict[int, list[float]] = {}
    for r in steps:
        grouped.setdefault(int(r["world_size"]), []).append(float(r["tokens_per_second"]))
    return {w: (len(v), sum(v) / len(v)) for w, v in grouped.items()}
