"""The eval vertex in a cluster: one pod per checkpoint, driven by the shared graph managers.

Nothing here decides when an eval runs. The monitor tick hands the shared loop two facts, and
the local backend's managers do the rest exactly as in `huorn run`:

- a checkpoint the trainers published in `/telemetry` that the eval vertex has not been handed
  yet becomes `Observation.checkpoint` (its step, path and the tokens trained into it); the
  CheckpointEdgeManager sets the vertex's `checkpoint` parameter and activates it;
- an eval pod that ended becomes a completed `InstanceState` whose `input` is the checkpoint the
  pod was started on (its `huorn.io/checkpoint` annotation); the OnDemandManager parks the vertex
  again, or replaces the instance when a newer checkpoint landed meanwhile.

"Already handed" is read from the graph in status (the vertex's `checkpoint` parameter), so an
operator restart neither skips nor repeats a checkpoint. A vertex has one instance, so at most
one eval runs per job; a failed eval is `completed` with a reason, never `failed`, because a
failed instance would be replaced (retried) by the InstanceManager. The pod's result reaches
status in the same patch as the graph mutation that ends its instance, so it is recorded once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from huorn.api.training import declared_steps, token_budget
from huorn.backends import monitor
from huorn.backends.kubernetes import manifests
from huorn.graph import model
from huorn.operator.index import TERMINAL_POD_PHASES, PodRecord

HISTORY = 8  # status.evaluations keeps this many results, newest last
MAX_SOURCES = 16  # per-source losses kept in status.lastEvaluation
MESSAGE_LIMIT = 512


def eval_vertices(graph: model.Graph) -> list[model.Vertex]:
    return [v for v in graph.vertices.values()
            if v.role == "eval" and v.mode is model.ExecutionMode.ON_DEMAND]


def pod_of(pods: Iterable[PodRecord], vertex: str, instance: str) -> PodRecord | None:
    """The live pod of one eval instance, found by labels (its name also carries the step)."""
    found = [p for p in pods if p.vertex == vertex and p.instance == instance and not p.deleting]
    return max(found, key=lambda p: p.name) if found else None


def build_pods(ref: manifests.JobRef, graph: model.Graph, spec: Mapping[str, Any],
               pods: Iterable[PodRecord]) -> list[dict[str, Any]]:
    """Pods to create: one for each instance of an active eval vertex that has none."""
    pods = list(pods)
    return [manifests.build_eval_pod(ref, i, spec, v.params.get("checkpoint"))
            for v in eval_vertices(graph) for i in v.instances if pod_of(pods, v.name, i.name) is None]


def wanted_pods(graph: model.Graph, pods: Iterable[PodRecord]) -> set[str]:
    """Names of the eval pods the graph still has an instance for; the others are deleted."""
    pods = list(pods)
    out = set()
    for v in eval_vertices(graph):
        for i in v.instances:
            pod = pod_of(pods, v.name, i.name)
            if pod is not None:
                out.add(pod.name)
    return out


def in_flight(graph: model.Graph) -> bool:
    return any(v.active and v.instances for v in eval_vertices(graph))


def still_leaving(graph: model.Graph, pods: Iterable[PodRecord]) -> bool:
    """A parked eval vertex whose last pod is not yet seen deleting (the decision that parked it
    is in status, the pod's delete is this reconcile's or just made). Such a vertex is not started
    again until that pod is: a vertex started again gets generation-0 instances, the very names
    of its last run, and took that finished pod for the new run's. Before, no pod was created for
    the new checkpoint (the trainers' final one, started by the reconcile right after the park),
    and the next tick recorded the old pod's result a second time and replaced the instance."""
    pods = list(pods)
    return any(not v.active and any(p.vertex == v.name and not p.deleting for p in pods)
               for v in eval_vertices(graph))


def is_over(pod: PodRecord, now: float, start_seconds: float) -> bool:
    """The pod ended, or never started: still Pending `start_seconds` after its creation."""
    return pod.phase in TERMINAL_POD_PHASES or pod.never_started(now, start_seconds)


def has_finished_pod(graph: model.Graph, pods: Iterable[PodRecord], now: float, start_seconds: float) -> bool:
    """An eval pod is over and its instance is still in the graph: the monitor has work to settle."""
    pods = list(pods)
    return any((p := pod_of(pods, v.name, i.name)) is not None and is_over(p, now, start_seconds)
               for v in eval_vertices(graph) for i in v.instances)


def build_states(graph: model.Graph, pods: Iterable[PodRecord], now: float, start_seconds: float
                 ) -> dict[str, monitor.InstanceState]:
    """The eval instances as the shared loop reads them; a pod that is over is `completed`."""
    pods = list(pods)
    states: dict[str, monitor.InstanceState] = {}
    for v in eval_vertices(graph):
        for i in v.instances:
            pod = pod_of(pods, v.name, i.name)
            if pod is None:
                continue
            done = is_over(pod, now, start_seconds)
            why = ""
            if done and pod.phase not in TERMINAL_POD_PHASES:
                why = (f"eval pod {pod.name} did not start within {start_seconds:.0f} s: "
                       f"{pod.not_started_reason()}")[:MESSAGE_LIMIT]
            elif done:
                why = failure(pod)
            states[i.name] = monitor.InstanceState(
                i.name, v.name, alive=not done, completed=done, reason=why, input=pod.input)
    return states


def parse_result(pod: PodRecord) -> dict[str, Any] | None:
    """The evaluator's compact result from the termination message; None if there is none."""
    try:
        value = json.loads(pod.message) if pod.message else None
    except ValueError:
        return None
    return value if isinstance(value, dict) and "loss" in value else None


def failure(pod: PodRecord) -> str:
    """Why a finished eval pod is a failure ('' when it succeeded with a readable result)."""
    if pod.phase == "Succeeded" and parse_result(pod) is not None:
        return ""
    if pod.phase == "Succeeded":
        return f"eval pod {pod.name} exited 0 without a result in its termination message"
    tail = pod.message.strip().splitlines()[-1][:MESSAGE_LIMIT] if pod.message.strip() else "no message"
    return f"eval pod {pod.name} failed with exit code {pod.exit_code}: {tail}"


def landed_checkpoint(graph: model.Graph, telemetry: Mapping[str, Mapping[str, Any]]
                      ) -> dict[str, Any] | None:
    """The checkpoint the lowest rank published, in the form the checkpoint edge carries, when
    some eval vertex has not been handed it (or anything newer) yet; None otherwise."""
    if not telemetry:
        return None
    first = min(telemetry.values(), key=lambda s: int(s.get("rank", 1 << 30)))
    landed = (first.get("parameters") or {}).get("checkpoint")
    if not isinstance(landed, dict) or landed.get("step") is None:
        return None
    data: dict[str, Any] = {"vertex": "trainer", "step": int(landed["step"]), "path": landed.get("path")}
    if landed.get("tokens") is not None:
        data["tokens"] = int(landed["tokens"])  # what final_checkpoint tells the last one by
    for edge in graph.edges_from("trainer"):
        if edge.kind != "checkpoint" or edge.target not in graph.vertices:
            continue
        handed = graph.vertices[edge.target].params.get("checkpoint") or {}
        if handed.get("final"):
            continue  # the trainers' last: nothing they publish is newer
        if handed.get("step") is None or int(handed["step"]) < data["step"]:
            return data
    return None


def final_step(job: Any) -> int | None:
    """The step of the trainers' last checkpoint, where the spec tells it: they always save at
    their last step, the declared steps for a pod (no stepLimit). None for a budget in tokens:
    the trainers end at the first step with the budget trained, and a batch grown by
    `scale-with-replicas` (or an edited globalBatch) takes fewer steps (or more) than the spec's
    globalBatch makes of it, so only the trainers know that step."""
    return declared_steps(job.spec) if token_budget(job.spec) is None else None


def is_final(checkpoint: Mapping[str, Any], job: Any) -> bool:
    """Whether a checkpoint handed to the eval vertex is the trainers' last: the one
    final_checkpoint hands, one of the final step, or, for a budget in tokens, one that holds
    the budget (`tokens`, which the trainers publish with each checkpoint)."""
    if checkpoint.get("final"):
        return True
    budget, step = token_budget(job.spec), final_step(job)
    if budget is not None:
        return checkpoint.get("tokens") is not None and int(checkpoint["tokens"]) >= budget
    return checkpoint.get("step") is not None and step is not None and int(checkpoint["step"]) >= step


def final_checkpoint(graph: model.Graph, job: Any) -> dict[str, Any] | None:
    """When every trainer pod succeeded: the last checkpoint, as a checkpoint edge carries it, if
    the eval vertex was not handed it (the monitor polls every few seconds, and a trainer exits
    right after its final save, so its telemetry may never have shown it). No path: the pod gets
    the checkpoint root, whose newest complete checkpoint the evaluator picks.

    Under a budget in tokens the step is not known here (final_step), so the checkpoint is
    handed as `final` with no step: the pod is named `-latest`, and its result carries the step
    the evaluator found. Before, it was handed as the declared steps, a step such a run never
    reaches once its batch grew: a final checkpoint the monitor had seen was evaluated twice, and
    one past the declared steps (a batch edited smaller) not at all."""
    step = final_step(job)
    for edge in graph.edges_from("trainer"):
        if edge.kind != "checkpoint" or edge.target not in graph.vertices:
            continue
        handed = graph.vertices[edge.target].params.get("checkpoint") or {}
        if not is_final(handed, job):
            return ({"vertex": "trainer", "step": step, "path": None} if step is not None
                    else {"vertex": "trainer", "step": None, "path": None, "final": True})
    return None


def build_result(pod: PodRecord, when: str, why: str | None = None) -> dict[str, Any]:
    """One bounded status entry for a finished eval pod (`why`: the failure, if known already)."""
    result = parse_result(pod)
    why = failure(pod) if why is None else why
    # None: a failed final eval of a budget in tokens, whose step only the evaluator would know
    step = (result or {}).get("step", (pod.input or {}).get("step"))
    entry: dict[str, Any] = {
        "pod": pod.name,
        "phase": "Failed" if why else "Succeeded",
        "step": -1 if step is None else int(step),
        "checkpoint": str((result or {}).get("checkpoint") or (pod.input or {}).get("path") or ""),
        "time": when,
    }
    if why:
        entry["message"] = why[:MESSAGE_LIMIT]
        return entry
    assert result is not None
    sources = dict(sorted((result.get("sources") or {}).items())[:MAX_SOURCES])
    entry.update({"loss": round(float(result["loss"]), 6),
                  "sources": {k: round(float(v), 6) for k, v in sources.items()}})
    if result.get("perplexity") is not None:
        entry["perplexity"] = round(float(result["perplexity"]), 4)
    omitted = int(result.get("sourcesOmitted", 0)) + len(result.get("sources") or {}) - len(sources)
    if omitted:
        entry["sourcesOmitted"] = omitted
    return entry


def settled(before: Mapping[str, monitor.InstanceState], graph: model.Graph,
            pods: Iterable[PodRecord]) -> list[tuple[PodRecord, str]]:
    """Finished eval pods, with their failure ('' for none), whose instance the tick's mutations
    took out of the graph."""
    live = set(graph.instance_names())
    by_instance = {p.instance: p for p in pods if p.vertex in {v.name for v in eval_vertices(graph)}
                   and not p.deleting}
    return [(by_instance[name], state.reason) for name, state in before.items()
            if state.completed and name not in live and name in by_instance]


def build_status(old: Mapping[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    """status.lastEvaluation (the newest, in full) and status.evaluations (a short history)."""
    if not results:
        return {}
    history = list(old.get("evaluations") or [])
    history += [{k: r[k] for k in ("step", "phase", "loss") if k in r} for r in results]
    return {"lastEvaluation": results[-1], "evaluations": history[-HISTORY:]}


def describe(entry: Mapping[str, Any]) -> str:
    """The Event's message for one result."""
    if entry["phase"] != "Succeeded":
        which = f"step {entry['step']}" if entry["step"] >= 0 else "the last step"
        return f"evaluation of the checkpoint of {which} failed: {entry.get('message', '')}"
    sources = ", ".join(f"{k} {v:.4f}" for k, v in entry.get("sources", {}).items())
    return (f"checkpoint of step {entry['step']}: loss {entry['loss']:.4f}"
            + (f" ({sources})" if sources else ""))
