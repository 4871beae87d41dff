"""huorn.operator.failures: Kubernetes Job's podFailurePolicy semantics, then Huorn's own rules."""

from __future__ import annotations

from typing import Any

import pytest
from kube import builders

from huorn.api.common import FailureAction, PodFailurePolicy
from huorn.graph import compiler, mutate
from huorn.graph.model import Mutation
from huorn.operator import failures, index, validation

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


def _replaced(at: float, failure: bool = True) -> Mutation:
    return Mutation(1, at, "replace", "trainer", "why", {"old": "trainer-0", "new": "trainer-0-g1",
                                                         **({"failure": True} if failure else {})})


@pytest.mark.parametrize(("log", "wait", "incidents"), [
    # The first failure is replaced at once: a lost spot node should cost nothing.
    ([], 0.0, 0),
    # Then 10 s after the previous replacement, 20 s, 40 s: here 3 s have passed since it.
    ([_replaced(997)], 7.0, 1),
    ([_replaced(900), _replaced(997)], 17.0, 2),
    ([_replaced(800), _replaced(900), _replaced(997)], 37.0, 3),
    # Capped at 60 s here (6 min by default).
    ([_replaced(500 + 50 * i) for i in range(9)] + [_replaced(997)], 57.0, 10),
    # Pods replaced in one reconcile (a node lost under three trainers) are one incident.
    ([_replaced(997.0), _replaced(997.2), _replaced(997.3)], 7.3, 1),
    # Waited out already: replace now, the count still says how many there were.
    ([_replaced(900), _replaced(950)], 0.0, 2),
    # Older than the 10 min window, or not failures (an S3 roll, a preemption): not counted.
    ([_replaced(300), _replaced(997, failure=False)], 0.0, 0),
])
def test_replacements_back_off_after_the_first_failure(log: list[Mutation], wait: float,
                                                       incidents: int) -> None:
    backoff = failures.replacement_backoff(log, now=1000.0, initial=10.0, cap=60.0)
    assert backoff == failures.Backoff(pytest.approx(wait), incidents)


def test_no_backoff_when_its_initial_wait_is_zero() -> None:
    assert failures.replacement_backoff([_replaced(999)], 1000.0, initial=0.0, cap=360.0).seconds == 0.0


def test_a_replacement_for_a_failure_is_marked_in_the_log() -> None:
    graph = compiler.compile(validation.load_job(builders.make_training_job("j", "vc", replicas=2, gpus=1)))
    mutate.replace_instance(graph, "trainer-0", reason="pod failed", failure=True)
    mutate.replace_instance(graph, "trainer-1", reason="S3 roll", drain=True)
    assert [bool(m.detail.get("failure")) for m in graph.log[-2:]] == [True, False]
    assert failures.replacement_backoff(graph.log, graph.log[-1].time, 10.0, 360.0).incidents == 1
