"""Compiling each job kind into its execution graph, and the graph → desired-resources mapping."""

from __future__ import annotations

import pytest

from huorn import graph
from huorn.graph import desired, managers, model, mutate


def build_training(name: str = "demo", lo: int = 1, hi: int = 2, **extra: object) -> dict:
    metadata = {"name": name, **extra.pop("metadata", {})}  # type: ignore[dict-item]
    spec = {"virtualCluster": "train", "elasticity": {"minReplicas": lo, "maxReplicas": hi}, **extra}
    return {"apiVersion": "huorn.io/v1alpha1", "kind": "TrainingJob", "metadata": metadata, "spec": spec}


def test_training_job_gets_trainer_gang_and_its_own_store_vertex() -> None:
    g = graph.compile(build_training(lo=1, hi=3, parallelism={"pipelineStages": 2}))
    assert g.kind == "TrainingJob" and g.version == 1
    store, trainer = g.vertex("rendezvous"), g.vertex("trainer")
    assert (store.min_replicas, store.max_replicas, store.replicas) == (1, 1, 1)
    assert store.resources.gpus == 0
    assert (trainer.min_replicas, trainer.max_replicas, trainer.replicas) == (1, 3, 1)
    assert trainer.mode == model.ExecutionMode.GANG
    assert trainer.params["pipelineStages"] == 2
    assert trainer.resources.cpu == 4.0 and trainer.resources.memory == 16 * 2**30
    (edge,) = g.edges
    assert (edge.source, edge.target, edge.kind) == ("rendezvous", "trainer", "rendezvous")
    assert edge.scheduling == model.Scheduling.CONCURRENT and edge.transport == model.Transport.NETWORK
    assert "eval" not in g.vertices


def test_eval_annotation_adds_waiting_eval_fed_by_checkpoint_edge() -> None:
    g = graph.compile(build_training(metadata={"annotations": {"huorn.io/eval": "true"}}))
    ev = g.vertex("eval")
    assert not ev.active and ev.replicas == 0 and ev.mode == model.ExecutionMode.ON_DEMAND
    edge = next(e for e in g.edges if e.target == "eval")
    assert edge.kind == "checkpoint" and edge.transport == model.Transport.CHECKPOINT_FILE
    assert edge.scheduling == model.Scheduling.SEQUENTIAL


def test_rl_job_compiles_roles_and_colocated_edges_use_memory() -> None:
    manifest = {
        "apiVersion": "huorn.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "rl"},
        "spec": {
            "virtualCluster": "train",
            "roles": {
                "actorTrain": {"replicas": 2, "colocationGroup": "main"},
                "rollout": {"replicas": 2, "colocationGroup": "main"},
                "reward": {"replicas": 1, "gpusPerReplica": 0},
            },
        },
    }
    g = graph.compile(manifest)
    assert set(g.vertices) == {"actor-train", "rollout", "reward"}
    kinds = {e.kind: e for e in g.edges}
    assert set(kinds) == {"responses", "rollouts", "rewards", "weights"}
    assert kinds["rollouts"].transport == model.Transport.MEMORY
    assert kinds["rewards"].transport == model.Transport.NETWORK
    assert kinds["weights"].pattern == model.Pattern.BROADCAST
    assert g.vertex("reward").mode == model.ExecutionMode.ON_DEMAND


def test_inference_job_compiles_servers_behind_router() -> None:
    manifest = {
        "apiVersion": "huorn.io/v1alpha1",
        "kind": "InferenceJob",
        "metadata": {"name": "serve"},
        "spec": {
            "virtualCluster": "infer",
            "model": {"checkpoint": "/ckpt"},
            "autoscaling": {"minReplicas": 2, "maxReplicas": 5},
        },
    }
    g = graph.compile(manifest)
    assert g.vertex("server").replicas == 2 and g.vertex("server").max_replicas == 5
    assert [(e.source, e.target, e.kind) for e in g.edges] == [("router", "server", "requests")]


def test_registry_names_compilable_kinds_for_unknown_one() -> None:
    assert graph.registered_kinds() == ["InferenceJob", "RLJob", "TrainingJob"]
    vc = {
        "apiVersion": "huorn.io/v1alpha1",
        "kind": "VirtualCluster",
        "metadata": {"name": "vc"},
        "spec": {"members": {"nodes": ["n1"]}},
    }
    with pytest.raises(ValueError, match="compilable kinds"):
        graph.compile(vc)
    with pytest.raises(ValueError, match="not a Huorn kind"):
        graph.compile({**vc, "kind": "Nope"})


def test_bad_manifest_error_names_the_field() -> None:
    with pytest.raises(ValueError, match="minReplicas"):
        graph.compile(build_training(lo=3, hi=2))


def test_desired_resources_are_deterministic_and_ordered() -> None:
    g1, g2 = graph.compile(build_training()), graph.compile(build_training())
    assert desired.build_desired(g1) == desired.build_desired(g2)
    kinds = [r.kind for r in desired.build_desired(g1)]
    assert kinds == sorted(kinds, key=["volume", "endpoint", "instance"].index)
    trainer = next(r for r in desired.build_desired(g1) if r.vertex == "trainer" and r.kind == "instance")
    assert trainer.depends_on == ("demo-rendezvous", "demo-trainer-checkpoints")


def test_replacement_is_one_delete_and_one_create() -> None:
    g = graph.compile(build_training(lo=1, hi=2))
    mutate.resize(g, "trainer", 2, reason="scale up")
    before = desired.build_desired(g)
    mutate.replace_instance(g, "trainer-1", reason="worker crashed")
    create, delete = desired.diff_desired(before, desired.build_desired(g))
    assert [r.name for r in create] == ["demo-trainer-1-g1"]
    assert [r.name for r in delete] == ["demo-trainer-1"]


def test_waiting_vertex_has_no_desired_resources_until_activated() -> None:
    g = graph.compile(build_training(metadata={"annotations": {"huorn.io/eval": "true"}}))
    assert not [r for r in desired.build_desired(g) if r.vertex == "eval"]
    mutate.set_active(g, "eval", True, reason="checkpoint landed")
    assert [r.name for r in desired.build_desired(g) if r.vertex == "eval"] == ["demo-eval-0"]


def test_an_eval_handed_a_checkpoint_reads_the_trainers_volume_and_has_none_of_its_own() -> None:
    """The checkpoint an edge hands the eval is a `checkpoint` parameter too; taken for a
    checkpoint spec, it made a volume `<job>-eval-checkpoints` that nothing wrote into (review:
    `huorn run` logged "created volume quickstart-eval-checkpoints", and left it empty)."""
    g = graph.compile(build_training(metadata={"annotations": {"huorn.io/eval": "true"}}))
    handed = {"vertex": "trainer", "step": 25, "path": "/ckpt/step-00000025"}
    edge = managers.Event(managers.EDGE_FIRED, "trainer->eval:checkpoint", handed)
    managers.build_default_managers().dispatch(g, edge)
    assert g.vertex("eval").params["checkpoint"] == handed and g.vertex("eval").active
    wanted = desired.build_desired(g)
    assert [r.name for r in wanted if r.kind == "volume"] == ["demo-trainer-checkpoints"]
    ev = next(r for r in wanted if r.kind == "instance" and r.vertex == "eval")
    assert ev.depends_on == ("demo-trainer-checkpoints",)
    assert desired.writes_checkpoints(g.vertex("trainer"))
    assert not desired.writes_checkpoints(g.vertex("eval"))


def test_producers_are_created_before_consumers_whatever_their_names() -> None:
    g = graph.compile(build_training())
    # Rename so the store would sort after the trainer alphabetically.
    store = g.vertices.pop("rendezvous")
    store.name = "zz-store"
    store.instances = [model.Instance("zz-store", 0)]
    g.vertices["zz-store"] = store
    g.edges[0].source = "zz-store"
    order = [r.vertex for r in desired.build_desired(g) if r.kind == "instance"]
    assert order == ["zz-store", "trainer"]
    rl = graph.compile(
        {
            "apiVersion": "huorn.io/v1alpha1",
            "kind": "RLJob",
            "metadata": {"name": "rl"},
            "spec": {
                "virtualCluster": "train",
                "roles": {"environment": {"replicas": 1}, "reward": {"replicas": 1}},
            },
        }
    )
    order = [r.vertex for r in desired.build_desired(rl) if r.kind == "instance"]
    assert (
        order.index("environment")
        < order.index("rollout")
        < order.index("reward")
        < order.index("actor-train")
    )
