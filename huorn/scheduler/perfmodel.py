"""Per-job throughput model: Pollux's parametric step time, a learned correction, and priors.

Step time follows Pollux (OSDI 2021):

    T = (T_compute^γ + T_net^γ)^(1/γ),   T_compute = a_c + b_c·local_batch,
    T_net = 0 for one replica, α_intra + β_intra·replicas on one node, α_inter + β_inter·replicas across nodes

γ between 1 (no overlap of compute and communication) and 10 (near-perfect overlap). The seven
parameters are fitted with scipy's least squares on log step time, so that a 10 ms and a 10 s
job weigh the same, and with a Gaussian prior per model family pulling each parameter towards its
family's value. The prior is what makes a cold job schedulable at all: with one sample at one
replica, the network terms are unidentified and would otherwise be anything.

Where the data show the parametric form misses (real runtimes have cache effects, the gloo
all-reduce switches algorithms at some sizes) a scikit-learn regressor is fitted on the log
residuals, and kept only if cross-validation (five shuffled folds) says it lowers the error;
every prediction, one configuration or the allocator's whole grid, applies it. The reported
uncertainty is the residual spread plus the prior's spread, shrinking as configurations are seen.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from scipy import optimize

if TYPE_CHECKING:
    from sklearn import ensemble

PARAM_NAMES = ("a_c", "b_c", "alpha_intra", "beta_intra", "alpha_inter", "beta_inter", "gamma")


@dataclass(frozen=True)
class PolluxParams:
    a_c: float  # s per step of fixed compute (optimizer, launch)
    b_c: float  # s per sample of compute
    alpha_intra: float
    beta_intra: float
    alpha_inter: float
    beta_inter: float
    gamma: float

    def as_array(self) -> np.ndarray:
        return np.array([getattr(self, n) for n in PARAM_NAMES], dtype=float)

    @classmethod
    def from_array(cls, values: Sequence[float]) -> PolluxParams:
        return cls(*(float(v) for v in values))


@dataclass(frozen=True)
class Sample:
    """One telemetry point: the runtime's median step time at one configuration."""

    replicas: int
    nodes: int
    local_batch: float
    step_time: float


@dataclass(frozen=True)
class Prediction:
    step_time: float
    throughput: float  # samples per second, all replicas together
    rel_std: float  # one standard deviation of the step time, relative


# Family priors at one billion parameters on an H200. [inferred] orders of magnitude from public
# step-time reports; what matters is that they start the fit in the right decade.
FAMILY_PRIORS: dict[str, PolluxParams] = {
    "transformer": PolluxParams(0.02, 0.004, 0.05, 0.004, 0.2, 0.02, 2.0),
    "transformer-tiny": PolluxParams(0.002, 0.002, 0.002, 0.001, 0.01, 0.005, 2.0),
    "moe": PolluxParams(0.03, 0.003, 0.08, 0.006, 0.4, 0.04, 1.5),
    "cnn": PolluxParams(0.01, 0.002, 0.02, 0.002, 0.08, 0.008, 3.0),
    "recommender": PolluxParams(0.01, 0.0005, 0.03, 0.003, 0.15, 0.015, 1.5),
}
# Relative compute speed of the GPU types in the OpenB trace and Huorn's own targets. [inferred]
# The data-centre types past the OpenB trace's (B200 … A40) from their dense bf16 throughput
# against the H100's, at the H100's 0.9: like the family priors, a start for the fit, which the
# measurements then set.
GPU_SPEED: dict[str, float] = {
    "H200": 1.0, "H100": 0.9, "A100": 0.45, "A10": 0.15, "V100M32": 0.2, "V100M16": 0.2, "V100": 0.2,
    "G2": 0.25, "G3": 0.3, "T4": 0.08, "P100": 0.1, "cpu": 1.0, "": 1.0,
    "B200": 2.0, "H800": 0.9, "A800": 0.45, "H20": 0.15, "L40S": 0.33, "L40": 0.16, "L4": 0.11, "A40": 0.14,
}
# The words of a product name that name a type (whole words: "A10" is not "A100").
_PRODUCT_TOKENS = ("B200", "H200", "H100", "H800", "H20", "A100", "A800", "A10", "A40", "L40S", "L40", "L4",
                   "V100", "T4", "P100")
_PRODUCT_ALIASES = {"GH200": "H200", "GH100": "H100", "A10G": "A10", "A100X": "A100"}  # variants of one chip


PRIOR_LOG_STD = 1.0  # a family prior is right within a factor e≈2.7 (one sigma)
MEASUREMENT_LOG_STD = 0.1  # a median step time is right within about 10 % (one sigma)


def gpu_type_of(product: str) -> str:
    """The `GPU_SPEED` key of a GPU product name, "" when none matches.

    Names come from NVIDIA GPU feature discovery's `nvidia.com/gpu.product` node label
    ("NVIDIA-H100-80GB-HBM3", "Tesla-V100-SXM2-16GB") or from the CUDA driver ("NVIDIA H100 80GB
    HBM3"): the type is the first whole token that names one, so "NVIDIA-A10" is an A10 and
    "NVIDIA-A100-SXM4-80GB" an A100."""
    words = product.upper().replace("_", "-").replace(" ", "-").split("-")
    if "MIG" in words or "SHARED" in words:
        # a MIG slice or a time-shared GPU (GFD's mig.strategy=mixed/single, sharing suffixes):
        # the node counts slices, each a fraction of the chip no prior knows
        return ""
    tokens = {_PRODUCT_ALIASES.get(w, w) for w in words}
    return next((known for known in _PRODUCT_TOKENS if known in tokens), "")


def runtime_prior_family(moe: bool) -> str:
    """The family prior a GPU job of Huorn's runtime starts from: its decoder is a transformer,
    with or without experts. One place for the operator's and `huorn run`'s prior
    (backends.goodput.prior_model) and the simulator's Huorn, which must pick as they do."""
    return "moe" if moe else "transformer"


def scale_prior(family: str, params_b: float, gpu_type: str, gpus: int = 1) -> PolluxParams:
    """The family prior for a model of `params_b` billion parameters on `gpu_type`, for a replica
    of `gpus` GPUs.

    Compute grows with parameters and shrinks with GPU speed; the network terms grow with the
    gradient bytes, that is with parameters, and do not depend on the GPU. A replica (a pod)
    runs a rank per GPU, and its local batch is the pod's: its `gpus` compute it about that many
    times faster, while the gradient it exchanges with the other replicas is no smaller. Priced
    as one GPU, an 8-GPU replica of a 7B transformer scaled to 4.9× at 8 replicas where its
    compute, 8× shorter, left the exchange to dominate (0.8×).
    """
    if family not in FAMILY_PRIORS:
        raise ValueError(f"model family {family!r} has no prior; use one of {sorted(FAMILY_PRIORS)}")
    if gpu_type not in GPU_SPEED:
        raise ValueError(f"gpu_type {gpu_type!r} is unknown; use one of {sorted(GPU_SPEED)}")
    if not params_b > 0:
        raise ValueError(f"params_b must be > 0 (billions of parameters), got {params_b}")
    p = FAMILY_PRIORS[family]
    if family == "transformer-tiny":
        return p  # measured directly on CPU; no scaling
    if gpus < 1:
        raise ValueError(f"gpus must be ≥ 1 (GPUs of a replica), got {gpus}")
    c = params_b / GPU_SPEED[gpu_type] / gpus
    return PolluxParams(p.a_c * c, p.b_c * c, p.alpha_intra * params_b, p.beta_intra * params_b,
                        p.alpha_inter * params_b, p.beta_inter * params_b, p.gamma)


def predict_step_time(params: PolluxParams | np.ndarray, replicas: np.ndarray | int, nodes: np.ndarray | int,
                      local_batch: np.ndarray | float) -> np.ndarray:
    """Pollux step time; vectorised so the allocator can price every replica count at once."""
    a = params.as_array() if isinstance(params, PolluxParams) else params
    r = np.asarray(replicas, dtype=float)
    n = np.asarray(nodes, dtype=float)
    t_compute = a[0] + a[1] * np.asarray(local_batch, dtype=float)
    t_net = np.where(n > 1, a[4] + a[5] * r, a[2] + a[3] * r)
    t_net = np.where(r > 1, t_net, 0.0)
    g = a[6]
    return (t_compute**g + t_net**g) ** (1.0 / g)


def _feature_rows(replicas: np.ndarray, nodes: np.ndarray, local_batch: np.ndarray) -> np.ndarray:
    """The residual regressor's inputs, one row per configuration (flattened)."""
    r, n, b = (np.asarray(v, dtype=float).ravel() for v in np.broadcast_arrays(replicas, nodes, local_batch))
    return np.column_stack([np.log(r), (n > 1).astype(float), np.log(n), np.log(b)])


def _features(samples: Sequence[Sample]) -> np.ndarray:
    return _feature_rows(np.array([s.replicas for s in samples], dtype=float),
                         np.array([s.nodes for s in samples], dtype=float),
                         np.array([s.local_batch for s in samples], dtype=float))


FitData = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # r, n, b, log step, log prior


def _fit_residuals(log_p: np.ndarray, data: FitData) -> np.ndarray:
    """Residuals of the MAP fit, each over its own sigma (measurement, then prior)."""
    r, n, b, y, log_prior = data
    fit = np.log(predict_step_time(np.exp(log_p), r, n, b)) - y
    return np.concatenate([fit / MEASUREMENT_LOG_STD, (log_p - log_prior) / PRIOR_LOG_STD])


def _residual_rows(log_ps: np.ndarray, data: FitData) -> np.ndarray:
    """`_fit_residuals` for several parameter vectors sharing one γ, in one set of array operations.

    Element by element the operations are the ones `_fit_residuals` does, with the same scalar
    exponent, so each row is bit-for-bit what it would return for that vector.
    """
    r, n, b, y, log_prior = data
    a = np.exp(log_ps)
    g = a[0, 6]
    t_compute = a[:, 0:1] + a[:, 1:2] * b
    t_net = np.where(n > 1, a[:, 4:5] + a[:, 5:6] * r, a[:, 2:3] + a[:, 3:4] * r)
    t_net = np.where(r > 1, t_net, 0.0)
    fit = np.log((t_compute**g + t_net**g) ** (1.0 / g)) - y
    return np.concatenate([fit / MEASUREMENT_LOG_STD, (log_ps - log_prior) / PRIOR_LOG_STD], axis=1)


def _fit_jacobian(log_p: np.ndarray, data: FitData, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """scipy's bounded 2-point forward-difference Jacobian, with its steps, in two batched calls.

    The fit spent most of its time in scipy's finite differencing, one Python-level residual call
    per parameter. This computes the same steps (√eps·max(1, |x|), flipped or shortened at a
    bound, as scipy.optimize.approx_derivative does) and the same differences, batched: the
    result is identical to jac="2-point" (a test checks it), only cheaper.
    """
    f0 = _fit_residuals(log_p, data)
    sign = (log_p >= 0).astype(float) * 2 - 1
    h = np.finfo(np.float64).eps ** 0.5 * sign * np.maximum(1.0, np.abs(log_p))
    lower, upper = log_p - lo, hi - log_p
    violated = ((log_p + h) < lo) | ((log_p + h) > hi)
    fitting = np.abs(h) <= np.maximum(lower, upper)
    h[violated & fitting] *= -1
    forward = (upper >= lower) & ~fitting
    h[forward] = upper[forward]
    backward = (upper < lower) & ~fitting
    h[backward] = -lower[backward]
    steps = np.repeat(log_p[None, :], len(log_p), axis=0)
    diag = np.arange(len(log_p))
    steps[diag, diag] = log_p + h
    f = np.empty((len(log_p), f0.size))
    f[:-1] = _residual_rows(steps[:-1], data)  # the rows that keep γ
    f[-1] = _residual_rows(steps[-1:], data)[0]  # the γ step: its own exponent
    dx = (log_p + h) - log_p
    return ((f - f0) / dx[:, None]).T


class PerfModel:
    """The throughput model of one job, fitted online from its telemetry."""

    def __init__(self, family: str, params_b: float = 1.0, gpu_type: str = "H200",
                 prior: PolluxParams | None = None, residual_min_samples: int = 12,
                 anchor_prior: bool = False):
        self.prior = prior or scale_prior(family, params_b, gpu_type)
        # Fit under the prior moved to the measured level (anchored_prior): for a job whose
        # prior's level is only a guess (the operator's and huorn run's, from the spec's size
        # and no GPU type), not for the simulator's, whose priors are its workload's own.
        self.anchor_prior = anchor_prior
        self.params = self.prior
        self.samples: list[Sample] = []
        self.residual_min_samples = residual_min_samples
        self._residual: ensemble.GradientBoostingRegressor | None = None
        self._resid_var = 0.0
        self._fitted_on = 0

    # ------------------------------------------------------------------ learning
    def observe(self, sample: Sample) -> None:
        self._check(sample)
        self.samples.append(sample)

    def set_samples(self, samples: list[Sample]) -> None:
        """Replace what the model learns from (a caller that keeps one median per configuration);
        the next prediction refits."""
        for sample in samples:
            self._check(sample)
        self.samples = list(samples)
        self._fitted_on = -1

    @staticmethod
    def _check(sample: Sample) -> None:
        if sample.replicas < 1 or sample.nodes < 1 or sample.nodes > sample.replicas:
            raise ValueError(f"sample: need 1 ≤ nodes ≤ replicas, got replicas={sample.replicas} "
                             f"nodes={sample.nodes}")
        if not (0 < sample.step_time < math.inf and 0 < sample.local_batch < math.inf):
            raise ValueError(f"sample: step_time and local_batch must be finite and > 0, got {sample}")

    def configs_seen(self) -> int:
        return len({(s.replicas, s.nodes, s.local_batch) for s in self.samples})

    def fit(self) -> PolluxParams:
        """Refit the parameters (MAP under the family prior) and the residual regressor."""
        if not self.samples:
            return self.params
        self._fitted_on = len(self.samples)
        r = np.array([s.replicas for s in self.samples], dtype=float)
        n = np.array([s.nodes for s in self.samples], dtype=float)
        b = np.array([s.local_batch for s in self.samples], dtype=float)
        y = np.log([s.step_time for s in self.samples])
        log_prior = np.log(self.anchored_prior().as_array())

        # MAP under Gaussian noise: each residual over its own sigma. Measurements are much tighter
        # than the prior, so a few samples override a prior that belongs to a different model.
        data = (r, n, b, y, log_prior)
        lo = np.full(7, -25.0)
        hi = np.full(7, 10.0)
        lo[6], hi[6] = 0.0, math.log(10.0)  # γ in [1, 10]
        # from the last fit, or the first time from the (anchored) prior
        first = self.params is self.prior
        start = np.clip(np.log(self.params.as_array()) if not first else log_prior, lo + 1e-9, hi - 1e-9)
        result = optimize.least_squares(
            _fit_residuals, start, jac=lambda log_p, d: _fit_jacobian(log_p, d, lo, hi),
            bounds=(lo, hi), method="trf", max_nfev=200, ftol=1e-4, xtol=1e-4, gtol=1e-4,
            args=(data,))  # 1e-4 in log time: 0.01 %
        self.params = PolluxParams.from_array(np.exp(result.x))
        resid = y - np.log(predict_step_time(self.params, r, n, b))
        self._resid_var = float(np.mean(resid**2)) if len(resid) > 1 else 0.0
        self._residual = self._maybe_fit_residual(resid)
        return self.params

    def anchored_prior(self) -> PolluxParams:
        """The prior, or with anchor_prior its time terms all scaled by the median ratio of the
        measured step times to the prior's prediction at the same configurations: the family
        gives the curve's shape, the measurements its level. The Pollux form is homogeneous in
        its time terms, so the scaled prior predicts those step times up to their spread.

        Unanchored, a prior a factor e^13 off (a 4-layer test model priced as a GPU job: 2 µs a
        step against the 1 s measured) cost more in the MAP objective than missing three
        measurements by 2×, and the fit predicted the same throughput at every batch size."""
        if not self.anchor_prior or not self.samples:
            return self.prior
        r = np.array([s.replicas for s in self.samples], dtype=float)
        n = np.array([s.nodes for s in self.samples], dtype=float)
        b = np.array([s.local_batch for s in self.samples], dtype=float)
        measured = np.array([s.step_time for s in self.samples])
        scale = float(np.median(measured / predict_step_time(self.prior, r, n, b)))
        p = self.prior
        return PolluxParams(p.a_c * scale, p.b_c * scale, p.alpha_intra * scale, p.beta_intra * scale,
                            p.alpha_inter * scale, p.beta_inter * scale, p.gamma)

    def _maybe_fit_residual(self, resid: np.ndarray) -> ensemble.GradientBoostingRegressor | None:
        """A correction model, kept only when cross-validation shows the parametric form misses."""
        if len(self.samples) < self.residual_min_samples:
            return None
        x = _features(self.samples)
        # NB: imported here, when a model first has enough samples to try one: scikit-learn
        # takes 0.7 s and tens of MiB to import, which every operator start paid for nothing.
        from sklearn import ensemble, model_selection

        reg = ensemble.GradientBoostingRegressor(n_estimators=60, max_depth=2, learning_rate=0.1,
                                                 random_state=0)
        # Shuffled folds: telemetry arrives sorted by configuration, and contiguous folds would
        # ask the regressor to extrapolate rather than to correct.
        folds = model_selection.KFold(min(5, len(self.samples)), shuffle=True, random_state=0)
        pred = model_selection.cross_val_predict(reg, x, resid, cv=folds)
        if np.mean(np.abs(resid - pred)) >= 0.9 * np.mean(np.abs(resid)):
            return None
        self._resid_var = float(np.mean((resid - pred) ** 2))  # the error of the corrected model
        return reg.fit(x, resid)

    # ------------------------------------------------------------------ predicting
    def predict(self, replicas: int, nodes: int, local_batch: float) -> Prediction:
        if self._fitted_on != len(self.samples):
            self.fit()
        t = float(predict_step_time(self.params, replicas, nodes, local_batch))
        if self._residual is not None:
            x = _features([Sample(replicas, nodes, local_batch, t)])
            t *= math.exp(float(self._residual.predict(x)[0]))
        seen = self.configs_seen()
        # The prior's weight fades as distinct configurations pin the curve down.
        prior_share = 1.0 / (1.0 + seen) ** 2
        rel_std = math.sqrt(self._resid_var + prior_share * PRIOR_LOG_STD**2)
        return Prediction(t, replicas * local_batch / t, rel_std)

    def predict_many(self, replicas: np.ndarray, nodes: np.ndarray, local_batch: np.ndarray) -> np.ndarray:
        """Throughput for many configurations at once (the allocator's inner loop), with the same
        correction `predict` applies: the allocator read the parametric part only, so a job whose
        measurements the Pollux form misses (kept only where cross-validation says so) was
        allocated by a curve its own model had already corrected."""
        if self._fitted_on != len(self.samples):
            self.fit()
        t = predict_step_time(self.params, replicas, nodes, local_batch)
        if self._residual is not None:
            shape = np.shape(t)
            t = t * np.exp(self._residual.predict(_feature_rows(replicas, nodes, local_batch))).reshape(shape)
        return np.asarray(replicas) * np.asarray(local_batch) / t
