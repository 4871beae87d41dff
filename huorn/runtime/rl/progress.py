"""The RL controller's progress over HTTP: `GET /progress` answers the latest step as JSON.

The operator polls it on the head pod, as it polls a trainer's /telemetry, and writes it into
the RLJob's status (`kubectl get rljobs` shows the step and the mean reward). It is state, not a
log: what the controller logged last of each kind, so a poll that misses steps loses nothing.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Progress:
    """What the controller has done so far, safe to read from the server's threads."""

    def __init__(self, job: str, steps: int) -> None:
        self._lock = threading.Lock()
        self._state: dict[str, Any] = {"job": job, "steps": steps, "step": 0}

    def record(self, event: dict[str, Any]) -> None:
        """Fold one step-log record in: `rl` steps, `eval` accuracy, `checkpoint`s, `done`."""
        kind = event.get("event")
        with self._lock:
            if kind == "start":
                self._state["step"] = int(event.get("resumed_from", 0))
                self._state["attempt"] = int(event.get("attempt", 1))  # the head's runs of the controller
            elif kind == "rl":
                self._state["step"] = int(event["step"]) + 1  # steps finished, as a checkpoint counts them
                if event.get("reward_mean") is not None:
                    self._state["rewardMean"] = float(event["reward_mean"])
                if event.get("rollout_workers") is not None:
                    self._state["rolloutWorkers"] = int(event["rollout_workers"])
                if event.get("role_replicas") is not None:  # the actors each role ran the step on
                    self._state["roleReplicas"] = {str(k): int(v) for k, v in event["role_replicas"].items()}
            elif kind == "eval":
                self._state["evalAccuracy"] = float(event["accuracy"])
            elif kind == "checkpoint":
                self._state["lastCheckpoint"] = {"step": int(event["step"]),
                                                 "path": str(event.get("path", ""))}
            elif kind == "done":
                self._state["done"] = True

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return json.loads(json.dumps(self._state))


class ProgressServer:
    """`/progress` on host:port (port 0 picks one) from a daemon thread; close() stops it."""

    def __init__(self, progress: Progress, host: str, port: int) -> None:
        state = progress

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's name
                if self.path.split("?")[0] != "/progress":
                    self.send_error(404, "only /progress is served here")
                    return
                body = json.dumps(state.snapshot()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return  # one poll every few seconds is no news

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="rl-progress", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
