"""The serving autoscaler's rule (huorn.scheduler.autoscale), the reading of real replica metrics
(the serving runtime's own Prometheus registry), and the objects a replica runs in."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import prometheus_client
import pytest
from hypothesis import given
from hypothesis import strategies as st

from huorn.api import inference
from huorn.backends import replica_metrics
from huorn.backends.kubernetes import manifests
from huorn.graph.model import Instance
from huorn.operator import serving
from huorn.runtime import serve
from huorn.scheduler import autoscale


def sample(t: float, busy: float, requests: float = 0.0, tokens: float = 0.0, latency: float = 0.0,
           buckets: tuple[tuple[float, float], ...] = ()) -> autoscale.ReplicaSample:
    return autoscale.ReplicaSample(t, requests, tokens, busy, latency_seconds=latency,
                                   latency_buckets=buckets)


def reading(in_flight: float, replicas: int = 1, p99: float | None = None,
            per_busy_second: float | None = None, requests: float | None = None) -> autoscale.LoadReading:
    """A fleet with nothing in flight had no request either, unless `requests` says so."""
    rate = (10.0 if in_flight > 0 else 0.0) if requests is None else requests
    return autoscale.LoadReading(replicas, rate, 100.0, 1.0, in_flight, p99, per_busy_second)


def rule(**kw: object) -> autoscale.ScalingRule:
    """Two batch slots per replica at a target of 0.5: one request in flight per replica."""
    args = {"min_replicas": 1, "max_replicas": 16, "slots_per_replica": 2, "target_utilization": 0.5,
            "scale_down_delay_seconds": 60.0}
    return autoscale.ScalingRule(**{**args, **kw})  # type: ignore[arg-type]


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    # 100 observations: 50 in (0, 0.1], 40 in (0.1, 0.5], 10 in (0.5, 1]
    buckets = [(0.1, 50.0), (0.5, 90.0), (1.0, 100.0), (float("inf"), 100.0)]
    assert autoscale.histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert autoscale.histogram_quantile(0.7, buckets) == pytest.approx(0.1 + 0.4 * 20 / 40)
    assert autoscale.histogram_quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * 9 / 10)
    # rank in the +Inf bucket: the last finite bound, as Prometheus answers
    assert autoscale.histogram_quantile(0.99, [(0.1, 1.0), (float("inf"), 10.0)]) == pytest.approx(0.1)
    assert autoscale.histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None


def test_read_load_sums_rates_and_leaves_out_a_restarted_replica() -> None:
    before = {"a": sample(0, busy=10, requests=100, tokens=1000, latency=40),
              "b": sample(0, busy=50, requests=7), "c": sample(0, busy=3, latency=5)}
    after = {"a": sample(10, busy=15, requests=150, tokens=3000, latency=70),
             "b": sample(10, busy=2, requests=1), "c": sample(10, busy=13, latency=15),
             "d": sample(10, busy=1)}
    got = autoscale.read_load(before, after)
    assert got is not None
    assert got.replicas == 2  # b restarted (its counters fell), d was not scraped before
    assert got.busy == pytest.approx(0.5 + 1.0)
    assert got.requests_per_second == pytest.approx(5.0)
    # Little's law: 30 + 10 request-seconds answered in 10 s = 4 requests in flight on average
    assert got.in_flight == pytest.approx(4.0) and got.utilization(2) == pytest.approx(1.0)
    assert got.tokens_per_busy_second == pytest.approx(2000 / 15)
    assert autoscale.read_load({}, after) is None
    # Answers stopped (overloaded or stuck): nothing completes, but 12 wait; that is the load.
    stuck = autoscale.read_load({"a": sample(0, busy=1, latency=4)},
                                {"a": dataclasses.replace(sample(10, busy=1, latency=4), in_flight=12)})
    assert stuck is not None and stuck.in_flight == 12


def test_a_busy_fleet_grows_at_once_within_the_growth_step_and_the_bounds() -> None:
    scaler = autoscale.Autoscaler(rule())
    rec = scaler.recommend(0.0, 2, reading(in_flight=3.6, replicas=2))
    assert rec.replicas == 4 and "3.6 request(s) in flight on 2 replica(s) of 2 slot(s)" in rec.reason
    assert "2 → 4" in rec.reason
    # 50 replicas' worth of load from 2: at most double or +4 per decision (the HPA's policy)
    assert autoscale.Autoscaler(rule()).recommend(0.0, 2, reading(in_flight=50, replicas=2)).replicas == 6
    capped = autoscale.Autoscaler(rule(max_replicas=3))
    assert capped.recommend(0.0, 2, reading(in_flight=4, replicas=2)).replicas == 3


def test_the_latency_guard_and_the_throughput_floor_raise_a_quiet_looking_fleet() -> None:
    guarded = autoscale.Autoscaler(rule(p99_seconds=0.25))
    slow = guarded.recommend(0.0, 3, reading(in_flight=0.3, replicas=3, p99=0.9))
    assert slow.replicas == 4 and "p99 latency 900 ms is above the SLO's 250 ms" in slow.reason
    floor = autoscale.Autoscaler(rule(tokens_per_second=2000)).recommend(
        0.0, 1, reading(in_flight=0.2, per_busy_second=1000))
    assert floor.replicas == 4 and "slo.tokensPerSecond 2000 needs 4" in floor.reason  # 2000 / (1000 × 0.5)


def test_a_fall_waits_for_the_whole_window_and_takes_its_highest_need() -> None:
    scaler = autoscale.Autoscaler(rule(scale_down_delay_seconds=60))
    assert scaler.recommend(0.0, 4, reading(in_flight=3.9, replicas=4)).replicas == 4  # needs 4
    assert scaler.recommend(30.0, 4, reading(in_flight=0.2, replicas=4)).replicas == 4  # window not elapsed
    assert scaler.recommend(59.0, 4, reading(in_flight=0.2, replicas=4)).replicas == 4
    rec = scaler.recommend(70.0, 4, reading(in_flight=0.2, replicas=4))  # t=0 left the window; 30..70 need 1
    assert rec.replicas == 1 and "for 60 s: 4 → 1" in rec.reason


def test_no_reading_keeps_the_replicas_inside_the_range() -> None:
    scaler = autoscale.Autoscaler(rule(min_replicas=1, max_replicas=3, scale_down_delay_seconds=0))
    assert scaler.recommend(0.0, 5, None).replicas == 3
    assert scaler.recommend(1.0, 0, None).replicas == 1
    assert scaler.recommend(2.0, 2, reading(in_flight=0.0, replicas=2)).replicas == 1
    with pytest.raises(ValueError, match="targetUtilization"):
        rule(target_utilization=1.5)


def test_the_forecast_floor_loads_replicas_before_the_rise_and_holds_them_through_the_window() -> None:
    """Predictive scaling: the board's peak of the next 10 minutes (here 45 requests/s at 10 a
    replica: 5) raises a quiet fleet before its replicas measure anything, and a fall waits while
    the forecast still needs them."""
    scaler = autoscale.Autoscaler(rule(scale_down_delay_seconds=60))
    coming = autoscale.ForecastFloor(5, 45.0, 10.0)
    # nothing measured yet: the forecast alone may raise the count, within the growth step
    first = scaler.recommend(0.0, 1, None, coming)
    assert first.replicas == 5 and first.reason == ("forecast peak 45 requests/s over the next 10 minutes "
                                                    "needs 5 replica(s) at 10 each: 1 → 5 replica(s)")
    assert scaler.recommend(1.0, 8, None, coming).replicas == 8  # and never lower it
    # measured and quiet (0.4 in flight needs 1), but the forecast needs 5: kept at 5
    quiet = scaler.recommend(10.0, 5, reading(in_flight=0.4, replicas=5), coming)
    assert quiet.replicas == 5 and quiet.reason.startswith("forecast peak 45 requests/s")
    # the forecast falls; the replicas go only once the whole window allows it
    calm = autoscale.ForecastFloor(1, 4.0, 10.0)
    assert scaler.recommend(40.0, 5, reading(in_flight=0.4, replicas=5), calm).replicas == 5
    assert scaler.recommend(80.0, 5, reading(in_flight=0.4, replicas=5), calm).replicas == 1
    # a measured need above the forecast wins, and the bounds still hold
    busy = scaler.recommend(90.0, 1, reading(in_flight=3.0, replicas=1), calm)
    assert busy.replicas == 3 and "in flight" in busy.reason
    capped = autoscale.Autoscaler(rule(max_replicas=3))
    assert capped.recommend(0.0, 1, None, coming).replicas == 3
    assert capped.recommend(1.0, 2, reading(in_flight=0.1, replicas=2), coming).replicas == 3


def test_scale_to_zero_needs_a_whole_quiet_window_and_held_requests_wake_it_at_once() -> None:
    scaler = autoscale.Autoscaler(rule(min_replicas=0, max_replicas=8, scale_down_delay_seconds=60))
    # any traffic at all rounds up to one replica: a trickle never scales to zero
    assert scaler.recommend(0.0, 1, reading(in_flight=0.01)).replicas == 1
    assert scaler.recommend(30.0, 1, reading(in_flight=0.0)).replicas == 1  # t=0's 1 still in the window
    gone = scaler.recommend(61.0, 1, reading(in_flight=0.0))
    assert gone.replicas == 0 and "1 → 0" in gone.reason
    # at zero nothing is measured, and nothing held keeps it there
    assert scaler.recommend(70.0, 0, None).replicas == 0
    # the activator holds 5 requests: two slots a replica at 0.5 → 5 replicas, at most 4 at once
    woken = scaler.recommend(131.0, 0, None, held=5)
    assert woken.replicas == 4 and woken.reason == ("5 request(s) held by the activator with no replica: "
                                                   "0 → 4 replica(s)")
    assert scaler.recommend(132.0, 0, None, held=1).replicas == 1
    # the first replicas still load and the activator holds more than they can take: more now
    loading = scaler.recommend(133.0, 4, None, held=12)
    assert loading.replicas == 8 and "4 replica(s) not ready yet: 4 → 8" in loading.reason
    assert scaler.recommend(134.0, 4, None, held=3).replicas == 4  # the coming ones suffice
    # a standing tokens-per-second SLO keeps one replica whatever the load
    tokens = autoscale.Autoscaler(rule(min_replicas=0, tokens_per_second=10.0, scale_down_delay_seconds=0))
    assert tokens.recommend(0.0, 1, reading(in_flight=0.0, per_busy_second=100.0)).replicas == 1



def test_a_replica_woken_from_zero_stays_a_whole_delay_after_it_served() -> None:
    """Woken by held requests, the replica answered them before its first scrape: the window
    held only the wake-up, older than the delay, and the job went back to zero seconds after
    serving, to cold-start again at the next request (found by review)."""
    scaler = autoscale.Autoscaler(rule(min_replicas=0, max_replicas=4, scale_down_delay_seconds=60))
    assert scaler.recommend(0.0, 0, None, held=1).replicas == 1
    assert scaler.recommend(120.0, 1, None, held=0).replicas == 1  # a slow model load
    assert scaler.recommend(135.0, 1, reading(in_flight=0.0)).replicas == 1
    # a request answered between two scrapes is a request, though none was in flight at either
    assert scaler.recommend(190.0, 1, reading(in_flight=0.0, requests=0.1)).replicas == 1
    assert scaler.recommend(240.0, 1, reading(in_flight=0.0)).replicas == 1
    assert scaler.recommend(251.0, 1, reading(in_flight=0.0)).replicas == 0


def test_the_latency_guard_waits_for_the_replica_it_added() -> None:
    """p99 above the SLO asked for one more replica at every tick, while the one added before
    still loaded (p99 is measured on ready replicas only): a burst longer than a model load asked
    for eight (found by review)."""
    scaler = autoscale.Autoscaler(rule(max_replicas=8, slots_per_replica=32, p99_seconds=1.0))
    current = 1
    for tick in range(8):
        current = scaler.recommend(15.0 * tick, current, reading(in_flight=1.0, replicas=1, p99=5.0)).replicas
    assert current == 2
    # once the added replica is measured and latency is still high, one more
    assert scaler.recommend(200.0, 2, reading(in_flight=1.0, replicas=2, p99=5.0)).replicas == 3

@given(st.integers(1, 20), st.lists(st.floats(0, 40), min_size=1, max_size=30), st.integers(0, 5),
       st.integers(1, 20))
def test_recommendations_stay_in_range_and_never_fall_inside_the_window(
    current: int, loads: list[float], low: int, span: int
) -> None:
    """The window is the test's own record of what each reading needed, not the scaler's deque: a
    scaler that dropped its history after a second fell inside the window and passed."""
    r = rule(min_replicas=low, max_replicas=low + span, scale_down_delay_seconds=25)
    scaler = autoscale.Autoscaler(r)
    outside = scaler.recommend(0.0, low + span + current, None)  # a bound lowered under the replicas
    assert outside.replicas == low + span and "outside" in outside.reason
    current = min(low + span, max(low, 1, current))
    needs: list[tuple[float, int]] = []  # (time, replicas the load then needed): one in flight each
    for step, busy in enumerate(loads):
        now = step * 10.0
        asked = max(math.ceil(busy - 1e-9), 1 if busy > 0 else 0)
        if current:
            rec = scaler.recommend(now, current, reading(in_flight=busy, replicas=current))
            needs.append((now, min(low + span, max(low, asked))))
        else:  # scaled to zero: the load is what the activator holds
            rec = scaler.recommend(now, current, None, held=busy)
            assert rec.replicas == (min(low + span, asked, 4) if busy > 0 else 0)
            needs.append((now, rec.replicas))
        window = [need for t, need in needs if t >= now - 25]
        assert low <= rec.replicas <= low + span
        if rec.replicas == 0:  # only after a whole window in which nothing was in flight
            assert now >= 25 and low == 0 and max(window) == 0
        if rec.replicas < current:
            assert now >= 25  # no fall before a whole window was seen
            assert rec.replicas >= max(window)
        current = rec.replicas


def test_the_serving_runtimes_metrics_read_back_as_a_sample() -> None:
    metrics = serve.Metrics()
    metrics.requests.labels("ok").inc(12)
    metrics.requests.labels("refused").inc(3)
    metrics.tokens.inc(480)
    metrics.busy.inc(2.5)
    metrics.in_flight.inc(3)
    for seconds in np.linspace(0.02, 0.4, 12):
        metrics.latency.observe(float(seconds))
    text = prometheus_client.generate_latest(metrics.registry).decode()
    got = replica_metrics.parse_metrics(text, 7.0)
    assert got is not None
    assert (got.time, got.requests, got.tokens, got.busy_seconds) == (7.0, 12.0, 480.0, 2.5)
    assert got.latency_seconds == pytest.approx(float(np.linspace(0.02, 0.4, 12).sum()))
    assert got.in_flight == 3
    assert got.latency_buckets[-1] == (float("inf"), 12.0)
    p99 = autoscale.histogram_quantile(0.99, got.latency_buckets)
    assert p99 is not None and 0.25 < p99 <= 0.5
    assert replica_metrics.parse_metrics("some_other_metric 1\n", 0.0) is None


def test_the_share_of_prompt_tokens_from_the_prefix_caches_is_read_over_the_interval() -> None:
    def scraped(t: float, cache: float, prefill: float) -> autoscale.ReplicaSample:
        metrics = serve.Metrics()
        metrics.busy.inc(t)
        metrics.prompt_tokens.labels("cache").inc(cache)
        metrics.prompt_tokens.labels("prefill").inc(prefill)
        got = replica_metrics.parse_metrics(prometheus_client.generate_latest(metrics.registry).decode(), t)
        assert got is not None
        return got

    before = {"a": scraped(1.0, 100, 900), "b": scraped(1.0, 0, 0)}
    after = {"a": scraped(2.0, 400, 1000), "b": scraped(2.0, 300, 200)}
    got = autoscale.read_load(before, after)
    # the interval's own tokens: a's 300 cached of 400, b's 300 of 500; not a's history before
    assert got is not None and got.cached_prompt_share == pytest.approx(600 / 900)
    idle = autoscale.read_load(after, {k: dataclasses.replace(v, time=3.0) for k, v in after.items()})
    assert idle is not None and idle.cached_prompt_share is None  # no prompt: no share to report


def test_a_replica_pod_is_pinned_probed_and_reads_its_config() -> None:
    ref = manifests.JobRef("InferenceJob", "chat", "team", "uid-1")
    spec = {"virtualCluster": "serve", "resources": {"gpus": 2}, "model": {"checkpoint": "/m/ckpt"},
            "checkpoint": {"volume": "models", "path": "/m"},
            "image": "mirror.example/huorn:1"}  # resolved already (operator.images.pin)
    pod = manifests.build_serve_pod(ref, Instance("server", 1, 2), "b0", spec, "serve")
    container = pod["spec"]["containers"][0]
    assert pod["metadata"]["name"] == "chat-server-1-g2"
    assert pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["b0"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2" and container["image"] == spec["image"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": manifests.SERVE_PORT}
    assert {"name": "checkpoints", "mountPath": "/m", "readOnly": True} in container["volumeMounts"]
    config = json.loads(manifests.build_serve_config_map(ref, spec)["data"]["config.json"])
    assert serve.ServeConfig.model_validate(config).port == manifests.SERVE_PORT
    cpu_spec = {**spec, "resources": {"gpus": 0}}
    cpu = manifests.build_serve_pod(ref, Instance("server", 0), "", cpu_spec, "serve")
    assert "affinity" not in cpu["spec"]  # the default scheduler places a CPU replica


def test_only_fields_a_running_replica_cannot_reread_roll_it() -> None:
    spec = {"model": {"checkpoint": "/a"}, "autoscaling": {"maxReplicas": 2}, "slo": {"p99LatencyMs": 100}}
    same = manifests.serve_template_hash(spec)
    assert manifests.serve_template_hash({**spec, "autoscaling": {"maxReplicas": 9}, "priority": 7}) == same
    assert manifests.serve_template_hash({**spec, "model": {"checkpoint": "/b"}}) != same
    assert manifests.serve_template_hash({**spec, "image": "other:1"}) != same
    assert manifests.serve_template_hash({**spec, "routing": {"policy": "prefix"}}) == same


def test_a_longer_activation_timeout_reaches_the_replicas_startup_probe_and_a_router_its_holding() -> None:
    """activationTimeoutSeconds feeds a replica's startup probe once above the default load limit,
    and `autoscaling` was left out of the hash whole: running replicas kept the shorter probe.
    A prefix router reads minReplicas 0 (hold requests while no replica is known) at its start:
    one started at minReplicas 1 was kept at 0, unready at zero replicas, for good."""
    spec = {"model": {"checkpoint": "/a"}, "autoscaling": {"activationTimeoutSeconds": 120}}
    same = manifests.serve_template_hash(spec)
    assert manifests.serve_template_hash({**spec, "autoscaling": {"activationTimeoutSeconds": 60}}) == same
    longer = {**spec, "autoscaling": {"activationTimeoutSeconds": 3000}}
    assert manifests.startup_seconds(longer) == 3000 and manifests.serve_template_hash(longer) != same
    assert same == manifests.serve_template_hash({"model": {"checkpoint": "/a"}})  # as before the change
    routed = {**spec, "routing": {"policy": "prefix"}, "autoscaling": {"minReplicas": 1}}
    to_zero = {**routed, "autoscaling": {"minReplicas": 0}}
    assert manifests.front_template_hash(to_zero) != manifests.front_template_hash(routed)
    assert manifests.front_template_hash({**routed, "autoscaling": {"minReplicas": 2}}) == \
        manifests.front_template_hash(routed)


def test_an_operator_upgrade_that_adds_the_prefix_cache_rolls_no_replica() -> None:
    before = {"model": {"checkpoint": "/a"}, "serving": {"maxBatch": 8, "maxTokens": 64}}
    started_by_old_operator = manifests.serve_template_hash(before)
    upgraded = {**before, "serving": {**before["serving"], "prefixCacheTokens": 8192},
                "routing": {"policy": "service", "loadFactor": 1.25}}
    assert started_by_old_operator in manifests.serve_template_hashes(upgraded)
    assert manifests.serve_template_hash(upgraded) in manifests.serve_template_hashes(upgraded)
    # a cache size the user set is a change a running replica cannot pick up: it rolls
    resized = {**upgraded, "serving": {**before["serving"], "prefixCacheTokens": 1024}}
    assert started_by_old_operator not in manifests.serve_template_hashes(resized)


def test_an_operator_upgrade_that_adds_continuous_batching_rolls_no_replica() -> None:
    oldest = {"model": {"checkpoint": "/a"}, "serving": {"maxBatch": 8, "maxTokens": 64}}
    with_cache = {**oldest, "serving": {**oldest["serving"], "prefixCacheTokens": 8192}}
    upgraded = {**with_cache, "serving": {**with_cache["serving"], "batching": "continuous"}}
    hashes = manifests.serve_template_hashes(upgraded)
    assert {manifests.serve_template_hash(s) for s in (oldest, with_cache, upgraded)} <= hashes
    # static batching, or a cache size, asked for: a running replica cannot pick either up
    static = {**upgraded, "serving": {**upgraded["serving"], "batching": "static"}}
    assert manifests.serve_template_hashes(static) == {manifests.serve_template_hash(static)}
    resized = {**upgraded, "serving": {**upgraded["serving"], "prefixCacheTokens": 64}}
    assert manifests.serve_template_hash(oldest) not in manifests.serve_template_hashes(resized)
    assert manifests.serve_template_hash(with_cache) not in manifests.serve_template_hashes(resized)


def test_every_serving_field_since_the_first_operator_rolls_no_replica_at_its_default() -> None:
    """A field added to spec.serving is defaulted into every stored spec once the new CRD is
    applied; unless it is in ADDED_SERVING_FIELDS, that changes every replica's hash and an
    operator upgrade rolls them all (cudaGraphs was added without it)."""
    first_operators = {"maxBatch", "maxTokens"}
    fields = {f.alias or name for name, f in inference.ServingLimits.model_fields.items()}
    added = [name for name, _ in manifests.ADDED_SERVING_FIELDS]
    assert fields - first_operators == set(added)
    oldest = {"model": {"checkpoint": "/a"}, "serving": {"maxBatch": 8, "maxTokens": 64}}
    defaults = inference.ServingLimits().model_dump(by_alias=True)
    upgraded = {**oldest, "serving": {**defaults, "maxBatch": 8, "maxTokens": 64}}
    assert manifests.serve_template_hash(oldest) in manifests.serve_template_hashes(upgraded)
    delayed = {**upgraded, "serving": {**upgraded["serving"], "prefillDelayFactor": 1.0}}
    assert manifests.serve_template_hash(oldest) not in manifests.serve_template_hashes(delayed)
    # a spec stored while prefillChunkTokens defaulted to 2048 carries it: still a default
    stored_then = {**upgraded, "serving": {**upgraded["serving"], "prefillChunkTokens": 2048}}
    assert manifests.serve_template_hash(oldest) in manifests.serve_template_hashes(stored_then)
    chosen = {**upgraded, "serving": {**upgraded["serving"], "prefillChunkTokens": 512}}
    assert manifests.serve_template_hash(oldest) not in manifests.serve_template_hashes(chosen)


def test_best_fit_fills_the_fullest_node_first_and_stops_when_full() -> None:
    free = {"b0": 8, "b1": 2, "b2": 4}
    assert serving.choose_nodes(free, 2, 3) == ["b1", "b2", "b2"]
    assert serving.choose_nodes({"b0": 1}, 2, 2) == []


def test_rows_in_flight_are_read_from_their_area_not_from_answers_that_ended() -> None:
    """Eight rows in flight all the time, answers of 60 s, scrapes 15 s apart: eight answers end
    in an interval. Little's law on the latency sum charged their whole 480 s to those 15 s and
    read 32 rows in flight; the area under the replica's in-flight gauge reads 8."""
    before = {"a": dataclasses.replace(sample(0, busy=0, latency=0), in_flight=8, row_seconds=1000.0)}
    after = {"a": dataclasses.replace(sample(15, busy=15, requests=8, latency=480), in_flight=8,
                                      row_seconds=1000.0 + 8 * 15)}
    assert autoscale.read_load(before, after).in_flight == pytest.approx(8)
    old = {"a": dataclasses.replace(before["a"], row_seconds=None)}  # a replica of an older version
    assert autoscale.read_load(old, after).in_flight == pytest.approx(32)


def test_a_replica_integrates_its_rows_in_flight_over_time() -> None:
    now = [0.0]
    area = serve.RowSeconds(clock=lambda: now[0])
    area.change(2)
    now[0] = 1.0
    area.change(3)  # 5 rows from t=1
    now[0] = 3.0
    area.change(-2)  # 3 rows from t=3
    now[0] = 4.0
    assert area.total() == pytest.approx(2 * 1 + 5 * 2 + 3 * 1)  # the open interval counted too
    metrics = serve.Metrics()
    metrics.rows_in_flight(4)
    text = prometheus_client.generate_latest(metrics.registry).decode()
    parsed = replica_metrics.parse_metrics(text, 10.0)
    assert parsed is not None and parsed.in_flight == 4 and parsed.row_seconds is not None
    assert parsed.row_seconds >= 0


def test_the_default_slo_is_on_the_first_token_which_more_replicas_shorten() -> None:
    """Adding replicas cannot shorten an answer whose length max_tokens sets: a whole-answer
    p99 of 1 s (the old default) pushed a lightly loaded job with default-length chats to its
    maxReplicas, one replica a tick. The default now bounds the time to the first token, which
    queueing lengthens and more replicas shorten."""
    spec = inference.InferenceJobSpec.model_validate(
        {"virtualCluster": "serve", "model": {"checkpoint": "/c"}, "autoscaling": {"maxReplicas": 8}})
    job_rule = autoscaling_rule(spec)
    assert (job_rule.ttft_p99_seconds, job_rule.p99_seconds) == (1.0, None)
    scaler = autoscale.Autoscaler(job_rule)
    long_answers = dataclasses.replace(reading(in_flight=0.2, p99=2.5), ttft_p99_seconds=0.05)
    assert scaler.recommend(0.0, 1, long_answers).replicas == 1
    queued = dataclasses.replace(reading(in_flight=0.2, p99=2.5), ttft_p99_seconds=1.5)
    grown = autoscale.Autoscaler(job_rule).recommend(0.0, 1, queued)
    assert grown.replicas == 2
    assert "p99 time to first token 1500 ms is above the SLO's 1000 ms" in grown.reason


def test_a_replica_s_time_to_first_token_reaches_the_reading() -> None:
    metrics = serve.Metrics()
    for seconds in [0.02] * 98 + [2.0, 2.0]:
        metrics.first_token.observe(seconds)
    def scrape(registry: prometheus_client.CollectorRegistry, now: float) -> autoscale.ReplicaSample | None:
        return replica_metrics.parse_metrics(prometheus_client.generate_latest(registry).decode(), now)

    before, after = scrape(serve.Metrics().registry, 0), scrape(metrics.registry, 10)
    assert before is not None and after is not None
    assert 1.0 < autoscale.read_load({"a": before}, {"a": after}).ttft_p99_seconds <= 2.5


def autoscaling_rule(spec: inference.InferenceJobSpec) -> autoscale.ScalingRule:
    from huorn.api import kinds
    from huorn.operator import autoscaling

    job = kinds.InferenceJob.model_validate({"apiVersion": "huorn.io/v1alpha1", "kind": "InferenceJob",
                                             "metadata": {"name": "chat"}, "spec": spec.to_wire()})
    return autoscaling.build_rule(job)
