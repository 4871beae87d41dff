"""An instance name is never used twice in a graph's life: parking a vertex (an eval between
checkpoints), a branch not taken and a resume all give the next instances new names. Found by
review: every eval run was eval-0, so all of them appended to logs/eval-0.log, and in a cluster a
pod name came back while the old pod might still exist."""

from __future__ import annotations

from huorn import graph
from huorn.backends.kubernetes import manifests
from huorn.graph import desired, model, mutate, render, serialise


def build_eval_graph() -> model.Graph:
    return graph.compile({
        "apiVersion": "huorn.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "demo", "annotations": {"huorn.io/eval": "true"}},
        "spec": {"virtualCluster": "train", "elasticity": {"minReplicas": 1, "maxReplicas": 2}},
    })


def eval_runs(g: model.Graph, runs: int) -> list[str]:
    names = []
    for run in range(runs):
        mutate.set_active(g, "eval", True, reason=f"checkpoint {run} landed")
        names.append(g.vertex("eval").instances[0].name)
        mutate.set_active(g, "eval", False, reason="done")
    return names


def test_each_activation_of_a_parked_vertex_has_new_instance_names() -> None:
    g = build_eval_graph()
    assert eval_runs(g, 3) == ["eval-0", "eval-0-g1", "eval-0-g2"]
    assert g.vertex("eval").retired == {0: 2} and g.vertex("eval").instances == []


def test_a_rerun_then_a_park_keeps_counting_generations() -> None:
    """The OnDemandManager's re-run on a newer checkpoint replaces the instance (eval-0-g1); the
    park after it must retire that generation, not the first one."""
    g = build_eval_graph()
    mutate.set_active(g, "eval", True, reason="checkpoint 5 landed")
    mutate.replace_instance(g, "eval-0", reason="checkpoint 10 landed meanwhile", counted=False)
    mutate.set_active(g, "eval", False, reason="done")
    mutate.set_active(g, "eval", True, reason="checkpoint 15 landed")
    assert [i.name for i in g.vertex("eval").instances] == ["eval-0-g2"]


def test_the_names_survive_the_status_round_trip() -> None:
    g = build_eval_graph()
    eval_runs(g, 2)
    back = serialise.from_status(serialise.to_status(g))
    assert back.vertex("eval").retired == {0: 1}
    assert eval_runs(back, 1) == ["eval-0-g2"]
    assert serialise.from_status(serialise.to_status(back)).vertex("eval").retired == {0: 2}


def test_a_branch_chosen_again_gets_new_names() -> None:
    g = build_eval_graph()
    g.vertices["ablation"] = model.Vertex("ablation", "eval", 2, 2, active=False)
    g.branches["which"] = model.Branch("which", {"main": ["eval"], "ablation": ["ablation"]})
    mutate.choose_branch(g, "which", "ablation", reason="try the ablation")
    assert [i.name for i in g.vertex("ablation").instances] == ["ablation-0", "ablation-1"]
    mutate.choose_branch(g, "which", "main", reason="back to the main line")
    assert g.vertex("ablation").retired == {0: 0, 1: 0}
    mutate.choose_branch(g, "which", "ablation", reason="the ablation again")
    assert [i.name for i in g.vertex("ablation").instances] == ["ablation-0-g1", "ablation-1-g1"]


def test_a_resumed_vertex_without_instances_takes_the_next_generation() -> None:
    g = build_eval_graph()
    trainer = g.vertex("trainer")
    trainer.active, trainer.instances, trainer.retired = False, [], {0: 3}
    mutate.resume(g, ["trainer"], reason="spec.suspend is false")
    assert [i.name for i in trainer.instances] == ["trainer-0-g4"]


def test_backends_and_the_picture_carry_the_new_names() -> None:
    g = build_eval_graph()
    eval_runs(g, 1)
    mutate.set_active(g, "eval", True, reason="checkpoint 10 landed")
    instance = g.vertex("eval").instances[0]
    assert [r.name for r in desired.build_desired(g) if r.kind == "instance" and r.vertex == "eval"] == [
        "demo-eval-0-g1"]
    job = manifests.JobRef("TrainingJob", "demo", "team", "uid-1")
    assert manifests.eval_pod_name(job, instance, {"step": 10}) == "demo-eval-0-g1-s10"
    assert "eval-0-g1" in render.render_dot(g)
