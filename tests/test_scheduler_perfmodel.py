"""The performance model: learns real DDP step times, starts from priors, reports uncertainty."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from huorn.scheduler import perfmodel

DATA = Path(__file__).parent / "data" / "ddp_step_times.csv"
HELD_OUT = {(1, 12.0), (2, 6.0), (2, 24.0), (1, 24.0)}
# The stated error: held-out configurations of the measured CPU DDP runs within 15 %.
HELD_OUT_TOLERANCE = 0.15
# Gangs of 1 to 12 replicas, one core each, on a 16-core host (median of five runs; docs/scheduling.md).
DATA_16CORE = Path(__file__).parent / "data" / "ddp_step_times_16core.csv"
MEASURED_GANGS = {1, 2, 4}
# The stated error of a gang size never measured, up to three times the largest measured: the median
# held-out configuration within 8 %, every one within 20 % (measured: 4.6 % and 19.4 %).
UNSEEN_GANG_MEDIAN, UNSEEN_GANG_MAX = 0.08, 0.20


def load_samples(path: Path = DATA) -> list[perfmodel.Sample]:
    with path.open() as fh:
        return [perfmodel.Sample(int(r["replicas"]), int(r["nodes"]), float(r["local_batch"]),
                                 float(r["step_time_s"])) for r in csv.DictReader(fh)]


def test_model_trained_on_measured_ddp_predicts_held_out_configs() -> None:
    samples = load_samples()
    model = perfmodel.PerfModel("transformer-tiny", gpu_type="cpu")
    for s in samples:
        if (s.replicas, s.local_batch) not in HELD_OUT:
            model.observe(s)
    model.fit()
    held = [s for s in samples if (s.replicas, s.local_batch) in HELD_OUT]
    assert len(held) == len(HELD_OUT)
    for s in held:
        predicted = model.predict(s.replicas, s.nodes, s.local_batch)
        assert abs(predicted.step_time / s.step_time - 1) < HELD_OUT_TOLERANCE, (s, predicted)
        assert predicted.rel_std < 0.3


def test_model_fitted_on_small_gangs_predicts_larger_unseen_gangs() -> None:
    """What the allocator asks of the model is a gang size it has not run yet, mostly a larger one:
    fitted on 1, 2 and 4 replicas, it prices 3, 6, 8 and 12 within the stated error, where the
    family prior alone is about 30 % off, and its one-sigma rel_std covers the error it makes."""
    samples = load_samples(DATA_16CORE)
    model = perfmodel.PerfModel("transformer-tiny", gpu_type="cpu")
    for s in samples:
        if s.replicas in MEASURED_GANGS:
            model.observe(s)
    model.fit()
    prior = perfmodel.PerfModel("transformer-tiny", gpu_type="cpu")
    held = [s for s in samples if s.replicas not in MEASURED_GANGS]
    assert {s.replicas for s in held} == {3, 6, 8, 12} and len(held) == 32
    predictions = [model.predict(s.replicas, s.nodes, s.local_batch) for s in held]
    errors = [abs(p.step_time / s.step_time - 1) for p, s in zip(predictions, held, strict=True)]
    prior_errors = [abs(prior.predict(s.replicas, s.nodes, s.local_batch).step_time / s.step_time - 1)
                    for s in held]
    assert np.median(errors) < UNSEEN_GANG_MEDIAN, sorted(errors)
    assert max(errors) < UNSEEN_GANG_MAX, sorted(errors)
    assert np.median(errors) < np.median(prior_errors) / 3  # it learned: the prior alone is ~30 % off
    within_two_sigma = [e < 2 * p.rel_std for e, p in zip(errors, predictions, strict=True)]
    assert sum(within_two_sigma) >= 0.9 * len(held), (errors, [p.rel_std for p in predictions])


def test_cold_start_uses_the_family_prior_and_is_uncertain() -> None:
    model = perfmodel.PerfModel("transformer", params_b=7.0, gpu_type="A100")
    cold = model.predict(4, 1, 8)
    # By hand from the transformer prior (a_c 0.02, b_c 0.004, alpha_intra 0.05, beta_intra 0.004,
    # gamma 2): compute scales with 7B parameters over the A100's speed 0.45, the network with 7B.
    compute = (0.02 + 0.004 * 8) * 7 / 0.45
    network = (0.05 + 0.004 * 4) * 7
    assert cold.step_time == pytest.approx((compute**2 + network**2) ** 0.5)
    assert cold.rel_std >= 0.5  # a prior alone is a guess: within a factor e at one sigma
    faster = perfmodel.PerfModel("transformer", params_b=7.0, gpu_type="H200").predict(4, 1, 8)
    assert faster.throughput > cold.throughput


def test_online_updates_move_the_model_towards_the_truth() -> None:
    truth = perfmodel.PolluxParams(0.05, 0.01, 0.1, 0.01, 0.5, 0.05, 2.5)
    model = perfmodel.PerfModel("transformer", params_b=1.0)
    rng = np.random.default_rng(0)
    errors = []
    stds = [model.predict(24, 3, 12).rel_std]
    configs = [(1, 1, 16), (2, 1, 16), (4, 1, 8), (8, 1, 16), (16, 2, 16), (32, 4, 8), (8, 2, 32)]
    for replicas, nodes, batch in configs:
        t = float(perfmodel.predict_step_time(truth, replicas, nodes, batch)) * rng.lognormal(0, 0.02)
        model.observe(perfmodel.Sample(replicas, nodes, batch, t))
        test_t = float(perfmodel.predict_step_time(truth, 24, 3, 12))
        errors.append(abs(model.predict(24, 3, 12).step_time / test_t - 1))
        stds.append(model.predict(24, 3, 12).rel_std)
    assert errors[-1] < 0.15
    assert errors[-1] < errors[0]
    assert stds[-1] < 0.2 < stds[0]  # the reported uncertainty shrinks as configurations are seen


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 64), st.integers(1, 8), st.floats(1, 256))
def test_step_time_is_positive_and_bounded_by_its_parts(replicas: int, nodes: int, batch: float) -> None:
    nodes = min(nodes, replicas)
    p = perfmodel.scale_prior("moe", 2.0, "H100")
    t = float(perfmodel.predict_step_time(p, replicas, nodes, batch))
    compute = p.a_c + p.b_c * batch
    net = 0.0 if replicas == 1 else (p.alpha_inter + p.beta_inter * replicas if nodes > 1
                                     else p.alpha_intra + p.beta_intra * replicas)
    assert max(compute, net) <= t * (1 + 1e-9)
    assert t <= compute + net + 1e-9


def test_bad_inputs_name_the_field() -> None:
    with pytest.raises(ValueError, match="model family 'lstm'"):
        perfmodel.PerfModel("lstm")
    with pytest.raises(ValueError, match="gpu_type"):
        perfmodel.PerfModel("cnn", gpu_type="TPU")
    with pytest.raises(ValueError, match="nodes"):
        perfmodel.PerfModel("cnn").observe(perfmodel.Sample(1, 2, 8, 0.1))


def test_residual_regressor_is_kept_only_where_the_form_misses() -> None:
    truth = perfmodel.PolluxParams(0.02, 0.004, 0.05, 0.004, 0.2, 0.02, 2.0)
    rng = np.random.default_rng(1)
    pollux_shaped = perfmodel.PerfModel("transformer")
    for replicas in (1, 2, 4, 8, 16):
        for batch in (4, 8, 16, 32):
            nodes = max(1, replicas // 8)
            t = float(perfmodel.predict_step_time(truth, replicas, nodes, batch)) * rng.lognormal(0, 0.01)
            pollux_shaped.observe(perfmodel.Sample(replicas, nodes, batch, t))
    pollux_shaped.fit()
    assert pollux_shaped._residual is None  # the parametric form already explains the data

    measured = perfmodel.PerfModel("transformer-tiny", gpu_type="cpu")
    for s in load_samples():
        measured.observe(s)
    measured.fit()
    assert measured._residual is not None  # shared-core contention is outside the Pollux form


def test_batched_jacobian_is_scipys_two_point_jacobian_bit_for_bit() -> None:
    """The fit's hand-batched Jacobian must not change a single fit: same steps, same differences."""
    from scipy.optimize._numdiff import approx_derivative

    rng = np.random.default_rng(7)
    lo, hi = np.full(7, -25.0), np.full(7, 10.0)
    lo[6], hi[6] = 0.0, np.log(10.0)
    prior = np.log(perfmodel.FAMILY_PRIORS["cnn"].as_array())
    for trial in range(300):
        k = int(rng.integers(1, 20))
        r = rng.integers(1, 65, k).astype(float)
        data = (r, np.minimum(r, rng.integers(1, 9, k)).astype(float), 2.0 ** rng.integers(0, 10, k),
                rng.normal(-2, 1, k), prior)
        x = np.clip(prior + rng.normal(0, 2, 7), lo + 1e-9, hi - 1e-9)
        x[6] = (lo[6] + 1e-12, np.log(2.0), hi[6] - 1e-12, x[6])[trial % 4]  # at both γ bounds too
        want = approx_derivative(lambda p, d=data: perfmodel._fit_residuals(p, d), x, method="2-point",
                                 bounds=(lo, hi))
        got = perfmodel._fit_jacobian(x, data, lo, hi)
        assert np.array_equal(want, got), trial


def test_the_allocators_grid_reads_the_corrected_model() -> None:
    """`predict_many` is what the allocator prices every size with: it must be the model `predict`
    reports (and the held-out error above is stated for), correction included, in any shape."""
    model = perfmodel.PerfModel("transformer-tiny", gpu_type="cpu")
    samples = load_samples()
    for s in samples:
        model.observe(s)
    model.fit()
    assert model._residual is not None
    r = np.array([[s.replicas for s in samples]] * 2, dtype=float)
    n = np.array([[s.nodes for s in samples]] * 2, dtype=float)
    b = np.array([[s.local_batch for s in samples]] * 2, dtype=float)
    many = model.predict_many(r, n, b)
    assert many.shape == r.shape
    one = np.array([model.predict(s.replicas, s.nodes, s.local_batch).throughput for s in samples])
    np.testing.assert_allclose(many[0], one, rtol=1e-12)
    np.testing.assert_allclose(many[1], one, rtol=1e-12)
    # and the corrected curve is nearer the measurements than the parametric part alone
    measured = np.array([s.replicas * s.local_batch / s.step_time for s in samples])
    parametric = r[0] * b[0] / perfmodel.predict_step_time(model.params, r[0], n[0], b[0])
    assert np.mean(np.abs(np.log(one / measured))) < np.mean(np.abs(np.log(parametric / measured)))
