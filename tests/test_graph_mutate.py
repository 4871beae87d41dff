"""The mutation API, the managers, and the serialised status (round trip and size bound)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from huorn import graph
from huorn.graph import desired, managers, model, mutate, serialise


class FakeClock:
    """An injected clock: each reading advances one second, so log times are predictable."""

    def __init__(self, start: float = 1000.0) -> None:
        self._ticks = itertools.count(start)

    def __call__(self) -> float:
        return float(next(self._ticks))


def build_graph(lo: int = 1, hi: int = 4, eval_vertex: bool = False) -> model.Graph:
    annotations = {"huorn.io/eval": "true"} if eval_vertex else {}
    g = graph.compile(
        {
            "apiVersion": "huorn.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": "demo", "annotations": annotations},
            "spec": {"virtualCluster": "train", "elasticity": {"minReplicas": lo, "maxReplicas": hi}},
        }
    )
    g.clock = FakeClock()
    return g


def test_each_mutation_bumps_version_once_and_logs_reason_and_time() -> None:
    g = build_graph()
    mutate.resize(g, "trainer", 3, reason="goodput says 3")
    mutate.replace_instance(g, "trainer-1", reason="worker exited -9")
    mutate.set_param(g, "trainer", "k", 2, reason="kFkB planner")
    assert g.version == 4
    assert [(m.version, m.time, m.action, m.reason) for m in g.log] == [
        (2, 1000.0, "resize", "goodput says 3"),
        (3, 1001.0, "replace", "worker exited -9"),
        (4, 1002.0, "set-param", "kFkB planner"),
    ]
    assert [i.name for i in g.vertex("trainer").instances] == ["trainer-0", "trainer-1-g1", "trainer-2"]
    assert g.action_counts == {"resize": 1, "replace": 1, "set-param": 1}


def test_an_uncounted_replacement_is_tallied_with_the_graph() -> None:
    """A failure the pod failure policy ignores: the tally is part of the graph, so it is written
    (and read back by a restarted operator) in the same status patch as the decision."""
    g = build_graph()
    mutate.replace_instance(g, "trainer-0", reason="crash")
    m = mutate.replace_instance(g, "trainer-0-g1", reason="evicted by a node drain", counted=False)
    assert m.detail == {"old": "trainer-0-g1", "new": "trainer-0-g2", "counted": False}
    assert g.action_counts == {"replace": 2, mutate.UNCOUNTED_REPLACE: 1}
    back = serialise.from_status(serialise.to_status(g))
    assert back.action_counts == g.action_counts


def test_noop_mutations_do_not_bump_version() -> None:
    g = build_graph()
    assert mutate.resize(g, "trainer", 1, reason="same") is None
    assert mutate.set_param(g, "trainer", "k", 1, reason="same") is None
    assert g.version == 1 and g.log == []


def test_resize_outside_range_names_the_field() -> None:
    g = build_graph(lo=1, hi=2)
    with pytest.raises(ValueError, match=r"elasticity.minReplicas..maxReplicas"):
        mutate.resize(g, "trainer", 3, reason="too many")
    with pytest.raises(ValueError, match="needs a reason"):
        mutate.resize(g, "trainer", 2, reason=" ")
    assert g.version == 1


def test_shrink_removes_named_instances_and_regrow_reuses_free_ordinals() -> None:
    g = build_graph()
    mutate.resize(g, "trainer", 4, reason="grow")
    mutate.resize(g, "trainer", 2, reason="reclaim", remove=["trainer-1", "trainer-2"])
    assert [i.name for i in g.vertex("trainer").instances] == ["trainer-0", "trainer-3"]
    mutate.resize(g, "trainer", 3, reason="regrow")
    assert [i.ordinal for i in g.vertex("trainer").instances] == [0, 1, 3]
    with pytest.raises(ValueError, match="must name at least"):
        mutate.resize(g, "trainer", 2, reason="bad", remove=["trainer-9"])


def test_a_replica_added_again_never_takes_a_name_a_shrink_gave_up() -> None:
    """The pod of a replica a shrink removed may still be checkpointing when the job grows
    again: the replica added on its ordinal takes the next generation, so the old pod is never
    taken for the new replica's (its exit read as the new one failing), through a status round
    trip too."""
    g = build_graph()
    mutate.resize(g, "trainer", 4, reason="grow")
    mutate.resize(g, "trainer", 2, reason="reclaim", remove=["trainer-1", "trainer-2"])
    g = serialise.from_status(serialise.to_status(g))
    mutate.resize(g, "trainer", 3, reason="regrow")
    assert [i.name for i in g.vertex("trainer").instances] == ["trainer-0", "trainer-1-g1", "trainer-3"]
    mutate.resize(g, "trainer", 2, reason="reclaim", remove=["trainer-1-g1"])
    mutate.resize(g, "trainer", 4, reason="regrow")
    assert [i.name for i in g.vertex("trainer").instances] == [
        "trainer-0", "trainer-1-g2", "trainer-2-g1", "trainer-3"]
    assert g.vertex("trainer").retired == {}
    back = serialise.from_status(serialise.to_status(g)).vertex("trainer")
    assert [i.name for i in back.instances] == [i.name for i in g.vertex("trainer").instances]


def test_insert_vertices_and_choose_branch() -> None:
    g = build_graph()
    fast = model.Vertex("distill-a", "distill", 1, 1, mode=model.ExecutionMode.ON_DEMAND, active=False)
    slow = model.Vertex("distill-b", "distill", 1, 1, mode=model.ExecutionMode.ON_DEMAND, active=False)
    edges = [
        model.Edge("trainer", "distill-a", "checkpoint"),
        model.Edge("trainer", "distill-b", "checkpoint"),
    ]
    mutate.insert_vertices(g, [fast, slow], edges, reason="teacher ready")
    g.branches["teacher"] = model.Branch("teacher", {"small": ["distill-a"], "large": ["distill-b"]})
    mutate.choose_branch(g, "teacher", "large", reason="upstream output is 2 GiB")
    assert g.vertex("distill-b").active and g.vertex("distill-b").replicas == 1
    assert not g.vertex("distill-a").active
    mutate.choose_branch(g, "teacher", "small", reason="flip")
    assert g.vertex("distill-a").replicas == 1 and g.vertex("distill-b").replicas == 0
    with pytest.raises(ValueError, match="already exist"):
        mutate.insert_vertices(g, [model.Vertex("trainer", "x", 1, 1)], [], reason="dup")
    with pytest.raises(ValueError, match="neither exists"):
        mutate.insert_vertices(g, [], [model.Edge("trainer", "ghost", "x")], reason="dangling")


def test_managers_resize_on_decision_and_replace_on_failure() -> None:
    g = build_graph()
    ms = managers.build_default_managers()
    done = ms.dispatch(g, managers.Event(managers.SCHEDULER_DECISION, "trainer", {"replicas": 2}))
    assert [m.action for m in done] == ["resize"] and g.vertex("trainer").replicas == 2
    done = ms.dispatch(
        g, managers.Event(managers.INSTANCE_FAILED, "trainer", {"instance": "trainer-0", "reason": "SIGKILL"})
    )
    assert [m.detail for m in done] == [{"old": "trainer-0", "new": "trainer-0-g1"}]


def test_checkpoint_edge_firing_starts_eval_and_completion_parks_it() -> None:
    g = build_graph(eval_vertex=True)
    ms = managers.build_default_managers()
    done = ms.dispatch(
        g,
        managers.Event(
            managers.EDGE_FIRED, "trainer->eval:checkpoint", {"step": 40, "path": "/ckpt/step-40"}
        ),
    )
    assert [m.action for m in done] == ["set-param", "activate"]
    assert g.vertex("eval").active and g.vertex("eval").params["checkpoint"]["step"] == 40
    ms.dispatch(g, managers.Event(managers.VERTEX_COMPLETED, "eval", {"reason": "eval done"}))
    assert not g.vertex("eval").active and g.vertex("eval").replicas == 0
    with pytest.raises(KeyError, match="neither a vertex nor an edge"):
        ms.dispatch(g, managers.Event(managers.EDGE_FIRED, "nowhere", {}))


def test_a_checkpoint_landing_during_an_eval_runs_it_again_on_the_newer_one() -> None:
    g = build_graph(eval_vertex=True)
    ms = managers.build_default_managers()
    first = {"step": 40, "path": "/ckpt/step-40"}
    ms.dispatch(g, managers.Event(managers.EDGE_FIRED, "trainer->eval:checkpoint", dict(first)))
    ms.dispatch(g, managers.Event(managers.EDGE_FIRED, "trainer->eval:checkpoint",
                                  {"step": 50, "path": "/ckpt/step-50"}))
    again = ms.dispatch(g, managers.Event(managers.VERTEX_COMPLETED, "eval",
                                          {"reason": "done", "inputs": [first]}))
    assert [m.action for m in again] == ["replace"] and "step 50 landed meanwhile" in again[0].reason
    assert "finished on the checkpoint of step 40" in again[0].reason
    assert g.vertex("eval").active and g.vertex("eval").instances[0].generation == 1
    parked = ms.dispatch(g, managers.Event(managers.VERTEX_COMPLETED, "eval", {
        "reason": "done", "inputs": [{"step": 50, "path": "/ckpt/step-50"}]}))
    assert [m.action for m in parked] == ["deactivate"] and not g.vertex("eval").active


def test_suspend_keeps_the_instances_to_resume_with_under_new_names() -> None:
    g = build_graph(lo=1, hi=4, eval_vertex=True)
    mutate.resize(g, "trainer", 3, reason="goodput says 3")
    managers.build_default_managers().dispatch(
        g, managers.Event(managers.EDGE_FIRED, "trainer->eval:checkpoint", {"step": 40, "path": "/c/40"}))
    m = mutate.suspend(g, ["trainer", "rendezvous", "eval"], reason="spec.suspend is true", renew=True)
    assert m is not None and m.action == "suspend"
    assert m.detail == {"vertices": ["trainer", "rendezvous", "eval"],
                        "replicas": {"trainer": 3, "rendezvous": 1}}
    trainer, store, ev = g.vertex("trainer"), g.vertex("rendezvous"), g.vertex("eval")
    assert not trainer.active and not store.active
    assert [i.name for i in trainer.instances] == ["trainer-0-g1", "trainer-1-g1", "trainer-2-g1"]
    # Nothing of a suspended vertex runs: no pod, no process, no store endpoint. The checkpoint
    # volume stays, for the eval and for the resume.
    assert g.instance_names() == ["eval-0-g1"]
    wanted = {(d.kind, d.vertex) for d in desired.build_desired(g)}
    assert {w for w in wanted if w[0] != "volume"} == {("instance", "eval")}
    assert ("volume", "trainer") in wanted
    # The eval in flight keeps its checkpoint and stays active: it runs again after the resume.
    assert ev.active and ev.params["checkpoint"]["step"] == 40
    assert mutate.suspend(g, ["trainer", "rendezvous", "eval"], reason="again", renew=True) is None
    assert trainer.instances[0].generation == 1, "a repeated suspend renews nothing"

    # The round trip through status keeps a suspended graph suspended, instances included.
    back = serialise.from_status(serialise.to_status(g))
    assert not back.vertex("trainer").active and back.vertex("trainer").replicas == 3

    r = mutate.resume(back, ["trainer", "rendezvous", "eval"], reason="spec.suspend is false")
    assert r is not None and r.detail == {"vertices": ["trainer", "rendezvous"],
                                          "replicas": {"trainer": 3, "rendezvous": 1}}
    assert sorted(back.instance_names()) == ["eval-0-g1", "rendezvous-0-g1", "trainer-0-g1", "trainer-1-g1",
                                             "trainer-2-g1"]
    assert mutate.resume(back, ["trainer", "rendezvous"], reason="again") is None
    assert back.action_counts == {"resize": 1, "set-param": 1, "activate": 1, "suspend": 1, "resume": 1}


def test_a_job_suspended_before_any_pod_keeps_its_first_names() -> None:
    g = build_graph(lo=2, hi=4)
    mutate.suspend(g, ["trainer", "rendezvous"], reason="created suspended", renew=False)
    mutate.resume(g, ["trainer", "rendezvous"], reason="admitted")
    assert sorted(g.instance_names()) == ["rendezvous-0", "trainer-0", "trainer-1"]


def test_status_round_trip_is_exact_when_log_fits() -> None:
    g = build_graph(eval_vertex=True)
    mutate.resize(g, "trainer", 3, reason="grow")
    mutate.replace_instance(g, "trainer-2", reason="crash")
    status = serialise.to_status(g)
    assert status["summary"]["logDropped"] == 0
    assert serialise.from_status(status, clock=g.clock) == g


# A random walk over the mutation API; each step is (operation, argument).
_OPS = st.lists(
    st.tuples(st.sampled_from(["resize", "replace", "param"]), st.integers(0, 7), st.text(max_size=300)),
    max_size=120,
)


@settings(max_examples=60, deadline=None)
@given(ops=_OPS, budget=st.integers(3000, 20000))
def test_serialised_status_respects_bound_and_keeps_totals(ops: list, budget: int) -> None:
    g = build_graph(lo=1, hi=8)
    for op, n, text in ops:
        trainer = g.vertex("trainer")
        reason = text.strip() or "random"
        if op == "resize":
            mutate.resize(g, "trainer", n + 1, reason=reason)
        elif op == "replace":
            mutate.replace_instance(g, trainer.instances[n % trainer.replicas].name, reason=reason)
        else:
            mutate.set_param(g, "trainer", "k", n, reason=reason)
    status = serialise.to_status(g, max_bytes=budget)
    assert serialise.measure(status) <= budget
    back = serialise.from_status(status)
    # Structure and totals survive whole; the log is the newest suffix of the real one.
    assert back.vertices == g.vertices and back.edges == g.edges and back.version == g.version
    assert back.mutation_count == len(g.log) and back.action_counts == g.action_counts
    kept = len(back.log)
    assert kept + status["summary"]["logDropped"] == len(g.log)
    assert [m.version for m in back.log] == [m.version for m in g.log[len(g.log) - kept :]]
    # Invariants of the mutation API, whatever the sequence.
    trainer = g.vertex("trainer")
    names = [i.name for i in trainer.instances]
    assert trainer.min_replicas <= trainer.replicas <= trainer.max_replicas and len(set(names)) == len(names)
    assert g.version == 1 + g.mutation_count
    # A restarted operator rebuilds the graph from status and computes the very same resources.
    assert desired.build_desired(back) == desired.build_desired(g)


def test_structure_over_budget_is_a_clear_error() -> None:
    g = build_graph()
    mutate.set_param(g, "trainer", "blob", "x" * 5000, reason="big")
    with pytest.raises(serialise.GraphTooLarge, match="status budget"):
        serialise.to_status(g, max_bytes=4096)


def test_instance_encoding_is_compact_and_exact() -> None:
    instances = [model.Instance("t", o) for o in range(4096)] + [model.Instance("t", 5000, 3)]
    text = serialise.encode_instances(instances)
    assert text == "0-4095,5000g3"
    assert serialise.decode_instances("t", text) == instances


def test_store_failure_replaces_store_and_every_trainer_that_joined_it() -> None:
    g = build_graph()
    mutate.resize(g, "trainer", 2, reason="grow")
    done = managers.build_default_managers().dispatch(
        g,
        managers.Event(managers.INSTANCE_FAILED, "rendezvous", {"instance": "rendezvous-0", "reason": "-9"}),
    )
    assert [(m.action, m.detail["old"], m.detail["new"]) for m in done] == [
        ("replace", "rendezvous-0", "rendezvous-0-g1"),
        ("replace", "trainer-0", "trainer-0-g1"),
        ("replace", "trainer-1", "trainer-1-g1"),
    ]
    assert "rendezvous-0-g1" in done[1].reason
    # The store is broken; the trainers are healthy and only move, so backends drain them.
    assert [m.detail.get("drain", False) for m in done] == [False, True, True]


def test_a_grow_can_replace_replicas_and_says_where_the_new_ones_go() -> None:
    """The goodput allocator moves a resized gang: the replicas off its placement leave, new ones
    take their place on the nodes it chose, and the status log keeps those nodes for the reconcile
    (a restarted operator places them there too)."""
    g = build_graph()
    mutate.resize(g, "trainer", 2, reason="grow")
    m = mutate.resize(g, "trainer", 3, reason="grow and move", remove=["trainer-0"], nodes=["b", "b"])
    assert m is not None and m.detail["from"] == 2 and m.detail["to"] == 3
    assert m.detail["removed"] == ["trainer-0"]
    assert m.detail["added"] == ["trainer-0-g1", "trainer-2"]  # a new generation on ordinal 0
    assert mutate.decode_nodes(m.detail["nodes"]) == ["b", "b"]
    assert [i.name for i in g.vertex("trainer").instances] == ["trainer-0-g1", "trainer-1", "trainer-2"]
    back = serialise.from_status(serialise.to_status(g))
    assert back.log[-1].detail["nodes"] == m.detail["nodes"]
    with pytest.raises(ValueError, match="one node for each of the 1 new"):
        mutate.resize(g, "trainer", 4, reason="bad", nodes=["b", "c"])
    with pytest.raises(ValueError, match="distinct"):
        mutate.resize(g, "trainer", 3, reason="bad", remove=["trainer-1", "trainer-1"])
    # a move at the same size is a mutation; the same size with nothing removed is none
    assert mutate.resize(g, "trainer", 3, reason="move", remove=["trainer-1"], nodes=["c"]) is not None
    assert mutate.resize(g, "trainer", 3, reason="noop") is None


def test_where_new_instances_go_survives_the_status_log_cutting_a_long_detail() -> None:
    """A detail over the log's limit keeps only its scalars and the instance lists: the nodes of
    a big move (GKE-long node names) are one scalar, so the reconcile still has them."""
    g = build_graph(hi=64)
    names = [f"gke-prod-a100-pool-7f3c9e2a-{i:04d}" for i in range(12)]
    nodes = [names[i % 12] for i in range(40)]
    m = mutate.resize(g, "trainer", 40, reason="grow", nodes=nodes[1:])
    assert m is not None and serialise.measure(m.detail) > serialise.DETAIL_LIMIT
    back = serialise.from_status(serialise.to_status(g)).log[-1].detail
    assert back.get("truncated") and sorted(mutate.decode_nodes(back["nodes"])) == sorted(nodes[1:])
    assert len(back["added"]) == 39


def test_a_final_checkpoint_handed_without_its_step_is_named_as_the_final_one() -> None:
    """A token budget's last checkpoint may be handed before its step is known (the trainers
    exited): the reasons said "step None"."""
    g = build_graph(eval_vertex=True)
    ms = managers.build_default_managers()
    final = {"step": None, "final": True, "path": "/ckpt"}
    done = ms.dispatch(g, managers.Event(managers.EDGE_FIRED, "trainer->eval:checkpoint", dict(final)))
    assert [m.reason for m in done] == ["the final checkpoint landed on trainer->eval:checkpoint",
                                        "checkpoint edge from trainer fired: the final checkpoint"]
    again = ms.dispatch(g, managers.Event(managers.VERTEX_COMPLETED, "eval", {
        "reason": "done", "inputs": [{"step": 40, "path": "/ckpt/step-40"}]}))
    assert "the final checkpoint landed meanwhile" in again[0].reason and "None" not in again[0].reason
