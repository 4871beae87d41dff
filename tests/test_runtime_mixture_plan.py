"""D-CPT mixture planning: the law's fit, the choice under the general-loss tolerance, the
weights, and real probes (the trainer on two gloo ranks splits them, a world of one computes the
same points, a restart reads the plan instead of probing again)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import runtime_harness as harness
import torch

from huorn.api import training
from huorn.runtime import config as run_config
from huorn.runtime import mixture_plan

TRUE = mixture_plan.Law(e=1.8, b=3.0, eta=0.8, beta=0.4, c=0.15, gamma=0.5, eps=0.05, scale=1e5)
SHARES = [0.1, 0.3, 0.5, 0.7, 0.9]


@pytest.fixture(scope="module")
def data_dir() -> Path:
    return harness.shared_data_dir()


def _points(law: mixture_plan.Law, noise: float, seed: int = 0) -> tuple[list[float], ...]:
    rng = np.random.default_rng(seed)
    tokens, shares, losses = [], [], []
    for share in SHARES:
        for d in (1e5, 2e5, 3e5, 4e5):
            tokens.append(d)
            shares.append(share)
            losses.append(float(law.predict(d, share)) + float(rng.normal(0, noise)))
    return tokens, shares, losses


def test_the_fit_recovers_a_law_and_extrapolates_to_ten_times_the_tokens() -> None:
    fit = mixture_plan.fit_law(*_points(TRUE, noise=0.002))
    assert fit.r2 > 0.999
    probe = np.array(SHARES)
    far = 4e6  # ten times the longest probe, as a plan extrapolates to the whole run
    error = np.abs(fit.law.predict(far, probe) - TRUE.predict(far, probe)) / TRUE.predict(far, probe)
    assert error.max() < 0.01, error
    with pytest.raises(ValueError, match="at least 8 points"):
        mixture_plan.fit_law([1.0] * 7, [0.5] * 7, [2.0] * 7)


def test_the_choice_is_the_lowest_domain_loss_within_the_general_tolerance() -> None:
    # Laws whose loss falls as their corpus's share grows, as measured ones do.
    domain = mixture_plan.Law(e=1.8, b=0.3, eta=0.5, beta=0.3, c=0.4, gamma=0.6, eps=0.05, scale=1e5)
    general = mixture_plan.Law(e=2.0, b=0.2, eta=0.7, beta=0.4, c=0.1, gamma=0.6, eps=0.05, scale=1e5)
    tokens = 1e6
    reference = float(general.predict(tokens, 1.0))
    for tolerance in (0.01, 0.05, 0.2):
        choice = mixture_plan.choose_share(domain, general, tokens, tolerance)
        grid = mixture_plan.SHARE_GRID
        allowed = grid[general.predict(tokens, 1.0 - grid) <= (1 + tolerance) * reference]
        best = allowed[np.argmin(domain.predict(tokens, allowed))]
        assert choice.share == pytest.approx(float(best))
        assert choice.within_tolerance and choice.general_loss <= (1 + tolerance) * reference + 1e-12
        assert choice.general_reference == pytest.approx(reference)
    loose, tight = (mixture_plan.choose_share(domain, general, tokens, t).share for t in (0.2, 0.01))
    assert loose > tight  # more room for general loss buys more domain data
    # No share keeps the general loss at the reference itself: the one nearest to it is taken, and said.
    strict = mixture_plan.choose_share(domain, general, tokens, 0.0)
    assert not strict.within_tolerance and strict.share == mixture_plan.SHARE_GRID[0]


def test_weights_give_the_domain_its_share_and_the_rest_its_listed_proportions() -> None:
    data = training.DataSpec.model_validate({
        "sources": [{"name": "general", "weight": 2}, {"name": "code", "weight": 1}, {"name": "math"}],
        "mixture": "auto", "plan": {"domain": "math"}})
    assert mixture_plan.share_weights(data, 0.4) == pytest.approx([0.4, 0.2, 0.4])


def _planned_spec(steps: int = 4, probe_steps: int = 8) -> dict:
    """Probes just long enough for two points each (8, the fit's minimum, from four probes); the
    run's own steps only need to exist for a restart to find them done."""
    spec = harness.build_spec(steps=steps, interval_steps=None)
    spec["data"]["mixture"] = "auto"
    spec["data"]["plan"] = {"domain": "math", "probeSteps": probe_steps, "probeEvaluations": 2,
                            "probeRatios": [0.2, 0.5, 0.8, 0.35]}
    return spec


def test_the_digest_follows_what_probes_depend_on_and_not_the_run_length() -> None:
    def digest(spec: dict) -> str:
        return mixture_plan.digest(training.TrainingJobSpec.model_validate(spec))

    base = digest(_planned_spec(steps=12))
    assert digest(_planned_spec(steps=500)) == base
    other = _planned_spec()
    other["data"]["plan"]["generalTolerance"] = 0.1
    wider = _planned_spec()
    wider["model"]["width"] = 64
    assert len({base, digest(other), digest(wider)}) == 3


@pytest.mark.slow
@pytest.mark.usefixtures("single_thread")  # the probes run here too, as the ranks do: one thread
def test_two_ranks_split_the_probes_and_agree_with_one_and_a_restart_reads_the_plan(
        tmp_path: Path, data_dir: Path) -> None:
    two = tmp_path / "two"
    two.mkdir()
    config = harness.write_config(two, data_dir, _planned_spec())
    log = two / "train.log"
    with open(log, "wb") as out:
        code = subprocess.run(harness.trainer_command(config, 2), cwd=harness.REPO, env=harness.child_env(),
                              stdout=out, stderr=subprocess.STDOUT, timeout=300).returncode
    assert code == 0, log.read_text()[-3000:]
    cfg = run_config.load_run_config(config)
    directory = mixture_plan.plan_directory(cfg)
    assert sorted(p.name for p in directory.glob("probe-*.json")) == [f"probe-{i}.json" for i in range(4)]
    events = [e for e in harness.read_events(two / "run") if e.get("event") == "dcpt"]
    assert len(events) == 1
    event = events[0]
    assert event["sources"] == ["general", "code", "math"]
    assert event["weights"][2] == pytest.approx(event["share"]) and sum(event["weights"]) == pytest.approx(1)
    assert event["weights"][0] == pytest.approx(2 * event["weights"][1])  # general:code stays 2:1
    both = log.read_text()
    assert "rank 0: D-CPT probe 1/4" in both and "rank 1: D-CPT probe 2/4" in both  # dealt round-robin

    # A world of one computes the very same points (those rank 1 probed are checked: rank 0's
    # ran in a process like this one), and so, from the same points, the same plan.
    one = tmp_path / "one"
    one.mkdir()
    alone_cfg = run_config.load_run_config(harness.write_config(one, data_dir, _planned_spec()))
    split = mixture_plan.Plan.read(next(directory.glob("plan-*.json")))
    for b in split.probes[1::2]:
        alone = mixture_plan.run_probe(alone_cfg, b["share"], torch.device("cpu"))
        for p, q in zip(alone, b["points"], strict=True):
            assert p["tokens"] == q["tokens"]
            assert p["domain_loss"] == pytest.approx(q["domain_loss"], abs=1e-5)
            assert p["general_loss"] == pytest.approx(q["general_loss"], abs=1e-5)
    tokens = mixture_plan.run_tokens(alone_cfg)
    refit = mixture_plan.build_plan(alone_cfg.spec.data, split.probes, tokens, 0.0)
    assert refit.share == split.share

    # A second start of the same run (its steps done) reads the plan: no probe runs again.
    before = {p: p.stat().st_mtime_ns for p in directory.iterdir()}
    process = harness.start_trainer(config, two / "again.log")
    assert process.wait(timeout=120) == 0, (two / "again.log").read_text()[-3000:]
    assert {p: p.stat().st_mtime_ns for p in directory.iterdir()} == before
    assert "D-CPT probe" not in (two / "again.log").read_text()
    plans = [json.loads(p.read_text()) for p in directory.glob("plan-*.json")]
    assert len(plans) == 1 and plans[0]["share"] == event["share"]


def test_a_run_resumed_across_the_exact_token_naming_takes_the_plan_it_trained_with(tmp_path: Path) -> None:
    """A budget in tokens names its plan by those tokens since f637dd3; it was named by them
    rounded up to whole steps of globalBatch. A resumed run missed its plan and fitted again from
    the probes, which could change its mixture mid-run."""
    spec = _planned_spec()
    del spec["optimization"]["steps"]
    spec["optimization"]["tokens"] = 1000  # not whole steps of globalBatch × context
    cfg = run_config.load_run_config(harness.write_config(tmp_path, harness.shared_data_dir(), spec))
    step_tokens = spec["optimization"]["globalBatch"] * spec["model"]["context"]
    rounded = -(-1000 // step_tokens) * step_tokens
    assert rounded != 1000 and mixture_plan.run_tokens(cfg) == 1000
    assert mixture_plan.planned_weights(cfg) is None
    old = mixture_plan.Plan(0.3, [0.5, 0.2, 0.3], rounded, {}, 0.9, 0.9, {}, {}, [], 1.0)
    directory = mixture_plan.plan_directory(cfg)
    directory.mkdir(parents=True)
    (directory / f"plan-{rounded}.json").write_text(json.dumps(dataclasses.asdict(old)))
    assert mixture_plan.planned_weights(cfg) == [0.5, 0.2, 0.3]
    assert mixture_plan.plan_mixture(cfg, 0, 1, torch.device("cpu")) == old  # no probe ran


def _checkpoint_with_plan(root: Path, step: int, plan: mixture_plan.Plan | None) -> None:
    """A complete checkpoint directory as the trainer writes one, its huorn.json carrying `plan`."""
    directory = root / f"step-{step:08d}"
    directory.mkdir(parents=True)
    (directory / ".metadata").write_bytes(b"")
    record = {"plan": dataclasses.asdict(plan), "sources": ["general", "code", "math"], "domain": "math"} \
        if plan else None
    meta = {"step": step, **({mixture_plan.CHECKPOINT_KEY: record} if record else {})}
    (directory / "huorn.json").write_text(json.dumps(meta))


def test_a_resumed_run_keeps_the_plan_its_checkpoint_trained_with_whatever_its_budget(tmp_path: Path) -> None:
    """The plan files are named after the run's tokens and the optimisation, so a resumed run
    whose budget was extended fitted again and changed its mixture mid-run (0.85 → 0.83 → 0.80
    over two edits, a reviewer's run); an optimiser edit re-ran every probe."""
    spec = _planned_spec(steps=40)
    cfg = run_config.load_run_config(harness.write_config(tmp_path, harness.shared_data_dir(), spec))
    trained = mixture_plan.Plan(0.85, [0.1, 0.05, 0.85], 1e4, {}, 0.9, 0.9, {}, {}, [], 1.0)
    _checkpoint_with_plan(Path(cfg.checkpoint_root), 4, trained)
    assert mixture_plan.plan_mixture(cfg, 0, 1, torch.device("cpu")) == trained  # no probe ran
    assert mixture_plan.planned_weights(cfg) == [0.1, 0.05, 0.85]
    assert not mixture_plan.plan_directory(cfg).exists()
    # its weights are by position: sources reordered, dropped, or another domain, and they are not
    # this run's (a reviewer's reorder trained math at 0.1 and code at 0.85)
    edits = ({"sources": ["math", "general", "code"]}, {"sources": ["general", "math"]}, {"domain": "code"})
    for edit in edits:
        other = json.loads(json.dumps(spec))
        if "sources" in edit:
            other["data"]["sources"] = [s for name in edit["sources"] for s in spec["data"]["sources"]
                                        if s["name"] == name]
        if "domain" in edit:
            other["data"]["plan"]["domain"] = edit["domain"]
        edited = run_config.load_run_config(harness.write_config(tmp_path, harness.shared_data_dir(), other))
        assert mixture_plan._checkpointed_plan(edited) is None, edit


def test_a_cpt_runs_probes_that_do_not_split_evenly_over_its_ranks(tmp_path: Path, data_dir: Path) -> None:
    """Each probe of a cpt run loaded the base checkpoint collectively, on a rank that ran it
    alone while the other polled for its results: 5 probes on 2 ranks (or a restart that found
    some done) waited out collectiveTimeoutS, and again at every restart."""
    base = tmp_path / "base"
    base.mkdir()
    config = harness.write_config(base, data_dir, harness.build_spec(steps=2, interval_steps=None))
    assert harness.start_trainer(config, base / "train.log").wait(timeout=120) == 0, \
        (base / "train.log").read_text()[-2000:]
    cpt = tmp_path / "cpt"
    cpt.mkdir()
    spec = _planned_spec(steps=2)
    spec["data"]["plan"]["probeRatios"] = [0.2, 0.35, 0.5, 0.65, 0.8]  # 5 on 2 ranks: rank 0 runs 3
    spec["task"] = {"kind": "cpt", "initCheckpoint": str(base / "ckpt")}
    config = harness.write_config(cpt, data_dir, spec, collectiveTimeoutS=20)
    log = cpt / "train.log"
    with open(log, "wb") as out:
        code = subprocess.run(harness.trainer_command(config, 2), cwd=harness.REPO, env=harness.child_env(),
                              stdout=out, stderr=subprocess.STDOUT, timeout=300).returncode
    assert code == 0, log.read_text()[-3000:]
    assert len(list(mixture_plan.plan_directory(run_config.load_run_config(config)).glob("plan-*.json"))) == 1
