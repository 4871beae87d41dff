"""Adaptive k into the graph's mutation log: a monitor policy (`decide(graph, observation)`).

The k of a `schedule: auto` pipeline is chosen inside the gang (rank 0 runs the planner every
few steps and broadcasts k; docs/pipeline.md says why the choice stays in the runtime), and the
trainer publishes each choice with its reason in its step log (`k_decision`) and under
`/telemetry` -> `parameters.pipeline`. This policy turns a new k (one other than `adaptiveK`, or
than the starting k = 1 while `adaptiveK` is unset) into a set-param of the trainer vertex's
`adaptiveK` with the planner's reason, so status and Events show when and why k changed, and
only then. It records, it never commands: the key is not the spec's `k` (which must stay 1 with
schedule auto), so a restart keeps `auto`.
"""

from __future__ import annotations

from typing import Any, Protocol

from huorn.graph import managers, model

PARAM = "adaptiveK"
# the k a `schedule: auto` job starts at (huorn.runtime.pipeline.job), which an unset adaptiveK
# stands for: a first decision that keeps it is no change to record
START_K = 1


class StepObservation(Protocol):
    steps: list[dict[str, Any]]
    telemetry: dict[str, dict[str, Any]]


class KDecisionPolicy:
    def decide(self, graph: model.Graph, observation: StepObservation) -> list[managers.Event]:
        trainers = graph.vertices_with_role("trainer")
        if not trainers:
            return []
        trainer = trainers[0]
        # The step log keeps every decision even when a poll of /telemetry missed one.
        decisions = [r["k_decision"] for r in observation.steps if r.get("k_decision")]
        decisions += [(s.get("parameters") or {}).get("pipeline", {}).get("decision")
                      for s in observation.telemetry.values() if s.get("rank") == 0]
        latest = max((d for d in decisions if d), key=lambda d: d["step"], default=None)
        if latest is None or trainer.params.get(PARAM, START_K) == latest["k"]:
            return []
        reason = (f"adaptive k at step {latest['step']}: k={latest['previous_k']} -> "
                  f"k={latest['k']}: {latest['reason']}")
        return [managers.Event(managers.PARAMETER_DECISION, trainer.name,
                               {"key": PARAM, "value": latest["k"], "reason": reason})]
