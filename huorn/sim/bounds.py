"""Upper bounds on saturated-window goodput that no policy can beat: yardsticks for reports.

Why: the 1.8× FIFO goal (issue 6) may be out of reach whatever the scheduler does, and a report
should say so with a number. Two bounds, both reading the truth (never an input to a policy):

- `saturated_goodput_bound`: capacity ignored, every job at its best configuration from its
  arrival (after the one restart every policy pays to start it). Only the jobs' elastic caps
  and curves limit it.
- `capacity_goodput_bound`: the same jobs, but sharing the GPUs a policy may use: the training
  cluster plus whatever inference does not need at the time. Each job's goodput is the upper
  concave hull of its best goodput at each replica count, so a linear programme over time slots
  (HiGHS, through scipy) gives the most work any schedule could finish by the window's end.
  Every relaxation in it can only raise the bound: a job may start in the slot its (post-restart)
  arrival falls in, GPUs are divisible and move without restarts, placement is free (a gang
  may use one node whenever it fits one), and a slot's capacity is its least-loaded moment's.
"""

from __future__ import annotations

import numpy as np
from scipy import optimize, sparse

from huorn.scheduler import perfmodel
from huorn.sim import engine, state


def best_rates(js: state.JobState, grid: int = 200) -> np.ndarray:
    """The job's best goodput (base-batch samples per second) at each replica count 1..max: any
    span (one node when the gang fits one, or several), any local batch on a `grid`-point log grid
    up to its memory limit, and the statistical efficiency of its largest noise scale."""
    job, fam = js.job, js.job.family
    a = job.truth.as_array()
    noise = job.noise_scale * (1 + state.NOISE_GROWTH)  # efficiency rises with the noise scale
    r = np.arange(1, job.max_replicas + 1, dtype=float)[:, None, None]
    low = np.maximum(1.0, fam.base_batch / r)
    span = np.log(np.maximum(fam.max_local_batch / low, 1.0))
    local = low * np.exp(span * np.linspace(0.0, 1.0, grid)[None, None, :])
    nodes = np.array([1.0, 2.0])[None, :, None]  # the step-time model only tells 1 from > 1
    ok = (low <= fam.max_local_batch) & ((nodes > 1) | (r * fam.gpus_per_replica <= 8))
    step = perfmodel.predict_step_time(a, r, nodes, local)
    m = r * local
    rate = np.where(ok, m / step * (noise + fam.base_batch) / (noise + m), 0.0)
    return rate.max(axis=(1, 2))


def saturated_window(sim: engine.Simulation) -> tuple[float, float]:
    """The saturated window T* (start, length): from the first arrival, as long as a perfectly
    packed static cluster needs for the whole trace. The report measures goodput over it too."""
    start = min(js.job.arrival for js in sim.jobs)
    window = max(sum(js.job.duration * js.job.requested_gpus for js in sim.jobs) / sim.train_gpus, 1.0)
    return start, window


def saturated_goodput_bound(sim: engine.Simulation, grid: int = 200) -> float:
    """GPU-equivalents over the saturated window with capacity ignored (module notes)."""
    start, window = saturated_window(sim)
    done = 0.0
    for js in sim.jobs:
        job = js.job
        rate = float(best_rates(js, grid).max())
        seconds = max(0.0, start + window - job.arrival - job.family.restart_seconds)
        done += job.requested_gpus * job.duration * min(1.0, rate * seconds / job.work)
    return done / window


def _hull(gpus: np.ndarray, value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Segment lengths and slopes of the upper concave hull of (0, 0) and the points, made
    non-decreasing first (a job may always leave GPUs idle). Slopes come out decreasing."""
    value = np.maximum.accumulate(value)
    xs, ys = [0.0], [0.0]
    for x, y in zip(gpus.tolist(), value.tolist(), strict=True):
        while len(xs) >= 2 and (ys[-1] - ys[-2]) * (x - xs[-2]) <= (y - ys[-2]) * (xs[-1] - xs[-2]):
            xs.pop()
            ys.pop()
        xs.append(x)
        ys.append(y)
    lengths, rises = np.diff(xs), np.diff(ys)
    keep = rises > 0
    return lengths[keep], rises[keep] / lengths[keep]


def capacity_goodput_bound(sim: engine.Simulation, slots: int = 48, grid: int = 200) -> float:
    """GPU-equivalents over the saturated window with the GPUs shared (module notes)."""
    start, window = saturated_window(sim)
    dt = window / slots
    load = sim.load
    capacity = np.empty(slots)
    for t in range(slots):
        lo, hi = start + t * dt, start + (t + 1) * dt
        probes = np.append(np.arange(lo, hi, load.bin_seconds), hi - 1e-6)
        least_need = min(load.need_at(p) for p in probes)
        capacity[t] = sim.train_gpus + max(0, sim.infer_gpus - least_need)
    cost, rows, cols, upper, caps = [], [], [], [], []
    work_cap = []
    var = 0
    jobs = [js for js in sim.jobs if js.job.arrival + js.job.family.restart_seconds < start + window]
    for i, js in enumerate(jobs):
        job = js.job
        per_gpu = job.requested_gpus * job.duration / job.work  # samples/s -> trace GPU-equivalents
        gpus = np.arange(1, job.max_replicas + 1) * job.family.gpus_per_replica
        lengths, slopes = _hull(gpus.astype(float), best_rates(js, grid) * per_gpu)
        first = int((job.arrival + job.family.restart_seconds - start) // dt)
        work_cap.append(job.requested_gpus * job.duration)
        for t in range(first, slots):
            n = len(slopes)
            cost.append(-slopes * dt)
            upper.append(lengths)
            ids = np.arange(var, var + n)
            rows.append(np.full(n, t))  # capacity row of slot t
            cols.append(ids)
            caps.append((np.full(n, slots + i), ids, slopes * dt))  # work row of job i
            var += n
    if var == 0:
        return 0.0
    cap_rows, cap_cols = np.concatenate(rows), np.concatenate(cols)
    work_rows = np.concatenate([r for r, _, _ in caps])
    work_cols = np.concatenate([c for _, c, _ in caps])
    work_vals = np.concatenate([v for _, _, v in caps])
    a_ub = sparse.csr_matrix(
        (np.concatenate([np.ones(len(cap_rows)), work_vals]),
         (np.concatenate([cap_rows, work_rows]), np.concatenate([cap_cols, work_cols]))),
        shape=(slots + len(jobs), var))
    b_ub = np.concatenate([capacity, np.asarray(work_cap, dtype=float)])
    bounds = np.column_stack([np.zeros(var), np.concatenate(upper)])
    result = optimize.linprog(np.concatenate(cost), A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs")
    if result.status != 0:
        raise RuntimeError(f"the capacity bound's linear programme did not solve: {result.message}")
    return float(-result.fun / window)
