"""`huorn run` for an RLJob: its single controller on this machine, over a local Ray cluster.

An RLJob has no elastic gang for the local backend to reconcile: the controller places its
roles as Ray actors itself. So `huorn run` writes the run config into the run directory, starts
`python -m huorn.runtime.rl.controller` as a process of its own (Ray stays out of the CLI's
process, and Ctrl-C reaches the controller, which shuts its actors down), shows the steps as a
progress bar and ends with the held-out accuracy before and after.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import Progress

from huorn.api import kinds
from huorn.cli import graph as graph_cli
from huorn.cli.stopping import shielded, start_in_own_session, wait_or_kill
from huorn.runtime import launcher

STEPS_FILE = "steps.jsonl"  # huorn.runtime.rl.controller's step log
# How long a stopped controller may take to end its step, save it and stop its actors before its
# whole session (the controller and the Ray processes it started) is killed.
STOP_SECONDS = 300.0


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def check(file: Path, job: kinds.RLJob) -> None:
    """Refuse, before anything is created, what the RL runtime cannot run (exit 2)."""
    from huorn.runtime.rl import controller  # Ray and torch only for an RLJob

    try:
        controller.check_runnable(job.spec)
    except ValueError as error:
        raise graph_cli.ManifestError(f"{file}: {error}") from None


def run_rl(job: kinds.RLJob, directory: Path, steps: int | None, watch: bool, as_json: bool) -> int:
    """Run the job to its end; the exit code huorn run gives (0 done, 1 failed, 2 refused, 130)."""
    spec = job.spec.to_wire()
    if steps is not None:
        spec["steps"] = steps
    run = directory / "run"
    config = directory / "rl-config.json"
    config.write_text(json.dumps({"jobName": job.metadata.name, "spec": spec, "runDir": str(run),
                                  "checkpointDir": str(directory / "checkpoints")}, indent=1))
    log = directory / "controller.log"
    total = int(spec.get("steps", job.spec.steps))
    # A Ctrl-C reaches this process alone, which hands the controller one SIGINT (it ends the
    # step, saves it and shuts its Ray actors down); a SIGKILL of this process, SIGTERM, taken
    # the same way.
    process = start_in_own_session(launcher.build_rl_controller_command(config), log)
    interrupted = False
    # on stderr, so that --json on stdout stays one clean document
    with Progress(console=Console(stderr=True), disable=not watch) as progress:
        task = progress.add_task(f"{job.metadata.name}: RL steps", total=total)
        try:
            while process.poll() is None:
                # The whole turn, not the sleep alone: a Ctrl-C lands wherever the loop is, and one
                # that hit the step log's read escaped with no summary and no outcome.
                try:
                    time.sleep(0.5)
                    done = sum(1 for e in _events(run / STEPS_FILE) if e.get("event") == "rl")
                    progress.update(task, completed=done)
                except KeyboardInterrupt:  # Ctrl-C, or SIGTERM/SIGHUP (huorn.cli.stopping)
                    interrupted = True
                    process.send_signal(signal.SIGINT)
        finally:
            # An interrupt anywhere else in the loop: the controller, in a session of its own,
            # must not outlive huorn run. It ends the step, saves it and stops its actors.
            with shielded():
                if process.poll() is None:
                    process.send_signal(signal.SIGINT)
                    wait_or_kill(process, STOP_SECONDS)  # its session: the controller and its Ray
    events = _events(run / STEPS_FILE)
    evals = [e for e in events if e.get("event") == "eval"]
    code = process.returncode
    outcome = ("interrupted" if interrupted else "finished" if code == 0
               else "refused" if code == 2 else f"failed (exit {code})")
    if code == 2:  # on stderr with --json too: the JSON summary says "refused", not why
        last = [line for line in log.read_text().splitlines() if line.startswith("error:")]
        typer.echo(last[-1] if last else f"the controller refused the job; see {log}", err=True)
    summary = {"outcome": outcome, "runDir": str(directory), "log": str(log),
               "steps": sum(1 for e in events if e.get("event") == "rl"),
               "accuracyBefore": evals[0]["accuracy"] if evals else None,
               "accuracyAfter": evals[-1]["accuracy"] if len(evals) > 1 else None}
    if as_json:
        typer.echo(json.dumps(summary))
    elif code == 0:
        typer.echo(f"{outcome}: {summary['steps']} RL steps; held-out accuracy {summary['accuracyBefore']} → "
                   f"{summary['accuracyAfter']}. Step log: {run / STEPS_FILE}")
    else:
        typer.echo(f"{outcome}. Controller log: {log}", err=True)
    return 130 if interrupted else 0 if code == 0 else 2 if code == 2 else 1
