"""batchRule goodput end to end: the allocator's batch, handed to the running gang, applied at a
step boundary with the square-root rule's learning rate, and progress counted as AdaScale does.

Before, the allocator chose a batch that no backend delivered: the trainer ran globalBatch under
batchRule goodput, and the documentation said the scheduler wrote the batch into the spec.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
from pathlib import Path

import pytest
import runtime_harness as harness
import yaml

from huorn import graph
from huorn.api import kinds, manifests, training
from huorn.backends import goodput, monitor
from huorn.backends.kubernetes import manifests as kube_manifests
from huorn.backends.local import backend as local_backend
from huorn.graph import managers, mutate
from huorn.runtime import batch_control, batching, steplog

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"


def optimization(rule: str = "goodput", steps: int | None = 100, **more: object) -> training.Optimization:
    return training.Optimization.model_validate({"globalBatch": 16, "microBatch": 2, "learningRate": 0.004,
                                                 "batchRule": rule, "steps": steps, **more})


def spec_of(rule: str, stages: int = 1, **optimization_fields: object) -> training.TrainingJobSpec:
    body = {"apiVersion": "huorn.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "llm"},
            "spec": {"virtualCluster": "train",
                     "model": {"layers": 4, "width": 32, "heads": 2, "context": 64},
                     "parallelism": {"pipelineStages": stages},
                     "optimization": {"globalBatch": 16, "microBatch": 2, "steps": 100, "batchRule": rule,
                                      **optimization_fields}}}
    return kinds.RESOURCE_MODELS["TrainingJob"].model_validate(body).spec  # type: ignore[attr-defined]


def test_the_plan_takes_the_allocators_batch_only_under_goodput() -> None:
    goodput_plan = batching.plan_batch(optimization(), 1, 2, chosen=64)
    assert (goodput_plan.global_batch, goodput_plan.micro_batches) == (64, 32)
    assert goodput_plan.learning_rate == pytest.approx(0.004 * 2)  # sqrt(64 / 16)
    # whole micro-batches, never below globalBatch
    assert batching.plan_batch(optimization(), 1, 2, chosen=37).global_batch == 36
    assert batching.plan_batch(optimization(), 1, 2, chosen=4).global_batch == 16
    assert batching.plan_batch(optimization(), 1, 2).global_batch == 16  # none chosen yet
    assert batching.plan_batch(optimization("fixed-global"), 1, 2, chosen=64).global_batch == 16


def test_progress_counts_a_larger_batch_at_its_adascale_gain() -> None:
    """r = (M/M0)(φ+M0)/(φ+M): at φ = 48, 64 sequences make 64/16 · 64/112 = 2.29 steps of 16."""
    opt = optimization()
    assert batching.progress_tokens(opt, 64, 64, 48.0) == round(64 / 16 * 64 / 112 * 16 * 64)
    assert batching.progress_tokens(opt, 64, 64, None) == 16 * 64  # no noise scale yet: r = 1
    assert batching.progress_tokens(opt, 64, 16, 48.0) == 16 * 64
    assert batching.progress_tokens(opt, 64, 64, 1e12) == pytest.approx(64 * 64, rel=1e-6)  # r → M/M0
    assert batching.progress_tokens(optimization("fixed-global"), 64, 64, 48.0) == 64 * 64  # tokens read
    # a budget the user gave in tokens counts the tokens read: 1.75x its budget otherwise
    assert batching.progress_tokens(optimization(steps=None, tokens=10**6), 64, 64, 48.0) == 64 * 64


def test_a_budget_in_steps_is_one_in_tokens_of_global_batch_under_goodput() -> None:
    assert training.token_budget(spec_of("goodput")) == 100 * 16 * 64
    assert training.token_budget(spec_of("fixed-global")) is None
    assert training.declared_steps(spec_of("goodput")) == 100
    budget = batching.Budget.of(spec_of("goodput"))
    assert budget.tokens == 100 * 16 * 64 and budget.steps is None


def test_the_batch_file_reads_as_absent_malformed_or_a_choice(tmp_path: Path) -> None:
    assert batch_control.read_control_file(tmp_path) == (None, 0)
    (tmp_path / batch_control.CONTROL_FILE).write_text('{"globalBatch": "many"}')
    assert batch_control.read_control_file(tmp_path) == (None, -1)
    (tmp_path / batch_control.CONTROL_FILE).write_text('{"globalBatch": 0}')
    assert batch_control.read_control_file(tmp_path)[0] is None
    (tmp_path / batch_control.CONTROL_FILE).write_text('{"globalBatch": 64, "reason": "r", "version": 3}')
    choice, stamp = batch_control.read_control_file(tmp_path)
    assert choice == batch_control.BatchChoice(64, "r", 3) and stamp > 0


def test_the_batch_rule_priced_is_the_one_the_trainer_runs() -> None:
    assert goodput.batch_rule_priced(spec_of("goodput")) == "goodput"
    assert goodput.batch_rule_priced(spec_of("goodput", stages=2)) == "fixed-global"  # its schedules
    assert goodput.batch_rule_priced(spec_of("fixed-global")) == "fixed-global"
    assert goodput.batch_rule_priced(spec_of("scale-with-replicas")) == "scale-with-replicas"


def quickstart_graph() -> graph.model.Graph:
    return graph.compile(manifests.load_manifest(yaml.safe_load(QUICKSTART.read_text())))


def cheap_large_batches(first: int) -> list[dict]:
    """A job whose step costs 0.95 s whatever its batch, and 3 ms a sequence more, with a large
    noise scale: a larger batch is nearly free and loses nothing statistically."""
    records = []
    for batch in (16, 32, 64):
        for _ in range(5):
            records.append({"step": first + len(records), "world_size": 1, "global_batch": batch,
                            "step_seconds": 0.95 + 0.003 * batch, "gradient_noise_scale": 1e5})
    return records


def test_the_policy_hands_a_goodput_job_the_allocators_batch() -> None:
    g = quickstart_graph()
    policy = goodput.GoodputPolicy("quickstart", "local", slots=1, global_batch=16.0, batch_rule="goodput",
                                   micro_batch=2, total_steps=10_000)
    events = policy.decide(g, monitor.Observation(time=0.0, steps=cheap_large_batches(1)))
    (event,) = [e for e in events if e.type == managers.PARAMETER_DECISION]
    assert event.data["key"] == "batch"
    chosen = event.data["value"]
    assert chosen == 16 * policy.max_batch_scale and chosen % 2 == 0  # the cap, in whole micro-batches
    assert "global batch 16 -> 128" in event.data["reason"]
    # applied by the graph's managers as a stamped set-param, which the backends deliver
    mutations = managers.ParameterManager().handle(g, event)
    assert g.vertex("trainer").params["batch"] == chosen and mutations[0].action == "set-param"
    # within the cooldown of that change, a new choice waits
    policy.max_batch_scale = 4.0
    policy._last_step = 0
    later = policy.decide(g, monitor.Observation(time=0.0, steps=cheap_large_batches(100)))
    assert not [e for e in later if e.type == managers.PARAMETER_DECISION]
    # the same telemetry under fixed-global: priced at globalBatch, no batch to hand over
    fixed = goodput.GoodputPolicy("quickstart", "local", slots=1, global_batch=16.0, micro_batch=2,
                                  total_steps=10_000)
    assert not [e for e in fixed.decide(quickstart_graph(), monitor.Observation(
        time=0.0, steps=cheap_large_batches(1))) if e.type == managers.PARAMETER_DECISION]


def test_the_backends_hand_the_batch_to_the_trainers(tmp_path: Path) -> None:
    g = quickstart_graph()
    mutate.set_param(g, "trainer", "batch", 48, reason="goodput allocator: 16 -> 48", stamp=True)
    # locally: the run directory's batch.json, which the trainer reads
    backend = local_backend.LocalBackend(g, tmp_path)
    (line,) = backend._deliver_batch(g)
    assert "wrote global batch 48" in line
    choice, _ = batch_control.read_control_file(backend.run_dir)
    assert choice is not None and (choice.global_batch, choice.version) == (48, g.version)
    # in a cluster: a key of the job's ConfigMap, which every pod mounts beside the run config
    control = kube_manifests.batch_control(g)
    assert control == kube_manifests.BatchControl(48, "goodput allocator: 16 -> 48", g.version)
    ref = kube_manifests.JobRef("TrainingJob", "quickstart", "t", "uid")
    config_map = kube_manifests.build_config_map(ref, g.vertex("trainer").params["spec"], batch=control)
    (tmp_path / "mounted").mkdir()
    mounted = config_map["data"][kube_manifests.BATCH_KEY]
    (tmp_path / "mounted" / batch_control.CONTROL_FILE).write_text(mounted)
    assert batch_control.read_control_file(tmp_path / "mounted")[0] == batch_control.BatchChoice(
        48, "goodput allocator: 16 -> 48", g.version)
    assert kube_manifests.control_version(None, control) == g.version


def test_a_running_trainer_takes_the_batch_at_a_step_boundary(tmp_path: Path) -> None:
    """A real gang of two under batchRule goodput, 12 steps of 4 sequences budgeted: a batch
    of 8 written mid-run is taken at the next boundary, at √2 the peak rate, each later step counts
    its AdaScale gain, and the run ends once those counts reach the budget."""
    spec = harness.build_spec(steps=16, interval_steps=None, global_batch=4, micro_batch=2,
                              max_replicas=1, batchRule="goodput", warmupSteps=0, schedule="constant")
    config = harness.write_config(tmp_path, harness.shared_data_dir(), spec)
    run_dir = tmp_path / "run"
    harness._set_pace(run_dir, 300)
    # two ranks (torchrun): one has no second gradient to measure the noise scale with
    with open(tmp_path / "trainer.log", "ab") as log:
        trainer = subprocess.Popen(harness.trainer_command(config, 2), cwd=harness.REPO,
                                   env=harness.child_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        harness.wait_for(lambda: steplog.last_step(run_dir) >= 2, 240, "two steps at globalBatch")
        (run_dir / batch_control.CONTROL_FILE).write_text(
            json.dumps({"globalBatch": 8, "reason": "test", "version": 1}))
        assert trainer.wait(timeout=240) == 0, (tmp_path / "trainer.log").read_text()[-2000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
    events = steplog.read_events(run_dir)
    (change,) = [e for e in events if e["event"] == "batch"]
    assert (change["from_global_batch"], change["global_batch"]) == (4, 8)
    assert change["peak_learning_rate"] == pytest.approx(0.003 * math.sqrt(2))
    steps = [e for e in events if e["event"] == "step"]
    assert {s["global_batch"] for s in steps if s["step"] <= change["step"]} == {4}
    after = [s for s in steps if s["step"] >= change["from_step"]]
    assert after and {s["global_batch"] for s in after} == {8}
    assert all(s["lr"] == pytest.approx(0.003 * math.sqrt(2)) for s in after)
    opt = training.Optimization.model_validate(spec["optimization"])
    noise = None
    for before, step in itertools.pairwise(steps):
        noise = step["gradient_noise_scale"] if step["gradient_noise_scale"] is not None else noise
        counted = batching.progress_tokens(opt, 32, step["global_batch"], noise)
        assert step["tokens"] - before["tokens"] == counted
    assert any(s["tokens"] - b["tokens"] > 4 * 32 for b, s in itertools.pairwise(after)), "a gain above 1"
    budget = 16 * 4 * 32
    assert steps[-1]["tokens"] >= budget > steps[-2]["tokens"]
    (done,) = [e for e in events if e["event"] == "done"]
    assert done["tokens"] == steps[-1]["tokens"]


def test_a_lagging_copy_of_an_older_batch_is_not_taken_back(tmp_path: Path) -> None:
    """Each pod's mounted ConfigMap updates on its own schedule: after a regroup, a new rank 0
    whose copy still holds version 7 must not take it over the version 12 in force."""
    from types import SimpleNamespace

    from huorn.runtime import train

    (tmp_path / batch_control.CONTROL_FILE).write_text(
        json.dumps({"globalBatch": 32, "reason": "old", "version": 7}))
    gang = SimpleNamespace(takes_batch_choice=True, spec=spec_of("goodput"), control_dir=tmp_path,
                           batch_stamp=12345, batch_version=12)
    assert not train.Trainer.batch_changed(gang)  # type: ignore[arg-type]
    (tmp_path / batch_control.CONTROL_FILE).write_text(
        json.dumps({"globalBatch": 64, "reason": "new", "version": 13}))
    assert train.Trainer.batch_changed(gang)  # type: ignore[arg-type]
    gang.spec = spec_of("fixed-global")  # the rule edited away: the file is not read
    assert not train.Trainer.batch_changed(gang)  # type: ignore[arg-type]
