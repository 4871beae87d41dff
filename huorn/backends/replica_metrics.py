"""A serving replica's load, read from its own Prometheus text (`/metrics`).

The serving runtime exports the counters the autoscaler's rule needs (huorn.scheduler.autoscale):
completions answered, tokens generated, seconds spent decoding, the rows in flight integrated
over time (whose rate is the mean in flight), and the latency histograms; and the prompt tokens
by where their K/V came from, which the job's status reports as its prefix cache's share. The
operator reads them from each ready pod, a benchmark from local processes: one parser for both.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

from huorn.backends import fetch
from huorn.scheduler import autoscale


def parse_metrics(text: str, now: float) -> autoscale.ReplicaSample | None:
    """A replica's counters from its Prometheus text; None when it does not export them (not a
    Huorn serving replica, or a version without the busy counter)."""
    values: dict[str, float] = {}
    buckets: list[tuple[float, float]] = []
    first: list[tuple[float, float]] = []
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "huorn_serve_requests_total" and sample.labels.get("outcome") == "ok":
                    values["requests"] = sample.value
                elif sample.name in ("huorn_serve_generated_tokens_total", "huorn_serve_busy_seconds_total",
                                     "huorn_serve_request_seconds_sum", "huorn_serve_in_flight",
                                     "huorn_serve_in_flight_row_seconds_total"):
                    values[sample.name] = sample.value
                elif sample.name == "huorn_serve_request_seconds_bucket":
                    buckets.append((float(sample.labels["le"]), sample.value))
                elif sample.name == "huorn_serve_time_to_first_token_seconds_bucket":
                    first.append((float(sample.labels["le"]), sample.value))
                elif sample.name == "huorn_serve_prompt_tokens_total":
                    values["prompt"] = values.get("prompt", 0.0) + sample.value
                    if sample.labels.get("source") == "cache":
                        values["cached"] = sample.value
    except (ValueError, KeyError):
        return None
    if "huorn_serve_busy_seconds_total" not in values:
        return None
    return autoscale.ReplicaSample(
        time=now,
        requests=values.get("requests", 0.0),
        tokens=values.get("huorn_serve_generated_tokens_total", 0.0),
        busy_seconds=values["huorn_serve_busy_seconds_total"],
        latency_seconds=values.get("huorn_serve_request_seconds_sum", 0.0),
        in_flight=values.get("huorn_serve_in_flight", 0.0),
        latency_buckets=tuple(sorted(buckets)),
        prompt_tokens=values.get("prompt", 0.0),
        cached_tokens=values.get("cached", 0.0),
        row_seconds=values.get("huorn_serve_in_flight_row_seconds_total"),
        ttft_buckets=tuple(sorted(first)),
    )


def parse_held(text: str) -> float | None:
    """Requests an activator (huorn.runtime.activator) holds for want of a replica; None when the
    text is not an activator's."""
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "huorn_activator_held_requests":
                    return sample.value
    except (ValueError, KeyError):
        return None
    return None


def fetch_text(url: str, timeout: float) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read().decode("utf-8", errors="replace")
    except (OSError, urllib.error.URLError, ValueError):
        return None


def fetch_all(targets: Mapping[str, str], timeout: float) -> dict[str, str]:
    """Every replica's text at once (replica → URL): one slow replica costs one timeout."""
    return fetch.fetch_all(targets, fetch_text, timeout)
