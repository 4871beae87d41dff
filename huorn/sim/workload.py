"""Simulator inputs: the OpenB pod and node lists, scaled to N GPUs, and the job catalogue.

Rules (each a documented choice, see docs/scheduling.md):

- Training jobs are the pods with qos BE or Burstable and num_gpu ≥ 1 (as the trace README
  suggests); LS and Guaranteed pods are services, whose role the inference virtual cluster and the
  GenAI QPS series play. Pods with num_gpu = 0 use no GPU and are left out. A pod with a shared GPU
  (gpu_milli < 1000) asks for one whole GPU, since Huorn schedules whole devices.
- A job's work is what its pod did in the trace: duration (deletion − creation) at its requested
  GPUs, run at the family's base batch. Every policy has to do the same work.
- Scaling to N GPUs: nodes are drawn (seeded) from the node list until they hold N GPUs; training
  pods are kept with probability N/1024 (all of them at 1,024 GPUs). Arrivals are compressed by
  one factor so that the offered training load equals `load` × the training GPUs: the trace spans
  40 days of a 6,000-GPU cluster, which at 1,024 GPUs would leave the GPUs nearly idle and every
  policy equal.
- The catalogue assigns each job a model family by a hash of its name (so the rule is stable
  across seeds and subsets): 8-GPU pods are large language models (8 GPUs per replica); others are
  CNN 35 %, transformer 35 %, recommender 15 %, MoE 10 %, and the CPU-measured tiny transformer 5 %.
  Each job's true curve is its family's Pollux curve with every parameter perturbed by a seeded
  log-normal factor (σ = 0.3), so a model has something to learn beyond the family prior.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from huorn.scheduler import perfmodel

POD_COLUMNS = ("name", "num_gpu", "gpu_milli", "qos", "creation_time", "deletion_time")
NODE_COLUMNS = ("sn", "gpu")
FULL_TRACE_GPUS = 1024


class TraceError(ValueError):
    """A trace CSV is malformed; the message names the file, the line and the column."""


@dataclass(frozen=True)
class Family:
    name: str
    params: perfmodel.PolluxParams  # true step-time curve (seconds) on one GPU
    base_batch: float
    max_local_batch: float
    noise_scale: float  # gradient noise scale at the start; it grows as training proceeds
    restart_seconds: float
    checkpoint_seconds: float
    gpus_per_replica: int = 1
    max_scale: int = 8  # max replicas = requested × this (capped at 64)


FAMILIES: dict[str, Family] = {
    "cnn": Family("cnn", perfmodel.PolluxParams(0.01, 0.002, 0.02, 0.002, 0.08, 0.008, 3.0),
                  128, 512, 2000, 40, 5),
    "transformer": Family("transformer", perfmodel.PolluxParams(0.02, 0.004, 0.05, 0.004, 0.2, 0.02, 2.0),
                          32, 128, 800, 60, 10),
    "recommender": Family("recommender", perfmodel.PolluxParams(0.01, 0.0005, 0.03, 0.003, 0.15, 0.015, 1.5),
                          1024, 8192, 4000, 30, 5),
    "moe": Family("moe", perfmodel.PolluxParams(0.03, 0.003, 0.08, 0.006, 0.4, 0.04, 1.5),
                  64, 256, 600, 90, 20),
    # Fitted from tests/data/ddp_step_times.csv (benchmarks/measure_step_times.py, CPU DDP over gloo).
    "transformer-tiny": Family("transformer-tiny",
                               perfmodel.PolluxParams(0.00139, 0.00208, 0.00396, 0.00407, 0.01, 0.005, 1.0),
                               8, 64, 200, 20, 2),
    "llm": Family("llm", perfmodel.PolluxParams(0.2, 0.08, 0.1, 0.01, 0.6, 0.06, 2.0),
                  16, 32, 300, 180, 30, gpus_per_replica=8, max_scale=4),
}
MIX = (("cnn", 0.35), ("transformer", 0.35), ("recommender", 0.15), ("moe", 0.10), ("transformer-tiny", 0.05))
PRIOR_FAMILY = {"llm": "transformer"}  # the family prior a scheduler starts an llm job from


@dataclass
class TrainingJob:
    name: str
    arrival: float
    requested_gpus: int
    family: Family
    truth: perfmodel.PolluxParams
    noise_scale: float
    min_replicas: int
    max_replicas: int
    requested_replicas: int
    work: float  # base-batch samples to process
    duration: float  # seconds it ran in the trace at its requested GPUs
    # The total work its spec declares (steps or tokens), as a multiple of `work`; None: the spec
    # declares none. Huorn's JCT terms read the declaration, never `work` itself. 1: exact.
    declared_factor: float | None = 1.0


@dataclass(frozen=True)
class Node:
    name: str
    gpus: int
    model: str


def _rows(path: Path, columns: tuple[str, ...]) -> list[dict[str, str]]:
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # -sig: a BOM is no part of a column's name
    except UnicodeDecodeError as error:
        raise TraceError(f"{path}: not UTF-8 text (byte {error.start}); expected a CSV with columns "
                         f"{list(columns)}") from None
    except OSError as error:
        raise TraceError(f"{path}: cannot read it ({error.strerror})") from None
    reader = csv.DictReader(io.StringIO(text, newline=""))
    if reader.fieldnames is not None:
        reader.fieldnames = [name.strip() for name in reader.fieldnames]
    missing = [c for c in columns if c not in (reader.fieldnames or [])]
    if missing:
        raise TraceError(f"{path}: column {missing[0]!r} is missing; expected columns {list(columns)}")
    return list(reader)


def _int(path: Path, line: int, row: dict[str, str], column: str, default: int | None = None) -> int:
    value = (row.get(column) or "").strip()
    if not value and default is not None:
        return default
    try:
        return int(float(value))
    except (ValueError, OverflowError):  # OverflowError: inf or 1e400, which no count can be
        raise TraceError(f"{path}:{line}: column {column!r} must be a finite number, got {value!r}") from None


def _unique(path: Path, rows: list[dict[str, str]], column: str) -> None:
    """Refuse a name that repeats: the simulator keys jobs and nodes by name, and a repeat ended
    in an internal error that named no file, line or column."""
    first: dict[str, int] = {}
    for i, r in enumerate(rows):
        name = r[column]
        if name in first:
            raise TraceError(f"{path}:{i + 2}: column {column!r} value {name!r} repeats line {first[name]}; "
                             "names must be unique")
        first[name] = i + 2


def load_nodes(path: Path, gpus: int, seed: int) -> list[Node]:
    """Nodes drawn from the node list until they hold exactly `gpus` GPUs (the last one trimmed)."""
    rows = _rows(path, NODE_COLUMNS)
    _unique(path, rows, "sn")
    nodes = [Node(r["sn"], _int(path, i + 2, r, "gpu"), r.get("model", "")) for i, r in enumerate(rows)]
    nodes = [n for n in nodes if n.gpus > 0]
    order = np.random.default_rng(seed).permutation(len(nodes))
    chosen: list[Node] = []
    total = 0
    for i in order:
        if total >= gpus:
            break
        n = nodes[i]
        take = min(n.gpus, gpus - total)
        chosen.append(Node(n.name, take, n.model))
        total += take
    if total < gpus:
        raise TraceError(f"{path}: holds {total} GPUs, fewer than the {gpus} asked (--gpus)")
    return chosen


def _unit(name: str, salt: str) -> float:
    digest = hashlib.sha256(f"{salt}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _family_of(name: str, gpus: int) -> Family:
    if gpus >= 8:
        return FAMILIES["llm"]
    u = _unit(name, "family")
    for fam, share in MIX:
        if u < share:
            return FAMILIES[fam]
        u -= share
    return FAMILIES[MIX[-1][0]]


# The most that _compression compresses arrivals by. Compressing more offers more load, but only up
# to a bound (every arrival at once, each job counted over a window that shrinks with them), so a
# load above what this factor offers is not reached: most_offered_load says how much is.
MAX_COMPRESSION = 1e5


def _offered_load(raw: list[tuple[int, int, int, str]], train_gpus: int) -> Callable[[float], float]:
    """The offered load over the arrival window, as a function of the compression factor.

    Offered load counts each job's GPU-seconds only up to the window's end, since a 20-hour job
    arriving at the end of a 6-hour window does not load that window.
    """
    if train_gpus < 1:  # a load per training GPU of none is a division by zero (engine.split_cluster)
        raise ValueError(f"train_gpus must be >= 1, got {train_gpus}")
    arrive = np.array([a for a, _, _, _ in raw], dtype=float)
    arrive -= arrive[0]
    dur = np.array([d for _, d, _, _ in raw], dtype=float)
    gpus = np.array([g for _, _, g, _ in raw], dtype=float)
    span = max(arrive[-1], 1.0)

    def offered(c: float) -> float:
        window = span / c
        return float(np.sum(gpus * np.minimum(dur, window - arrive / c)) / (train_gpus * window))

    return offered


def _compression(raw: list[tuple[int, int, int, str]], train_gpus: int, load: float) -> float:
    """The factor that makes the offered load over the arrival window equal `load` (bisection), or
    MAX_COMPRESSION where the trace cannot offer that much."""
    offered = _offered_load(raw, train_gpus)
    lo, hi = 1.0, MAX_COMPRESSION
    if offered(lo) >= load:
        return lo
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if offered(mid) < load else (lo, mid)
    return hi


def declared_factor(name: str, seed: int, error: float, undeclared_share: float) -> float | None:
    """How far a job's declared total work is from the truth, as a factor; None: not declared.

    The factor is log-normal with σ `error` (0: exact) and a share `undeclared_share` of jobs
    declares nothing. Both are drawn from the job's name and the seed, so every policy sees the
    same declarations and a run is reproducible.
    """
    if undeclared_share > 0 and _unit(name, f"undeclared:{seed}") < undeclared_share:
        return None
    if error == 0:
        return 1.0
    u = min(max(_unit(name, f"declared:{seed}"), 1e-12), 1 - 1e-12)
    return math.exp(error * statistics.NormalDist().inv_cdf(u))


def _training_pods(path: Path, gpus: int, seed: int) -> list[tuple[int, int, int, str]]:
    """(creation time, duration, GPUs, name) of the training pods kept for `gpus` GPUs, by arrival."""
    rows = _rows(path, POD_COLUMNS)
    _unique(path, rows, "name")
    rng = np.random.default_rng(seed)
    keep = min(1.0, gpus / FULL_TRACE_GPUS)
    raw = []
    training = 0  # before sampling: a small trace can have some and keep none
    for i, r in enumerate(rows):
        line = i + 2
        n_gpu = _int(path, line, r, "num_gpu")
        if r["qos"] not in ("BE", "Burstable") or n_gpu < 1:
            continue
        training += 1
        if rng.random() >= keep:
            continue
        created = _int(path, line, r, "creation_time")
        deleted = _int(path, line, r, "deletion_time", default=created + 1)
        if deleted < created:
            raise TraceError(f"{path}:{line}: column 'deletion_time' ({deleted}) is before creation_time")
        raw.append((created, max(1, deleted - created), n_gpu, r["name"]))
    if not training:
        raise TraceError(f"{path}: no training pods (qos BE or Burstable with num_gpu ≥ 1) to simulate")
    if not raw:
        raise TraceError(f"{path}: {training} training pod(s), none kept by sampling at --gpus {gpus} "
                         f"(each kept with probability {gpus}/{FULL_TRACE_GPUS}); use --gpus "
                         f"{FULL_TRACE_GPUS} or a larger trace")
    raw.sort()
    return raw


def most_offered_load(path: Path, gpus: int, train_gpus: int, seed: int) -> float:
    """The most training load that load_jobs can offer from this trace for `gpus` GPUs, of which
    `train_gpus` train (the same jobs: same seed). load_jobs runs a larger `load` at this one, so a
    caller that takes the load from a user refuses a larger one (huorn simulate --load)."""
    return _offered_load(_training_pods(path, gpus, seed), train_gpus)(MAX_COMPRESSION)


def load_jobs(path: Path, gpus: int, train_gpus: int, load: float, seed: int,
              elastic_range: int = 1, restart_cost: float = 1.0, work_estimate_error: float = 0.0,
              undeclared_share: float = 0.0) -> list[TrainingJob]:
    """Training jobs from an OpenB-format pod list, sampled and time-compressed for `gpus` GPUs.
    `elastic_range` multiplies every family's elastic range and the 64-replica cap (1: the
    documented rule), and `restart_cost` every family's restart time (1: the catalogue's); both
    exist only for sensitivity studies of what bounds goodput. `work_estimate_error` and
    `undeclared_share` make the declared totals wrong or absent (`declared_factor`), for the
    study of how much of the JCT gain survives that; 0 and 0 are exact declarations."""
    if elastic_range < 1:
        raise ValueError(f"elastic_range must be >= 1, got {elastic_range}")
    if restart_cost < 0:
        raise ValueError(f"restart_cost must be >= 0, got {restart_cost}")
    if work_estimate_error < 0:
        raise ValueError(f"work_estimate_error must be >= 0, got {work_estimate_error}")
    if not 0 <= undeclared_share <= 1:
        raise ValueError(f"undeclared_share must lie in [0, 1], got {undeclared_share}")
    raw = _training_pods(path, gpus, seed)
    compress = _compression(raw, train_gpus, load)
    start = raw[0][0]
    jobs = []
    for created, duration, n_gpu, name in raw:
        fam = _family_of(name, n_gpu)
        if restart_cost != 1.0:
            fam = dataclasses.replace(fam, restart_seconds=fam.restart_seconds * restart_cost)
        jrng = np.random.default_rng([seed, int(_unit(name, "curve") * 2**32)])
        truth = perfmodel.PolluxParams.from_array(
            fam.params.as_array() * np.exp(jrng.normal(0, 0.3, 7) * np.array([1, 1, 1, 1, 1, 1, 0])))
        req = max(1, n_gpu // fam.gpus_per_replica)
        local = max(1.0, fam.base_batch / req)
        nodes = math.ceil(req * fam.gpus_per_replica / 8)
        step = float(perfmodel.predict_step_time(truth, req, nodes, local))
        work = duration * req * local / step  # samples its trace run processed at the base batch
        noise = fam.noise_scale * float(jrng.lognormal(0, 0.3))
        jobs.append(TrainingJob(name, (created - start) / compress, n_gpu, fam, truth, noise,
                                1, min(64 * elastic_range, req * fam.max_scale * elastic_range), req, work,
                                float(duration),
                                declared_factor(name, seed, work_estimate_error, undeclared_share)))
    return jobs
