"""RemediationPolicy.resume: a policy built anew (a restarted operator, an edited spec) takes up
the S2 counts or S3 layer split that the trainer vertex holds, and prices them from its first new
step on. The operator's end of it: tests/test_operator_remediation_resume.py."""

from __future__ import annotations

import pytest
from remediation_support import GRAPH, Seen, noisy_gang

from huorn.api.common import MitigationLevel, Remediation
from huorn.scheduler.remediation import policy

ONE_RANK_SLOW = {"level": "rebalance", "action": "rebalance-microbatches", "ranks": [1], "plan": {}}


def new_policy() -> policy.RemediationPolicy:
    return policy.RemediationPolicy(Remediation.model_validate({"maxMitigation": "resplit"}))


@pytest.mark.parametrize("params", [{}, {"microbatches": [4, 4]}, {"microbatches": [5, 4]},
                                    {"stageLayers": [2, 2, 2]}, {"microbatches": [8]}],
                         ids=["none", "even", "even-remainder", "even-layers", "one-rank"])
def test_nothing_to_take_up_without_an_uneven_split(params: dict) -> None:
    remediation = new_policy()
    assert not remediation.resume(params)
    assert remediation.ladder.level is None and remediation.ladder.applied is None


def test_s2_counts_are_taken_up_with_the_ranks_they_were_for() -> None:
    remediation = new_policy()
    assert remediation.resume({"microbatches": [7, 1], "mitigation": ONE_RANK_SLOW})
    lad = remediation.ladder
    assert lad.level is MitigationLevel.REBALANCE and lad.applied == {"microbatches": [7, 1]}
    assert lad.counts_in_force == [7, 1] and lad.ranks == (1,) and lad.settled_steps() == 0


def test_an_s3_split_is_taken_up_with_s2_counts_beside_it() -> None:
    remediation = new_policy()
    assert remediation.resume({"stageLayers": [3, 1], "microbatches": [6, 2]})
    lad = remediation.ladder
    assert lad.level is MitigationLevel.RESPLIT and lad.applied == {"stageLayers": [3, 1]}
    assert lad.counts_in_force == [6, 2]


def run_ticks(remediation: policy.RemediationPolicy, until: int) -> list[str]:
    for last in range(100, until, 5):  # the job ran 100 steps before this policy was built
        remediation.decide(GRAPH, Seen(time=0.0, telemetry=noisy_gang(last, [7, 1], [0.1, 0.1], 0.02, 0)))
    return [d.action for d in remediation.decisions]


def test_a_resumed_plan_is_given_back_once_its_saving_pays_and_a_fresh_one_never_is() -> None:
    # both ranks healthy at [7, 1]: 0.7 s a step against [4, 4]'s 0.4 s; S2's 30 s re-plan is
    # paid after 100 steps on the plan, counted from the first step after the resume (the 100
    # before it ran under speeds nobody measured now, so they are not credited)
    resumed = new_policy()
    resumed.resume({"microbatches": [7, 1], "mitigation": ONE_RANK_SLOW})
    assert run_ticks(resumed, 200) == []
    assert run_ticks(resumed, 260) == ["restore-even"]
    assert resumed.decisions[-1].plan["microbatches"] == [4, 4] and resumed.ladder.level is None
    assert run_ticks(new_policy(), 400) == []  # the defect: at rest, nothing ever gives it back
