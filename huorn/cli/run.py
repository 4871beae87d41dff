"""`huorn run FILE.yaml`: validate, compile and run a job on this machine, then write a report.

This is the same path the operator takes in a cluster (compile → monitor loop → backend apply),
with the local backend in place of the Kubernetes one. Nothing starts until the manifest has
been validated and compiled, so a bad manifest exits 2 with no process left behind.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

import typer

from huorn.api import kinds, training
from huorn.backends import goodput, monitor
from huorn.backends.local import backend as local_backend
from huorn.backends.local import report
from huorn.cli import graph as graph_cli
from huorn.cli import live, run_rl, run_serve
from huorn.cli.output import check_number, check_writable
from huorn.cli.stopping import shielded, stop_signals
from huorn.graph import jobs, model, mutate
from huorn.scheduler import perfmodel

# --interval: the monitor loop sleeps this long between ticks, so an hour is already a run that
# nobody watches; inf overflowed sleep() after the trainers had started.
MIN_INTERVAL, MAX_INTERVAL = 0.1, 3600.0


def parse_scale_at(values: list[str], trainer: model.Vertex, last_step: int | None = None,
                   last_from: str = "--steps") -> list[tuple[int, int]]:
    """--scale-at as (step, replicas). A STEP at or after `last_step` (where the trainers stop,
    `last_from` saying who set it) is refused: the run ended first and the resize was silently
    never made."""
    plan = []
    for value in values:
        step, _, replicas = value.partition(":")
        if not (step.isdigit() and replicas.isdigit()) or int(step) < 1:
            raise graph_cli.ManifestError(
                f"--scale-at {value!r}: expected STEP:REPLICAS, e.g. --scale-at 20:2"
            )
        if not trainer.min_replicas <= int(replicas) <= trainer.max_replicas:
            raise graph_cli.ManifestError(
                f"--scale-at {value}: {replicas} replicas is outside spec.elasticity "
                f"{trainer.min_replicas}..{trainer.max_replicas}"
            )
        if last_step is not None and int(step) >= last_step:
            raise graph_cli.ManifestError(
                f"--scale-at {value}: step {step} is not before the run's last step, {last_step} "
                f"({last_from}), so the resize would never happen; give a STEP below {last_step} "
                f"or run longer with --steps"
            )
        plan.append((int(step), int(replicas)))
    return plan


def build_policies(
    g: model.Graph, plan: list[tuple[int, int]], policy: str, slots: int, steps: int | None = None
) -> list[monitor.Policy]:
    """--scale-at is an explicit plan and wins; otherwise goodput asks the allocator. `steps`
    (--steps) is where the trainers stop, so it is the job's length for the allocator's JCT terms
    too: the spec's declared steps would price work that this run never does."""
    if plan:
        return [monitor.ScheduledResize("trainer", plan)]
    if policy != "goodput":
        return []
    spec = training.TrainingJobSpec.model_validate(g.vertex("trainer").params["spec"])
    return [
        goodput.GoodputPolicy(
            g.name, spec.virtual_cluster, slots, float(spec.optimization.global_batch),
            total_steps=steps if steps is not None else training.declared_steps(spec),
            in_place=jobs.resizes_in_place(g.vertex("trainer")),
            # a budget in tokens: the work left is the tokens not trained yet, whatever the batch
            # grew to (scale-with-replicas); --steps overrides it, as it does in the trainers
            tokens=training.token_budget(spec) if steps is None else None, context=spec.model.context,
            batch_rule=goodput.batch_rule_priced(spec), micro_batch=spec.optimization.micro_batch,
            # a local replica is one data-parallel rank (one process, or a pipeline's stages),
            # whatever resources.gpus asks for a pod
            perf=goodput.prior_model(spec, local_gpu_type() if spec.resources.gpus else "",
                                     gpus_per_replica=1),
        )
    ]


def local_gpu_type() -> str:
    """This machine's GPU type (perfmodel.gpu_type_of of CUDA's device name), which a GPU job's
    performance-model prior is scaled to; "" without CUDA or for a GPU no prior knows."""
    import torch  # NB: here, not at the top: a CPU run never pays for it in the CLI process

    if not torch.cuda.is_available():
        return ""
    return perfmodel.gpu_type_of(torch.cuda.get_device_name(0))


# The flags each kind reads (--run-dir, --json and --watch/--no-watch, a display preference: all
# of them); any other is refused, since a flag silently ignored reads as one obeyed.
FLAGS_BY_KIND: dict[str, frozenset[str]] = {
    "TrainingJob": frozenset({"--replicas", "--steps", "--scale-at", "--interval", "--policy", "--slots",
                              "--stall-timeout"}),
    "RLJob": frozenset({"--steps"}),
    "InferenceJob": frozenset({"--replicas", "--port", "--serve-seconds"}),
}


def refuse_other_kinds_flags(kind: str, given: dict[str, bool]) -> None:
    """ManifestError naming the first given flag that `kind` does not read, and who reads it. A
    kind huorn run does not run at all gets that error instead, later."""
    reads = FLAGS_BY_KIND.get(kind)
    if reads is None:
        return
    for flag, was_given in given.items():
        if was_given and flag not in reads:
            readers = [k for k, flags in FLAGS_BY_KIND.items() if flag in flags]
            raise graph_cli.ManifestError(f"{flag} applies to {' and '.join(readers)} only, not to this "
                                          f"job's kind, {kind}")


# Files that a run of each kind writes first into its run directory (TrainingJob: the backend's
# action log, or at least the report; RLJob and InferenceJob: the config handed to the runtime).
# A non-empty --run-dir with none of them is not a previous run, and is not moved aside.
RUN_MARKERS = ("actions.jsonl", "steps.jsonl", "graph.json", "rl-config.json", "controller.log",
               "serve-config.json", "serve.log", "replica-0/serve-config.json")


def run_dir_refusal(run_dir: Path, manifest: Path | None = None) -> str | None:
    """Why `run_dir` must not be a run directory, or None. A previous run there is renamed aside,
    so `--run-dir .` (or `~`, `..`) once renamed the user's working directory, manifest and all."""
    here, target = Path.cwd().resolve(), run_dir.resolve()
    if target == here or target in here.parents:
        what = "the current directory" if target == here else "a directory above the current one"
    elif target == Path.home().resolve():
        what = "your home directory"
    elif manifest is not None and target in manifest.resolve().parents:
        what = f"the directory that holds {manifest}"
    elif target.is_dir() and any(target.iterdir()) and not any((target / m).exists() for m in RUN_MARKERS):
        what = "a directory of other files (no previous Huorn run: none of steps.jsonl, actions.jsonl, "
        what += "rl-config.json, serve-config.json)"
    else:
        return None
    return (f"--run-dir {run_dir}: is {what}; a run directory is moved aside when it is used again, so "
            f"give a new or empty directory of its own (default: runs/<job name>)")


def prepare_run_dir(run_dir: Path, manifest: Path | None = None) -> Path | None:
    """Keep a previous run's directory by renaming it (its checkpoints may matter); return where.
    Exit 2 with nothing moved where run_dir_refusal objects."""
    check_writable(run_dir, "--run-dir", directory=True)
    refused = run_dir_refusal(run_dir, manifest)
    if refused is not None:
        typer.echo(f"error: {refused}", err=True)
        raise typer.Exit(graph_cli.EXIT_INVALID)
    if not run_dir.exists() or not any(run_dir.iterdir()):
        run_dir.mkdir(parents=True, exist_ok=True)
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    kept = run_dir.with_name(f"{run_dir.name}-{stamp}")
    copy = 1
    while kept.exists():  # two runs within a second
        kept, copy = run_dir.with_name(f"{run_dir.name}-{stamp}-{copy}"), copy + 1
    try:
        run_dir.rename(kept)
        run_dir.mkdir(parents=True)
    except OSError as error:  # e.g. a mount point, or a read-only parent
        typer.echo(f"error: --run-dir {run_dir} holds a previous run, which cannot be moved aside to "
                   f"{kept.name} ({error.strerror}); empty it or choose another --run-dir", err=True)
        raise typer.Exit(graph_cli.EXIT_INVALID) from None
    return kept


def run_command(
    file: Path = typer.Argument(..., metavar="FILE",
                                help="A TrainingJob, RLJob or InferenceJob manifest (YAML)."),
    replicas: int | None = typer.Option(
        None, "--replicas", min=1, metavar="N",
        help="Start with this many trainer replicas; an InferenceJob serves this many, behind its "
             "prefix router when more than one (spec.routing.policy: prefix)."),
    steps: int | None = typer.Option(
        None, "--steps", min=1, metavar="N", help="Stop after this many steps (overrides spec)."
    ),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Where logs, checkpoints and the report go."),
    scale_at: list[str] = typer.Option(
        [], "--scale-at", metavar="STEP:REPLICAS", help="Resize to REPLICAS when training reaches STEP; "
        "repeat for more."
    ),
    watch: bool | None = typer.Option(
        None, "--watch/--no-watch", help="Live progress (default: on a terminal)."
    ),
    interval: float = typer.Option(
        1.0, "--interval", help=f"Seconds between monitor ticks ({MIN_INTERVAL:g} to {MAX_INTERVAL:g})."),
    policy: str | None = typer.Option(
        None, "--policy", help="goodput or fixed (default: spec.elasticity.policy); --scale-at overrides it."
    ),
    slots: int | None = typer.Option(
        None,
        "--slots",
        min=1,
        metavar="N",
        help="Replicas this machine can run at once, for goodput (default: CPU count).",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print a JSON summary at the end instead of a sentence."
    ),
    serve_port: int = typer.Option(8000, "--port", min=0, max=65535, metavar="PORT",
                                   help="InferenceJob: the port to serve on (0 picks a free one)."),
    serve_seconds: float | None = typer.Option(None, "--serve-seconds",
                                               help="InferenceJob: stop serving after this long (≥ 1)."),
    stall_timeout: float = typer.Option(
        600.0, "--stall-timeout", help="Give up when no step completes for this long (seconds, ≥ 10)."
    ),
) -> None:
    """Run a job locally: a TrainingJob's rendezvous store and, per replica, one trainer process
    (resize inPlace) or a torchrun agent (resize restart); an RLJob's single controller over a
    local Ray cluster; InferenceJob replicas (one, or --replicas behind the prefix router),
    serving until Ctrl-C."""
    # Before the manifest, and so before any process or directory: --interval inf had passed its
    # minimum (inf ≥ 0.1) and overflowed sleep() once the trainers ran, leaving a half-written run.
    check_number("--interval", interval, MIN_INTERVAL, MAX_INTERVAL)
    check_number("--serve-seconds", serve_seconds, 1)
    check_number("--stall-timeout", stall_timeout, 10)
    try:
        job, g = graph_cli.compile_file(file)
        refuse_other_kinds_flags(g.kind, {
            "--replicas": replicas is not None, "--steps": steps is not None, "--scale-at": bool(scale_at),
            "--interval": interval != 1.0, "--policy": policy is not None,
            "--slots": slots is not None, "--port": serve_port != 8000,
            "--serve-seconds": serve_seconds is not None, "--stall-timeout": stall_timeout != 600.0,
        })
        if isinstance(job, kinds.InferenceJob):
            refused = run_serve.refusal(job, serve_port, replicas or 1)
            if refused is not None:
                raise graph_cli.ManifestError(refused)
            directory = (run_dir or Path("runs") / g.name).resolve()
            kept = prepare_run_dir(directory, file)
            if kept is not None:
                typer.echo(f"kept the previous run in {kept}", err=True)
            with stop_signals():
                code = run_serve.run_serve(job, directory, serve_port, as_json, serve_seconds, replicas or 1)
            raise typer.Exit(code)
        if isinstance(job, kinds.RLJob):
            run_rl.check(file, job)
            directory = (run_dir or Path("runs") / g.name).resolve()
            kept = prepare_run_dir(directory, file)
            if kept is not None:
                typer.echo(f"kept the previous run in {kept}", err=True)
            shown = sys.stderr.isatty() if watch is None else watch
            with stop_signals():
                code = run_rl.run_rl(job, directory, steps, shown, as_json)
            raise typer.Exit(code)
        if g.kind != "TrainingJob":
            raise graph_cli.ManifestError(f"{file}: kind: huorn run does not run a {g.kind} locally")
        if isinstance(job, kinds.TrainingJob) and job.spec.suspend:
            raise graph_cli.ManifestError(
                f"{file}: spec.suspend is true, so the job is not to run; set it to false (or remove it)"
            )
        if isinstance(job, kinds.TrainingJob):
            from huorn.runtime.data import sampler  # torch: only once a TrainingJob is to run

            try:
                sampler.check_sources([(s.name, s.path) for s in job.spec.data.sources])
            except ValueError as error:
                raise graph_cli.ManifestError(f"{file}: {error}") from None
            cluster_only = [f for f, v in (("activeDeadlineSeconds", job.spec.active_deadline_seconds),
                                           ("ttlSecondsAfterFinished", job.spec.ttl_seconds_after_finished))
                            if v is not None]
            if cluster_only:
                typer.echo(f"note: spec.{' and spec.'.join(cluster_only)} apply in a cluster (the operator); "
                           "huorn run does not enforce them (--stall-timeout bounds a stuck run)", err=True)
        trainer = g.vertex("trainer")
        if steps is not None:
            last_step, last_from = steps, f"--steps {steps}"
        else:
            declared = training.TrainingJobSpec.model_validate(trainer.params["spec"])
            last_step = training.declared_steps(declared)
            last_from = (f"spec.optimization.steps {last_step}" if declared.optimization.steps is not None
                         else f"spec.optimization.tokens, {last_step} steps")
        plan = parse_scale_at(scale_at, trainer, last_step, last_from)
        chosen = policy or trainer.params["policy"]
        if chosen not in ("goodput", "fixed"):
            raise graph_cli.ManifestError(f"--policy {chosen!r}: use goodput or fixed")
        if replicas is not None and not trainer.min_replicas <= replicas <= trainer.max_replicas:
            raise graph_cli.ManifestError(
                f"--replicas {replicas} is outside spec.elasticity "
                f"{trainer.min_replicas}..{trainer.max_replicas}"
            )
    except graph_cli.ManifestError as error:
        graph_cli.fail_invalid(error)
        return
    if replicas is not None:
        mutate.resize(g, "trainer", replicas, reason=f"--replicas {replicas} on the command line")
    directory = (run_dir or Path("runs") / g.name).resolve()
    kept = prepare_run_dir(directory, file)
    if kept is not None:
        typer.echo(f"kept the previous run in {kept}", err=True)
    backend = local_backend.LocalBackend(g, directory, local_backend.LocalSettings(step_limit=steps))
    policies = build_policies(g, plan, chosen, slots or os.cpu_count() or 1, steps)
    view = live.RunView(g, total_steps=steps, enabled=sys.stderr.isatty() if watch is None else watch)
    loop = monitor.Monitor(g, backend, policies, on_tick=view.update)
    with stop_signals():
        outcome = _drive(loop, backend, view, interval, stall_timeout)
    path = report.write_report(directory, g, outcome, "huorn run " + shlex.join(sys.argv[2:]))
    if as_json:
        steps = report.summarise_steps(report.replica_steps(report.read_records(directory), g))
        typer.echo(
            json.dumps(
                {
                    "outcome": outcome,
                    "report": str(path),
                    "runDir": str(directory),
                    "lastStep": steps.last,
                    "missingSteps": steps.missing,
                    "worldSizes": steps.world_sizes,
                    "graphVersion": g.version,
                    "mutations": [
                        {"version": m.version, "action": m.action, "target": m.target, "reason": m.reason}
                        for m in g.log
                    ],
                }
            )
        )
    else:
        typer.echo(f"{outcome}. Report: {path}")
    raise typer.Exit(0 if outcome == "finished" else 130 if outcome.startswith("interrupted") else 1)


def _drive(
    loop: monitor.Monitor,
    backend: local_backend.LocalBackend,
    view: live.RunView,
    interval: float,
    stall_timeout: float,
) -> str:
    """Run the loop; Ctrl-C, SIGTERM or SIGHUP (stop_signals, which the caller holds) stops the
    trainers with a checkpoint, then everything."""
    last_progress = time.monotonic()

    def stalled(result: monitor.TickResult) -> bool:
        nonlocal last_progress
        if result.observation.steps or result.mutations:
            last_progress = time.monotonic()
        return time.monotonic() - last_progress > stall_timeout

    outcome = "failed"
    try:
        with view:
            loop.start()
            result = loop.run(interval=interval, should_stop=stalled)
            outcome = (
                "finished" if result.observation.finished else f"stalled (no step for {stall_timeout:.0f} s)"
            )
    except KeyboardInterrupt:
        outcome = "interrupted"
    except local_backend.LocalBackendError as error:
        typer.echo(f"error: {error}", err=True)
    finally:
        with shielded():  # a second Ctrl-C must not cut the checkpoint short
            backend.stop(graceful=not outcome.startswith("finished"))
            view.update_final(backend.observe())
    return stop_outcome(backend.run_dir) if outcome == "interrupted" else outcome


def stop_outcome(run_dir: Path) -> str:
    """How an interrupted run ended, as its step log tells it once everything has stopped. It
    said "checkpointed" on faith: a stop checkpoint that a slow step pushed past a grace period
    was SIGKILLed unwritten, and the steps since the last checkpoint were lost without a word."""
    last = saved = None
    for record in report.read_records(run_dir):
        if record.get("event") == "step":
            last = int(record["step"])
        elif record.get("event") == "checkpoint":
            saved = max(int(record["step"]), saved or 0)
    if last is None:
        return "interrupted (stopped before the first step)"
    if saved is not None and saved >= last:
        return "interrupted (checkpointed and stopped)"
    first_lost = 1 if saved is None else saved + 1
    kept = "no checkpoint was written" if saved is None else f"the last checkpoint is step {saved}"
    lost = f"step {last} is" if first_lost == last else f"steps {first_lost}-{last} are"
    return f"interrupted (stopped without a stop checkpoint: {kept}, so {lost} lost)"
