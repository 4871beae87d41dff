"""Simulator inputs: the OpenB pod and node lists, scaled to N GPUs, and the job catalogue.

Rules (each a documented choice, see docs/scheduling.md):

- Training jobs are the pods with qos BE or Burstable and num_gpu ≥ 1 (as the trace README
  suggests); LS and Guaranteed pods are services, whose role the inference virtual cluster and the
  GenAI QPS series play. Pods with num_gpu = 0 use no GPU and are left out. A pod with a shared GPU
  (num_gpu = 1, gpu_milli < 1000) asks for one whole GPU, since Huorn schedules whole devices, so
  gpu_milli is never read and not required. num_gpu is a whole count (a share goes in gpu_milli),
  and a pod of 8 GPUs or more asks for whole 8-GPU replicas.
- Times are in seconds. Every training pod needs both times; one that ran more than a year, or
  training arrivals spread over more than five years, is refused as a trace in milliseconds or
  nanoseconds (every row is checked before sampling, so a bad row fails at any cluster size).
- A job's work is what its pod did in the trace: duration (deletion − creation) at its requested
  GPUs, run at the family's base batch. Every policy has to do the same work.
- Scaling to N GPUs: nodes are drawn (seeded) from the node list until they hold N GPUs; training
  pods are kept with probability N/1024 (all of them at 1,024 GPUs; `Sample` says how many).
  Arrivals are compressed by one factor so that the offered training load equals `load` × the
  training GPUs: the trace spans 40 days of a 6,000-GPU cluster, which at 1,024 GPUs would leave
  the GPUs nearly idle and every policy equal.
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
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from huorn.scheduler import perfmodel

# gpu_milli is not among them: a shared GPU counts as one whole GPU, so nothing reads it
POD_COLUMNS = ("name", "num_gpu", "qos", "creation_time", "deletion_time")
NODE_COLUMNS = ("sn", "gpu")
FULL_TRACE_GPUS = 1024
TRAINING_QOS = ("BE", "Burstable")

# Times must be in seconds. The OpenB trace's longest training pod ran 19.6 days and its training
# arrivals span 40 days; a pod longer than a year, or arrivals spread over more than five years,
# is what a trace in milliseconds or nanoseconds looks like. Such a trace ran on 60-second ticks
# for hours or without end, or gave JCTs a thousand times too long.
YEAR_SECONDS = 365 * 86400
MAX_POD_SECONDS = YEAR_SECONDS
MAX_SPAN_SECONDS = 5 * YEAR_SECONDS
SECONDS_FIX = "times must be in seconds (divide milliseconds by 1e3, nanoseconds by 1e9)"


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
    # Values are stripped as names are: with ", " between values, "BE" read as " BE", no pod was
    # training and the trace was refused as having no training pods.
    reader = csv.DictReader(io.StringIO(text, newline=""), skipinitialspace=True)
    if reader.fieldnames is not None:
        reader.fieldnames = [name.strip() for name in reader.fieldnames]
    missing = [c for c in columns if c not in (reader.fieldnames or [])]
    if missing:
        raise TraceError(f"{path}: column {missing[0]!r} is missing; expected columns {list(columns)}")
    # a row longer than the header keeps its surplus as a list under None: no value of ours
    return [{k: v.strip() if isinstance(v, str) else v for k, v in row.items()} for row in reader]


def _int(path: Path, line: int, row: dict[str, str], column: str) -> int:
    value = (row.get(column) or "").strip()
    try:
        return int(float(value))
    except (ValueError, OverflowError):  # OverflowError: inf or 1e400, which no count can be
        raise TraceError(f"{path}:{line}: column {column!r} must be a finite number, got {value!r}") from None


def _gpu_count(path: Path, line: int, row: dict[str, str]) -> int:
    """num_gpu, a whole count: int(float()) made 0.5 a pod with no GPU and 1.5 a 1-GPU pod."""
    n = _int(path, line, row, "num_gpu")
    value = row["num_gpu"]
    if float(value) != n:  # finite: _int refused the rest
        raise TraceError(f"{path}:{line}: column 'num_gpu' must be a whole number of GPUs, got {value!r}; "
                         "a fraction of a GPU goes in gpu_milli with num_gpu=1 (e.g. 500 for half)")
    return n


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


@dataclass(frozen=True)
class Sample:
    """The training pods kept for a cluster size: `pods` are (creation time, duration, GPUs, name)
    by arrival, `training` the trace's training pods before sampling, each kept with probability
    `keep`. A caller tells the user how many were kept (huorn simulate), since the N/1024 rule
    applies to any trace."""

    pods: list[tuple[int, int, int, str]]
    training: int
    keep: float

    def compression(self, train_gpus: int, load: float) -> float:
        """The factor load_jobs compresses arrivals by for `load` on `train_gpus` training GPUs."""
        return _compression(self.pods, train_gpus, load)

    def offered_load(self, train_gpus: int, compression: float) -> float:
        """The training load offered over the arrival window once compressed by `compression`."""
        return _offered_load(self.pods, train_gpus)(compression)


def _pod_times(path: Path, line: int, row: dict[str, str]) -> tuple[int, int]:
    """A training pod's creation time and duration, checked: an empty deletion_time made a silent
    1-second job, and times in milliseconds or nanoseconds ran for hours (MAX_POD_SECONDS)."""
    created = _int(path, line, row, "creation_time")
    if not row.get("deletion_time"):
        raise TraceError(f"{path}:{line}: column 'deletion_time' is empty; a training pod needs the time "
                         "it ended (seconds, as creation_time) for its duration: fill it in or drop the row")
    deleted = _int(path, line, row, "deletion_time")
    if deleted < created:
        raise TraceError(f"{path}:{line}: column 'deletion_time' ({deleted}) is before creation_time")
    if (ran := deleted - created) > MAX_POD_SECONDS:
        raise TraceError(f"{path}:{line}: column 'deletion_time' ({deleted}) is {ran:.4g} after "
                         f"creation_time, {ran / YEAR_SECONDS:.3g} years if in seconds; "
                         f"{SECONDS_FIX}. A training pod longer than a year is refused")
    return created, max(1, deleted - created)


def _no_training_pods(path: Path, rows: list[dict[str, str]]) -> TraceError:
    """The error for a trace with no training pod, showing the qos values it holds: "be" or
    " BE" looked like a trace of services only."""
    seen = Counter(r["qos"] for r in rows)
    shown = ", ".join(f"{q!r} ({n})" for q, n in seen.most_common(8)) + (" ..." if len(seen) > 8 else "")
    return TraceError(f"{path}: no training pods (qos BE or Burstable, as written, with num_gpu ≥ 1) to "
                      f"simulate; column 'qos' holds {shown or 'no rows'}")


def sample_training_pods(path: Path, gpus: int, seed: int) -> Sample:
    """The training pods kept for `gpus` GPUs. Every training row is checked before its sampling
    draw (a bad row failed only at a size that kept it), with one draw per training row as ever,
    so the same seed keeps the same pods."""
    rows = _rows(path, POD_COLUMNS)
    _unique(path, rows, "name")
    rng = np.random.default_rng(seed)
    keep = min(1.0, gpus / FULL_TRACE_GPUS)
    per_replica = FAMILIES["llm"].gpus_per_replica
    raw = []
    training = 0  # before sampling: a small trace can have some and keep none
    first = last = (0, 0)  # (creation time, line) of the earliest and the latest training arrival
    for i, r in enumerate(rows):
        line = i + 2
        n_gpu = _gpu_count(path, line, r)
        if r["qos"] not in TRAINING_QOS or n_gpu < 1:
            continue
        if n_gpu >= per_replica and n_gpu % per_replica:
            raise TraceError(f"{path}:{line}: column 'num_gpu' is {n_gpu}: a pod of {per_replica} GPUs or "
                             f"more runs as {per_replica}-GPU replicas (an LLM), and {n_gpu} is not a whole "
                             f"number of them; give a multiple of {per_replica}")
        created, duration = _pod_times(path, line, r)
        if not training or created < first[0]:
            first = (created, line)
        if not training or created > last[0]:
            last = (created, line)
        training += 1
        if rng.random() >= keep:
            continue
        raw.append((created, duration, n_gpu, r["name"]))
    if not training:
        raise _no_training_pods(path, rows)
    if (span := last[0] - first[0]) > MAX_SPAN_SECONDS:
        raise TraceError(f"{path}:{last[1]}: column 'creation_time' ({last[0]}) is {span:.4g} after "
                         f"line {first[1]}'s, {span / YEAR_SECONDS:.3g} years if in seconds; "
                         f"{SECONDS_FIX}. Training arrivals spread over more than five years are refused")
    if not raw:
        raise TraceError(f"{path}: {training} training pod(s), none kept by sampling at --gpus {gpus} "
                         f"(each kept with probability {gpus}/{FULL_TRACE_GPUS}); use --gpus "
                         f"{FULL_TRACE_GPUS} or a larger trace")
    raw.sort()
    return Sample(raw, training, keep)


def most_offered_load(path: Path, gpus: int, train_gpus: int, seed: int) -> float:
    """The most training load that load_jobs can offer from this trace for `gpus` GPUs, of which
    `train_gpus` train (the same jobs: same seed). load_jobs runs a larger `load` at this one, so a
    caller that takes the load from a user refuses a larger one (huorn simulate --load)."""
    return sample_training_pods(path, gpus, seed).offered_load(train_gpus, MAX_COMPRESSION)


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
    sample = sample_training_pods(path, gpus, seed)
    raw = sample.pods
    compress = sample.compression(train_gpus, load)
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
