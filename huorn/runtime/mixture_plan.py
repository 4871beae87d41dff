"""D-CPT mixture planning: the domain's share of a pre-training or continual pre-training run,
chosen from short probe runs before the run starts.

The D-CPT Law (arXiv 2406.01375) says a corpus's validation loss after D tokens of training in
which that corpus has share r is L(N, D, r) = E + A/N^α + B·r^η/D^β + C/(r + ε)^γ. Probes run at
the job's own model size, so N is fixed and E + A/N^α is one constant: seven parameters, fitted by
L-BFGS on a Huber loss from several starts, as the paper fits. The domain corpus's loss is fitted
with r the domain's share, the general corpus's with 1 − r. The share for the whole run (D = its
tokens) is the one of lowest predicted domain loss whose predicted general loss stays within
(1 + T) of a run on the general corpus alone: the paper's first use, the trade-off between
general and domain ability.

Probes are independent, so the ranks split them (rank i of W runs probes i, i + W, ...) and
each writes its points to a file of its own under the checkpoint root, whole or not at all. Rank
0 fits once every probe is there and writes the plan; the others read that file, so every rank
draws with the same weights whatever its floating point. A restart skips the probes already
written, and a resumed run reads the plan instead of probing again. The directory is named after
a digest of everything a probe's outcome depends on, so a changed spec probes afresh.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from huorn import models
from huorn.api import training
from huorn.models import decay
from huorn.runtime import batching, checkpoint, distill, init_weights
from huorn.runtime import config as run_config
from huorn.runtime.data import sampler

if TYPE_CHECKING:
    from scipy.optimize import OptimizeResult

HUBER_DELTA = 1e-3  # the paper's
# Each validation point of a probe is taken after a branch that decays the learning rate over
# this fraction of the steps so far (warmup-stable-decay): the run ends annealed, and a point on
# the constant-rate trunk would sit well above where an annealed run of that length ends.
COOLDOWN_FRACTION = 0.2
LR_FLOOR = 0.1  # the trainer's schedules end at 10 % of the peak (huorn.runtime.batching)
SHARE_GRID = np.round(np.linspace(0.01, 0.99, 99), 2)
_WAIT_POLL_S = 0.5


@dataclass(frozen=True)
class Law:
    """One corpus's fitted D-CPT law at a fixed model size; tokens are counted in `scale`s."""

    e: float
    b: float
    eta: float
    beta: float
    c: float
    gamma: float
    eps: float
    scale: float

    def predict(self, tokens: np.ndarray | float, share: np.ndarray | float) -> np.ndarray:
        d = np.asarray(tokens, dtype=np.float64) / self.scale
        r = np.asarray(share, dtype=np.float64)
        return self.e + self.b * r**self.eta / d**self.beta + self.c / (r + self.eps) ** self.gamma


@dataclass(frozen=True)
class Fit:
    law: Law
    r2: float  # on the probe points it was fitted to


def _unpack(raw: np.ndarray, scale: float) -> Law:
    # All seven are positive (E is the loss floor, and a loss is never negative); fitted as
    # logarithms so L-BFGS needs no bounds.
    e, b, eta, beta, c, gamma, eps = np.exp(np.clip(raw, -30.0, 30.0))
    return Law(float(e), float(b), float(eta), float(beta), float(c), float(gamma), float(eps), scale)


def fit_law(tokens: list[float], shares: list[float], losses: list[float]) -> Fit:
    """The seven parameters minimising the Huber loss of the residuals, best of a grid of starts
    (the objective has flat valleys where one start alone stops early)."""
    # Imported here: scipy.optimize costs every trainer start about 0.3 s, and only a job with
    # mixture: auto ever fits a law.
    from scipy import optimize, special

    d = np.asarray(tokens, dtype=np.float64)
    r = np.asarray(shares, dtype=np.float64)
    y = np.asarray(losses, dtype=np.float64)
    if not (len(d) == len(r) == len(y)) or len(y) < 8:
        raise ValueError(f"a D-CPT fit needs at least 8 points (seven parameters), got {len(y)}")
    scale = float(d.min())
    spread = max(float(y.max() - y.min()), 1e-3)

    x = d / scale
    log_x = np.log(x)

    def objective(raw: np.ndarray) -> tuple[float, np.ndarray]:
        # The gradient is analytic: L-BFGS-B's finite differences cost eight evaluations per
        # gradient, and the fit took seconds of every planned start (and of the planning tests).
        e, b, eta, beta, c, gamma, eps = p = np.exp(np.clip(raw, -30.0, 30.0))
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            data_term = r**eta / x**beta
            data_part = b * data_term
            floor = (r + eps) ** -gamma
            residual = e + data_part + c * floor - y
            log_r = np.where(r > 0, np.log(np.where(r > 0, r, 1.0)), 0.0)
            partials = np.stack([np.ones_like(x), data_term, data_part * log_r, -data_part * log_x, floor,
                                 -c * floor * np.log(r + eps), -c * gamma * floor / (r + eps)])
        if not np.all(np.isfinite(residual)) or not np.all(np.isfinite(partials)):
            return 1e30, np.zeros_like(raw)
        slope = np.clip(residual, -HUBER_DELTA, HUBER_DELTA)  # d huber / d residual
        inside = (np.abs(raw) < 30.0).astype(np.float64)  # exp's clip stops the gradient
        return float(special.huber(HUBER_DELTA, residual).sum()), partials @ slope * p * inside

    best: OptimizeResult | None = None
    for eta in (0.5, 1.5):
        for beta in (0.3, 1.0):
            for gamma in (0.2, 1.0):
                start = np.array([math.log(max(y.min() - 0.1 * spread, 1e-3)), math.log(spread),
                                  math.log(eta), math.log(beta),
                                  math.log(0.1 * spread), math.log(gamma), math.log(0.1)])
                result = optimize.minimize(objective, start, method="L-BFGS-B", jac=True,
                                           options={"maxiter": 2000, "maxfun": 20000})
                if best is None or result.fun < best.fun:
                    best = result
    assert best is not None
    law = _unpack(best.x, scale)
    residual = law.predict(d, r) - y
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((residual**2).sum()) / total if total > 0 else 1.0
    return Fit(law, r2)


@dataclass(frozen=True)
class Choice:
    share: float
    domain_loss: float  # predicted, at the run's tokens
    general_loss: float
    general_reference: float  # predicted for the general corpus alone
    within_tolerance: bool  # False: no share kept the bound, and the one nearest to it was taken


def choose_share(domain: Law, general: Law, tokens: float, tolerance: float) -> Choice:
    """The share of lowest predicted domain loss among those that keep the general loss within
    (1 + tolerance) of the general corpus alone; the general law sees the general share 1 − r."""
    domain_loss = domain.predict(tokens, SHARE_GRID)
    general_loss = general.predict(tokens, 1.0 - SHARE_GRID)
    reference = float(general.predict(tokens, 1.0))
    feasible = general_loss <= (1.0 + tolerance) * reference
    if feasible.any():
        index = int(np.flatnonzero(feasible)[np.argmin(domain_loss[feasible])])
    else:
        index = int(np.argmin(general_loss))
    return Choice(float(SHARE_GRID[index]), float(domain_loss[index]), float(general_loss[index]), reference,
                  bool(feasible.any()))


def share_weights(data: training.DataSpec, share: float) -> list[float]:
    """Sampling weights in data.sources' order: the domain takes `share`, the other sources the
    rest in the proportions of their listed weights."""
    assert data.plan is not None
    general = sum(s.weight for s in data.sources if s.name != data.plan.domain)
    return [share if s.name == data.plan.domain else (1.0 - share) * s.weight / general
            for s in data.sources]


def digest(spec: training.TrainingJobSpec) -> str:
    """What a probe's outcome depends on: the model, the data, the optimiser and the starting
    weights; not the run's length, elasticity or checkpointing."""
    opt = spec.optimization
    key = {
        "model": spec.model.to_wire(),
        "data": spec.data.to_wire(),
        "optimization": [opt.global_batch, opt.micro_batch, opt.learning_rate, opt.warmup_steps,
                         opt.weight_decay],
        "init": spec.task.init_checkpoint,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def plan_directory(cfg: run_config.RunConfig) -> Path:
    return cfg.checkpoint_root / f"mixture-plan-{digest(cfg.spec)}"


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    scratch.write_text(json.dumps(payload, indent=1))
    os.replace(scratch, path)


def _starting_model(cfg: run_config.RunConfig, device: torch.device) -> torch.nn.Module:
    spec = cfg.spec
    torch.manual_seed(spec.data.seed)
    model = models.build_model(run_config.build_model_config(spec.model)).to(device)
    if spec.task.init_checkpoint:
        source = init_weights.starting_checkpoint(spec.task.init_checkpoint, spec.model)
        # `local`: each rank runs its own probes, while the process group is up. A collective
        # load waited for a rank that was polling for the other probes' results: with probes
        # that do not split evenly over the ranks (5 on 2, or a restart that found some done)
        # the gang deadlocked until collectiveTimeoutS, and again on every restart
        checkpoint.load_checkpoint(source, model, None, local=True)
    return model


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, mixture: sampler.Mixture, steps: range,
           rate: Callable[[int], float], opt: training.Optimization, device: torch.device) -> None:
    micro_batches = opt.global_batch // opt.micro_batch
    for step in steps:
        for group in optimizer.param_groups:
            group["lr"] = rate(step)
        for index in range(micro_batches):
            tokens, targets = mixture.micro_batch(step, index, opt.micro_batch)
            loss = model(tokens.to(device), targets.to(device))[1]
            (loss / micro_batches).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def run_probe(cfg: run_config.RunConfig, share: float, device: torch.device) -> list[dict[str, float]]:
    """One probe: the job's model trained alone for probeSteps at this domain share, with the
    job's optimiser at a constant learning rate after a short warm-up; at each validation point
    a copy decays the rate to the schedule's floor over COOLDOWN_FRACTION more steps and is
    measured, so every point is an annealed run of its own length (a constant schedule, as the
    job asks for one, skips the decay)."""
    spec = cfg.spec
    plan, opt = spec.data.plan, spec.optimization
    assert plan is not None
    everything = sampler.build_mixture([(s.name, 1.0, s.path) for s in spec.data.sources], spec.data.seed,
                                       spec.model.context, cfg.data_dir)
    mixture = everything.with_probabilities(share_weights(spec.data, share))
    names = [s.name for s in spec.data.sources]
    domain = names.index(plan.domain)
    general = [(i, s.weight) for i, s in enumerate(spec.data.sources) if i != domain and s.weight > 0]
    general_total = sum(w for _, w in general)
    model = _starting_model(cfg, device)
    model.train()
    optimizer = decay.adamw(model, opt.learning_rate, opt.weight_decay)
    peak, warmup = opt.learning_rate, min(opt.warmup_steps, plan.probe_steps // 10)
    decays = opt.schedule != training.LrSchedule.CONSTANT
    evaluations = plan.probe_evaluations
    marks = sorted({max(1, plan.probe_steps * k // evaluations) for k in range(1, evaluations + 1)})
    points: list[dict[str, float]] = []
    done = 0
    for mark in marks:
        _train(model, optimizer, mixture, range(done, mark),
               lambda step: peak * min(1.0, (step + 1) / warmup) if warmup else peak, opt, device)
        done = mark
        measured, optimizer_state = model, None
        cooldown = max(1, round(COOLDOWN_FRACTION * mark)) if decays else 0
        if cooldown:
            measured = copy.deepcopy(model)
            optimizer_state = copy.deepcopy(optimizer.state_dict())
            branch = decay.adamw(measured, peak, opt.weight_decay)
            branch.load_state_dict(optimizer_state)
            _train(measured, branch, mixture, range(mark, mark + cooldown),
                   lambda step, start=mark, length=cooldown: peak * (1 - (1 - LR_FLOOR) * (step - start + 1)
                                                                    / length), opt, device)
        batches = cfg.validation_batches
        losses = {i: distill.mean_loss(measured, everything.only(i), batches, opt.micro_batch, device,
                                       part="steer")
                  for i in [domain, *(i for i, _ in general)]}
        points.append({
            "tokens": float((mark + cooldown) * opt.global_batch * spec.model.context),
            "domain_loss": losses[domain],
            "general_loss": sum(w * losses[i] for i, w in general) / general_total,
        })
    return points


@dataclass(frozen=True)
class Plan:
    share: float
    weights: list[float]  # in data.sources' order
    tokens: float  # of the whole run, where the laws were evaluated
    choice: dict[str, Any]
    domain_r2: float
    general_r2: float
    domain_law: dict[str, float]
    general_law: dict[str, float]
    probes: list[dict[str, Any]]
    seconds: float  # probing and fitting, as measured by rank 0

    @classmethod
    def read(cls, path: Path) -> Plan:
        return cls(**json.loads(path.read_text()))


def build_plan(data: training.DataSpec, probes: list[dict[str, Any]], tokens: float, seconds: float) -> Plan:
    """Fit both laws to the probes' points and choose the share for a run of `tokens`."""
    assert data.plan is not None
    rows = [(p["share"], point) for p in probes for point in p["points"]]
    d = [point["tokens"] for _, point in rows]
    domain = fit_law(d, [share for share, _ in rows], [point["domain_loss"] for _, point in rows])
    general = fit_law(d, [1.0 - share for share, _ in rows], [point["general_loss"] for _, point in rows])
    choice = choose_share(domain.law, general.law, tokens, data.plan.general_tolerance)
    return Plan(choice.share, share_weights(data, choice.share), tokens, asdict(choice), domain.r2,
                general.r2, asdict(domain.law), asdict(general.law), probes, seconds)


def plan_mixture(cfg: run_config.RunConfig, rank: int, world: int, device: torch.device,
                 progress: Callable[[str], None] = lambda _: None) -> Plan:
    """The run's plan: the one its newest checkpoint trained with; else one an earlier start made;
    else probed (this rank's share of the probes), fitted by rank 0 and read by the others.

    The checkpoint's first: the plan files are named after the run's tokens and the spec's
    optimisation, so a resumed run whose budget or optimiser was edited fitted again and changed
    its mixture mid-run (0.85 → 0.83 → 0.80 over two budget edits). A run plans once, at its
    start; resumed, it keeps its mixture, as DDK keeps its weights."""
    if (trained := _checkpointed_plan(cfg)) is not None:
        return trained
    spec = cfg.spec
    plan = spec.data.plan
    assert plan is not None
    directory = plan_directory(cfg)
    tokens = run_tokens(cfg)
    plan_file = directory / f"plan-{tokens:.0f}.json"  # the probes serve any length; the choice not
    if (made := _made_plan(cfg)) is not None:
        return Plan.read(made)
    directory.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    files = [directory / f"probe-{index}.json" for index in range(len(plan.probe_ratios))]
    for index in range(rank, len(files), world):
        if files[index].exists():
            continue
        share = plan.probe_ratios[index]
        progress(f"D-CPT probe {index + 1}/{len(files)}: domain share {share:g}, {plan.probe_steps} steps")
        probe_started = time.monotonic()
        points = run_probe(cfg, share, device)
        _write_json(files[index], {"share": share, "points": points,
                                   "seconds": time.monotonic() - probe_started})
    # NB: a rank that dies here takes the gang with it (torchrun restarts every worker, a pod's
    # loss restarts the gang), and the restart re-deals only the probes still missing.
    target = files if rank == 0 else [plan_file]
    while not all(path.exists() for path in target):
        time.sleep(_WAIT_POLL_S)
    if rank != 0:
        return Plan.read(plan_file)
    probes = [json.loads(path.read_text()) for path in files]
    result = build_plan(spec.data, probes, tokens, time.monotonic() - started)
    _write_json(plan_file, asdict(result))
    return result


def run_tokens(cfg: run_config.RunConfig) -> float:
    """Tokens of the whole run: the D at which the laws choose. A budget in tokens is that budget,
    which the trainer trains whatever the batch does (batching.Budget); one in steps (or a
    stepLimit) is its steps × globalBatch × context. Before, a budget in tokens was rounded up to
    whole steps of globalBatch, up to one step's tokens more than the run trains."""
    budget = batching.Budget.of(cfg.spec, cfg.step_limit)
    if budget.tokens is not None:
        return float(budget.tokens)
    assert budget.steps is not None
    return float(budget.steps * budget.step_tokens)


CHECKPOINT_KEY = "mixture_plan"  # the plan in a checkpoint's huorn.json


def checkpoint_record(plan: Plan, data: training.DataSpec) -> dict[str, Any]:
    """What a checkpoint keeps of the plan: the plan, and the sources and domain its weights are
    for (by position), which an edit of spec.data may change."""
    assert data.plan is not None
    return {"plan": asdict(plan), "sources": [s.name for s in data.sources], "domain": data.plan.domain}


def _checkpointed_plan(cfg: run_config.RunConfig) -> Plan | None:
    """The plan the run's newest checkpoint was trained with, while spec.data lists the same
    sources in the same order with the same domain (every rank reads the same shared directory,
    and nothing writes it before the gang's first step). With other sources its weights belong
    to other positions (a source dropped had failed the trainer, a reorder trained the wrong
    ones), so the run plans for its new data instead."""
    latest = checkpoint.find_latest(cfg.checkpoint_root)
    if latest is None:
        return None
    recorded = checkpoint.read_meta(latest).get(CHECKPOINT_KEY)
    data = cfg.spec.data
    if recorded is None or data.plan is None or recorded.get("sources") != [s.name for s in data.sources] \
            or recorded.get("domain") != data.plan.domain:
        return None
    return Plan(**recorded["plan"])


def _made_plan(cfg: run_config.RunConfig) -> Path | None:
    """The plan an earlier start made for this run, if one did. A budget in tokens was once
    named by its tokens rounded up to whole steps of globalBatch (before f637dd3): a run resumed
    across that change takes the plan it trained with rather than fitting again, which could
    change its mixture mid-run."""
    budget = batching.Budget.of(cfg.spec, cfg.step_limit)
    names = [run_tokens(cfg)]
    if budget.tokens is not None:
        names.append(float(math.ceil(budget.tokens / budget.step_tokens) * budget.step_tokens))
    directory = plan_directory(cfg)
    return next((path for tokens in names if (path := directory / f"plan-{tokens:.0f}.json").exists()), None)


def planned_weights(cfg: run_config.RunConfig) -> list[float] | None:
    """The weights the run trains with, if it planned them (the evaluator's mixture): its newest
    checkpoint's, else the plan an earlier start made for this spec."""
    if cfg.spec.data.plan is None:
        return None
    if (trained := _checkpointed_plan(cfg)) is not None:
        return trained.weights
    made = _made_plan(cfg)
    return Plan.read(made).weights if made is not None else None
