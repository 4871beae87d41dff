"""What a failed pod costs its TrainingJob: the spec's podFailurePolicy first, then Huorn's rules.

The restart budget (spec.remediation.maxRestarts) is there to stop a job that keeps failing, and
a pod evicted by a node drain, the kubelet under pressure or the kube-scheduler's preemption says
nothing about the job: on a busy cluster, counting those fails long jobs that did nothing wrong.
The other way round, a training script that knows a failure is final (a corrupt dataset, a
licence check) should fail the job at once instead of spending the budget on certain repeats.
Kubernetes Job's podFailurePolicy answers both, so Huorn takes its rules and their meaning as
they are: tried in order on each failed pod, the first match decides, and a failure no rule
matches falls through to Huorn's own (exit code 2, the runtime refusing its config, fails the
job; anything else counts). A pod that never started has not failed, so no rule judges it; it
counts, as Kueue's waitForPodsReady would.

A job that keeps failing is also slowed down before it fails, as a Kubernetes Job is: without a
back-off, a transient cause (a storage outage, a bad node the scheduler picks again) spends the
whole budget within seconds, where a pause would have outlasted it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from huorn.api.common import ExitCodeOperator, FailureAction, PodFailurePolicy, PodFailureRule
from huorn.graph.model import Mutation
from huorn.operator.index import PodRecord

PERMANENT_EXIT_CODES = frozenset({2})  # the runtime refused its config: a new pod would too
FIELD = "spec.remediation.podFailurePolicy"
BACKOFF_WINDOW_SECONDS = 600.0  # failures older than this no longer slow the next replacement
INCIDENT_SECONDS = 1.0  # replacements this close together were one reconcile's: one incident


@dataclass(frozen=True)
class Verdict:
    action: FailureAction
    why: str  # for the decision or the failure message: which rule, or which built-in reason
    rule: int | None = None  # the index of the podFailurePolicy rule that decided, if one did


def _matches(rule: PodFailureRule, pod: PodRecord) -> bool:
    if rule.on_exit_codes is not None:
        if pod.exit_code is None:
            return False
        listed = pod.exit_code in rule.on_exit_codes.values
        return listed if rule.on_exit_codes.operator == ExitCodeOperator.IN else not listed
    wanted = {(c.type, c.status) for c in rule.on_pod_conditions or ()}
    return any(c in wanted for c in pod.conditions)


def _describe(rule: PodFailureRule, pod: PodRecord) -> str:
    if rule.on_exit_codes is not None:
        return f"exit code {pod.exit_code} {rule.on_exit_codes.operator.value} {rule.on_exit_codes.values}"
    wanted = {(c.type, c.status) for c in rule.on_pod_conditions or ()}
    held = [t if s == "True" else f"{t}={s}" for t, s in pod.conditions if (t, s) in wanted]
    return f"pod condition {held[0]}"


def judge(pod: PodRecord, policy: PodFailurePolicy | None, *, never_started: bool = False) -> Verdict:
    """The action for one failed (or never started) pod, and why, in words for its decision."""
    if never_started:
        return Verdict(FailureAction.COUNT, "")
    for index, rule in enumerate(policy.rules if policy is not None else ()):
        if _matches(rule, pod):
            matched = f"{FIELD}.rules[{index}] ({_describe(rule, pod)})"
            return Verdict(rule.action, f"{matched}: {rule.action.value}", index)
    if pod.exit_code in PERMANENT_EXIT_CODES:
        return Verdict(FailureAction.FAIL_JOB, "the runtime refused its config")
    return Verdict(FailureAction.COUNT, "")


@dataclass(frozen=True)
class Backoff:
    seconds: float  # left to wait before the next failure replacement; 0: replace now
    incidents: int  # failure replacements in the window, pods replaced together counted once


def replacement_backoff(log: Iterable[Mutation], now: float, initial: float, cap: float) -> Backoff:
    """Kubernetes Job's pod failure back-off, from the graph's own log (so an operator restarted
    mid-wait keeps it): the first failure is replaced at once, since a lost spot node should cost
    nothing, and each further one within BACKOFF_WINDOW_SECONDS waits twice as long as the one
    before (`initial`, 2×, 4×, ... up to `cap`) after the previous replacement. Pods that fail
    together (a node lost under four trainers) are one incident, replaced together."""
    times = sorted(m.time for m in log if m.action == "replace" and m.detail.get("failure")
                   and now - m.time < BACKOFF_WINDOW_SECONDS)
    incidents = sum(1 for i, t in enumerate(times) if i == 0 or t - times[i - 1] > INCIDENT_SECONDS)
    if not incidents or initial <= 0:
        return Backoff(0.0, incidents)
    wait = min(initial * 2 ** (incidents - 1), cap)
    return Backoff(max(0.0, times[-1] + wait - now), incidents)
