"""The resolved run configuration that `python -m huorn.runtime.train --config FILE` reads.

Backends (local and Kubernetes) write this file; the trainer reads nothing else, so the same
trainer runs under a laptop's process launcher and in a pod. It is JSON or YAML with camelCase
keys (snake_case accepted), and carries the TrainingJob spec verbatim in its wire form: the
trainer validates it with the same pydantic model as the API server, so a job that passed
admission cannot be read differently here. docs/runtime.md lists every field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, TypeVar

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from huorn.api import base, training
from huorn.models import config as model_config

FaultKind = Literal["slow-compute", "hang-compute", "hang-collective", "slow-comm", "slow-link"]
FAULTS_FILE = "faults.json"
STEPS_FILE = "steps.jsonl"
ENDPOINTS_DIR = "endpoints"
ConfigModel = TypeVar("ConfigModel", bound=BaseModel)


class Fault(base.ApiModel):
    """One injected fault. It applies to the ranks it selects from `fromStep` until `untilStep`."""

    kind: FaultKind
    from_step: int = Field(default=0, ge=0, description="First global step (0-based) it applies to.")
    until_step: int | None = Field(default=None, ge=0, description="First step it no longer applies to.")
    ms: float = Field(default=0.0, ge=0, description="Delay per step for slow-compute, per collective for "
                      "slow-comm, per message for slow-link.")
    factor: float | None = Field(default=None, gt=1, description="slow-compute instead of ms: the rank "
                                 "computes this many times slower than it measures itself computing "
                                 "(a throttled device), so the slowdown keeps its size on any host; "
                                 "whole steps or perMicroBatch, not perLayer.")
    per_micro_batch: bool = Field(default=False, description="slow-compute: delay every micro-batch the "
                                  "rank computes (a slower device), not once per step.")
    per_layer: bool = Field(default=False, description="slow-compute: delay every decoder layer's forward "
                            "on the rank (a slower device whose cost moves with the layers it holds, "
                            "as in a pipeline stage), not once per step.")
    direction: Literal["forward", "backward"] | None = Field(
        default=None, description="slow-link: which of the rank's outgoing pipeline links is slowed, "
        "forward (activations to the next stage) or backward (gradients to the previous stage); "
        "None: both.")
    rank: int | None = Field(default=None, ge=0, description="Global rank it hits; None: every rank.")
    replica: str | None = Field(default=None, description="HUORN_REPLICA of the process it hits.")

    @model_validator(mode="after")
    def _check_delay(self) -> Fault:
        if self.factor is not None:
            if self.kind != "slow-compute":
                raise ValueError(f"fault {self.kind!r}: factor applies to slow-compute only; use ms")
            if self.ms > 0:
                raise ValueError("fault slow-compute: ms and factor exclude each other; set one of them")
            if self.per_layer:
                raise ValueError("fault slow-compute: factor applies to whole steps or perMicroBatch, "
                                 "not perLayer (a layer's backward is not timed apart); use ms")
        elif self.kind.startswith("slow-") and self.ms <= 0:
            hint = (" or factor > 1, e.g. {kind: slow-compute, factor: 2}" if self.kind == "slow-compute"
                    else "")
            raise ValueError(f"fault {self.kind!r} needs ms > 0, e.g. {{kind: {self.kind}, ms: 200}}{hint}")
        if self.per_layer and self.per_micro_batch:
            raise ValueError("fault: perLayer and perMicroBatch exclude each other; set one of them")
        if (self.per_layer or self.per_micro_batch) and self.kind != "slow-compute":
            raise ValueError(f"fault {self.kind!r}: perLayer and perMicroBatch apply to slow-compute only")
        if self.direction is not None and self.kind != "slow-link":
            raise ValueError(f"fault {self.kind!r}: direction applies to slow-link only (the pipeline's "
                             "point-to-point links); remove it or use kind slow-link")
        return self

    def applies(self, step: int, rank: int, replica: str | None) -> bool:
        return (
            step >= self.from_step
            and (self.until_step is None or step < self.until_step)
            and (self.rank is None or self.rank == rank)
            and (self.replica is None or self.replica == replica)
        )


class RunConfig(base.ApiModel):
    job_name: str = Field(min_length=1, description="Name of the TrainingJob (labels, metrics).")
    spec: training.TrainingJobSpec
    run_dir: Path = Field(description="Step log, telemetry endpoint files and the fault control file.")
    control_dir: Path | None = Field(default=None, description="Where the control plane's run-time "
                                     "files appear (remediation S2's micro-batch counts); default run_dir. "
                                     "In a pod: the job's ConfigMap volume, which the operator updates.")
    checkpoint_dir: Path | None = Field(default=None, description="Default: spec.checkpoint.path.")
    data_dir: Path | None = Field(default=None, description="Corpus cache; default $HUORN_DATA_DIR.")
    telemetry_host: str = Field(default="0.0.0.0", description="Address the telemetry server binds.")
    telemetry_port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port per rank; "
                                "otherwise port + local rank.")
    telemetry_history: int = Field(default=256, ge=1, le=100_000, description="Steps kept for /telemetry.")
    step_limit: int | None = Field(default=None, ge=1, description="Overrides spec.optimization.steps.")
    validation_interval: int = Field(default=0, ge=0, description="Validation loss every N steps; 0: off.")
    validation_batches: int = Field(default=2, ge=1, le=1000)
    collective_timeout_s: float = Field(default=120.0, gt=0, description="Gloo/NCCL timeout per collective.")
    peer_timeout_s: float = Field(default=15.0, gt=1, description=(
        "In place: a member whose heartbeat stands still this long is dead, and the gang regroups "
        "without it (huorn.runtime.peer_watch)."))
    keep_checkpoints: int = Field(default=3, ge=1, le=1000, description="Complete checkpoints kept.")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    pipeline_replan_every: int = Field(default=5, ge=1, le=100_000,
                                       description="Steps between adaptive-k decisions (schedule auto).")
    stage_layers: list[int] | None = Field(default=None, description="Layers per pipeline stage, e.g. "
                                           "[3, 1] (remediation S3); default: balanced by count.")
    faults: list[Fault] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_batch(self) -> RunConfig:
        opt = self.spec.optimization
        if opt.global_batch % opt.micro_batch:
            raise ValueError(
                f"spec.optimization.globalBatch ({opt.global_batch}) must be a multiple of microBatch "
                f"({opt.micro_batch}); change one of them"
            )
        stages = self.spec.parallelism.pipeline_stages
        split, layers = self.stage_layers, self.spec.model.layers
        if split is not None and (len(split) != stages or min(split) < 1 or sum(split) != layers):
            example = [layers - stages + 1] + [1] * (stages - 1)
            raise ValueError(f"stageLayers {split} must have one entry per pipeline stage ({stages}), each "
                             f">= 1, summing to spec.model.layers ({layers}); e.g. {example}")
        if self.step_limit is None and opt.steps is None and opt.tokens is None:
            raise ValueError("set spec.optimization.steps or spec.optimization.tokens (or the run "
                             "config's stepLimit): the trainer needs to know when to stop")
        return self

    @property
    def checkpoint_root(self) -> Path:
        return self.checkpoint_dir or Path(self.spec.checkpoint.path)

    def total_steps(self) -> int:
        """Optimizer steps of the whole run; the learning-rate schedule spans exactly these."""
        if self.step_limit is not None:
            return self.step_limit
        return training.declared_steps(self.spec)

    def checkpoint_interval_s(self) -> float | None:
        """Seconds between time-based checkpoints, or None when intervalSteps governs."""
        if self.spec.checkpoint.interval_steps is not None:
            return None
        return base.parse_duration(self.spec.checkpoint.interval)


def build_model_config(spec: training.ModelSpec) -> model_config.ModelConfig:
    """Translate a TrainingJob's model section into the models package's plain dataclass."""
    moe = None
    if spec.moe is not None:
        try:
            moe = model_config.MoEConfig(
                experts=spec.moe.experts, prototypes=spec.moe.prototypes, top_k=spec.moe.top_k,
                capacity_factor=spec.moe.capacity_factor, balance_loss_weight=spec.moe.balance_loss_weight,
            )
        except model_config.ConfigError as error:
            raise ValueError(f"spec.model.{error}") from error
    try:
        return model_config.ModelConfig(
            layers=spec.layers, width=spec.width, heads=spec.heads, kv_heads=spec.kv_heads,
            vocabulary=spec.vocabulary, context=spec.context, kv_sharing=spec.kv_sharing.value, moe=moe,
        )
    except model_config.ConfigError as error:
        raise ValueError(f"spec.model.{error}") from error


def read_config(path: Path, model: type[ConfigModel], what: str = "run config") -> ConfigModel:
    """Read and validate a process's config file (JSON, or YAML); every error is a ValueError that
    names the file and, for a bad value, the field, which the entry points print with exit 2."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"cannot read {what} {path}: {error.strerror}") from error
    except UnicodeDecodeError as error:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {error.start})") from error
    try:
        raw = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as error:
        raise ValueError(f"{what} {path} is not valid JSON/YAML: {error}") from error
    if not isinstance(raw, dict):
        raise ValueError(f"{what} {path} must be a mapping, got {type(raw).__name__}")
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in error.errors()
        )
        raise ValueError(f"{what} {path} is invalid: {problems}") from error


def load_run_config(path: Path) -> RunConfig:
    """Read and validate a run config; errors name the file and the offending field."""
    return read_config(path, RunConfig)


def write_run_config(config: RunConfig, path: Path) -> Path:
    """Write `config` as JSON (what backends call); the spec goes out in its wire form."""
    payload = config.model_dump(by_alias=True, exclude_none=True, mode="json")
    payload["spec"] = config.spec.to_wire()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")
    return Path(path)


def read_faults_file(run_dir: Path) -> list[Fault] | None:
    """Faults from the control file a harness may (re)write while the job runs: `{"faults": [...]}`
    or a bare list. None when it is missing, mid-write or malformed, so a harness cannot crash
    the trainer."""
    path = Path(run_dir) / FAULTS_FILE
    try:
        raw = json.loads(path.read_text())
        items = raw.get("faults", []) if isinstance(raw, dict) else raw
        return [Fault.model_validate(item) for item in items]
    except (OSError, ValueError, ValidationError, AttributeError, TypeError):
        return None
