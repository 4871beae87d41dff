"""VirtualCluster: a tenant's share of GPU nodes, which it may lend and borrow."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from huorn.api import base, rules
from huorn.api.base import ApiModel, DnsLabel
from huorn.api.common import (
    BOARD_BIN_SECONDS,
    BOARD_BINS_BEYOND_HORIZON,
    BOARD_HORIZON_BINS,
    CONDITION_LIMIT,
    MAX_HISTORY,
    MIN_HISTORY,
    RECLAIM_TICK_SECONDS,
    Condition,
    RateHistory,
    RateReading,
    board_history_seconds,
)


class LabelSelector(ApiModel):
    match_labels: dict[str, str] = Field(default_factory=dict)


# A taint's key is a label key, its value a label value; empty is allowed for both (Exists, and
# Equal to "").
TaintKey = base.kubernetes_string(
    base.LABEL_KEY_PATTERN, base.LABEL_KEY_LIMIT,
    "a taint key: a name of at most 63 letters, digits, '-', '_' and '.' (starting and ending with a "
    "letter or digit), with an optional DNS prefix and '/', as in node.example.com/dedicated")
TaintValue = base.kubernetes_string(
    base.LABEL_VALUE_PATTERN, 63,
    "a taint value: at most 63 letters, digits, '-', '_' and '.', starting and ending with a letter or digit")


@rules.attach(
    rules.Rule(
        name="toleration-exists-no-value",
        field="value",
        cel="self.operator != 'Exists' || !has(self.value) || self.value == ''",
        holds=lambda t: t.operator != "Exists" or t.value == "",
        message="must be empty with operator Exists, which matches every value of the key",
        detail=lambda t: f"value {t.value!r}",
        fix="remove value, or set operator: Equal",
    ),
    rules.Rule(
        name="toleration-empty-key-exists",
        field="operator",
        cel="(has(self.key) && self.key != '') || self.operator == 'Exists'",
        holds=lambda t: t.key != "" or t.operator == "Exists",
        message="must be Exists when key is empty (tolerate every taint)",
        fix="set key to the taint's key, or operator: Exists",
    ),
    rules.Rule(
        name="toleration-key-prefix",
        field="key",
        cel="!self.key.contains('/') || self.key.matches('^[^/]{1,253}/')",
        holds=lambda t: "/" not in t.key or len(t.key.split("/", 1)[0]) <= 253,
        message="has a prefix (before '/') longer than 253 characters, which Kubernetes refuses in a pod",
        detail=lambda t: f"{len(t.key.split('/', 1)[0])} characters",
        fix="shorten the key's prefix to a DNS subdomain of at most 253 characters",
    ),
    rules.Rule(
        name="toleration-seconds-no-execute",
        field="tolerationSeconds",
        cel="!has(self.tolerationSeconds) || self.effect == 'NoExecute'",
        holds=lambda t: t.toleration_seconds is None or t.effect == "NoExecute",
        message="applies only to effect NoExecute (how long a running pod stays once the taint comes)",
        detail=lambda t: f"effect {t.effect!r}",
        fix="set effect: NoExecute, or remove tolerationSeconds",
    ),
)
class Toleration(ApiModel):
    """A pod toleration, as Kubernetes writes it into a pod (core/v1 Toleration)."""

    key: TaintKey = Field(default="", description="The taint's key; empty with operator Exists "
                                                   "tolerates every taint.")
    operator: Literal["Equal", "Exists"] = "Equal"
    value: TaintValue = ""
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] = Field(
        default="", description="The taint's effect; empty tolerates every effect.")
    toleration_seconds: int | None = Field(default=None, ge=0, le=31536000)


@rules.attach(
    rules.Rule(
        name="members-selector-or-nodes",
        field="",
        cel="has(self.nodeSelector) || (has(self.nodes) && size(self.nodes) > 0)",
        holds=lambda m: m.node_selector is not None or bool(m.nodes),
        message="need a nodeSelector or a non-empty list of nodes",
        fix="set members.nodeSelector.matchLabels or list members.nodes",
    ),
)
class Members(ApiModel):
    node_selector: LabelSelector | None = None
    nodes: list[str] | None = Field(default=None, max_length=10000)
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32,
        description="Taints of the member nodes that Huorn's pods tolerate there (as a Kueue "
                    "ResourceFlavor's tolerations): every pod Huorn places on a member node carries "
                    "them, a borrower's too, and a node whose NoSchedule or NoExecute taints they "
                    "cover takes new pods. Huorn's pods always tolerate nvidia.com/gpu:NoSchedule.")


@rules.attach(
    rules.Rule(
        name="rate-history-bounds",
        field="history",
        cel=f"!has(self.history) || (duration(self.history) >= duration('{MIN_HISTORY}') && "
            f"duration(self.history) <= duration('{MAX_HISTORY}'))",
        holds=lambda h: base.parse_duration(MIN_HISTORY) <= base.parse_duration(h.history)
        <= base.parse_duration(MAX_HISTORY),
        message=f"must lie between {MIN_HISTORY} (the 18 five-minute bins the board fits on) and "
                f"{MAX_HISTORY} (Prometheus answers at most 11,000 points a query)",
        detail=lambda h: h.history,
        fix=f"set history between {MIN_HISTORY} and {MAX_HISTORY}; 24h (the default) fits a daily cycle",
    ),
)
class LoadForecast(RateHistory):
    """Where an inference cluster's request rate comes from, and what one GPU of it serves.

    The cluster keeps unlent, or reclaims ahead of time, the GPUs that the forecast peak of the
    next 10 minutes needs (of the reclaim grace and 10 s where that is longer); a rate above that
    reserve is reclaimed for at once.
    """

    requests_per_gpu: float = Field(
        gt=0, alias="requestsPerGPU", description="Requests per second one GPU serves within the SLO.")
    headroom: float = Field(default=0.1, ge=0, le=1, description="Spare capacity kept above the forecast.")


@rules.attach(
    rules.Rule(
        name="lending-max-needs-lendable",
        field="maxGPUsLent",
        cel="self.lendable || self.maxGPUsLent == 0",
        holds=lambda lending: lending.lendable or lending.max_gpus_lent == 0,
        message="must be 0 unless lendable is true",
        detail=lambda lending: f"maxGPUsLent {lending.max_gpus_lent} with lendable false",
        fix="set lendable: true, or maxGPUsLent: 0",
    ),
)
class Lending(ApiModel):
    lendable: bool = False
    max_gpus_lent: int = Field(default=0, ge=0, alias="maxGPUsLent")
    reclaim_grace_seconds: int = Field(default=30, ge=0, le=86400)
    reclaim_policy: Literal["Preempt", "Shrink"] = Field(
        default="Preempt",
        description="How lent GPUs come back when this cluster needs them. Preempt: shrink elastic "
                    "borrowers, and stop (checkpoint, requeue) a borrower that cannot shrink. Shrink: "
                    "never stop a borrower; one at its minimum keeps the GPUs until it ends.")
    forecast: LoadForecast | None = Field(
        default=None,
        description="Inference clusters only: reserve the GPUs the forecast request rate needs, "
                    "not only the InferenceJobs' floors.")


class Borrowing(ApiModel):
    max_gpus_borrowed: int = Field(default=0, ge=0, alias="maxGPUsBorrowed")


# common.board_history_seconds in CEL, from the same constants and the API's defaults
_GRACE = ("(has(self.lending.reclaimGraceSeconds) ? self.lending.reclaimGraceSeconds : "
          f"{Lending.model_fields['reclaim_grace_seconds'].default})")
_AHEAD = f"({_GRACE} + {RECLAIM_TICK_SECONDS + BOARD_BIN_SECONDS - 1}) / {BOARD_BIN_SECONDS}"
_HORIZON = f"({_AHEAD} > {BOARD_HORIZON_BINS} ? {_AHEAD} : {BOARD_HORIZON_BINS})"
_HISTORY_COVERS_GRACE = (
    "!has(self.lending) || !has(self.lending.forecast) || "
    "duration(has(self.lending.forecast.history) ? self.lending.forecast.history : "
    f"'{RateHistory.model_fields['history'].default}') >= "
    f"duration(string(({BOARD_BINS_BEYOND_HORIZON} + {_HORIZON}) * {BOARD_BIN_SECONDS}) + 's')")


def _history_covers_grace(spec: VirtualClusterSpec) -> bool:
    forecast = spec.lending.forecast
    return forecast is None or (
        base.parse_duration(forecast.history) >= board_history_seconds(spec.lending.reclaim_grace_seconds))


def _history_needed(spec: VirtualClusterSpec) -> str:
    return f"{board_history_seconds(spec.lending.reclaim_grace_seconds) // 60}m"


@rules.attach(
    rules.Rule(
        name="forecast-needs-inference",
        field="lending.forecast",
        cel="!has(self.lending) || !has(self.lending.forecast) || self.purpose == 'inference'",
        holds=lambda spec: spec.lending.forecast is None or spec.purpose == "inference",
        message="is read only by an inference virtual cluster",
        detail=lambda spec: f"purpose {spec.purpose}",
        fix="set purpose: inference, or remove lending.forecast",
    ),
    rules.Rule(
        name="forecast-history-covers-grace",
        field="lending.forecast.history",
        # NB: the arithmetic of common.board_history_seconds, with the API's defaults (grace 30 s,
        # history 24h); tests/test_api_rules.py checks this string against the model at its edges
        cel=_HISTORY_COVERS_GRACE,
        holds=_history_covers_grace,
        message="must hold enough bins to fit the board for a horizon that covers "
                "lending.reclaimGraceSeconds (a victim keeps its GPUs that long after the tick that "
                "asks them back)",
        detail=lambda spec: f"history {spec.lending.forecast.history if spec.lending.forecast else ''}, "
                            f"at least {_history_needed(spec)} for a grace of "
                            f"{spec.lending.reclaim_grace_seconds}s",
        fix="lengthen lending.forecast.history, or shorten lending.reclaimGraceSeconds",
    ),
)
class VirtualClusterSpec(ApiModel):
    members: Members
    purpose: Literal["training", "inference"] = "training"
    lending: Lending = Field(default_factory=Lending)
    borrowing: Borrowing = Field(default_factory=Borrowing)
    namespaces: list[DnsLabel] = Field(
        default_factory=list, max_length=1024, description="Namespaces allowed to use it; empty means all."
    )


class ForecastReading(RateReading):
    gpus: int = Field(ge=0, description="GPUs that peak needs: what this cluster keeps unlent.")


LINE_SHOWN = 20  # entries of status.line: the head of the line, which moves next


class LineEntry(ApiModel):
    """One job of a cluster's waiting line, in the order it gets GPUs (Kueue's visibility API
    lists a ClusterQueue's pending workloads so: position, priority)."""

    position: int = Field(ge=1, description="1 for the job that gets GPUs first.")
    job: str = Field(description="namespace/name.")
    kind: Literal["TrainingJob", "RLJob"] = "TrainingJob"
    priority: int
    gpus: int = Field(ge=0, description="GPUs it waits for to start.")


class VirtualClusterStatus(ApiModel):
    model_config = ApiModel.model_config | {"extra": "allow"}

    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list, max_length=CONDITION_LIMIT)
    nodes: int = 0
    capacity: int = Field(default=0, description="GPUs on member nodes.")
    allocated: int = 0
    lent: int = 0
    borrowed: int = 0
    waiting_jobs: int = Field(default=0, description="TrainingJobs and RLJobs of this cluster waiting in "
                              "line for GPUs (Kueue's pendingWorkloads).")
    waiting_gpus: int = Field(default=0, alias="waitingGPUs",
                              description="GPUs those waiting jobs need to start.")
    line: list[LineEntry] = Field(
        default_factory=list, max_length=LINE_SHOWN,
        description=f"The first {LINE_SHOWN} jobs waiting in line for this cluster's GPUs, in the order "
                    "they get them: priority, then creation time.")
    forecast: ForecastReading | None = Field(
        default=None, description="The prediction board's last reading (inference clusters with "
                                  "lending.forecast).")
