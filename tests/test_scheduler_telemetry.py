"""The perf model learns from the real runtime's step log (an excerpt of a local elastic run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from huorn.backends import goodput
from huorn.scheduler import perfmodel, telemetry

# Rank 0's steps.jsonl from `benchmarks/local_elastic.py` (the huorn run: 1 worker, then resized
# to 2), trimmed to 49 events; checkpoint paths dropped.
EXCERPT = Path(__file__).parent / "data" / "runtime_steps_excerpt.jsonl"


def load_events() -> list[dict]:
    return [json.loads(line) for line in EXCERPT.read_text().splitlines()]


def test_step_log_becomes_one_median_sample_per_configuration() -> None:
    events = load_events()
    samples = telemetry.samples_from_step_events(events)
    assert [(s.replicas, s.local_batch) for s in samples] == [(1, 16.0), (2, 8.0)]
    ws2 = sorted(e["step_seconds"] for e in events if e.get("event") == "step" and e["world_size"] == 2)[2:]
    assert min(ws2) <= samples[1].step_time <= max(ws2)
    assert all(s.nodes == 1 for s in samples)


def test_perf_model_fitted_on_runtime_telemetry_reproduces_it() -> None:
    samples = telemetry.samples_from_step_events(load_events())
    model = perfmodel.PerfModel("transformer-tiny", gpu_type="cpu")
    for s in samples:
        model.observe(s)
    for s in samples:
        predicted = model.predict(s.replicas, s.nodes, s.local_batch)
        assert predicted.step_time == pytest.approx(s.step_time, rel=0.2)


def test_noise_scale_is_read_from_the_log() -> None:
    events = load_events()
    reported = [e["gradient_noise_scale"] for e in events if e.get("gradient_noise_scale") is not None]
    scale = telemetry.noise_scale_from_step_events(events, window=5)
    assert scale == pytest.approx(sum(reported[-5:]) / 5)
    assert telemetry.noise_scale_from_step_events(events[:3]) is None


def test_a_pipelined_job_is_sampled_at_its_replicas_not_its_ranks() -> None:
    """A 2-stage replica runs 2 ranks and the runtime logs the gang's ranks as `world_size`; read
    as replicas, 1 and 2 replicas of global batch 16 were sampled at (2, 8.0) and (4, 4.0)."""
    events: list[dict] = []
    for replicas, seconds in ((1, 0.148), (2, 0.134)):
        events.append({"event": "start", "world_size": 2 * replicas, "global_batch": 16})
        events += [{"event": "step", "world_size": 2 * replicas, "step_seconds": seconds}] * 6
    samples = telemetry.samples_from_step_events(events, ranks_per_replica=2)
    assert [(s.replicas, s.nodes, s.local_batch, s.step_time) for s in samples] == [
        (1, 1, 16.0, 0.148), (2, 1, 8.0, 0.134)]
    # one rank a replica (the default) reads the log as it always did
    assert [(s.replicas, s.local_batch) for s in telemetry.samples_from_step_events(events)] == [
        (2, 8.0), (4, 4.0)]


def test_a_step_is_sampled_at_the_slowest_replicas_whole_micro_batches() -> None:
    """The runtime deals whole micro-batches and a step waits for the replica with the most: 13
    replicas of a 512 batch in micro-batches of 8 each wait for 40 samples, the local batch the
    goodput policy learns at and the allocator prices. This reader took 512 / 13 = 39.4."""
    events = [{"event": "start", "world_size": 13, "global_batch": 512}]
    events += [{"event": "step", "world_size": 13, "step_seconds": 0.5}] * 5
    (even,) = telemetry.samples_from_step_events(events)
    assert even.local_batch == pytest.approx(512 / 13)
    (whole,) = telemetry.samples_from_step_events(events, micro_batch=8)
    assert (whole.replicas, whole.local_batch, whole.step_time) == (13, 40.0, 0.5)
    policy = goodput.GoodputPolicy("j", "vc", slots=16, global_batch=512.0, micro_batch=8)
    assert policy.step_local_batch(512.0, 13) == whole.local_batch
