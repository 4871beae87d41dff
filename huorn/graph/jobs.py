"""The graph compilers of the three job kinds.

TrainingJob: an elastic trainer gang plus its own rendezvous-store vertex. torchrun measurements
(notes/torchrun-elastic.md) show the agent that hosts the c10d store is a single point of
failure, so the store lives in a one-replica vertex that no shrink, reclaim or remediation ever
picks. The trainer's `resize` parameter (inPlace or restart, never auto) says whether a replica
is the trainer process itself, which survives a membership change, or a torchrun agent. An
optional on-demand eval vertex hangs off a checkpoint edge.
RLJob: one vertex per ROLL role, joined by rollout, reward and weight edges; colocated roles
talk through memory, the others through the network.
InferenceJob: serving replicas behind a router.
"""

from __future__ import annotations

from huorn.api import kinds, rl, training
from huorn.api.common import ResizeMode
from huorn.graph import compiler
from huorn.graph.model import (
    Edge,
    ExecutionMode,
    Graph,
    Pattern,
    ResourceRequest,
    Scheduling,
    Transport,
    Vertex,
    build_instances,
)

EVAL_ANNOTATION = "huorn.io/eval"
STORE_RESOURCES = ResourceRequest(gpus=0, cpu=0.25, memory=256 * 2.0**20)
ROUTER_RESOURCES = ResourceRequest(gpus=0, cpu=0.5, memory=512 * 2.0**20)


def _vertex(name: str, role: str, lo: int, hi: int, replicas: int, **kwargs: object) -> Vertex:
    v = Vertex(name=name, role=role, min_replicas=lo, max_replicas=hi, **kwargs)  # type: ignore[arg-type]
    if v.active:
        v.instances = build_instances(name, replicas)
    return v


@compiler.register("TrainingJob")
def compile_training(job: kinds.TrainingJob) -> Graph:
    spec = job.spec
    name = compiler.resource_name(job)
    graph = Graph(name=name, kind="TrainingJob")
    el = spec.elasticity
    if el.min_replicas > el.max_replicas:
        raise ValueError(
            f"spec.elasticity.minReplicas ({el.min_replicas}) exceeds maxReplicas ({el.max_replicas}); "
            "raise maxReplicas or lower minReplicas"
        )
    graph.vertices["rendezvous"] = _vertex(
        "rendezvous", "rendezvous", 1, 1, 1, resources=STORE_RESOURCES, params={"runId": name}
    )
    graph.vertices["trainer"] = _vertex(
        "trainer",
        "trainer",
        el.min_replicas,
        el.max_replicas,
        el.min_replicas,
        resources=compiler.build_request(spec.resources),
        params={
            "policy": el.policy.value,
            "pipelineStages": spec.parallelism.pipeline_stages,
            "pipelineSchedule": spec.parallelism.schedule.value,
            "k": spec.parallelism.k,
            # inPlace or restart, `auto` decided here once: how a backend launches each replica
            # (the trainer itself, or a torchrun agent) follows from it.
            "resize": training.resolve_resize(spec).value,
            "checkpoint": spec.checkpoint.to_wire(),
            "spec": spec.to_wire(),
        },
    )
    graph.edges.append(
        Edge(
            "rendezvous", "trainer", "rendezvous", Pattern.BROADCAST, Scheduling.CONCURRENT, Transport.NETWORK
        )
    )
    if job.metadata.annotations.get(EVAL_ANNOTATION, "").lower() == "true":
        graph.vertices["eval"] = _vertex(
            "eval",
            "eval",
            1,
            1,
            0,
            resources=compiler.build_request(spec.resources),
            mode=ExecutionMode.ON_DEMAND,
            active=False,
            params={"model": spec.model.to_wire()},
        )
        graph.edges.append(
            Edge(
                "trainer",
                "eval",
                "checkpoint",
                Pattern.ONE_TO_ONE,
                Scheduling.SEQUENTIAL,
                Transport.CHECKPOINT_FILE,
                params={"path": spec.checkpoint.path},
            )
        )
    return graph


_RL_ROLES = {
    "actor_train": ("actor-train", ExecutionMode.GANG),
    "rollout": ("rollout", ExecutionMode.GANG),
    "reference": ("reference", ExecutionMode.GANG),
    "reward": ("reward", ExecutionMode.ON_DEMAND),
    "environment": ("environment", ExecutionMode.ON_DEMAND),
}
# (source, target, what flows, pattern, scheduling): the ROLL data flow of one RL step.
_RL_FLOWS = [
    ("environment", "rollout", "observations", Pattern.ONE_TO_ONE, Scheduling.CONCURRENT),
    ("rollout", "reward", "responses", Pattern.ALL_TO_ALL, Scheduling.CONCURRENT),
    ("rollout", "actor-train", "rollouts", Pattern.ALL_TO_ALL, Scheduling.CONCURRENT),
    ("reference", "actor-train", "log-probs", Pattern.ONE_TO_ONE, Scheduling.CONCURRENT),
    ("reward", "actor-train", "rewards", Pattern.ALL_TO_ALL, Scheduling.CONCURRENT),
    ("actor-train", "rollout", "weights", Pattern.BROADCAST, Scheduling.SEQUENTIAL),
]


@compiler.register("RLJob")
def compile_rl(job: kinds.RLJob) -> Graph:
    spec = job.spec
    graph = Graph(name=compiler.resource_name(job), kind="RLJob")
    groups: dict[str, str | None] = {}
    for field_name, (vertex_name, mode) in _RL_ROLES.items():
        role: rl.Role | None = getattr(spec.roles, field_name)
        if role is None or role.replicas == 0:
            continue
        request = compiler.build_request(spec.resources)
        params: dict[str, object] = {
            "colocationGroup": role.colocation_group,
            "deviceMapping": role.device_mapping,
        }
        if vertex_name == "actor-train":
            params |= {
                "algorithm": spec.algorithm.to_wire(),
                "steps": spec.steps,
                "model": spec.model.to_wire(),
            }
        if vertex_name == "rollout":
            params |= {"rollout": spec.rollout.to_wire(), "model": spec.model.to_wire()}
        if vertex_name == "reward":
            params |= {"reward": spec.reward.to_wire()}
        graph.vertices[vertex_name] = _vertex(
            vertex_name,
            vertex_name,
            role.replicas,
            role.replicas,
            role.replicas,
            mode=mode,
            resources=ResourceRequest(role.gpus_per_replica, request.cpu, request.memory),
            params=params,
        )
        groups[vertex_name] = role.colocation_group
    for source, target, flow, pattern, scheduling in _RL_FLOWS:
        if source in graph.vertices and target in graph.vertices:
            shared = groups[source] is not None and groups[source] == groups[target]
            transport = Transport.MEMORY if shared else Transport.NETWORK
            graph.edges.append(Edge(source, target, flow, pattern, scheduling, transport))
    return graph


@compiler.register("InferenceJob")
def compile_inference(job: kinds.InferenceJob) -> Graph:
    spec = job.spec
    graph = Graph(name=compiler.resource_name(job), kind="InferenceJob")
    scale = spec.autoscaling
    if scale.min_replicas > scale.max_replicas:
        raise ValueError(
            f"spec.autoscaling.minReplicas ({scale.min_replicas}) exceeds maxReplicas ({scale.max_replicas})"
        )
    graph.vertices["router"] = _vertex(
        "router", "router", 1, 1, 1, resources=ROUTER_RESOURCES,
        params={"slo": spec.slo.to_wire(), "routing": spec.routing.to_wire()},
    )
    graph.vertices["server"] = _vertex(
        "server",
        "server",
        scale.min_replicas,
        scale.max_replicas,
        max(scale.min_replicas, 1),
        resources=compiler.build_request(spec.resources),
        params={
            "model": spec.model.to_wire(),
            "serving": spec.serving.to_wire(),
            "quantization": spec.quantization.to_wire(),
        },
    )
    graph.edges.append(
        Edge("router", "server", "requests", Pattern.ALL_TO_ALL, Scheduling.CONCURRENT, Transport.NETWORK)
    )
    return graph


def resizes_in_place(trainer: Vertex) -> bool:
    """Whether each replica of this trainer vertex is the trainer process itself, taking part in
    the rendezvous directly (huorn.runtime.membership), rather than a torchrun agent. A graph
    compiled before the `resize` parameter existed runs its replicas as it started them: under
    torchrun."""
    return trainer.params.get("resize") == ResizeMode.IN_PLACE.value


def build_training_spec(trainer: Vertex) -> dict:
    """The TrainingJobSpec wire dict a trainer vertex runs now: the compiled spec with the
    knobs that mutations own (replica range, pipeline parameters) laid over it, so a backend
    never runs a stale value after a set-param."""
    spec = dict(trainer.params["spec"])
    spec["elasticity"] = {
        **spec.get("elasticity", {}),
        "minReplicas": trainer.min_replicas,
        "maxReplicas": trainer.max_replicas,
    }
    spec["parallelism"] = {
        **spec.get("parallelism", {}),
        "pipelineStages": trainer.params["pipelineStages"],
        "schedule": trainer.params["pipelineSchedule"],
        "k": trainer.params["k"],
    }
    return spec
