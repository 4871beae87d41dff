"""What the goodput policy learns from telemetry, and at which batch the allocator prices a job.

The operator and `huorn run` feed the runtime's step records to a job's performance model and
ask the allocator for its replicas; these tests hold the learning to the records' own
configuration (replicas, nodes, batch) and the pricing to the batch the trainer really runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import job_support
import numpy as np
import pytest
import yaml

from huorn import graph
from huorn.api import kinds, manifests, training
from huorn.backends import goodput, monitor
from huorn.backends.kubernetes import observe
from huorn.backends.local import backend as local_backend
from huorn.backends.local import commands
from huorn.cli import run as cli_run
from huorn.graph import model
from huorn.operator import allocation, index, monitoring
from huorn.runtime import telemetry as runtime_telemetry
from huorn.runtime.data import sampler
from huorn.scheduler import allocator, perfmodel, placement, snapshot

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"
# A job whose network makes replicas cheap within a node and dear across nodes (Pollux's form).
TRUE = perfmodel.PolluxParams(0.10, 0.003, 0.02, 0.005, 0.2, 0.02, 1.5)


def true_step(replicas: int, nodes: int, local: float) -> float:
    return float(perfmodel.predict_step_time(TRUE, replicas, nodes, local))


def fitted(configs: list[tuple[int, int, float]]) -> perfmodel.PerfModel:
    model = perfmodel.PerfModel("transformer-tiny", params_b=0.001, gpu_type="cpu")
    model.set_samples([perfmodel.Sample(r, n, b, true_step(r, n, b)) for r, n, b in configs])
    return model


@pytest.mark.parametrize("rule", ["goodput", "fixed-global", "scale-with-replicas"])
def test_each_replica_count_is_priced_at_the_batch_its_rule_runs(rule: str) -> None:
    """A large noise scale makes a larger batch nearly free of statistical cost, so the grid's best
    batch grows with the gang; a fixed-global trainer keeps 32 whatever the replicas, and a
    scale-with-replicas one keeps 32 / min_replicas a replica. Priced on the grid, a fixed-global
    job looked several times faster at 8 replicas than it ran."""
    perf = fitted([(r, 1, b) for r in (1, 2, 4, 8) for b in (32 / r, 64 / r, 8.0, 16.0)])
    job = allocator.JobView("j", "vc", perf=perf, min_replicas=2, max_replicas=8, noise_scale=2000.0,
                            base_batch=32.0, max_local_batch=64.0, batch_rule=rule)
    table = allocator.Allocator(allocator.AllocatorConfig(gpus_per_node=8)).table(job)
    chosen = {r: table.choice(r).global_batch for r in (2, 4, 8)}  # type: ignore[union-attr]
    if rule == "fixed-global":
        assert chosen == {2: 32.0, 4: 32.0, 8: 32.0}
    elif rule == "scale-with-replicas":
        assert chosen == {2: 32.0, 4: 64.0, 8: 128.0}
    else:
        assert chosen[8] > 32.0
    # the speedup the allocator sees at 8 replicas is that of the batch it priced
    eight = table.choice(8)
    assert eight is not None
    expected = eight.global_batch / true_step(8, 1, eight.local_batch)
    assert eight.throughput == pytest.approx(expected, rel=0.05)


def test_a_batch_rule_the_allocator_does_not_know_is_refused() -> None:
    with pytest.raises(ValueError, match="batch_rule 'adaptive'"):
        allocator.JobView("j", "vc", batch_rule="adaptive")


def records(world: int, steps: range, seconds: float = 0.5, **extra: object) -> list[dict]:
    return [{"step": s, "world_size": world, "step_seconds": seconds, "global_batch": 16, **extra}
            for s in steps]


def policy() -> goodput.GoodputPolicy:
    return goodput.GoodputPolicy("j", "vc", slots=4, global_batch=16.0)


def samples(p: goodput.GoodputPolicy) -> list[tuple[int, int, float, float]]:
    return [(s.replicas, s.nodes, s.local_batch, s.step_time) for s in p.perf.samples]


def test_the_first_steps_of_each_configuration_are_left_out() -> None:
    """A grow's first step pays a new process group: 5× slower here. Kept, it put the model's
    speedup at 2 replicas at 0.92× where it was 1.25×."""
    p = policy()
    p.learn(records(1, range(1, 11), 0.4))
    p.learn([{"step": 11, "world_size": 2, "step_seconds": 2.0, "global_batch": 16},
             {"step": 12, "world_size": 2, "step_seconds": 0.9, "global_batch": 16},
             *records(2, range(13, 16), 0.25)])
    assert samples(p) == [(1, 1, 16.0, 0.4), (2, 1, 8.0, 0.25)]
    assert p.model_version() % goodput.EPOCH_STRIDE == 8 + 3


def test_a_configuration_keeps_the_median_of_a_bounded_window() -> None:
    """One sample per step, kept for good and refitted at every decision, cost the operator's
    event loop 3.3 s per decision at 20,000 steps; now the model holds one median per configuration."""
    p = policy()
    p.learn(records(1, range(1, 20_001), 0.5))
    p.learn(records(1, range(20_001, 20_031), 0.7))  # the job slowed: the window follows it
    assert samples(p) == [(1, 1, 16.0, 0.7)]
    assert len(p._times[(1, 1, 16.0)]) == p.window


@pytest.mark.parametrize("bad", [math.inf, math.nan, 0.0, -1.0, None, "fast"])
def test_a_step_time_or_noise_scale_that_is_no_finite_positive_number_is_skipped(bad: object) -> None:
    """An infinite step time once made every later fit fail; a NaN noise scale was kept."""
    p = policy()
    p.learn(records(1, range(1, 6), 0.5, gradient_noise_scale=40.0))
    p.learn([{"step": 6, "world_size": 1, "step_seconds": bad, "global_batch": 16,
              "gradient_noise_scale": bad}])
    assert samples(p) == [(1, 1, 16.0, 0.5)] and p.noise_scale == 40.0
    p.perf.fit()
    with pytest.raises(ValueError, match="finite and > 0"):
        p.perf.observe(perfmodel.Sample(1, 1, 16.0, math.inf))


def test_samples_carry_the_span_of_the_trainers_and_a_window_across_a_change_is_left_out() -> None:
    """Every sample said one node: a gang across two was fitted to the intra-node terms, and the
    model then ranked spreading it above packing it."""
    p = policy()
    p.learn(records(4, range(1, 8), 0.3), nodes=1)
    p.learn(records(4, range(8, 12), 0.9), nodes=2)  # read across the move: which span ran them?
    p.learn(records(4, range(12, 16), 0.8), nodes=2)
    assert samples(p) == [(4, 1, 4.0, 0.3), (4, 2, 4.0, 0.8)]
    # through decide: the span is the nodes of the gang's replicas in the observation
    q = policy()
    pods = [pod(0, "a"), pod(1, "b"), pod(2, "b"), pod(3, "a")]
    q.decide(build_graph(), poll(pods, records(4, range(1, 8), 0.8)))
    assert [s.nodes for s in q.perf.samples] == [2]


def pod(i: int, node: str, phase: str = "Running", deleting: bool = False) -> index.PodRecord:
    return index.PodRecord("ns", f"j-trainer-{i}", "j", "trainer", f"j-trainer-{i}", node, 1, 1000, "vc",
                           phase=phase, deleting=deleting, ip=f"10.0.0.{i}")


def poll(pods: list[index.PodRecord], steps: list[dict]) -> monitor.Observation:
    """What the operator's monitor reads of the pods (monitoring.fetch_observation, tick_job): the
    telemetry of every running trainer not being deleted, each saying the world of its gang, and
    where every trainer holding its GPUs is placed."""
    world = steps[-1]["world_size"]
    polled = [p for p in pods if p.phase == "Running" and not p.deleting]
    snapshots = {p.instance: {"rank": rank, "world_size": world, "steps": steps}
                 for rank, p in enumerate(polled)}
    observation = observe.build_observation(0.0, snapshots, after_step=0, gpus_per_replica=1)
    observation.nodes.update(allocation.trainer_nodes(pods))
    return observation


def test_a_gang_is_learned_at_its_own_span_while_a_resize_is_in_flight() -> None:
    """A grow places its new pods at once and the old gang trains on while they start; a shrink's
    leaving pods drop out of the span while the old gang still steps. The span of the trainer
    pods put the old gang's steps at 2 nodes (grow) and at 1 (shrink), gangs that never ran
    there: the inter-node cost vanished from the model, and it priced spreading a gang as cheap."""
    g, grow = build_graph(), policy()
    two = [pod(0, "a"), pod(1, "a")]
    grow.decide(g, poll(two, records(2, range(1, 11), 0.25)))
    growing = [*two, pod(2, "b", "Pending"), pod(3, "b", "Pending")]
    for first, last in ((11, 16), (16, 26), (26, 36)):
        grow.decide(g, poll(growing, records(2, range(first, last), 0.25)))
    assert samples(grow) == [(2, 1, 8.0, 0.25)]
    shrink = policy()
    four = [pod(0, "a"), pod(1, "a"), pod(2, "b"), pod(3, "b")]
    shrink.decide(g, poll(four, records(4, range(1, 11), 0.6)))
    leaving = [*four[:2], pod(2, "b", deleting=True), pod(3, "b", deleting=True)]
    for first, last in ((11, 14), (14, 20)):
        shrink.decide(g, poll(leaving, records(4, range(first, last), 0.6)))
    assert samples(shrink) == [(4, 2, 4.0, 0.6)]
    # once the grown gang answers whole, its steps are learned at its span
    grown = [*two, pod(2, "b"), pod(3, "b")]
    grow.decide(g, poll(grown, records(4, range(36, 46), 0.5)))
    assert samples(grow) == [(2, 1, 8.0, 0.25), (4, 2, 4.0, 0.5)]


def test_a_step_taken_before_an_in_place_resize_keeps_its_own_world() -> None:
    """The runtime's telemetry outlives an in-place resize; the operator put every step it read
    after the resize at the new world, so the old gang's steps were learned as the new one's."""
    tel = runtime_telemetry.Telemetry("j", rank=0, world_size=4, replica="r0", history=64)
    for step in range(1, 11):
        tel.record_step(step, 0.157, 0.02, 2.0, 100.0, None, global_batch=32)
    tel.rejoin(0, 8)
    for step in range(11, 13):
        tel.record_step(step, 0.139, 0.02, 2.0, 100.0, None, global_batch=32)
    snapshot = tel.snapshot()
    assert snapshot["world_size"] == 8
    obs = observe.build_observation(0.0, {"r0": snapshot}, after_step=0, gpus_per_replica=2)
    assert [r["world_size"] for r in obs.steps] == [2] * 10 + [4] * 2
    # a trainer from before records carried no world: the snapshot's, as it was
    old = {**snapshot,
           "steps": [{k: v for k, v in r.items() if k != "world_size"} for r in snapshot["steps"]]}
    assert {r["world_size"] for r in observe.build_observation(0.0, {"r0": old}, 0, 2).steps} == {4}


def training_spec(gpus: int, moe: bool = False) -> training.TrainingJobSpec:
    body = {"apiVersion": "huorn.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "llm"},
            "spec": {"virtualCluster": "train", "resources": {"gpus": gpus},
                     "model": {"layers": 32, "width": 4096, "heads": 32, "vocabulary": 32000, "context": 4096,
                               **({"moe": {"experts": 8, "topK": 2}} if moe else {})},
                     "optimization": {"steps": 10}}}
    return kinds.RESOURCE_MODELS["TrainingJob"].model_validate(body).spec  # type: ignore[attr-defined]


def test_a_job_on_gpus_starts_from_its_familys_prior_at_its_size() -> None:
    """A 32 × 4096 decoder is about 6.7 billion parameters (Llama-2-7B's shape, 6.7B with its
    11008-wide MLP). Every job started from the CPU prior of the shipped tiny models, which
    priced a cold 7B job on GPUs as scaling almost linearly."""
    dense = goodput.prior_model(training_spec(gpus=8))
    params = training.approximate_parameters(training_spec(8).model)
    assert 6.0e9 < params < 7.5e9
    assert dense.prior == perfmodel.scale_prior("transformer", params / 1e9, "H200", gpus=8)
    moe = goodput.prior_model(training_spec(gpus=8, moe=True))
    assert moe.prior.gamma == perfmodel.FAMILY_PRIORS["moe"].gamma
    assert goodput.prior_model(training_spec(gpus=0)).prior == perfmodel.FAMILY_PRIORS["transformer-tiny"]
    # cold, at one replica measured: the family prior predicts far less of 8 replicas than the CPU one
    tiny = perfmodel.PerfModel("transformer-tiny", params_b=0.001, gpu_type="cpu")
    step = float(perfmodel.predict_step_time(dense.prior, 1, 1, 4.0))
    for cold in (tiny, dense):
        cold.set_samples([perfmodel.Sample(1, 1, 4.0, step)])
    speedup = {name: float(m.predict_many(np.array([8.0]), np.array([1.0]), np.array([4.0]))[0]
                           / m.predict_many(np.array([1.0]), np.array([1.0]), np.array([4.0]))[0])
               for name, m in (("tiny", tiny), ("family", dense))}
    assert speedup["family"] < 0.6 * speedup["tiny"]


def test_a_replica_of_several_gpus_starts_from_a_prior_that_computes_on_all_of_them() -> None:
    """A pod runs a rank per GPU and its local batch is the pod's: 8 GPUs compute it about 8×
    faster, and the gradient exchange between pods is no smaller. The prior priced an 8-GPU
    replica as one GPU, so a cold 7B job of 8-GPU replicas was sped up 4.9× by 8 of them (the
    one-GPU curve) where its exchange then dominates."""
    one, eight = (goodput.prior_model(training_spec(gpus=g), "H100") for g in (1, 8))
    assert (eight.prior.a_c, eight.prior.b_c) == pytest.approx((one.prior.a_c / 8, one.prior.b_c / 8))
    assert eight.prior.alpha_inter == one.prior.alpha_inter and eight.prior.beta_intra == one.prior.beta_intra
    speedups = {}
    for gpus, cold in ((1, one), (8, eight)):
        # one measurement at one replica: the anchored prior keeps its shape, at the measured level
        measured = float(perfmodel.predict_step_time(cold.prior, 1, 1, 512.0))
        cold.set_samples([perfmodel.Sample(1, 1, 512.0, measured)])
        job = allocator.JobView("j", "vc", perf=cold, gpus_per_replica=gpus, min_replicas=1, max_replicas=8,
                                base_batch=512.0, max_local_batch=512.0, batch_rule="fixed-global")
        speedups[gpus] = allocator.Allocator(allocator.AllocatorConfig(gpus_per_node=8)).table(job).speedup[8]
    assert speedups[1] > 4.0 and speedups[8] < 1.0, speedups


def build_graph() -> model.Graph:
    """The quickstart's graph (elastic 1..2)."""
    return graph.compile(manifests.load_manifest(yaml.safe_load(QUICKSTART.read_text())))


def test_a_prior_far_from_the_measurements_is_anchored_to_their_level() -> None:
    """A 4-layer test model priced as a GPU job: its family prior says microseconds a step, the
    trainers measure about a second. Unanchored, the prior outweighed the measurements in the
    MAP fit, which then predicted one throughput at every batch size (the allocator saw no gain
    in a larger batch); anchored, the fit keeps the measurements."""
    tiny_gpu = perfmodel.scale_prior("transformer", 1e-4, "H200")
    samples = [perfmodel.Sample(2, 1, local, 0.95 + 0.002 * local) for local in (24.0, 48.0, 96.0)]
    errors = {}
    for anchored in (False, True):
        model = perfmodel.PerfModel("transformer", prior=tiny_gpu, anchor_prior=anchored)
        model.set_samples(samples)
        predicted = model.predict_many(np.full(3, 2.0), np.ones(3), np.array([24.0, 48.0, 96.0]))
        measured = np.array([2 * s.local_batch / s.step_time for s in samples])
        errors[anchored] = float(np.max(np.abs(predicted / measured - 1)))
    assert errors[True] < 0.1 < 0.4 < errors[False]


def test_a_pipelined_local_job_is_learned_at_its_replicas(tmp_path: Path) -> None:
    """A local replica runs a rank per pipeline stage and the runtime logs the gang's ranks; the
    local backend handed them on as replicas, so a 2-stage job's steps were learned at twice its
    replicas and half their local batch, and its 2 replicas priced at 1.54× one replica's
    throughput where they ran 1.11×."""
    manifest = job_support.tiny_job(replicas=1, steps=40, micro_batch=2, parallelism={"pipelineStages": 2})
    manifest["spec"]["elasticity"].update(maxReplicas=2, policy="goodput")
    backend = local_backend.LocalBackend(graph.compile(manifest), tmp_path)
    logged = [{"event": "step", "step": s, "world_size": 2 * replicas, "step_seconds": seconds,
               "global_batch": 16} for replicas, seconds, steps in ((1, 0.148, range(1, 11)),
                                                                     (2, 0.134, range(11, 21)))
              for s in steps]
    (tmp_path / commands.STEPS_FILE).write_text("".join(json.dumps(r) + "\n" for r in logged))
    p = policy()
    p.learn(backend.observe().steps)
    assert samples(p) == [(1, 1, 16.0, 0.148), (2, 1, 8.0, 0.134)]


def test_a_noise_scale_read_from_steps_left_out_still_reaches_the_allocators_table() -> None:
    """The allocator caches a job's goodput table by its model version, which counted only the
    steps learned: the noise scale of steps left out (here the first two at a new batch) reached
    the job's view, and the cached table, built at the old one, kept the batch it had chosen (16
    where the new noise scale makes 128 nearly free)."""
    g = build_graph()
    p = goodput.GoodputPolicy("j", "vc", slots=2, global_batch=16.0, batch_rule="goodput",
                              perf=perfmodel.PerfModel("transformer-tiny", params_b=0.001, gpu_type="cpu",
                                                       anchor_prior=True))
    p.decide(g, monitor.Observation(time=0.0, steps=records(1, range(1, 11), 0.26, gradient_noise_scale=1.0)))
    before, first = p.model_version(), p.last_decision
    assert first is not None and first.global_batch == 16.0
    skipped = records(1, range(19, 21), 0.4, gradient_noise_scale=5000.0, global_batch=32)
    p.decide(g, monitor.Observation(time=1.0, steps=skipped))
    assert p.model_version() != before and p.view is not None and p.view.noise_scale == 5000.0
    local = snapshot.ClusterSnapshot([placement.NodeView("local", 2, 2, virtual_cluster="vc")],
                                     [snapshot.VirtualClusterView("vc")])
    (fresh,) = allocator.Allocator(p.decider.config).allocate(local, [p.view], 1.0)
    assert p.last_decision is not None and p.last_decision.global_batch == fresh.global_batch > 16.0


def test_a_step_is_priced_and_learned_at_its_slowest_ranks_whole_micro_batches() -> None:
    """examples/training-job.yaml: globalBatch 512 in micro-batches of 8, 4 to 16 replicas. The
    runtime deals the 64 micro-batches round-robin and the step waits for the rank with the most:
    5 of them (40 samples) at 13, 14 and 15 replicas alike. Priced at 512 / replicas, 15 looked
    7 % faster than 13 where it ran 1.5 % slower, and the allocator took 15 GPUs for 13's work."""
    micro, params = 8, perfmodel.PolluxParams(0.05, 0.004, 0.05, 0.004, 0.2, 0.02, 2.0)

    def step(replicas: int, local: float) -> float:
        return float(perfmodel.predict_step_time(params, replicas, 1, local))

    def runtime_step(replicas: int) -> float:
        return step(replicas, math.ceil(512 / micro / replicas) * micro)

    job = allocator.JobView("j", "vc", perf=perfmodel.PerfModel("transformer", prior=params),
                            min_replicas=4, max_replicas=16, base_batch=512.0, max_local_batch=512.0,
                            batch_rule="fixed-global", micro_batch=micro)
    decider = allocator.Allocator(allocator.AllocatorConfig(gpus_per_node=16))
    speedup = decider.table(job).speedup
    for replicas in range(4, 17):
        assert speedup[replicas] == pytest.approx(runtime_step(4) / runtime_step(replicas), rel=1e-6)
    one_node = snapshot.ClusterSnapshot([placement.NodeView("n0", 16, 15, virtual_cluster="vc")],
                                        [snapshot.VirtualClusterView("vc")])
    (decision,) = decider.allocate(one_node, [job], 0.0)
    assert decision.replicas == 13
    # a job of no micro-batch size (the simulator's) is priced at the even split, as before
    even = decider.table(dataclasses.replace(job, name="even", micro_batch=None)).speedup
    assert even[15] == pytest.approx(step(4, 128.0) / step(15, 512 / 15), rel=1e-6)
    assert even[15] > even[13]
    # and a sample is learned at the local batch its step time is that of
    p = goodput.GoodputPolicy("j", "vc", slots=16, global_batch=512.0, micro_batch=micro)
    p.learn([{"step": s, "world_size": 13, "step_seconds": 0.5, "global_batch": 512} for s in range(1, 6)])
    assert samples(p) == [(13, 1, 40.0, 0.5)]


def goodput_job(gpus: int, stages: int = 1) -> object:
    """A TrainingJob of 8-GPU-style pods under the goodput policy, as the operator reads it."""
    body = {"apiVersion": "huorn.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "pods"},
            "spec": {"virtualCluster": "train", "resources": {"gpus": gpus},
                     "parallelism": {"pipelineStages": stages},
                     "model": {"layers": 8, "width": 512, "heads": 8, "vocabulary": 32000, "context": 512},
                     "elasticity": {"minReplicas": 2, "maxReplicas": 8, "policy": "goodput"},
                     "optimization": {"steps": 100, "globalBatch": 512, "microBatch": 8}}}
    return kinds.RESOURCE_MODELS["TrainingJob"].model_validate(body)


def test_a_pods_slowest_share_is_counted_over_every_rank_of_the_gang() -> None:
    """A pod of 8 GPUs runs 8 ranks, and the runtime deals the micro-batches over all of the
    gang's ranks: 5 and 6 pods (512 in micro-batches of 8) each run 128 samples a pod, as 4 do.
    Rounded per pod, they were priced and learned at 104 and 88, so the model saw them faster
    than they ran and filed their step times under batches they never ran (a final review)."""
    policy = monitoring.build_policies(goodput_job(gpus=8), ("default", 1)).goodput
    assert policy is not None and policy.data_ranks_per_replica == 8
    for pods in range(2, 9):
        ranks = pods * 8
        slowest = max(len(sampler.assign_micro_batches(512 // 8, ranks, r)) for r in range(ranks)) * 8
        assert policy.step_local_batch(512.0, pods) == slowest * 8, pods  # a pod: 8 such ranks
    assert policy.step_local_batch(512.0, 5) == policy.step_local_batch(512.0, 4) == 128.0
    # two pipeline stages a pod of 8 GPUs: 4 data-parallel ranks
    piped = monitoring.build_policies(goodput_job(gpus=8, stages=2), ("default", 1)).goodput
    assert piped is not None and piped.data_ranks_per_replica == 4


def test_a_cpu_pod_of_a_pipeline_is_one_replica_of_a_process_per_stage() -> None:
    """A pod without GPUs runs a process per pipeline stage, as a local replica does; its gang's
    ranks were counted by the pod's GPUs (none, so one), a gang of 3 such pods read as 6 replicas
    of which only 3 answered, and no span of it was ever learned."""
    policy = monitoring.build_policies(goodput_job(gpus=0, stages=2), ("default", 1)).goodput
    assert policy is not None and (policy.ranks_per_replica, policy.data_ranks_per_replica) == (2, 1)
    pods = {f"trainer-{i}": f"node-{i // 2}" for i in range(3)}
    telemetry = {f"{pod}{suffix}": {"world_size": 6} for pod in pods for suffix in ("", "/1")}
    seen = monitor.Observation(time=0.0, telemetry=telemetry, nodes=pods)
    assert goodput.gang_spans(seen, policy.ranks_per_replica) == {3: 2}
    gpu_pods = monitoring.build_policies(goodput_job(gpus=8, stages=2), ("default", 1)).goodput
    assert gpu_pods is not None and gpu_pods.ranks_per_replica == 8


def test_huorn_run_prices_a_replica_as_the_one_rank_it_starts() -> None:
    """`huorn run` starts one data-parallel rank a replica whatever resources.gpus asks for a pod;
    its prior divided compute by the spec's GPUs, so a manifest of 8-GPU pods run locally started
    with compute 8 times too short against the exchange."""
    priors = []
    for gpus in (1, 8):
        manifest = job_support.tiny_job(replicas=1, steps=40, micro_batch=2,
                                        resources={"gpus": gpus, "cpu": 8})
        manifest["spec"]["elasticity"].update(maxReplicas=4, policy="goodput")
        (policy,) = cli_run.build_policies(graph.compile(manifest), [], "goodput", slots=4)
        assert isinstance(policy, goodput.GoodputPolicy) and policy.data_ranks_per_replica == 1
        priors.append(policy.perf.prior)
    assert priors[0] == priors[1]
