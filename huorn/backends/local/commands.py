"""Command lines and files of a local run: the store, the torchrun agents, the run config.

Backends may not import huorn.runtime (the import contracts keep the control plane and the pod
apart), so the flags below follow the runtime's documented launcher (docs/runtime.md,
huorn/runtime/launcher.py) rather than calling it. Three choices matter, all measured by the
runtime's elastic tests: agents connect to a stand-alone store with `is_host=false`; each replica
has its own loopback address; and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 makes rank 0 publish a
fresh MASTER_ADDR/PORT every rendezvous round, which avoids the split-port hang.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huorn.graph import jobs, model

STEPS_FILE = "steps.jsonl"
ENDPOINTS_DIR = "endpoints"
CONFIG_FILE = "config.json"
STORE_PORT_FILE = "store.port"
MICROBATCHES_FILE = "microbatches.json"  # huorn.runtime.microbatches.CONTROL_FILE: S2 counts


@dataclass(frozen=True)
class ElasticTuning:
    """How fast a local gang notices changes; see notes/torchrun-elastic.md for what each costs."""

    monitor_interval: float = 0.5
    last_call_timeout: int = 2
    join_timeout: int = 300
    close_timeout: int = 10
    keep_alive_interval: int = 1
    keep_alive_max_attempt: int = 3
    max_restarts: int = 100


def replica_address(ordinal: int) -> str:
    """127.0.0.2, 127.0.0.3, ...: Linux routes all of 127/8 to loopback, so each replica looks
    like its own host to the rendezvous, as pods do."""
    return f"127.0.0.{2 + ordinal % 250}"


def build_store_command(host: str, port_file: Path, python: str = sys.executable) -> list[str]:
    return [python, "-m", "huorn.runtime.store", "--host", host, "--port", "0", "--port-file", str(port_file)]


def build_agent_command(
    config_path: Path,
    trainer: model.Vertex,
    rdzv_endpoint: str,
    run_id: str,
    local_addr: str,
    tuning: ElasticTuning,
    python: str = sys.executable,
) -> list[str]:
    conf = ",".join(
        [
            "is_host=false",
            f"last_call_timeout={tuning.last_call_timeout}",
            f"join_timeout={tuning.join_timeout}",
            f"close_timeout={tuning.close_timeout}",
            f"keep_alive_interval={tuning.keep_alive_interval}",
            f"keep_alive_max_attempt={tuning.keep_alive_max_attempt}",
        ]
    )
    return [
        python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={trainer.min_replicas}:{trainer.max_replicas}",
        # One replica is one whole pipeline: torchrun numbers a node's workers consecutively, which
        # is the runtime's replica-major layout, and a resize adds or removes whole pipelines.
        f"--nproc-per-node={int(trainer.params.get('pipelineStages', 1))}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={conf}",
        f"--monitor-interval={tuning.monitor_interval}",
        f"--max-restarts={tuning.max_restarts}",
        f"--local-addr={local_addr}",
        "-m",
        "huorn.runtime.train",
        "--config",
        str(config_path),
    ]


def build_agent_env(instance: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "HUORN_REPLICA": instance,
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            "LOGLEVEL": env.get("LOGLEVEL", "INFO"),
        }
    )
    env.update(extra or {})
    return env


def build_run_config(
    job_name: str, trainer: model.Vertex, run_dir: Path, checkpoint_dir: Path, step_limit: int | None
) -> dict[str, Any]:
    """The runtime's resolved config (docs/runtime.md) for the trainer vertex as it is now."""
    config: dict[str, Any] = {
        "jobName": job_name,
        "spec": jobs.build_training_spec(trainer),
        "runDir": str(run_dir),
        "checkpointDir": str(checkpoint_dir),
        "telemetryHost": "127.0.0.1",
        "telemetryPort": 0,
        "device": "cpu",
    }
    if step_limit is not None:
        config["stepLimit"] = step_limit
    return config


def write_json_atomically(path: Path, payload: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.tmp")
    scratch.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(scratch, path)
    return path
