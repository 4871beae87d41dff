"""`huorn run` for an InferenceJob: serving replicas on this machine, until Ctrl-C.

Each replica is `python -m huorn.runtime.serve` in a process of its own (the CLI stays light,
and Ctrl-C reaches the CLI alone, which stops the servers with one SIGINT each). One replica
serves on `--port` itself. Several (`--replicas N`) each take a free port and the job's prefix
router (`python -m huorn.runtime.activator --replica ...`, what `routing.policy: prefix` runs in
a cluster) serves on `--port` in front of them: there is no Service here to spread requests, so
several replicas need that policy. It prints where to send requests once every replica has
loaded its model (and quantised it, if the spec says so).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import typer

from huorn.api import kinds
from huorn.cli.output import cannot_listen
from huorn.cli.stopping import shielded, start_in_own_session, wait_or_kill
from huorn.runtime import launcher

STOP_SECONDS = 120.0  # for a server to finish what it serves once told to stop
START_SECONDS = 600.0  # a replica that has not loaded its model by then is reported, and all stop


def _write_config(path: Path, job: kinds.InferenceJob, port: int, run: Path) -> Path:
    path.write_text(json.dumps({"jobName": job.metadata.name, "spec": job.spec.to_wire(),
                                "host": "127.0.0.1", "port": port, "runDir": str(run)}, indent=1))
    return path


def _announcement(path: Path) -> dict[str, Any] | None:
    """The facts a server or router wrote on listening, or None while it has not. A file being
    written is taken for one not yet there: a server older than the atomic write wrote it in two
    steps, and a poll in between read half a document."""
    try:
        facts = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return facts if isinstance(facts, dict) and "port" in facts else None


def refusal(job: kinds.InferenceJob, port: int, replicas: int) -> str | None:
    """What `huorn run` refuses before it keeps the previous run or starts anything."""
    if replicas > 1 and job.spec.routing.policy != "prefix":
        return (f"--replicas {replicas}: several local replicas are served behind the prefix router "
                "(there is no Service here to spread requests); set spec.routing.policy: prefix, or "
                "serve one replica")
    why = cannot_listen(port, "127.0.0.1") if port else None
    if why is not None:
        return f"--port {port}: cannot listen there ({why}); choose another, or --port 0"
    from huorn.runtime import checkpoint  # torch: only once an InferenceJob is to be served

    try:  # what the server would find only once started, after the run dir was kept aside
        checkpoint.resolve(Path(job.spec.model.checkpoint))
    except ValueError as error:
        return f"spec.model.checkpoint: {error}; train one first, or point it at one"
    return None


def run_serve(job: kinds.InferenceJob, directory: Path, port: int, as_json: bool,
              duration: float | None = None, replicas: int = 1) -> int:
    """Serve until Ctrl-C (or `duration` seconds); the exit code huorn run gives. The caller has
    checked `refusal` first."""
    if replicas == 1:
        servers = [(directory / "run", directory / "serve-config.json", directory / "serve.log", port)]
    else:
        servers = [(directory / f"replica-{i}" / "run", directory / f"replica-{i}" / "serve-config.json",
                    directory / f"replica-{i}" / "serve.log", 0) for i in range(replicas)]
    processes: list[tuple[subprocess.Popen, Path]] = []
    front: Path | None = None
    started = time.monotonic()
    announced = timed_out = cut_short = False
    try:
        for run, config, log, replica_port in servers:
            config.parent.mkdir(parents=True, exist_ok=True)
            _write_config(config, job, replica_port, run)
            processes.append((start_in_own_session(launcher.build_serve_command(config), log), log))
        while all(p.poll() is None for p, _ in processes):
            seen = [] if announced else [_announcement(run / "serve.json") for run, *_ in servers]
            infos = [info for info in seen if info is not None]
            if seen and len(infos) == len(servers):
                if replicas > 1 and front is None:
                    urls = [f"http://127.0.0.1:{info['port']}" for info in infos]
                    config = _write_config(directory / "router-config.json", job, port, directory / "run")
                    router = launcher.build_router_command(config, replicas=urls)
                    processes.append((start_in_own_session(router, directory / "router.log"),
                                      directory / "router.log"))
                    front = directory / "run" / "activator.json"
                routed_by = _announcement(front) if front is not None else infos[0]
                if routed_by is not None:
                    listening = routed_by["port"]
                    url = f"http://127.0.0.1:{listening}"
                    info = {**infos[0], "port": listening, "replicas": replicas}
                    routed = f", {replicas} replicas behind the prefix router" if replicas > 1 else ""
                    typer.echo(json.dumps({"url": url, **info}) if as_json else
                               f"serving {job.metadata.name} at {url}/v1/completions "
                               f"({info['quantization']}{routed}); Ctrl-C stops it")
                    announced = True
            if not announced and time.monotonic() - started > START_SECONDS:
                typer.echo(f"error: not serving after {START_SECONDS:g} s; see the logs in {directory}",
                           err=True)
                timed_out = True
                break
            if duration is not None and time.monotonic() - started > duration:
                # ending before anything was served is no success: no URL was ever printed
                cut_short = not announced
                if cut_short:
                    typer.echo(f"error: --serve-seconds {duration:g}: the time ran out before the model "
                               f"had loaded, so nothing was served; give it longer (see the logs in "
                               f"{directory})", err=True)
                break
            time.sleep(0.2)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM/SIGHUP (huorn.cli.stopping)
        for process, _ in processes:
            process.send_signal(signal.SIGINT)
    finally:
        # whatever ended the loop, no server outlives huorn run (they run in sessions of their own)
        with shielded():
            for process, _ in processes:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            codes = [(wait_or_kill(process, STOP_SECONDS), log) for process, log in processes]
    for code, log in codes:
        if code == 2:
            lines = log.read_text().splitlines()
            errors = [line for line in lines if line.startswith(("error:", "activator:"))]
            typer.echo(errors[-1] if errors else f"the server refused the job; see {log}", err=True)
            return 2
    ended = [(code, log) for code, log in codes if code not in (0, -signal.SIGTERM, -signal.SIGINT)]
    for code, log in ended:
        typer.echo(f"error: {log.stem} exited with code {code}; see {log}", err=True)
    return 0 if not ended and not timed_out and not cut_short else 1
