"""Command lines and files of a local run: the store, the replicas (torchrun agents, or trainers
that resize in place), the run config.

The agents and the store are started with the runtime's own launcher (huorn.runtime.launcher,
the one module of the runtime that the control plane may import; a contract in pyproject.toml
says so), so a local replica and a pod run exactly the same command. Three choices matter, all
measured by the runtime's elastic tests: agents connect to a stand-alone store with
`is_host=false`; each replica has its own loopback address; and
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 makes rank 0 publish a fresh MASTER_ADDR/PORT every
rendezvous round, which avoids the split-port hang.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from huorn.api import files
from huorn.graph import jobs, model
from huorn.runtime import launcher

STEPS_FILE = "steps.jsonl"
ENDPOINTS_DIR = "endpoints"
CONFIG_FILE = "config.json"
STORE_PORT_FILE = "store.port"
MICROBATCHES_FILE = "microbatches.json"  # huorn.runtime.microbatches.CONTROL_FILE: S2 counts
BATCH_FILE = "batch.json"  # huorn.runtime.batch_control.CONTROL_FILE: the goodput allocator's batch


# What an agent keeps of the backend's stop grace for itself: once its workers are gone it still
# has to exit before the backend SIGKILLs its tree.
AGENT_STOP_MARGIN_S = 10.0


def agent_shutdown_timeout(stop_grace_s: float) -> int:
    """Seconds a torchrun agent gives its workers to stop (torch's own default is 30 s, which cut
    a slow step's agreed checkpoint short while the backend would have waited `stop_grace_s`):
    the backend's grace less a margin (at most a quarter of it) for the agent's own exit."""
    return max(1, int(stop_grace_s - min(AGENT_STOP_MARGIN_S, stop_grace_s / 4)))


def replica_address(ordinal: int) -> str:
    """Each replica looks like its own host to the rendezvous, as pods do."""
    return launcher.replica_address(ordinal % 250)


def build_eval_command(config_path: Path, checkpoint: Path, python: str = sys.executable) -> list[str]:
    return launcher.build_eval_command(config_path, checkpoint, python)


def build_store_command(host: str, port_file: Path, python: str = sys.executable, port: int = 0) -> list[str]:
    """`port` 0: a free one; a store started again takes its old port, which the gang's
    members hold (they re-form on it, huorn.runtime.train.Trainer.count_joiners)."""
    return launcher.build_store_command(host, port, port_file, python)


def build_agent_command(
    config_path: Path,
    trainer: model.Vertex,
    rdzv_endpoint: str,
    run_id: str,
    local_addr: str,
    tuning: Mapping[str, Any] | None = None,
    python: str = sys.executable,
) -> list[str]:
    """One replica's command: a torchrun agent, or, when the trainer vertex resizes in place, the
    trainer itself in the same rendezvous (no agent, so a membership change keeps its process and
    state). `tuning` overrides launcher.ElasticSettings' knobs; the agent's own (monitor interval,
    restarts) mean nothing in place.

    One replica is one whole pipeline: torchrun numbers a node's workers consecutively, which is
    the runtime's replica-major layout, and a resize adds or removes whole pipelines. In place, a
    replica is one process (the API's rule and the compiler's `auto` make sure of it)."""
    settings = launcher.ElasticSettings(
        min_nodes=trainer.min_replicas,
        max_nodes=trainer.max_replicas,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=run_id,
        nproc_per_node=int(trainer.params.get("pipelineStages", 1)),
        local_addr=local_addr,
        **dict(tuning or {}),
    )
    if jobs.resizes_in_place(trainer):
        return launcher.build_in_place_command(config_path, settings, python)
    return launcher.build_agent_command(config_path, settings, python)


def build_agent_env(instance: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = launcher.build_agent_env(instance)
    env.setdefault("LOGLEVEL", "INFO")
    env.update(extra or {})
    return env


def absolute_paths(spec: dict[str, Any], base: Path) -> dict[str, Any]:
    """`spec` (a TrainingJobSpec wire dict) with its relative filesystem paths made absolute
    against `base`, the directory `huorn run` was started in. They were checked there (a source's
    corpus, before anything started), but trainers and eval processes run in the run directory,
    where the same relative path names something else or nothing, and the runtime then refused
    its config after the gang had formed. `spec` itself is left as it was (it is the graph's)."""

    def absolute(path: str) -> str:
        return path if Path(path).is_absolute() else str(base / path)

    out = dict(spec)
    data = spec.get("data") or {}
    if any(source.get("path") for source in data.get("sources", [])):
        out["data"] = {**data, "sources": [
            {**source, "path": absolute(source["path"])} if source.get("path") else source
            for source in data["sources"]]}
    task = dict(spec.get("task") or {})
    if task.get("initCheckpoint"):
        task["initCheckpoint"] = absolute(task["initCheckpoint"])
    if (task.get("teacher") or {}).get("checkpoint"):
        task["teacher"] = {**task["teacher"], "checkpoint": absolute(task["teacher"]["checkpoint"])}
    if task:
        out["task"] = task
    return out


def build_run_config(
    job_name: str, trainer: model.Vertex, run_dir: Path, checkpoint_dir: Path, step_limit: int | None,
    base_dir: Path | None = None,
) -> dict[str, Any]:
    """The runtime's resolved config (docs/runtime.md) for the trainer vertex as it is now;
    relative paths in the spec are made absolute against `base_dir` (default: the current
    directory), since the runtime runs in `run_dir` (absolute_paths says why)."""
    config: dict[str, Any] = {
        "jobName": job_name,
        "spec": absolute_paths(jobs.build_training_spec(trainer), base_dir or Path.cwd()),
        "runDir": str(run_dir),
        "checkpointDir": str(checkpoint_dir),
        "telemetryHost": "127.0.0.1",
        "telemetryPort": 0,
        "device": "cpu",
    }
    if step_limit is not None:
        config["stepLimit"] = step_limit
    if trainer.params.get("stageLayers"):
        config["stageLayers"] = [int(n) for n in trainer.params["stageLayers"]]  # remediation S3
    return config


def write_json_atomically(path: Path, payload: Any) -> Path:
    """The runtime reads these files while they may be rewritten (huorn.api.files says why)."""
    return files.write_text_atomically(path, json.dumps(payload, indent=2) + "\n")
