"""`huorn run` for an InferenceJob: one serving replica on this machine, until Ctrl-C.

The replica is `python -m huorn.runtime.serve` in a process of its own (the CLI stays light,
and Ctrl-C reaches the CLI alone, which stops the server with one SIGINT). It prints where the
server listens once the model is loaded (and quantised, if the spec says so).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import typer

from huorn.api import kinds
from huorn.runtime import launcher


def run_serve(job: kinds.InferenceJob, directory: Path, port: int, as_json: bool,
              duration: float | None = None) -> int:
    """Serve until Ctrl-C (or `duration` seconds); the exit code huorn run gives."""
    run = directory / "run"
    config = directory / "serve-config.json"
    config.write_text(json.dumps({"jobName": job.metadata.name, "spec": job.spec.to_wire(),
                                  "host": "127.0.0.1", "port": port, "runDir": str(run)}, indent=1))
    log = directory / "serve.log"
    with open(log, "wb") as out:
        command = launcher.build_serve_command(config)
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    ready = run / "serve.json"
    started = time.monotonic()
    announced = False
    try:
        while process.poll() is None:
            if not announced and ready.exists():
                info = json.loads(ready.read_text())
                url = f"http://127.0.0.1:{info['port']}"
                typer.echo(json.dumps({"url": url, **info}) if as_json else
                           f"serving {job.metadata.name} at {url}/v1/completions "
                           f"({info['quantization']}); Ctrl-C stops it")
                announced = True
            if duration is not None and time.monotonic() - started > duration:
                process.send_signal(signal.SIGTERM)
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        process.send_signal(signal.SIGINT)
    code = process.wait()
    if code == 2:
        errors = [line for line in log.read_text().splitlines() if line.startswith("error:")]
        typer.echo(errors[-1] if errors else f"the server refused the job; see {log}", err=True)
        return 2
    return 0 if code == 0 else 1
