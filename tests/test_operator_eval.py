"""The eval vertex in a cluster: real kopf against KMock, real `/telemetry` from the runtime's own
Telemetry class on 127.0.0.x pod IPs (as in test_operator_monitor.py).

The trainers publish a checkpoint; the operator starts one eval pod on it; a newer checkpoint
that lands meanwhile is evaluated next, never in parallel; the pod's termination message (what
`python -m huorn.runtime.evaluate --result-file /dev/termination-log` writes) reaches status
and an Event; a failure is reported once and not retried; and a restarted operator resumes from
the API objects alone.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import torch
import yaml
from kube import builders
from kube import operator as operator_mod
from kube.cluster import EmulatedCluster, wait_for
from kube.ranks import IPS, Ranks

from huorn import models
from huorn.backends.kubernetes import manifests
from huorn.graph import compiler
from huorn.graph.model import Instance
from huorn.operator import evaluation, index, validation
from huorn.operator.index import PodRecord
from huorn.runtime import checkpoint, evaluate
from huorn.runtime import config as run_config

pytest_plugins = ["kube.fixtures"]

NS = "team"
PODS = kmock.resource("", "v1", "pods")


@pytest.fixture()
def ranks() -> Iterator[Ranks]:
    r = Ranks("llm")
    yield r
    r.close()


def start_operator(cluster: EmulatedCluster, port: int, eval_start_seconds: float = 600.0
                   ) -> operator_mod.OperatorThread:
    settings = dataclasses.replace(operator_mod.FAST, monitor_seconds=0.3, telemetry_port=port,
                                   telemetry_timeout_seconds=1.0, eval_start_seconds=eval_start_seconds)
    return operator_mod.OperatorThread(cluster.api_client(), settings)


def make_job(name: str) -> dict[str, Any]:
    body = builders.make_training_job(name, "train", replicas=2, max_replicas=2, gpus=2)
    body["metadata"]["annotations"] = {"huorn.io/eval": "true"}
    return body


def run_with_ips(kube: builders.Kube, name: str) -> None:
    wait_for(lambda: len(kube.pods(NS, name, "trainer")) == 2, what="2 trainer pods")
    for pod in kube.pods(NS, name):
        instance = pod.metadata.labels["huorn.io/instance"]
        status = {"phase": "Running", "podIP": IPS.get(instance, "127.0.0.9")}
        kube.core.patch_namespaced_pod_status(pod.metadata.name, NS, {"status": status})
    wait_for(lambda: kube.job_status(NS, name).get("phase") == "Running", what="phase Running")


def eval_pods(kube: builders.Kube, name: str) -> list[str]:
    return [p.metadata.name for p in kube.pods(NS, name, "eval")]


def finish(kube: builders.Kube, pod: str, exit_code: int, message: str) -> None:
    """The kubelet's report of an ended eval container, termination message included."""
    terminated = {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                  "message": message}
    status = {"phase": "Succeeded" if exit_code == 0 else "Failed", "containerStatuses": [
        {"name": "eval", "ready": False, "restartCount": 0, "image": "x", "imageID": "x",
         "state": {"terminated": terminated}}]}
    kube.core.patch_namespaced_pod_status(pod, NS, {"status": status})


def result_message(step: int, loss: float) -> str:
    """The termination message exactly as the evaluator builds it."""
    return evaluate.build_compact_result({
        "step": step, "checkpoint": f"/checkpoints/step-{step:08d}", "batches": 2, "sequences": 4,
        "loss": loss, "sources": {"web": loss - 0.25, "code": loss + 0.5}, "perplexity": 2.718 ** loss,
        "seconds": 1.5})


def eval_vertex(kube: builders.Kube, name: str) -> dict[str, Any]:
    graph = kube.job_status(NS, name)["graph"]
    return next(v for v in graph["vertices"] if v["name"] == "eval")


def events(kube: builders.Kube, name: str, reason: str) -> list[str]:
    return [e.message for e in kube.events(NS, name) if e.reason == reason]


def test_checkpoints_run_one_eval_pod_at_a_time_and_results_reach_status(
        cluster: EmulatedCluster, kube: builders.Kube, ranks: Ranks) -> None:
    with start_operator(cluster, ranks.port):
        kube.create_job(NS, make_job("llm"))
        run_with_ips(kube, "llm")
        assert eval_pods(kube, "llm") == [], "no eval before a checkpoint lands"

        ranks.checkpoint(5)
        first = wait_for(lambda: eval_pods(kube, "llm"), what="an eval pod")
        assert first == ["llm-eval-0-s5"]
        pod = kube.core.read_namespaced_pod("llm-eval-0-s5", NS)
        container = pod.spec.containers[0]
        assert container.command == ["python", "-m", "huorn.runtime.evaluate", "--config",
                                     "/etc/huorn/config.json", "--checkpoint", "/checkpoints/step-00000005",
                                     "--result-file", "/dev/termination-log"]
        assert container.termination_message_policy == "FallbackToLogsOnError"
        assert manifests.GPU_RESOURCE not in (container.resources.limits or {}), "the evaluator runs on CPU"
        mounts = {m.name: (m.mount_path, m.read_only) for m in container.volume_mounts}
        assert mounts["checkpoints"] == ("/checkpoints", True)
        assert mounts["config"] == ("/etc/huorn", True)
        volumes = {v.name: v for v in pod.spec.volumes}
        assert volumes["checkpoints"].persistent_volume_claim.claim_name == "ckpt"
        assert volumes["config"].config_map.name == "llm-config"
        assert pod.spec.restart_policy == "Never"
        owner = pod.metadata.owner_references[0]
        assert (owner.kind, owner.name, owner.controller) == ("TrainingJob", "llm", True)
        assert json.loads(pod.metadata.annotations[manifests.ANNOTATION_CHECKPOINT]) == {
            "vertex": "trainer", "step": 5, "path": "/checkpoints/step-00000005"}

        # A newer checkpoint while the eval runs: handed to the vertex, but no second pod.
        ranks.checkpoint(10)
        wait_for(lambda: eval_vertex(kube, "llm")["params"]["checkpoint"]["step"] == 10,
                 what="the eval vertex handed step 10")
        assert eval_pods(kube, "llm") == ["llm-eval-0-s5"], "at most one eval in flight"

        # The first eval ends: its result goes to status and an Event; step 10 is evaluated next.
        kube.set_pod_phase(NS, "llm-eval-0-s5", "Running")
        finish(kube, "llm-eval-0-s5", 0, result_message(5, 2.5))
        wait_for(lambda: eval_pods(kube, "llm") == ["llm-eval-0-g1-s10"], what="a re-run on step 10")
        last = kube.job_status(NS, "llm")["lastEvaluation"]
        assert last["phase"] == "Succeeded" and last["step"] == 5 and last["pod"] == "llm-eval-0-s5"
        assert last["loss"] == pytest.approx(2.5)
        assert last["sources"] == pytest.approx({"web": 2.25, "code": 3.0})
        assert last["checkpoint"] == "/checkpoints/step-00000005"
        assert wait_for(lambda: events(kube, "llm", "Evaluated"), what="an Evaluated event") == [
            "checkpoint of step 5: loss 2.5000 (code 3.0000, web 2.2500)"]
        second = kube.core.read_namespaced_pod("llm-eval-0-g1-s10", NS).spec.containers[0]
        assert "/checkpoints/step-00000010" in second.command

        # Training ends while the re-run works: the job waits for it before it is Succeeded.
        for trainer in kube.pods(NS, "llm", "trainer"):
            kube.set_pod_phase(NS, trainer.metadata.name, "Succeeded")
        wait_for(lambda: kube.condition(NS, "llm", "Ready").get("message") == "0/2 trainer pods running",
                 what="the trainers' success seen")
        assert kube.job_status(NS, "llm")["phase"] != "Succeeded"

        # It fails: reported once (status, Warning Event), not retried on that checkpoint.
        finish(kube, "llm-eval-0-g1-s10", 2, "evaluate: /checkpoints/step-00000010 holds no complete "
                                             "Huorn checkpoint\n")
        status = wait_for(lambda: (s := kube.job_status(NS, "llm")).get("lastEvaluation", {})
                          .get("step") == 10 and s, what="the failure in status")
        assert status["lastEvaluation"]["phase"] == "Failed"
        assert "exit code 2" in status["lastEvaluation"]["message"]
        assert "holds no complete Huorn checkpoint" in status["lastEvaluation"]["message"]
        assert len(wait_for(lambda: events(kube, "llm", "EvaluationFailed"), what="a Warning")) == 1

        # The trainers' final checkpoint (step 100, which the monitor never saw: they exited right
        # after saving it) is evaluated before the job is done, from the checkpoint root.
        wait_for(lambda: eval_pods(kube, "llm") == ["llm-eval-0-g2-s100"], what="the final eval")
        final = kube.core.read_namespaced_pod("llm-eval-0-g2-s100", NS).spec.containers[0]
        assert final.command[final.command.index("--checkpoint") + 1] == "/checkpoints"
        assert kube.job_status(NS, "llm")["phase"] != "Succeeded"
        finish(kube, "llm-eval-0-g2-s100", 0, result_message(100, 1.25))
        wait_for(lambda: kube.job_status(NS, "llm").get("phase") == "Succeeded", what="Succeeded")
        status = kube.job_status(NS, "llm")
        assert status["evaluations"] == [{"step": 5, "phase": "Succeeded", "loss": 2.5},
                                         {"step": 10, "phase": "Failed"},
                                         {"step": 100, "phase": "Succeeded", "loss": 1.25}]
        vertex = eval_vertex(kube, "llm")
        assert vertex["active"] is False and not vertex["instances"]
        wait_for(lambda: eval_pods(kube, "llm") == [], what="the finished eval pod cleaned up")
        actions = [d["action"] for d in status["decisions"]]
        assert actions.count("activate") == 2 and actions.count("deactivate") == 2
        assert actions.count("replace") == 1, "one re-run for the newer checkpoint, no retry"


def test_a_restarted_operator_resumes_evals_from_the_api_objects(
        cluster: EmulatedCluster, kube: builders.Kube, ranks: Ranks) -> None:
    km = cluster.kmock
    assert km is not None
    with start_operator(cluster, ranks.port) as first:
        kube.create_job(NS, make_job("llm"))
        run_with_ips(kube, "llm")
        # The eval pod's create meets a 500 first; exactly one pod comes of it.
        km["post", PODS, kmock.body(re.compile(r".*huorn\.runtime\.evaluate.*", re.S))][:1].override << 500
        before = first.ctx.client.retries
        ranks.checkpoint(5)
        wait_for(lambda: eval_pods(kube, "llm") == ["llm-eval-0-s5"], what="an eval pod")
        # Polled, not read once: the emulator stores the pod before it answers 500, so the test
        # can see the pod before the operator's thread has counted the retry.
        wait_for(lambda: first.ctx.client.retries > before, what="the injected 500 answered and retried")
    # The operator is gone: the eval ends and a newer checkpoint lands meanwhile.
    finish(kube, "llm-eval-0-s5", 0, result_message(5, 2.0))
    ranks.checkpoint(8)
    with start_operator(cluster, ranks.port):
        wait_for(lambda: eval_pods(kube, "llm") == ["llm-eval-0-g1-s8"], what="the re-run on step 8")
        wait_for(lambda: kube.job_status(NS, "llm").get("lastEvaluation", {}).get("step") == 5,
                 what="the result of the eval that ended while no operator ran")
        # Another operator restart with the re-run in flight: nothing is created or recorded twice.
    with start_operator(cluster, ranks.port):
        wait_for(lambda: kube.job_status(NS, "llm").get("phase") == "Running", what="Running")
        kube.set_pod_phase(NS, "llm-trainer-0", "Running")  # a pod event: one more reconcile
        finish(kube, "llm-eval-0-g1-s8", 0, result_message(8, 1.75))
        wait_for(lambda: eval_pods(kube, "llm") == [], what="the vertex parked, its pod deleted")
        status = kube.job_status(NS, "llm")
    assert status["evaluations"] == [{"step": 5, "phase": "Succeeded", "loss": 2.0},
                                     {"step": 8, "phase": "Succeeded", "loss": 1.75}]
    actions = [d["action"] for d in status["decisions"]]
    assert actions.count("activate") == 1 and actions.count("replace") == 1
    assert actions.count("deactivate") == 1
    assert len(events(kube, "llm", "Evaluated")) == 2


def test_an_eval_pod_that_never_starts_is_reported_and_does_not_stall_later_evals(
        cluster: EmulatedCluster, kube: builders.Kube, ranks: Ranks) -> None:
    with start_operator(cluster, ranks.port, eval_start_seconds=2.0):
        kube.create_job(NS, make_job("llm"))
        run_with_ips(kube, "llm")
        ranks.checkpoint(5)
        wait_for(lambda: eval_pods(kube, "llm") == ["llm-eval-0-s5"], what="an eval pod")
        waiting = {"phase": "Pending", "containerStatuses": [
            {"name": "eval", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
             "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}}}]}
        kube.core.patch_namespaced_pod_status("llm-eval-0-s5", NS, {"status": waiting})
        last = wait_for(lambda: kube.job_status(NS, "llm").get("lastEvaluation"), timeout=30,
                        what="the stuck eval reported")
        assert last["phase"] == "Failed" and last["step"] == 5
        assert "did not start within 2 s: ImagePullBackOff: Back-off pulling image" in last["message"]
        wait_for(lambda: eval_pods(kube, "llm") == [], what="the stuck pod deleted, the vertex parked")
        assert eval_vertex(kube, "llm")["active"] is False
        ranks.checkpoint(9)  # the next checkpoint is evaluated as usual
        wait_for(lambda: eval_pods(kube, "llm") == ["llm-eval-0-g1-s9"], what="the next eval")


async def test_an_eval_started_again_never_takes_the_last_runs_pod_for_its_own(
        cluster: EmulatedCluster, kube: builders.Kube, ranks: Ranks) -> None:
    """A parked eval vertex started again gets the instance names of its last run, and its last
    pod, finished and not yet seen deleting, was taken for the new run's: no pod was created for
    the new checkpoint, and the next tick recorded the old result twice. Replayed by hand (the
    monitor's ticks and the reconciles called directly, the pod watch's reports when the test
    says): once for a checkpoint a tick hands before the watch has reported the old pod's delete,
    once for the trainers' final checkpoint, which the reconcile right after the park hands."""
    from huorn.operator import monitoring, runner, training

    settings = dataclasses.replace(operator_mod.FAST, telemetry_port=ranks.port,
                                   telemetry_timeout_seconds=1.0)
    ctx = runner.build_context(cluster.api_client(), settings)
    ctx.post_event = lambda *args, **kwargs: None  # kopf's poster needs a running operator
    for node in await ctx.client.list("Node", None, {}):
        ctx.index.nodes[node["metadata"]["name"]] = index.build_node_record(node)
    for vc in await ctx.client.list_custom("virtualclusters", None):
        ctx.index.vcs[vc["metadata"]["name"]] = dict(vc.get("spec") or {})

    async def report_pods() -> None:  # what the pod watch would have said by now
        ctx.index.resync_pods(await ctx.client.list("Pod", NS, {}), ctx.index.observations)

    async def reconcile() -> str:
        return await training.reconcile(ctx, await ctx.client.get_custom(training.PLURAL, NS, "llm"))

    async def evaluate(pod: str, step: int) -> None:
        """The pod runs and ends with its result; the monitor's tick parks the vertex."""
        kube.set_pod_phase(NS, pod, "Running")
        finish(kube, pod, 0, result_message(step, 2.0))
        await report_pods()
        assert [m.action for m in await monitoring.tick_job(ctx, NS, "llm")] == ["deactivate"]

    kube.create_job(NS, make_job("llm"))
    await reconcile()
    for pod in kube.pods(NS, "llm"):
        ip = IPS.get(pod.metadata.labels["huorn.io/instance"], "127.0.0.9")
        status = {"phase": "Running", "podIP": ip}
        kube.core.patch_namespaced_pod_status(pod.metadata.name, NS, {"status": status})
    await report_pods()
    assert await reconcile() == "Running"
    ranks.checkpoint(5)
    await monitoring.tick_job(ctx, NS, "llm")
    assert eval_pods(kube, "llm") == ["llm-eval-0-s5"]
    await evaluate("llm-eval-0-s5", 5)  # its pod deleted; the watch has not said so yet
    ranks.checkpoint(10)
    for _ in range(2):  # ticks before it does: step 10 is handed once the old pod is seen going
        await monitoring.tick_job(ctx, NS, "llm")
    await report_pods()
    await monitoring.tick_job(ctx, NS, "llm")
    assert eval_pods(kube, "llm") == ["llm-eval-0-g1-s10"]

    for trainer in kube.pods(NS, "llm", "trainer"):
        kube.set_pod_phase(NS, trainer.metadata.name, "Succeeded")
    await evaluate("llm-eval-0-g1-s10", 10)  # and the reconcile after it, the final checkpoint's turn
    assert eval_pods(kube, "llm") == [] and kube.job_status(NS, "llm")["phase"] != "Succeeded"
    await report_pods()
    await reconcile()  # the old pod's DELETED event
    assert eval_pods(kube, "llm") == ["llm-eval-0-g2-s100"]
    assert await monitoring.tick_job(ctx, NS, "llm") == []  # nothing of the old run to settle again
    status = kube.job_status(NS, "llm")
    assert status["evaluations"] == [{"step": 5, "phase": "Succeeded", "loss": 2.0},
                                     {"step": 10, "phase": "Succeeded", "loss": 2.0}]
    assert [d["action"] for d in status["decisions"]].count("replace") == 0


# ---------------------------------------------------------------- the pieces, without a cluster
def eval_graph(handed: dict[str, Any] | None) -> Any:
    graph = compiler.compile(make_job("llm") | {"metadata": {"name": "llm",
                                                             "annotations": {"huorn.io/eval": "true"}}})
    if handed is not None:
        graph.vertex("eval").params["checkpoint"] = handed
    return graph


def test_a_checkpoint_fires_only_when_newer_than_the_one_handed() -> None:
    telemetry = {"trainer-1": {"rank": 2, "parameters": {"checkpoint": {"step": 3, "path": "/c/3"}}},
                 "trainer-0": {"rank": 0, "parameters": {"checkpoint": {"step": 7, "path": "/c/7"}}}}
    fresh = evaluation.landed_checkpoint(eval_graph(None), telemetry)
    assert fresh == {"vertex": "trainer", "step": 7, "path": "/c/7"}, "the lowest rank's, edge-shaped"
    assert evaluation.landed_checkpoint(eval_graph(dict(fresh)), telemetry) is None
    assert evaluation.landed_checkpoint(eval_graph({"vertex": "trainer", "step": 9, "path": "/c/9"}),
                                        telemetry) is None, "an older one never fires after a newer"
    no_eval = eval_graph(None)
    no_eval.edges = [e for e in no_eval.edges if e.kind != "checkpoint"]
    assert evaluation.landed_checkpoint(no_eval, telemetry) is None


def test_results_are_bounded_and_failures_say_why() -> None:
    many = {f"s{i:02d}": 1.0 + i for i in range(40)}
    message = json.dumps({"step": 4, "loss": 2.0, "perplexity": 7.389, "checkpoint": "/c/4",
                          "sources": many, "sourcesOmitted": 3})
    ok = PodRecord(NS, "llm-eval-0-s4", "llm", "eval", "eval-0", "", 0, 0, "", phase="Succeeded",
                   exit_code=0, message=message, input={"step": 4, "path": "/c/4"})
    entry = evaluation.build_result(ok, "t")
    assert entry["phase"] == "Succeeded" and entry["loss"] == 2.0 and entry["step"] == 4
    assert len(entry["sources"]) == evaluation.MAX_SOURCES and entry["sourcesOmitted"] == 3 + 40 - 16
    assert evaluation.failure(ok) == ""
    silent = dataclasses.replace(ok, message="")
    assert "without a result" in evaluation.failure(silent)
    crashed = dataclasses.replace(ok, phase="Failed", exit_code=137, message="x" * 5000 + "\nOOMKilled")
    bad = evaluation.build_result(crashed, "t")
    assert bad["phase"] == "Failed" and bad["step"] == 4 and "loss" not in bad
    assert "exit code 137: OOMKilled" in bad["message"] and len(bad["message"]) <= evaluation.MESSAGE_LIMIT
    history = evaluation.build_status({"evaluations": [{"step": i} for i in range(10)]}, [entry])
    assert len(history["evaluations"]) == evaluation.HISTORY and history["evaluations"][-1]["step"] == 4


def test_the_final_step_is_the_trainers_total_steps() -> None:
    """A budget in steps; one in tokens has no final step the operator could know
    (tests/test_token_budget_progress.py)."""
    by_steps = make_job("llm")
    by_steps["spec"]["optimization"] = {"steps": 2, "globalBatch": 48, "microBatch": 4}
    job = validation.load_job(by_steps | {"metadata": {"name": "llm", "namespace": NS}})
    ref = manifests.JobRef("TrainingJob", "llm", NS, "u1")
    cfg = run_config.RunConfig.model_validate(manifests.build_run_config(ref, by_steps["spec"]))
    assert evaluation.final_step(job) == cfg.total_steps() == 2
    graph = eval_graph({"vertex": "trainer", "step": 2, "path": "/c/2"})
    assert evaluation.final_checkpoint(graph, job) is None
    graph = eval_graph({"vertex": "trainer", "step": 1, "path": "/c/1"})
    assert evaluation.final_checkpoint(graph, job) == {"vertex": "trainer", "step": 2, "path": None}


def test_the_evaluators_termination_message_is_what_the_operator_records(tmp_path: Path) -> None:
    """The real evaluator, run as the eval pod runs it (the pod's command on the ConfigMap's run
    config), writes a termination message that the operator turns into the right status entry."""
    spec = yaml.safe_load((Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml")
                          .read_text())["spec"]
    spec["model"].update({"layers": 2, "width": 32, "heads": 2, "context": 32})
    spec["checkpoint"] = {"path": str(tmp_path / "ck"), "volume": "ckpt"}
    spec["image"] = "mirror.example/huorn:1"  # resolved already (huorn.operator.images.pin)
    ref = manifests.JobRef("TrainingJob", "llm", NS, "u1")
    config = manifests.build_run_config(ref, spec) | {"runDir": str(tmp_path / "run")}  # the emptyDir
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = run_config.load_run_config(tmp_path / "config.json")
    torch.manual_seed(0)
    model = models.build_model(run_config.build_model_config(cfg.spec.model))
    saved = checkpoint.save_checkpoint(cfg.checkpoint_root, 6, model, torch.optim.AdamW(model.parameters()),
                                       {"job": "llm"}, rank=0, barrier=lambda: None)
    landed = {"vertex": "trainer", "step": 6, "path": str(saved)}
    pod = manifests.build_eval_pod(ref, Instance("eval", 0), spec, landed)
    argv = pod["spec"]["containers"][0]["command"]
    assert argv[:3] == ["python", "-m", "huorn.runtime.evaluate"]
    args = argv[3:]
    args[args.index("--config") + 1] = str(tmp_path / "config.json")  # the ConfigMap's mount here
    args[args.index("--result-file") + 1] = str(tmp_path / "termination-log")
    assert evaluate.main(args) == 0
    record = index.build_pod_record(pod | {"status": {"phase": "Succeeded", "containerStatuses": [
        {"state": {"terminated": {"exitCode": 0, "message": (tmp_path / "termination-log").read_text()}}}]}})
    assert record is not None and record.input == landed
    entry = evaluation.build_result(record, "t")
    full = json.loads((tmp_path / "run" / "evals" / "eval-00000006.json").read_text())
    assert entry["phase"] == "Succeeded" and entry["step"] == 6 and entry["checkpoint"] == str(saved)
    assert entry["loss"] == pytest.approx(full["loss"], abs=1e-6)
    assert entry["sources"] == pytest.approx(full["sources"], abs=1e-6)
    assert sorted(entry["sources"]) == ["code", "general", "math"]
