"""huorn.operator.failures: Kubernetes Job's podFailurePolicy semantics, then Huorn's own rules."""

from __future__ import annotations

from typing import Any

import pytest

from huorn.api.common import FailureAction, PodFailurePolicy
from huorn.operator import failures, index

RULE = "spec.remediation.podFailurePolicy.rules"
DISRUPTED = (("Ready", "False"), ("DisruptionTarget", "True"))


def _pod(exit_code: int | None = None, conditions: tuple[tuple[str, str], ...] = ()) -> index.PodRecord:
    return index.PodRecord(namespace="ns", name="j-trainer-0", job="j", vertex="trainer",
                           instance="trainer-0", node="n", gpus=1, cpu_milli=0, virtual_cluster="vc",
                           phase="Failed", exit_code=exit_code, conditions=conditions)


def _policy(*rules: dict[str, Any]) -> PodFailurePolicy:
    return PodFailurePolicy.model_validate({"rules": list(rules)})


IGNORE_DISRUPTION = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
FAIL_ON_42 = {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [42]}}


@pytest.mark.parametrize(("pod", "policy", "action", "why"), [
    # Without a policy: exit code 2 (the runtime refused its config) fails, anything else counts.
    (_pod(2), None, FailureAction.FAIL_JOB, "the runtime refused its config"),
    (_pod(137), None, FailureAction.COUNT, ""),
    (_pod(None, DISRUPTED), None, FailureAction.COUNT, ""),
    # The first rule that matches decides; an unmatched failure falls through to the built-ins.
    (_pod(137, DISRUPTED), _policy(IGNORE_DISRUPTION, FAIL_ON_42), FailureAction.IGNORE,
     RULE + "[0] (pod condition DisruptionTarget): Ignore"),
    (_pod(42, DISRUPTED), _policy(FAIL_ON_42, IGNORE_DISRUPTION), FailureAction.FAIL_JOB,
     RULE + "[0] (exit code 42 In [42]): FailJob"),
    (_pod(42), _policy(IGNORE_DISRUPTION, FAIL_ON_42), FailureAction.FAIL_JOB,
     RULE + "[1] (exit code 42 In [42]): FailJob"),
    (_pod(1), _policy(IGNORE_DISRUPTION, FAIL_ON_42), FailureAction.COUNT, ""),
    (_pod(2), _policy(IGNORE_DISRUPTION, FAIL_ON_42), FailureAction.FAIL_JOB,
     "the runtime refused its config"),
    # A rule may overrule a built-in: exit code 2 counted like any other.
    (_pod(2), _policy({"action": "Count", "onExitCodes": {"operator": "In", "values": [2]}}),
     FailureAction.COUNT, RULE + "[0] (exit code 2 In [2]): Count"),
    # NotIn: every exit code but those listed; a pod with no exit code matches no exit-code rule.
    (_pod(1), _policy({"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [137, 143]}}),
     FailureAction.FAIL_JOB, RULE + "[0] (exit code 1 NotIn [137, 143]): FailJob"),
    (_pod(143), _policy({"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [137, 143]}}),
     FailureAction.COUNT, ""),
    (_pod(None, DISRUPTED),
     _policy({"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [1]}}),
     FailureAction.COUNT, ""),
    # A condition matches on its type and its status (True unless the rule says otherwise).
    (_pod(1, (("DisruptionTarget", "False"),)), _policy(IGNORE_DISRUPTION), FailureAction.COUNT, ""),
    (_pod(1, (("DisruptionTarget", "False"),)),
     _policy({"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "False"}]}),
     FailureAction.IGNORE, RULE + "[0] (pod condition DisruptionTarget=False): Ignore"),
])
def test_the_first_matching_rule_decides_then_the_built_in_rules(
        pod: index.PodRecord, policy: PodFailurePolicy | None, action: FailureAction, why: str) -> None:
    verdict = failures.judge(pod, policy)
    assert (verdict.action, verdict.why) == (action, why)


def test_a_pod_that_never_started_counts_whatever_the_rules_say() -> None:
    """Kubernetes judges failed pods only; a pod stuck Pending has no exit code or disruption to judge."""
    pending = _pod(None, DISRUPTED)
    verdict = failures.judge(pending, _policy(IGNORE_DISRUPTION), never_started=True)
    assert verdict.action == FailureAction.COUNT


def test_pod_records_carry_their_conditions() -> None:
    body = {"metadata": {"name": "j-trainer-0", "namespace": "ns", "labels": {"huorn.io/job": "j"}},
            "status": {"phase": "Failed", "reason": "Evicted", "conditions": [
                {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"},
                {"type": "Ready", "status": "False"}]}}
    record = index.build_pod_record(body)
    assert record is not None
    assert record.conditions == (("DisruptionTarget", "True"), ("Ready", "False"))
    assert failures.judge(record, _policy(IGNORE_DISRUPTION)).action == FailureAction.IGNORE
