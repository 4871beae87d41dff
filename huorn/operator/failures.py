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
"""

from __future__ import annotations

from dataclasses import dataclass

from huorn.api.common import ExitCodeOperator, FailureAction, PodFailurePolicy, PodFailureRule
from huorn.operator.index import PodRecord

PERMANENT_EXIT_CODES = frozenset({2})  # the runtime refused its config: a new pod would too
FIELD = "spec.remediation.podFailurePolicy"


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
