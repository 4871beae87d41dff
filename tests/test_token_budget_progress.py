"""Readers of a run's progress under a budget in `optimization.tokens` (commit 63da27b made the
trainer end such a run on the tokens it trained): with batchRule scale-with-replicas a gang above
minReplicas trains more than globalBatch × context a step, so it ends in fewer steps than the
spec's globalBatch makes of the budget. Progress, the ETA, the final checkpoint, the goodput
model's work left and D-CPT's run length read the tokens trained, not those steps."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import runtime_harness as harness
from rich.console import Console

from huorn import graph
from huorn.api import kinds, manifests, training
from huorn.api.common import ElasticityPolicy
from huorn.backends import goodput, monitor
from huorn.backends.kubernetes import manifests as kube_manifests
from huorn.backends.kubernetes import observe
from huorn.cli import live
from huorn.graph import compiler, model
from huorn.operator import context, evaluation, monitoring
from huorn.operator.index import PodRecord
from huorn.runtime import config as run_config
from huorn.runtime import mixture_plan
from huorn.runtime import telemetry as runtime_telemetry
from huorn.scheduler import telemetry as scheduler_telemetry

CONTEXT = 128
BATCH = 16  # the spec's globalBatch, at minReplicas 1
STEP_TOKENS = BATCH * CONTEXT
BUDGET = 100 * STEP_TOKENS  # 100 steps at the spec's batch; 50 at a world of 2
QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"


def build_job(tokens: int | None = BUDGET, steps: int | None = None) -> object:
    body = {
        "apiVersion": "huorn.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "llm", "namespace": "t"},
        "spec": {"virtualCluster": "train",
                 "elasticity": {"minReplicas": 1, "maxReplicas": 4},
                 "model": {"layers": 2, "width": 32, "heads": 2, "context": CONTEXT},
                 "optimization": {"globalBatch": BATCH, "microBatch": 4, "batchRule": "scale-with-replicas",
                                  **({"tokens": tokens} if tokens is not None else {}),
                                  **({"steps": steps} if steps is not None else {})}},
    }
    return kinds.RESOURCE_MODELS["TrainingJob"].model_validate(body)


def steps_at_world(world: int, first: int, last: int, step_seconds: float = 1.0) -> list[dict]:
    """Step records as a gang of `world` replicas publishes them (runtime.telemetry.record_step),
    from a run that trained at that world since its first step."""
    tel = runtime_telemetry.Telemetry("llm", 0, world, "trainer-0", history=1000)
    for step in range(first, last + 1):
        tel.record_step(step, step_seconds, 0.1, 2.0, world * STEP_TOKENS / step_seconds, None,
                        global_batch=world * BATCH, tokens=step * world * STEP_TOKENS)
    return tel.snapshot()["steps"]


class RecordingClient:
    def __init__(self) -> None:
        self.patches: list[dict] = []

    async def patch_status(self, plural: str, namespace: str, name: str, patch: dict) -> None:
        self.patches.append(patch)


@pytest.mark.looptime
async def test_progress_and_eta_count_the_tokens_trained_at_a_grown_batch() -> None:
    """World 2 under scale-with-replicas: 32 sequences a step, so the budget of 100 steps of 16
    takes 50. Before, step 25 read 25 % (it is half the budget) and the ETA counted 80 steps left
    after step 20 where 30 are; the job succeeded from 50 %."""
    client = RecordingClient()
    ctx = type("Ctx", (), {"client": client, "settings": context.OperatorSettings(progress_seconds=10.0)})()
    state = monitoring.build_policies(build_job(), ("uid", 1))
    records = steps_at_world(2, 1, 50)
    assert records[24]["tokens"] == 50 * STEP_TOKENS, "telemetry carries the tokens trained"

    assert await monitoring.write_progress(ctx, "t", "llm", state,
                                           monitor.Observation(time=100.0, steps=records[:10]))
    assert client.patches[-1]["progressPercent"] == 20  # 10 steps of 32 of 100 of 16
    # 10 steps of 32 sequences in the 10 s since the first write
    assert await monitoring.write_progress(ctx, "t", "llm", state,
                                           monitor.Observation(time=110.0, steps=records[10:20]))
    written = client.patches[-1]
    assert written["step"] == 20 and written["progressPercent"] == 40
    assert written["estimatedRemainingSeconds"] == 30  # 30 steps of 32 left, one a second
    assert await monitoring.write_progress(ctx, "t", "llm", state,
                                           monitor.Observation(time=140.0, steps=records[20:50]))
    last = client.patches[-1]
    assert last["progressPercent"] == 100 and last["estimatedRemainingSeconds"] == 0


def test_before_a_second_write_the_eta_is_the_newest_steps_tokens_per_second() -> None:
    records = steps_at_world(4, 1, 10, step_seconds=2.0)  # 64 sequences a step: 25 steps in all
    progress = monitoring.build_progress(monitor.Observation(time=50.0, steps=records), total_steps=100,
                                         tokens=BUDGET)
    assert progress["progressPercent"] == 40
    assert progress["estimatedRemainingSeconds"] == 30  # 15 steps of 2 s


def test_a_budget_in_steps_and_a_record_without_tokens_count_steps() -> None:
    by_steps = monitoring.build_policies(build_job(tokens=None, steps=100), ("uid", 1))
    assert by_steps.tokens is None
    records = steps_at_world(2, 1, 25)
    progress = monitoring.build_progress(monitor.Observation(time=1.0, steps=records), 100, None,
                                         by_steps.tokens)
    assert progress["progressPercent"] == 25  # steps are the budget, whatever their batch
    # a trainer from before the tokens were published: steps of the spec's batch, as before
    old = [{k: v for k, v in r.items() if k != "tokens"} for r in records]
    progress = monitoring.build_progress(monitor.Observation(time=1.0, steps=old), 100, None, BUDGET)
    assert progress["progressPercent"] == 25


_RUN = """
import json, os, sys
from pathlib import Path
from huorn.runtime import config, train

trainer = train.Trainer(config.load_run_config(Path(sys.argv[1])))
code = trainer.run()
snapshot = trainer.telemetry.snapshot()
print(json.dumps({"steps": [{k: s.get(k) for k in ("step", "tokens", "global_batch")}
                            for s in snapshot["steps"]],
                  "checkpoint": snapshot["parameters"].get("checkpoint")}), flush=True)
os._exit(code)
"""


def test_the_trainer_publishes_the_tokens_it_trained_in_telemetry(tmp_path: Path) -> None:
    """A real trainer (one process, CPU, 3 steps): /telemetry's step records and its last
    checkpoint carry the count the trainer ends on, which the operator reads for progress and to
    tell the final checkpoint (before, only the trainer's own step log and checkpoints had it)."""
    context_ = 32  # harness.build_spec's
    spec = harness.build_spec(steps=None, interval_steps=None, global_batch=4, micro_batch=2,
                              tokens=3 * 4 * context_)
    del spec["optimization"]["steps"]
    config = harness.write_config(tmp_path, harness.shared_data_dir(), spec)
    done = subprocess.run([sys.executable, "-c", _RUN, str(config)], cwd=harness.REPO,
                          env=harness.child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    published = json.loads(done.stdout.strip().splitlines()[-1])
    assert published["steps"] == [{"step": s, "tokens": s * 4 * context_, "global_batch": 4}
                                  for s in (1, 2, 3)]
    assert (published["checkpoint"]["step"], published["checkpoint"]["tokens"]) == (3, 3 * 4 * context_)


def quickstart_by_tokens(tokens: int = BUDGET) -> object:
    """examples/quickstart.yaml (context 128, globalBatch 16, 1-2 replicas) with its 300 steps
    made a budget of `tokens` under scale-with-replicas."""
    resource = manifests.load_manifest(QUICKSTART)
    resource.spec.optimization.tokens = tokens
    resource.spec.optimization.steps = None
    resource.spec.optimization.batch_rule = training.BatchRule.SCALE_WITH_REPLICAS
    return graph.compile(resource)


def test_the_live_view_shows_a_token_budget_by_the_tokens_trained() -> None:
    """Before, `huorn run` of a budget in tokens printed 'step 20/?' and a full bar from the first
    step; at world 2 the run ends at step 50, which no step total of the spec's batch says."""
    view = live.RunView(quickstart_by_tokens(), total_steps=None, enabled=False)
    buffer = io.StringIO()
    view.console = Console(file=buffer, width=200)
    seen = monitor.Observation(time=0.0, steps=[{**r, "world_size": 2} for r in steps_at_world(2, 1, 20)])
    view.update(monitor.TickResult(seen, [], [], []))
    assert buffer.getvalue().splitlines()[-1].startswith("step 20 (tokens 81,920/204,800, 40%)  loss")
    assert view.progress() == (BUDGET, 40 * STEP_TOKENS)
    limited = live.RunView(quickstart_by_tokens(), total_steps=30, enabled=False)  # --steps wins
    limited.update(monitor.TickResult(seen, [], [], []))
    assert limited.summary_line().startswith("step 20/30  loss") and limited.progress() == (30, 20)


def eval_job(tokens: int | None = BUDGET, steps: int | None = None) -> tuple[object, model.Graph]:
    """A job of build_job with an eval vertex (huorn.io/eval), and its graph."""
    job = build_job(tokens, steps)
    job.metadata.annotations = {"huorn.io/eval": "true"}  # type: ignore[attr-defined]
    return job, compiler.compile(job)


def handed(graph: model.Graph) -> dict | None:
    return graph.vertex("eval").params.get("checkpoint")


def hand_final(graph: model.Graph, job: object) -> dict | None:
    """What the reconcile does once every trainer pod succeeded (operator.training.reconcile)."""
    last = evaluation.final_checkpoint(graph, job)
    if last is not None:
        observation = monitor.Observation(time=0.0, checkpoint=last, finished=True)
        monitor.Monitor(graph, observe.ObservedBackend(observation), []).tick()
    return last


def published(step: int, tokens: int | None) -> dict:
    """/telemetry of rank 0 with the checkpoint the trainer published last."""
    checkpoint = {"step": step, "path": f"/c/{step}", **({"tokens": tokens} if tokens is not None else {})}
    return {"trainer-0": {"rank": 0, "parameters": {"checkpoint": checkpoint}}}


def test_the_final_checkpoint_seen_at_a_grown_batch_is_not_evaluated_again() -> None:
    """World 2: the run ends at step 50 with the budget trained, and the monitor saw that
    checkpoint land. Before, the final step was the declared 100, so the reconcile handed a
    'step 100' the run never reached and the same checkpoint was evaluated a second time."""
    job, graph = eval_job()
    landed = evaluation.landed_checkpoint(graph, published(50, BUDGET))
    assert landed is not None
    seen = monitor.Observation(time=0.0, checkpoint=landed)
    monitor.Monitor(graph, observe.ObservedBackend(seen), []).tick()
    assert handed(graph) == landed
    assert evaluation.final_checkpoint(graph, job) is None
    assert landed == {"vertex": "trainer", "step": 50, "path": "/c/50", "tokens": BUDGET}


def test_an_unseen_final_checkpoint_of_a_token_budget_is_handed_once_as_final() -> None:
    """The trainers exited right after their final save, before a poll: the last checkpoint the
    monitor saw holds less than the budget. Its step is not known here, so it is handed as the
    final one, evaluated once (pod `-latest`), and not again."""
    job, graph = eval_job()
    assert evaluation.landed_checkpoint(graph, published(40, 80 * STEP_TOKENS)) is not None
    graph.vertex("eval").params["checkpoint"] = {"vertex": "trainer", "step": 40, "path": "/c/40",
                                                 "tokens": 80 * STEP_TOKENS}
    last = hand_final(graph, job)
    assert last == {"vertex": "trainer", "step": None, "path": None, "final": True}
    assert handed(graph) == last and graph.vertex("eval").active
    ref = kube_manifests.JobRef("TrainingJob", "llm", "t", "u1")
    instance = graph.vertex("eval").instances[0]
    assert kube_manifests.eval_pod_name(ref, instance, last).endswith("-latest")
    assert hand_final(graph, job) is None, "handed once"
    assert evaluation.landed_checkpoint(graph, published(50, BUDGET)) is None, "nothing is newer"


def test_a_final_step_past_the_declared_steps_is_still_evaluated() -> None:
    """globalBatch edited smaller mid-run: the run passes the 100 steps the spec's (new) batch
    makes of the budget before it has trained it. Before, a periodic checkpoint at step 110 read
    as the final one, and the real final checkpoint was never evaluated."""
    job, graph = eval_job()
    graph.vertex("eval").params["checkpoint"] = {"vertex": "trainer", "step": 110, "path": "/c/110",
                                                 "tokens": 90 * STEP_TOKENS}
    assert hand_final(graph, job) == {"vertex": "trainer", "step": None, "path": None, "final": True}


def test_a_budget_in_steps_still_names_its_final_step() -> None:
    job, graph = eval_job(tokens=None, steps=30)
    assert evaluation.final_step(job) == 30
    graph.vertex("eval").params["checkpoint"] = {"vertex": "trainer", "step": 25, "path": "/c/25"}
    assert hand_final(graph, job) == {"vertex": "trainer", "step": 30, "path": None}
    assert hand_final(graph, job) is None


def test_a_failed_final_eval_of_unknown_step_is_reported() -> None:
    pod = PodRecord("t", "llm-eval-0-latest", "llm", "eval", "eval-0", "", 0, 0, "", phase="Failed",
                    exit_code=1, message="error: no checkpoint", input={"vertex": "trainer", "step": None,
                                                                        "path": None, "final": True})
    entry = evaluation.build_result(pod, "t")
    assert entry["step"] == -1 and entry["phase"] == "Failed"
    assert evaluation.describe(entry).startswith("evaluation of the checkpoint of the last step failed")


def goodput_policy() -> tuple[goodput.GoodputPolicy, model.Graph]:
    """The operator's goodput policy of build_job (policy goodput, no GPUs: it decides alone)."""
    job = build_job()
    job.spec.elasticity.policy = ElasticityPolicy.GOODPUT  # type: ignore[attr-defined]
    policy = monitoring.build_policies(job, ("uid", 1)).goodput
    assert policy is not None
    return policy, compiler.compile(job)


def test_the_goodput_model_learns_each_step_at_the_batch_it_trained() -> None:
    """Two replicas under scale-with-replicas compute 16 sequences each (32 in all). Before, the
    samples said 8 (the spec's 16 ÷ 2): the model put a grown gang's step time at half its work."""
    policy, _ = goodput_policy()
    policy.learn([{**r, "world_size": 2} for r in steps_at_world(2, 1, 4)])
    assert [(s.replicas, s.local_batch) for s in policy.perf.samples] == [(2, 16.0)]


def test_the_work_left_of_a_token_budget_is_the_tokens_not_trained_in_samples() -> None:
    """Step 20 at two replicas has trained 40 steps of the spec's batch: 60 × 16 samples are left
    (30 steps of 32). Before, 80 declared steps × 16 were: a third more work than there is, which
    the allocator's JCT terms weigh."""
    policy, graph = goodput_policy()
    policy.decide(graph, monitor.Observation(time=0.0, steps=[{**r, "world_size": 2}
                                                               for r in steps_at_world(2, 1, 20)]))
    assert policy.view is not None and policy.view.remaining_work == 60 * BATCH
    # a budget in steps (or a trainer that reports no tokens) counts steps of globalBatch, as before
    by_steps = goodput.GoodputPolicy("llm", "train", slots=4, global_batch=BATCH, total_steps=100)
    by_steps.learn(steps_at_world(2, 1, 20))
    assert by_steps.remaining_work(20) == 80 * BATCH


def test_the_step_log_takes_the_batch_of_a_regroup_not_only_of_a_start() -> None:
    """An in-place resize logs `regroup` with the new gang's batch, and no `start`. Before, the
    steps after it were counted at the start's batch over the new world (8 a replica, not 16)."""
    events = [{"event": "start", "world_size": 1, "global_batch": 16}]
    events += [{"event": "step", "world_size": 1, "step_seconds": 1.0} for _ in range(4)]
    events += [{"event": "regroup", "world_size": 2, "global_batch": 32}]
    events += [{"event": "step", "world_size": 2, "step_seconds": 1.1} for _ in range(4)]
    samples = scheduler_telemetry.samples_from_step_events(events)
    assert [(s.replicas, s.local_batch) for s in samples] == [(1, 16.0), (2, 16.0)]
    # a step record's own global_batch (the trainer logs it since 63da27b) wins
    events[-1] = {**events[-1], "global_batch": 48}
    samples = scheduler_telemetry.samples_from_step_events(events)
    assert [(s.replicas, s.local_batch) for s in samples] == [(1, 16.0), (2, 16.0), (2, 24.0)]


def _run_config(tmp_path: Path, steps: int | None = None, step_limit: int | None = None,
                tokens: int | None = None) -> object:
    spec = harness.build_spec(steps=steps, global_batch=4, micro_batch=2, tokens=tokens)
    spec["optimization"] = {k: v for k, v in spec["optimization"].items() if v is not None}
    fields = {} if step_limit is None else {"stepLimit": step_limit}
    return run_config.load_run_config(harness.write_config(tmp_path, tmp_path / "data", spec, **fields))


def test_dcpt_chooses_at_the_tokens_of_the_budget(tmp_path: Path) -> None:
    """D-CPT's D is the run's tokens. A budget in tokens is what the trainer trains (at any
    batch); before, it was rounded up to whole steps of globalBatch: 1,000 tokens at 4 × 32 a
    step were taken for 8 steps, 1,024."""
    assert mixture_plan.run_tokens(_run_config(tmp_path, tokens=1_000)) == 1_000
    # a budget in steps, or a step limit over either, is its steps of globalBatch × context
    assert mixture_plan.run_tokens(_run_config(tmp_path, steps=5)) == 5 * 4 * 32
    assert mixture_plan.run_tokens(_run_config(tmp_path, step_limit=3, tokens=1_000)) == 3 * 4 * 32
