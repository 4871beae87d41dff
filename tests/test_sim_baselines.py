"""The simulator's baselines and Huorn as faithful as the review of 2026-12-07 asked: Huorn starts
each job from the prior its operator would pick, not from the job's own family curve; Pollux also
runs as AdaptDL is deployed (admission on arrival), and the best Pollux is taken over all six forms."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from huorn.scheduler import allocator, placement
from huorn.sim import engine, policies, report, run, shared_data, workload

DATA = shared_data.shared_data_dir()
TRACE = DATA / "openb_pod_list_default.csv"
NODES = DATA / "openb_node_list_gpu_node.csv"
QPS = DATA / "genai_qps.csv"
pytestmark = pytest.mark.skipif(not TRACE.exists(), reason="shared OpenB trace not present")


def _by_family(sim: engine.Simulation) -> dict[str, list]:
    out: dict[str, list] = {}
    for js in sim.jobs:
        out.setdefault(js.job.family.name, []).append(js)
    return out


def test_huorn_starts_each_job_from_the_operators_prior_anchored() -> None:
    """huorn/backends/goodput.py prior_model: moe for an MoE model, otherwise transformer, anchored.
    A cnn job's belief was the cnn curve (the centre its true curve is drawn from)."""
    sim = run.build_simulation(TRACE, NODES, QPS, "huorn", engine.SimConfig(gpus=128, seed=0))
    families = _by_family(sim)
    assert {"cnn", "recommender", "moe", "transformer"} <= set(families)
    for name, jobs in families.items():
        expected = "moe" if name == "moe" else "transformer"
        for js in jobs:
            assert js.belief is not None and js.belief.anchor_prior, (name, js.job.name)
            assert js.belief.prior == workload.FAMILIES[expected].params, (name, js.job.name)


@pytest.mark.parametrize("policy", ["pollux", "pollux-p-1", "pollux-p-1-fair"])
def test_pollux_keeps_one_generic_unanchored_prior(policy: str) -> None:
    sim = run.build_simulation(TRACE, NODES, QPS, policy, engine.SimConfig(gpus=32, seed=1))
    for js in sim.jobs:
        assert js.belief is not None and not js.belief.anchor_prior
        assert js.belief.prior == workload.FAMILIES["transformer"].params


def test_a_study_can_still_give_a_policy_each_jobs_own_family_curve(monkeypatch: pytest.MonkeyPatch) -> None:
    """scheduling_pollux_priors.py registers Pollux variants with priors="family"."""
    spec = dataclasses.replace(policies.POLICIES["pollux"], name="pollux+priors", priors="family")
    monkeypatch.setitem(policies.POLICIES, spec.name, spec)
    sim = run.build_simulation(TRACE, NODES, QPS, spec.name, engine.SimConfig(gpus=32, seed=1))
    for js in sim.jobs:
        fam = workload.PRIOR_FAMILY.get(js.job.family.name, js.job.family.name)
        assert js.belief is not None and js.belief.prior == workload.FAMILIES[fam].params
        assert not js.belief.anchor_prior


def test_an_unknown_prior_kind_is_refused_by_name() -> None:
    job = run.build_simulation(TRACE, NODES, QPS, "pollux", engine.SimConfig(gpus=32, seed=1)).jobs[0].job
    with pytest.raises(ValueError, match="priors 'catalogue' is unknown"):
        engine.initial_belief(job, "catalogue")


# ---------------------------------------------------------------- AdaptDL's admission on arrival

ARRIVAL_FORMS = ("pollux-arrival", "pollux-p-1-arrival", "pollux-p-1-fair-arrival")


def _binds(policy: str, monkeypatch: pytest.MonkeyPatch, config: engine.SimConfig) -> tuple[
        engine.Simulation, list[tuple[float, str, int, list[str], str | None]]]:
    """Run `policy`; every bind: (time, job, replicas, the nodes of its replicas, the first
    training node by name that had room for the job's minimum just before)."""
    sim = run.build_simulation(TRACE, NODES, QPS, policy, config)
    seen: list[tuple[float, str, int, list[str], str | None]] = []
    real = engine.Simulation.bind

    def spy(self: engine.Simulation, js, where, replicas, local, restart):  # type: ignore[no-untyped-def]
        gpr = js.job.family.gpus_per_replica
        first = next((n for n in self.train_nodes if isinstance(
            self.snap.place_at("train", [n] * js.job.min_replicas, gpr), placement.Placement)), None)
        seen.append((self.now, js.job.name, replicas, list(where.assignments), first))
        return real(self, js, where, replicas, local, restart)

    monkeypatch.setattr(engine.Simulation, "bind", spy)
    sim.run()
    return sim, seen


@pytest.mark.parametrize("policy", ARRIVAL_FORMS)
def test_a_pollux_arrival_form_admits_an_arriving_job_at_once_at_its_minimum_on_one_node(
        policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """AdaptDL's allocate_job: on arrival, min replicas on the first node with room; between ticks
    nothing else is bound, and a completion admits nothing (only the job that arrives just then)."""
    config = engine.SimConfig(gpus=128, seed=0)
    sim, binds = _binds(policy, monkeypatch, config)
    jobs = sim.by_name
    off_tick = [b for b in binds if b[0] % config.tick_seconds]
    assert len(off_tick) > 20  # the trace's arrivals mostly fall between ticks
    for now, name, replicas, nodes, first in off_tick:
        job = jobs[name].job
        assert now == job.arrival, (name, now)  # only on its own arrival: never on a completion
        assert replicas == job.min_replicas and len(set(nodes)) == 1
        assert sim.node_vc[nodes[0]] == "train" and nodes[0] == first  # no loaning; first by name
    # and it starts before the tick after its arrival, where the plain form waits for the tick
    started = [jobs[name] for _, name, *_ in off_tick]
    assert all(js.started == js.job.arrival for js in started)


def test_the_plain_pollux_forms_still_start_jobs_on_ticks_only() -> None:
    config = engine.SimConfig(gpus=32, seed=1)
    _, sims = run.run_policies(TRACE, NODES, QPS, ["pollux-p-1", "pollux-p-1-fair"], config)
    for sim in sims.values():
        assert all(js.started % config.tick_seconds == 0 for js in sim.jobs), sim.spec.name


def test_a_job_pending_when_another_completes_waits_for_the_tick_under_an_arrival_form(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A completion between ticks frees GPUs; AdaptDL admits nothing then (ADDED events only)."""
    config = engine.SimConfig(gpus=128, seed=0, load=1.5)
    sim, binds = _binds("pollux-arrival", monkeypatch, config)
    completions = {js.finished for js in sim.jobs if js.finished % config.tick_seconds}
    arrivals = {js.job.arrival for js in sim.jobs}
    assert completions - arrivals  # completions fall between ticks, apart from arrivals
    assert not [b for b in binds if b[0] in completions - arrivals]


def test_six_pollux_forms_and_the_best_pollux_is_taken_over_all_of_them() -> None:
    assert ("pollux", "pollux-p-1", "pollux-p-1-fair", *ARRIVAL_FORMS) == policies.POLLUX_FORMS
    for name in ARRIVAL_FORMS:
        plain = policies.POLICIES[name.removesuffix("-arrival")]
        assert policies.POLICIES[name] == dataclasses.replace(plain, name=name, arrival_admission=True)
    results = {name: {"jct_mean_s": 100.0 + i} for i, name in enumerate(policies.POLLUX_FORMS)}
    results["pollux-p-1-fair-arrival"]["jct_mean_s"] = 50.0
    assert report.best_pollux(results) == "pollux-p-1-fair-arrival"
    del results["pollux-arrival"]
    with pytest.raises(KeyError, match="pollux-arrival"):
        report.best_pollux(results)
    suffixed = {f"{k}+x": {"jct_mean_s": 1.0 if k == "pollux-p-1" else 2.0} for k in policies.POLLUX_FORMS}
    assert report.best_pollux(suffixed, suffix="+x") == "pollux-p-1+x"


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
REGISTERING = ("scheduling_huorn_settings", "scheduling_jct_weight", "scheduling_pollux_borrowing",
               "study_common")


@pytest.fixture
def benchmark_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """The study modules register their variants in policies.POLICIES when imported. Each test
    that imports one gets its own copy of the registry, and imports the module afresh into it, so
    the variants never reach the other tests of the worker: test_sim_board checks every registered
    policy's board, and `huorn simulate --policy all` runs every registered policy (both failed
    after these tests ran in the same worker)."""
    monkeypatch.setattr(policies, "POLICIES", dict(policies.POLICIES))
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    for name in REGISTERING:
        monkeypatch.delitem(sys.modules, name, raising=False)


@pytest.mark.usefixtures("benchmark_modules")
def test_the_benchmarks_take_the_best_pollux_over_all_six_forms() -> None:
    import scheduling_huorn_settings
    import study_common

    assert study_common.POLLUXES == policies.POLLUX_FORMS
    assert scheduling_huorn_settings.POLLUXES == policies.POLLUX_FORMS
    assert ("fifo", "kueue", *policies.POLLUX_FORMS, "huorn") == report.ORDER
    compared = report.compare({"huorn": {"jct_mean_s": 80.0, "inference_slo_attainment": 1.0},
                               **{k: {"jct_mean_s": 100.0 if k != "pollux-arrival" else 90.0}
                                  for k in policies.POLLUX_FORMS}})
    assert compared["best_baseline_by_mean_jct"] == "pollux-arrival"


@pytest.mark.usefixtures("benchmark_modules")
def test_the_weight_studies_run_huorn_as_committed_beside_the_weight_before_it() -> None:
    """The rank weight's evidence (docs/scheduling.md, "Allocator", items 10 and 11): the studies'
    last arm is Huorn as committed, and the arms before it differ from it in the weight alone."""
    import scheduling_huorn_settings as settings
    import scheduling_jct_weight as weights
    import study_common

    for study in (settings.STEPS, weights.WEIGHTS):
        for label, config in study.items():
            spec = policies.POLICIES[study_common.huorn_variant(label)]
            assert spec == dataclasses.replace(policies.POLICIES["huorn"], name=spec.name, allocator=config)
    huorn = settings.STEPS["+ rank among live jobs, 0.7 (HUORN)"]
    assert weights.WEIGHTS["rank^0.7"] == huorn == allocator.HUORN
    ranked_before = (weights.WEIGHTS["rank^0.4 among the allocation (before)"],
                     settings.STEPS["+ rank weight 0.4 among the allocation"])
    for before in ranked_before:
        assert (before.jct_weight_by, before.jct_weight, before.rank_among) == ("rank", 0.4, "allocation")
        assert dataclasses.replace(before, jct_weight=0.7, rank_among="live") == allocator.HUORN
    for before in (weights.WEIGHTS["remaining^0.35 (before)"], settings.STEPS["+ weight 0.35"]):
        assert (before.jct_weight_by, before.jct_weight) == ("remaining", 0.35)
        assert dataclasses.replace(before, jct_weight=0.7, jct_weight_by="rank") == allocator.HUORN


# ---------------------------------------------------------------- the borrowing study (finding 1)

@pytest.mark.usefixtures("benchmark_modules")
def test_the_borrowing_study_compares_huorn_with_the_best_pollux_with_and_without_loaning() -> None:
    """benchmarks/scheduling_pollux_borrowing.py: each Pollux form also borrows as Kueue lends,
    Huorn also runs without loaning, and each margin is taken over all six forms of its kind."""
    import scheduling_pollux_borrowing as study

    for form in policies.POLLUX_FORMS:
        spec = policies.POLICIES[f"{form}{study.LOAN}"]
        assert spec == dataclasses.replace(policies.POLICIES[form], name=spec.name, loaning="kueue")
    assert policies.POLICIES[study.NOLOAN].loaning == "none"
    assert study.seed_list("0-2,7") == [0, 1, 2, 7] and study.seed_list("none") == []
    row = study._one((1, 32, 0.8, "middle"))
    jct = {name: p["jct_mean_s"] for name, p in row["policies"].items()}
    assert row["best_pollux"] in policies.POLLUX_FORMS
    assert jct[row["best_pollux"]] == min(jct[f] for f in policies.POLLUX_FORMS)
    assert jct[row["best_pollux_borrowing"]] == min(jct[f"{f}{study.LOAN}"] for f in policies.POLLUX_FORMS)
    assert row["huorn_vs_best_pollux"] == pytest.approx(1 - jct["huorn"] / jct[row["best_pollux"]])
    assert row["huorn_noloan_vs_best_pollux"] == pytest.approx(
        1 - jct[study.NOLOAN] / jct[row["best_pollux"]])
    assert row["huorn_vs_best_pollux_borrowing"] == pytest.approx(
        1 - jct["huorn"] / jct[row["best_pollux_borrowing"]])


# ---------------------------------------------------------------- saturated goodput per GPU in use

def test_saturated_goodput_per_gpu_in_use_divides_by_the_gpus_each_policy_held() -> None:
    """The saturated window is not saturated for FIFO (the review's sat.py: 51.5 of 96 training
    GPUs in use on average over it at 128 GPUs, seed 0); per GPU in use says how fast the GPUs a
    policy did use turned into progress, borrowed ones included."""
    results, sims = run.run_policies(TRACE, NODES, QPS, ["fifo", "huorn"], engine.SimConfig(gpus=128, seed=0))
    fifo, huorn = results["fifo"], results["huorn"]
    assert fifo["saturated_mean_gpus_in_use"] == pytest.approx(51.5, abs=1.0)
    assert fifo["saturated_mean_gpus_in_use"] < fifo["training_gpus"]
    for r in (fifo, huorn):
        assert 0 < r["saturated_mean_gpus_in_use"] <= r["training_gpus"] + r["inference_gpus"]
        assert r["goodput_saturated_per_gpu_in_use"] == pytest.approx(
            r["goodput_saturated_gpu_equiv"] / r["saturated_mean_gpus_in_use"])
    # FIFO runs every job at its trace size and base batch: one GPU in use is one GPU-equivalent
    assert fifo["goodput_saturated_per_gpu_in_use"] == pytest.approx(1.0, abs=0.05)
    # the per-tick series of GPU-seconds ends with the run's total
    for sim in sims.values():
        assert sim.totals.series_gpu_seconds[-1][1] == pytest.approx(sim.totals.train_gpu_seconds)


def test_no_study_variant_is_left_registered_by_the_tests_before() -> None:
    """Runs after the tests above that import study modules (file order, where one worker runs
    them all): the registry holds the simulator's own policies only."""
    assert set(policies.POLICIES) == set(report.ORDER)
