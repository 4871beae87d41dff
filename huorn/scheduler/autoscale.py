"""How many serving replicas an InferenceJob needs, from what its replicas measure.

The rule is the Kubernetes HorizontalPodAutoscaler's, on the metric a batching server saturates
on, its requests in flight against its batch slots (Knative's concurrency target, and what
KServe users scale vLLM on), with the job's SLO as two further floors; platform teams already
know how it behaves, and each part of it answers a known failure of simpler rules:

- **Slot utilisation.** Rows in flight per replica come from the area under its in-flight
  gauge (`huorn_serve_in_flight_row_seconds_total`): its growth over an interval, divided by the
  interval, is the mean number in flight then; or from the count not yet answered at the scrape,
  where that is more. (A replica too old to export the area is read by Little's law on its
  latency histogram's sum, which charges each request's whole duration to the interval it ends
  in: for answers longer than the interval it reads two to four times the load.) The fleet needs
  ceil(in flight / (serving.maxBatch × targetUtilization)) replicas, so that each would fill
  that share of its batch, with room left for a burst while new replicas load. A replica's
  busy fraction (seconds decoding per second) is no measure of its capacity when it batches:
  one request at a time keeps it busy all the time at a fraction of what it serves with full
  batches (measured: benchmarks/serving_autoscale.py scaled to its maximum on the first, light,
  minute of the trace with busy fraction as the metric).
- **Latency guard.** A p99 latency above `slo.p99LatencyMs` (from the replicas' latency
  histograms, interpolated as Prometheus's histogram_quantile does) asks for one replica more
  than now even when utilisation looks low: long prompts queue behind each other without a
  replica ever looking busier than its batch.
- **Throughput floor.** With `slo.tokensPerSecond`, the fleet keeps enough replicas to generate
  that many tokens a second at the target utilisation, from the tokens a replica generates per
  busy second.
- **Forecast floor (predictive scaling).** With `autoscaling.forecast`, the replicas that the
  prediction board's forecast peak of the next 10 minutes needs are a floor too (ForecastFloor),
  so replicas load before a rise rather than after it: a replica takes minutes to load a model,
  and a rule on what the replicas measure sees a rise only once requests queue. The floor joins
  the stabilisation window like any reading, so the fleet does not shrink ahead of a forecast
  rise either. With no replica measured yet, the floor alone may raise the count.
- **Growth is fast, shrinking is slow.** A rise is applied at once (at most doubling, or four
  more, per decision: the HPA's default policy), a fall only once every recommendation in the
  last `scaleDownDelaySeconds` agrees (its stabilisation window), so a replica that took minutes
  to load is not dropped in a lull between two bursts.

- **Scale to zero** (`minReplicas: 0`). The fleet goes to zero only when every recommendation
  of the window was zero, which takes a whole `scaleDownDelaySeconds` with no request in flight
  at all (any traffic rounds up to one replica), no latency or token floor and no forecast that
  needs one; `slo.tokensPerSecond` is a standing capacity and keeps one replica. At zero there
  is nothing to measure: the activator (huorn.runtime.activator) holds the requests that come,
  and the count it holds (`held`) asks for replicas at once, ceil(held / (slots × target)); so
  does a count beyond what the replicas still loading can take.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReplicaSample:
    """One replica's counters at one scrape, cumulative as the replica exports them."""

    time: float
    requests: float
    tokens: float
    busy_seconds: float
    latency_seconds: float = 0.0  # the latency histogram's sum: seconds of all requests answered
    in_flight: float = 0.0  # requests accepted and not yet answered, at the scrape
    latency_buckets: tuple[tuple[float, float], ...] = ()  # (upper bound, cumulative count), +Inf last
    prompt_tokens: float = 0.0  # prompt tokens prefilled or taken from the prefix cache
    cached_tokens: float = 0.0  # of those, taken from the prefix cache
    # rows in flight integrated over time (None from a replica of a version without it)
    row_seconds: float | None = None
    ttft_buckets: tuple[tuple[float, float], ...] = ()  # time to first token, as latency_buckets


@dataclass(frozen=True)
class LoadReading:
    """The fleet's load between two scrapes, over the replicas measured both times."""

    replicas: int
    requests_per_second: float
    tokens_per_second: float
    busy: float  # Σ busy fraction: replicas' worth of decoding
    in_flight: float  # mean requests in flight over the fleet (queued or decoding)
    p99_seconds: float | None
    tokens_per_busy_second: float | None
    # Share of the interval's prompt tokens whose K/V came from the replicas' prefix caches: what
    # prefix routing and the cache's size buy (None: no prompt came)
    cached_prompt_share: float | None = None
    ttft_p99_seconds: float | None = None  # arrival to first token

    def utilization(self, slots: int) -> float:
        """Share of the measured replicas' batch slots in use."""
        return self.in_flight / (self.replicas * slots) if self.replicas and slots else 0.0


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus's histogram_quantile over cumulative (upper bound, count) buckets: linear
    within the bucket the rank falls in; the last finite bound when it falls in +Inf."""
    if not buckets or not 0 <= q <= 1:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            width = count - lower_count
            share = (rank - lower_count) / width if width > 0 else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def read_load(before: Mapping[str, ReplicaSample], after: Mapping[str, ReplicaSample]) -> LoadReading | None:
    """Rates over the replicas scraped both times. A replica whose counters went down restarted
    (its process began again from zero) and is left out of this reading; None when no replica
    can be read twice yet."""
    requests = tokens = busy = busy_seconds = in_flight = in_flight_now = 0.0
    merged: dict[float, float] = {}
    first: dict[float, float] = {}
    measured = 0
    for replica, now in after.items():
        then = before.get(replica)
        if then is None or now.time <= then.time:
            continue
        deltas = (now.requests - then.requests, now.tokens - then.tokens,
                  now.busy_seconds - then.busy_seconds, now.latency_seconds - then.latency_seconds)
        if min(deltas) < 0:
            continue
        elapsed = now.time - then.time
        measured += 1
        requests += deltas[0] / elapsed
        tokens += deltas[1] / elapsed
        busy += min(1.0, deltas[2] / elapsed)
        busy_seconds += deltas[2]
        area = (now.row_seconds, then.row_seconds)
        if area[0] is not None and area[1] is not None and area[0] >= area[1]:
            in_flight += (area[0] - area[1]) / elapsed  # the interval's exact mean
        else:  # Little's law, exact only for answers much shorter than the interval
            in_flight += deltas[3] / elapsed
        in_flight_now += now.in_flight
        for into, was, is_now in ((merged, then.latency_buckets, now.latency_buckets),
                                  (first, then.ttft_buckets, now.ttft_buckets)):
            old = dict(was)
            for bound, count in is_now:
                into[bound] = into.get(bound, 0.0) + max(0.0, count - old.get(bound, 0.0))
    if not measured:
        return None
    buckets = sorted(merged.items())
    p99 = histogram_quantile(0.99, buckets)
    made = sum(now.tokens - before[r].tokens for r, now in after.items()
               if r in before and now.time > before[r].time and now.tokens >= before[r].tokens)
    prompts = cached = 0.0
    for replica, now in after.items():
        then = before.get(replica)
        if then is not None and now.time > then.time and now.prompt_tokens >= then.prompt_tokens \
                and now.cached_tokens >= then.cached_tokens:
            prompts += now.prompt_tokens - then.prompt_tokens
            cached += now.cached_tokens - then.cached_tokens
    return LoadReading(
        replicas=measured,
        requests_per_second=requests,
        tokens_per_second=tokens,
        busy=busy,
        # The interval's mean, or the count now when more are waiting than that: a replica whose
        # answers stopped (overloaded, stuck) completes nothing and would otherwise read idle.
        in_flight=max(in_flight, in_flight_now),
        p99_seconds=p99,
        tokens_per_busy_second=made / busy_seconds if busy_seconds > 0 and made > 0 else None,
        cached_prompt_share=cached / prompts if prompts > 0 else None,
        ttft_p99_seconds=histogram_quantile(0.99, sorted(first.items())),
    )


@dataclass(frozen=True)
class ScalingRule:
    """The job's autoscaling settings and SLO, in the units the rule uses."""

    min_replicas: int
    max_replicas: int
    slots_per_replica: int = 1  # serving.maxBatch: requests a replica decodes together
    target_utilization: float = 0.7
    p99_seconds: float | None = None  # the whole answer's
    ttft_p99_seconds: float | None = None  # to the first token's
    tokens_per_second: float | None = None
    scale_down_delay_seconds: float = 300.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"replica range [{self.min_replicas}, {self.max_replicas}] is empty "
                             "(spec.autoscaling.minReplicas..maxReplicas)")
        if self.slots_per_replica < 1:
            raise ValueError(f"slots_per_replica must be ≥ 1 (spec.serving.maxBatch), got "
                             f"{self.slots_per_replica}")
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"target_utilization {self.target_utilization} is outside (0, 1] "
                             "(spec.autoscaling.targetUtilization)")

    @property
    def floor(self) -> int:
        return self.min_replicas


@dataclass(frozen=True)
class ForecastFloor:
    """The replicas the forecast peak rate needs (huorn.scheduler.forecast's board, at one
    replica's rate)."""

    replicas: int
    peak_requests_per_second: float
    requests_per_replica: float

    @property
    def reason(self) -> str:
        return (f"forecast peak {self.peak_requests_per_second:.3g} requests/s over the next 10 minutes "
                f"needs {self.replicas} replica(s) at {self.requests_per_replica:g} each")


@dataclass(frozen=True)
class Recommendation:
    replicas: int
    reason: str


@dataclass
class Autoscaler:
    """One InferenceJob's rule and the recent raw recommendations its stabilisation window reads.
    Memory only: a restarted operator starts with an empty window, and keeps the replicas it
    finds until the window has filled again."""

    rule: ScalingRule
    window: deque[tuple[float, int]] = field(default_factory=deque)
    started: float | None = None

    def raw(self, current: int, reading: LoadReading,
            forecast: ForecastFloor | None = None) -> tuple[int, str]:
        """What this reading and the forecast ask for, and why."""
        rule = self.rule
        need = math.ceil(reading.in_flight / (rule.slots_per_replica * rule.target_utilization) - 1e-9)
        why = (f"{reading.in_flight:.1f} request(s) in flight on {reading.replicas} replica(s) of "
               f"{rule.slots_per_replica} slot(s) (target utilisation {rule.target_utilization:g})")
        if reading.requests_per_second > 0 and need < 1:
            # a request came: "scaled to zero after scaleDownDelaySeconds without a request"
            need, why = 1, f"{reading.requests_per_second:.2g} request(s)/s"
        targets = (("p99 time to first token", rule.ttft_p99_seconds, reading.ttft_p99_seconds),
                   ("p99 latency", rule.p99_seconds, reading.p99_seconds))
        late = "; ".join(f"{what} {p99 * 1000:.0f} ms is above the SLO's {target * 1000:.0f} ms"
                         for what, target, p99 in targets
                         if target is not None and p99 is not None and p99 > target)
        if late:
            if reading.replicas < current:
                # A replica added is still loading (p99 is measured on ready replicas only): wait
                # for it before adding another. Adding one a tick, a burst that outlasted a model
                # load asked for a dozen replicas, all kept for scaleDownDelaySeconds.
                if current > need:
                    need = current
                    why = f"{late}; {current - reading.replicas} replica(s) still starting"
            elif current + 1 > need:
                need, why = current + 1, late
        if rule.tokens_per_second is not None and reading.tokens_per_busy_second:
            per_replica = reading.tokens_per_busy_second * rule.target_utilization
            floor = math.ceil(rule.tokens_per_second / per_replica)
            if floor > need:
                need = floor
                why = (f"slo.tokensPerSecond {rule.tokens_per_second:g} needs {floor} replica(s) at "
                       f"{reading.tokens_per_busy_second:.0f} tokens per busy second")
        if forecast is not None and forecast.replicas > need:
            need, why = forecast.replicas, forecast.reason
        return need, why

    def recommend(self, now: float, current: int, reading: LoadReading | None,
                  forecast: ForecastFloor | None = None, held: float = 0.0) -> Recommendation:
        """`held`: requests the activator holds for want of a replica (scaled to zero)."""
        rule = self.rule
        lo, hi = rule.floor, rule.max_replicas
        if self.started is None:
            self.started = now
        inside = min(hi, max(lo, current))
        if inside != current:
            return Recommendation(inside, f"{current} replica(s) is outside {lo}..{hi} (spec.autoscaling): "
                                          f"{current} → {inside}")
        if reading is None and held > 0:
            # No replica measured (none runs, or the first ones still load): what the activator
            # holds is the load, and more of it than the replicas coming can take asks for more now
            need = math.ceil(held / (rule.slots_per_replica * rule.target_utilization) - 1e-9)
            need = max(1, need, forecast.replicas if forecast is not None else 0)
            step = min(hi, need, max(2 * current, current + 4))
            if step > current:
                self.window.append((now, step))
                ready = "no replica" if current == 0 else f"{current} replica(s) not ready yet"
                return Recommendation(step, f"{held:.0f} request(s) held by the activator with {ready}: "
                                            f"{current} → {step} replica(s)")
        if reading is None:
            # Nothing measured: the forecast may only raise the count, and is not a reading the
            # scale-down window could trust later.
            if forecast is not None and min(hi, forecast.replicas) > current:
                step = min(hi, forecast.replicas, max(2 * current, current + 4))
                return Recommendation(step, f"{forecast.reason}: {current} → {step} replica(s)")
            if current == 0:
                return Recommendation(0, "scaled to zero: no request held")
            # The replicas starting are still wanted: nothing measured says otherwise. Without
            # this, a replica woken from zero that answered its held requests before its first
            # scrape found only the wake-up in the window, older than the delay, and went back to
            # zero seconds later.
            self.window.append((now, current))
            return Recommendation(current, "no replica measured twice yet")
        need, why = self.raw(current, reading, forecast)
        need = min(hi, max(lo, need))
        self.window.append((now, need))
        while self.window and self.window[0][0] < now - rule.scale_down_delay_seconds:
            self.window.popleft()
        if need > current:
            step = min(need, max(2 * current, current + 4))
            return Recommendation(step, f"{why}: {current} → {step} replica(s)")
        if need < current:
            # Every recommendation of the whole window must allow the fall, and the window must
            # really span the delay (a restarted operator has no history to trust yet).
            if now - self.started < rule.scale_down_delay_seconds:
                return Recommendation(current, f"{why}; kept: the scale-down window has not elapsed")
            floor = max(n for _, n in self.window)
            if floor < current:
                return Recommendation(floor, f"{why} for {rule.scale_down_delay_seconds:.0f} s: "
                                             f"{current} → {floor} replica(s)")
            return Recommendation(current, f"{why}; kept: load in the last "
                                           f"{rule.scale_down_delay_seconds:.0f} s needed {floor}")
        return Recommendation(current, why)
