"""The operator's Prometheus metrics, in a registry of its own.

A registry per operator (not the process-global one) lets tests run several operators in one
process and read exact values, and keeps the runtime's metrics out of the operator's endpoint.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import prometheus_client as prom

RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class OperatorMetrics:
    registry: prom.CollectorRegistry = field(default_factory=prom.CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.reconciles = prom.Counter(
            "huorn_reconcile",
            "Reconciles, by kind and result (ok, error, stalled).",
            ["kind", "result"],
            registry=r,
        )
        self.reconcile_seconds = prom.Histogram(
            "huorn_reconcile_duration_seconds",
            "Wall time of one reconcile.",
            ["kind"],
            buckets=RECONCILE_BUCKETS,
            registry=r,
        )
        self.jobs = prom.Gauge("huorn_jobs", "Jobs by kind and phase.", ["kind", "phase"], registry=r)
        self.vc_gpus = prom.Gauge(
            "huorn_virtualcluster_gpus",
            "GPUs of a virtual cluster by state (capacity, allocated, lent, borrowed; waiting: what its "
            "jobs waiting in line need; unschedulable: those of member nodes that take no new pods; "
            "forecast: what the prediction board reserves, inference clusters with lending.forecast "
            "only).",
            ["virtual_cluster", "state"],
            registry=r,
        )
        self.vc_waiting_jobs = prom.Gauge(
            "huorn_virtualcluster_waiting_jobs",
            "TrainingJobs and RLJobs waiting in line for a virtual cluster's GPUs.",
            ["virtual_cluster"], registry=r,
        )
        self.decisions = prom.Counter(
            "huorn_decisions", "Decisions taken, by kind and action.", ["kind", "action"], registry=r
        )
        self.inference_replicas = prom.Gauge(
            "huorn_inferencejob_replicas", "An InferenceJob's serving replicas: desired (the autoscaler's "
            "count) and ready (the Service's endpoints).", ["namespace", "job", "state"], registry=r,
        )
        self.api_retries = prom.Gauge(
            "huorn_api_retries", "API writes retried after 409/429/5xx.", registry=r
        )
        # kopf pauses a standby's handlers, so its other gauges stay at what it last set while it
        # led: alerts read them only where this is 1 (helm/huorn/templates/prometheusrule.yaml)
        self.leader = prom.Gauge(
            "huorn_leader", "1 on the operator that acts (it leads its kopf peering, or runs alone), "
            "0 on a standby, whose other gauges are frozen.", registry=r)
        self.leader.set(1)
        self._phases: dict[tuple[str, str, str], str] = {}

    def forget_inference_job(self, namespace: str, name: str) -> None:
        """Drop a job's replica gauges: one no longer reconciled to the end (deleted, Stalled, its
        cluster gone) would keep its last counts, which an alert reads as a job short of replicas."""
        for state in ("desired", "ready"):
            with contextlib.suppress(KeyError):  # never counted: no sample to drop
                self.inference_replicas.remove(namespace, name, state)

    def record_phase(self, kind: str, key: str, phase: str | None) -> None:
        """Move one job between phase gauges; None forgets it (deleted)."""
        old = self._phases.pop((kind, key, ""), None)
        if old is not None:
            self.jobs.labels(kind, old).dec()
        if phase is not None:
            self._phases[(kind, key, "")] = phase
            self.jobs.labels(kind, phase).inc()

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's value (0 when absent), for tests and the benchmark."""
        return self.registry.get_sample_value(name, labels or {}) or 0.0
