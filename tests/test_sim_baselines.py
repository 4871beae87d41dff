"""The simulator's baselines and Huorn as faithful as the review of 2026-12-07 asked: Huorn starts
each job from the prior its operator would pick, not from the job's own family curve."""

from __future__ import annotations

import dataclasses

import pytest

from huorn.sim import engine, policies, run, shared_data, workload

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
