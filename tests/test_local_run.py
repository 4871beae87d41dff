"""`huorn run` end to end on this machine: a real store process and the real trainer, its
replicas either trainers that resize in place or torchrun agents (spec.elasticity.resize; the
quickstart's `auto` picks in place). One scenario covers the resize (1 → 2 during the run), a
kill -9 of a worker and of the store; a second covers a shrink and Ctrl-C; both run in both
modes. The bad-manifest cases check that nothing starts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch
import typer
import yaml
from typer.testing import CliRunner

from huorn import models
from huorn.api import training
from huorn.backends.local import report
from huorn.cli import main
from huorn.cli import run as run_cli
from huorn.runtime import checkpoint, serve, steplog
from huorn.runtime import config as run_config

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
HUORN = [sys.executable, "-c", "from huorn.cli.main import app; app()"]


def read_steps(run_dir: Path) -> list[dict]:
    return [r for r in report.read_records(run_dir) if r.get("event") == "step"]


def quickstart_with(directory: Path, resize: str) -> Path:
    """The quickstart manifest with spec.elasticity.resize set, written into `directory`."""
    manifest = yaml.safe_load(QUICKSTART.read_text())
    manifest["spec"]["elasticity"]["resize"] = resize
    path = directory / f"quickstart-{resize}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def start_run(run_dir: Path, manifest: Path, *args: str) -> subprocess.Popen:
    argv = [
        *HUORN,
        "run",
        str(manifest),
        "--run-dir",
        str(run_dir),
        "--no-watch",
        "--interval",
        "0.5",
        *args,
    ]
    log = open(run_dir.parent / f"{run_dir.name}.out", "wb")  # noqa: SIM115 - closed by the child's exit
    return subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def wait_for(predicate, timeout: float, proc: subprocess.Popen) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"huorn run exited early with {proc.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(0.3)


def leftover_processes(run_dir: Path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if any(str(run_dir) in part for part in process.info["cmdline"] or []):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def stop_leftovers(proc: subprocess.Popen, run_dir: Path) -> None:
    """A failed test must not leave the run's processes behind (they live in their own sessions)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=60)
    for process in leftover_processes(run_dir):
        process.kill()


def gang_starts(run_dir: Path) -> list[dict]:
    """The step log's `start` events: one per (re)started worker gang."""
    return [r for r in report.read_records(run_dir) if r.get("event") == "start"]


def regroups(run_dir: Path) -> list[tuple[str, int, int]]:
    """In-place regroups as (why, world size before, after), but for missed joins
    (steplog.missed_join), which lose nothing."""
    return [(r["reason"].split(":")[0], r["from_world_size"], r["world_size"])
            for r in report.read_records(run_dir)
            if r.get("event") == "regroup" and not steplog.missed_join(r)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_resizes_survives_losing_each_kind_of_replica_and_reports_it(tmp_path: Path) -> None:
    """Resize 1 → 2 at step 3, SIGKILL the worker of trainer-1, then SIGKILL the rendezvous store.

    In place, the default for the quickstart's one-process replicas. The same scenario under
    torchrun agents (`resize: restart`, what pipelines and multi-GPU replicas run) is covered by
    the agents' own acceptance test (test_runtime_elastic.py), the local backend's reading of an
    agent's log (test_local_backend.py) and the local pipeline runs (test_pipeline_local_job.py,
    test_remediation_s3_local.py); running it here too cost the suite 38 s."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    manifest = quickstart_with(tmp_path, "inPlace")
    proc = start_run(run_dir, manifest, "--steps", "34", "--scale-at", "3:2", "--json")
    try:

        def stepping_at_two_after(step: int) -> bool:
            steps = read_steps(run_dir)
            return bool(steps) and steps[-1]["world_size"] == 2 and steps[-1]["step"] >= step

        wait_for(lambda: stepping_at_two_after(13), 240, proc)
        victim = json.loads((run_dir / "endpoints" / "trainer-1-0.json").read_text())["pid"]
        assert "huorn.runtime.train" in " ".join(psutil.Process(victim).cmdline())
        os.kill(victim, signal.SIGKILL)
        killed_at = len(read_steps(run_dir))
        wait_for(lambda: len(read_steps(run_dir)) >= killed_at + 4 and stepping_at_two_after(20), 240, proc)
        store = next(
            p
            for p in psutil.process_iter(["cmdline"])
            if "huorn.runtime.store" in " ".join(p.info["cmdline"] or [])
            and str(run_dir) in " ".join(p.info["cmdline"] or [])
        )
        store.kill()
        assert proc.wait(timeout=300) == 0, (run_dir.parent / "run.out").read_text()[-3000:]
    finally:
        stop_leftovers(proc, run_dir)
    printed = json.loads((run_dir.parent / "run.out").read_text().splitlines()[-1])
    assert printed["outcome"] == "finished" and printed["report"] == str(run_dir / "report.md")
    assert [m["action"] for m in printed["mutations"]] == [
        "resize",
        "replace",
        "replace",
        "replace",
        "replace",
    ]
    steps = read_steps(run_dir)
    summary = report.summarise_steps(steps)
    assert summary.last == 34 and summary.missing == [] and summary.world_sizes == [1, 2]
    # The resize is graceful (under torchrun an agreed checkpoint at the boundary; in place the
    # state goes over to the newcomer), so across it the step sequence continues with the very
    # next step: no gap and no repeat.
    first_two = next(i for i, r in enumerate(steps) if r["world_size"] == 2)
    assert steps[first_two]["step"] == steps[first_two - 1]["step"] + 1
    # The join and the kill kept the first process: the only other gang start is the one after
    # the store's loss, which no process of the old rendezvous survives.
    assert len(gang_starts(run_dir)) == 2 and all(s["in_place"] for s in gang_starts(run_dir))
    assert regroups(run_dir)[0] == ("join", 1, 2)
    assert "peer-lost" in [why for why, _, _ in regroups(run_dir)]
    status = json.loads((run_dir / "graph.json").read_text())
    changes = [(m["action"], m["detail"]) for m in status["log"]]
    assert changes[0] == ("resize", {"from": 1, "to": 2, "added": ["trainer-1"]})
    assert changes[1] == ("replace", {"old": "trainer-1", "new": "trainer-1-g1"})
    assert changes[2:] == [
        ("replace", {"old": "rendezvous-0", "new": "rendezvous-0-g1"}),
        ("replace", {"old": "trainer-0", "new": "trainer-0-g1", "drain": True}),
        ("replace", {"old": "trainer-1-g1", "new": "trainer-1-g2", "drain": True}),
    ]
    text = (run_dir / "report.md").read_text()
    assert "Outcome: **finished**" in text and "no gaps" in text
    assert f"trainer-1 → trainer-1-g1: worker pid {victim} of trainer-1 was killed by SIGKILL" in text
    assert "rendezvous-0 → rendezvous-0-g1: rendezvous process of rendezvous-0 exited with code -9" in text
    for picture in ("loss.png", "throughput.png", "graph.png"):
        assert (run_dir / picture).stat().st_size > 10_000
    assert leftover_processes(run_dir) == []


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_shrink_then_ctrl_c_checkpoints_and_stops_everything(tmp_path: Path) -> None:
    """Start at 2 replicas, shrink to 1 at step 6 (SIGTERM: an agreed checkpoint; under torchrun
    the survivor then restarts, in place it goes on in its process), then Ctrl-C (a checkpoint and
    a clean stop)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = start_run(run_dir, quickstart_with(tmp_path, "inPlace"), "--steps", "500", "--replicas", "2",
                     "--scale-at", "6:1")
    try:

        def stepping_alone() -> bool:
            steps = read_steps(run_dir)
            return bool(steps) and steps[-1]["world_size"] == 1 and steps[-1]["step"] >= 10

        wait_for(stepping_alone, 300, proc)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=180) == 130
    finally:
        stop_leftovers(proc, run_dir)
    records = report.read_records(run_dir)
    steps = [r for r in records if r.get("event") == "step"]
    summary = report.summarise_steps(steps)
    assert summary.missing == [] and summary.repeated == 0 and summary.world_sizes == [2, 1]
    checkpoints = [r for r in records if r.get("event") == "checkpoint"]
    # The shrink: both ranks checkpoint together at one step; rank 0 logs it, as the leaver
    # ("sigterm") or the survivor ("peer-stop"), whichever it was.
    shrink = next(c for c in checkpoints if c["reason"] in ("sigterm", "peer-stop"))
    assert shrink["step"] >= 6 and shrink is not checkpoints[-1]
    # ... and the survivor went on in its own process
    assert regroups(run_dir) == [("leave", 2, 1)] and len(gang_starts(run_dir)) == 1
    assert checkpoints[-1]["reason"] == "sigterm" and checkpoints[-1]["step"] == summary.last
    status = json.loads((run_dir / "graph.json").read_text())
    assert [m["detail"] for m in status["log"]][-1] == {"from": 2, "to": 1, "removed": ["trainer-1"]}
    assert "Outcome: **interrupted" in (run_dir / "report.md").read_text()
    assert leftover_processes(run_dir) == []


def invoke_run(tmp_path: Path, manifest: dict | None, *args: str) -> tuple[int, str, Path]:
    path = tmp_path / "job.yaml"
    source = manifest if manifest is not None else yaml.safe_load(QUICKSTART.read_text())
    path.write_text(yaml.safe_dump(source))
    run_dir = tmp_path / "never"
    result = CliRunner().invoke(main.app, ["run", str(path), "--run-dir", str(run_dir), "--no-watch", *args])
    return result.exit_code, result.stderr, run_dir


def test_bad_manifest_exits_2_naming_the_field_and_starts_nothing(tmp_path: Path) -> None:
    manifest = yaml.safe_load(QUICKSTART.read_text())
    manifest["spec"]["elasticity"]["maxReplica"] = 2
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    code, err, run_dir = invoke_run(tmp_path, manifest)
    assert code == 2 and "spec.elasticity.maxReplica" in err
    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not run_dir.exists() and started == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--replicas", "3"), "--replicas 3 is outside spec.elasticity 1..2"),
        (("--scale-at", "10:5"), "--scale-at 10:5: 5 replicas is outside spec.elasticity 1..2"),
        (("--scale-at", "ten"), "expected STEP:REPLICAS"),
    ],
)
def test_bad_options_exit_2_before_anything_starts(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    code, err, run_dir = invoke_run(tmp_path, None, *args)
    assert code == 2 and message in err and not run_dir.exists()


def test_a_suspended_job_is_refused_with_exit_2(tmp_path: Path) -> None:
    manifest = yaml.safe_load(QUICKSTART.read_text())
    manifest["spec"]["suspend"] = True
    code, err, run_dir = invoke_run(tmp_path, manifest)
    assert code == 2 and "spec.suspend is true" in err and not run_dir.exists()


def test_other_kinds_are_refused_with_exit_2(tmp_path: Path) -> None:
    manifest = next(yaml.safe_load_all((ROOT / "examples" / "virtual-cluster.yaml").read_text()))
    assert manifest["kind"] == "VirtualCluster"
    code, err, run_dir = invoke_run(tmp_path, manifest)
    assert code == 2 and "VirtualCluster" in err and not run_dir.exists()


def _serve_in_thread(path: Path, run_dir: Path, ready: Path,
                     *options: str) -> tuple[threading.Thread, dict, int]:
    """`huorn run` of an InferenceJob in a thread; returns once `ready` names the port it serves on."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(outcome=CliRunner().invoke(main.app, [
        "run", str(path), "--run-dir", str(run_dir), "--port", "0", *options, "--json"])))
    thread.start()
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert thread.is_alive() and time.monotonic() < deadline, result
        time.sleep(0.1)
    return thread, result, json.loads(ready.read_text())["port"]


def _complete(port: int, prompt: str) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                     data=json.dumps({"prompt": prompt, "max_tokens": 2}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.mark.slow
def test_huorn_run_serves_an_inference_job_until_told_to_stop(tmp_path: Path) -> None:
    architecture = {"layers": 2, "width": 32, "heads": 2, "context": 64}
    spec = training.ModelSpec.model_validate(architecture)
    model = models.build_model(run_config.build_model_config(spec))
    checkpoint.save_checkpoint(tmp_path / "ckpt", 1, model, torch.optim.AdamW(model.parameters()),
                               {"model": spec.to_wire()}, rank=0, barrier=lambda: None)
    manifest = {"apiVersion": "huorn.io/v1alpha1", "kind": "InferenceJob", "metadata": {"name": "chat"},
                "spec": {"virtualCluster": "local", "model": {"checkpoint": str(tmp_path / "ckpt"),
                                                               "architecture": architecture}}}
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump(manifest))
    run_dir = tmp_path / "serving"
    thread, result, port = _serve_in_thread(path, run_dir, run_dir / "run" / "serve.json",
                                            "--serve-seconds", "10")
    assert _complete(port, "Q: 1 + 1?\nA:")["tokens"] == 2
    thread.join(timeout=60)
    outcome = result["outcome"]
    assert outcome.exit_code == 0, outcome.output
    assert json.loads(outcome.stdout.strip().splitlines()[0])["url"] == f"http://127.0.0.1:{port}"


@pytest.mark.slow
def test_huorn_run_serves_replicas_behind_the_prefix_router(tmp_path: Path) -> None:
    architecture = {"layers": 2, "width": 32, "heads": 2, "context": 128}
    serve.save_untrained(tmp_path / "ckpt", training.ModelSpec.model_validate(architecture))
    manifest = {"apiVersion": "huorn.io/v1alpha1", "kind": "InferenceJob", "metadata": {"name": "chat"},
                "spec": {"virtualCluster": "local", "routing": {"policy": "prefix"},
                         "model": {"checkpoint": str(tmp_path / "ckpt"), "architecture": architecture}}}
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump(manifest))
    run_dir = tmp_path / "serving"
    thread, result, port = _serve_in_thread(path, run_dir, run_dir / "run" / "activator.json",
                                            "--replicas", "2", "--serve-seconds", "20")
    preamble = "You are a careful assistant. Answer in one line, no more.\n"
    cached = [_complete(port, preamble + q)["cached_tokens"] for q in ("Q: 1 + 1?\nA:", "Q: 2 + 2?\nA:")]
    assert cached == [0, 48]  # the second prompt went where the first one's preamble is cached
    replicas = sorted(p.name for p in run_dir.iterdir() if p.name.startswith("replica-"))
    assert replicas == ["replica-0", "replica-1"]
    thread.join(timeout=60)
    outcome = result["outcome"]
    assert outcome.exit_code == 0, outcome.output
    shown = json.loads(outcome.stdout.strip().splitlines()[0])
    assert shown["url"] == f"http://127.0.0.1:{port}" and shown["replicas"] == 2


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL],
                         ids=["SIGTERM", "SIGHUP", "SIGKILL"])
def test_a_stop_signal_to_huorn_run_stops_the_server_it_started(tmp_path: Path, stop: int) -> None:
    """`kill`, `timeout` and a closed terminal stop huorn run as Ctrl-C does. Its server runs in a
    session of its own (so that Ctrl-C reaches huorn run alone), and it had outlived a huorn run
    that such a signal ended, still holding the port. A SIGKILLed huorn run (an OOM kill) stops
    nothing itself: the kernel sends the server SIGTERM (launcher.dies_with_parent)."""
    architecture = {"layers": 1, "width": 32, "heads": 2, "context": 32}
    serve.save_untrained(tmp_path / "ckpt", training.ModelSpec.model_validate(architecture))
    manifest = {"apiVersion": "huorn.io/v1alpha1", "kind": "InferenceJob", "metadata": {"name": "chat"},
                "spec": {"virtualCluster": "local",
                         "model": {"checkpoint": str(tmp_path / "ckpt"), "architecture": architecture}}}
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump(manifest))
    run_dir = tmp_path / "serving"
    proc = subprocess.Popen([*HUORN, "run", str(path), "--run-dir", str(run_dir), "--port", "0", "--json"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (run_dir / "run" / "serve.json").exists(), 120, proc)
        port = json.loads((run_dir / "run" / "serve.json").read_text())["port"]
        assert leftover_processes(run_dir), "the server runs"
        proc.send_signal(stop)
        code = proc.wait(timeout=60)
        assert code == (-stop if stop == signal.SIGKILL else 0), \
            proc.stdout.read().decode()[-2000:] if proc.stdout else ""
        _, alive = psutil.wait_procs(leftover_processes(run_dir), timeout=30)
        assert alive == []
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        stop_leftovers(proc, run_dir)


def test_several_local_replicas_without_prefix_routing_are_refused_naming_the_field(tmp_path: Path) -> None:
    manifest = {"apiVersion": "huorn.io/v1alpha1", "kind": "InferenceJob", "metadata": {"name": "chat"},
                "spec": {"virtualCluster": "local", "model": {"checkpoint": str(tmp_path / "none")}}}
    code, err, run_dir = invoke_run(tmp_path, manifest, "--replicas", "2")
    assert code == 2 and "spec.routing.policy: prefix" in err and not run_dir.exists()


def _chat(tmp_path: Path) -> dict:
    return {"apiVersion": "huorn.io/v1alpha1", "kind": "InferenceJob", "metadata": {"name": "chat"},
            "spec": {"virtualCluster": "local", "model": {"checkpoint": str(tmp_path / "none")}}}


@pytest.mark.parametrize(("kind", "args", "message"), [
    ("InferenceJob", ("--steps", "5"), "--steps applies to TrainingJob and RLJob only, not to this"),
    ("RLJob", ("--port", "9000"), "--port applies to InferenceJob only, not to this job's kind, RLJob"),
    ("TrainingJob", ("--serve-seconds", "5"), "--serve-seconds applies to InferenceJob only"),
])
def test_a_flag_the_kind_does_not_read_is_refused_not_ignored(
    tmp_path: Path, kind: str, args: tuple[str, ...], message: str
) -> None:
    manifest = {"InferenceJob": _chat(tmp_path), "TrainingJob": None,
                "RLJob": yaml.safe_load((ROOT / "examples" / "rl-job.yaml").read_text())}[kind]
    code, err, run_dir = invoke_run(tmp_path, manifest, *args)
    assert code == 2 and message in err and not run_dir.exists()


def test_a_checkpoint_that_is_not_there_is_refused_before_anything_starts(tmp_path: Path) -> None:
    code, err, run_dir = invoke_run(tmp_path, _chat(tmp_path))
    assert code == 2 and not run_dir.exists()
    assert f"spec.model.checkpoint: {tmp_path / 'none'} holds no complete Huorn checkpoint" in err


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path: Path) -> None:
    manifest = {"apiVersion": "huorn.io/v1alpha1", "kind": "InferenceJob", "metadata": {"name": "chat"},
                "spec": {"virtualCluster": "local", "model": {"checkpoint": str(tmp_path / "none")}}}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err, run_dir = invoke_run(tmp_path, manifest, "--port", str(port))
    assert code == 2 and f"--port {port}: cannot listen there" in err and "--port 0" in err
    assert not run_dir.exists()


def test_a_data_source_without_a_corpus_is_refused_naming_its_field_before_anything_starts(
    tmp_path: Path,
) -> None:
    manifest = yaml.safe_load(QUICKSTART.read_text())
    manifest["spec"]["data"]["sources"] = [{"name": "general"}, {"name": "mine", "path": str(tmp_path)}]
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    code, err, run_dir = invoke_run(tmp_path, manifest)
    assert code == 2 and "spec.data.sources[1].path" in err and "train.bin" in err
    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not run_dir.exists() and started == []


def test_an_rl_job_the_runtime_cannot_run_is_refused_before_anything_starts(tmp_path: Path) -> None:
    manifest = yaml.safe_load((ROOT / "examples" / "rl-job.yaml").read_text())
    manifest["spec"]["roles"]["actorTrain"]["replicas"] = 0  # no one to train the policy
    code, err, run_dir = invoke_run(tmp_path, manifest)
    assert code == 2 and "spec.roles.actorTrain.replicas: 0" in err and not run_dir.exists()
    manifest["spec"]["roles"]["actorTrain"] = {"replicas": 1, "colocationGroup": "main"}
    manifest["spec"]["algorithm"]["name"] = "ppo"
    code, err, run_dir = invoke_run(tmp_path, manifest)
    assert code == 2 and "spec.algorithm.name: ppo needs a critic" in err and not run_dir.exists()


def _tiny_rl_job(tmp_path: Path, steps: int) -> Path:
    """A small RLJob's manifest, written to tmp_path/rl.yaml: a step takes a second or two here."""
    manifest = {"apiVersion": "huorn.io/v1alpha1", "kind": "RLJob", "metadata": {"name": "tiny-rl"},
                "spec": {"virtualCluster": "local",
                         "model": {"layers": 2, "width": 32, "heads": 2, "context": 64},
                         "algorithm": {"name": "lite-ppo", "groupSize": 4},
                         "reward": {"type": "format", "dataset": "arithmetic-small"},
                         "rollout": {"maxNewTokens": 6}, "optimization": {"promptsPerStep": 2},
                         "steps": steps}}
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


@pytest.mark.slow
def test_huorn_run_runs_an_rl_job_through_its_controller(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # A host where `ray start` once ran records that cluster's address (ray_current_cluster), and
    # a plain ray.init() joins it instead of starting its own: long gone, that was a failed run.
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt"))  # short: Ray's socket paths must fit 107 bytes
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
    path = _tiny_rl_job(tmp_path, steps=50)
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(main.app, ["run", str(path), "--run-dir", str(run_dir), "--steps", "2",
                                           "--no-watch", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["outcome"] == "finished" and summary["steps"] == 2
    assert 0 <= summary["accuracyBefore"] <= 1 and 0 <= summary["accuracyAfter"] <= 1
    events = [json.loads(line) for line in (run_dir / "run" / "steps.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "rl"] == [0, 1]
    assert (run_dir / "checkpoints" / "latest").exists()


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_stop_of_huorn_run_stops_an_rl_controller_after_saving_its_step(tmp_path: Path, stop: int) -> None:
    """The RL controller runs in a session of its own; a SIGTERM that ended huorn run left it (and
    its Ray cluster) training with no one to stop it. A SIGKILLed huorn run stops nothing itself:
    the kernel sends the controller SIGTERM (launcher.dies_with_parent)."""
    path = _tiny_rl_job(tmp_path, steps=500)
    run_dir = tmp_path / "run"
    env = {**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(prefix="rt")}  # short: Ray's socket paths
    proc = subprocess.Popen([*HUORN, "run", str(path), "--run-dir", str(run_dir), "--no-watch", "--json"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    steps = run_dir / "run" / "steps.jsonl"
    try:
        wait_for(lambda: steps.exists() and '"event": "rl"' in steps.read_text(), 180, proc)
        proc.send_signal(stop)
        if stop == signal.SIGKILL:
            assert proc.wait(timeout=30) == -stop
            _, alive = psutil.wait_procs(leftover_processes(run_dir), timeout=180)
            assert alive == []
        else:
            assert proc.wait(timeout=180) == 130
            output = proc.stdout.read().decode() if proc.stdout else ""
            assert json.loads(output.strip().splitlines()[-1])["outcome"] == "interrupted", output[-2000:]
            assert leftover_processes(run_dir) == []
        assert (run_dir / "checkpoints" / "latest").exists(), "the step in flight was saved"
    finally:
        stop_leftovers(proc, run_dir)


def test_a_previous_run_is_kept_beside_and_two_in_one_second_do_not_collide(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run_cli.time, "strftime", lambda _: "20261206-010203")
    run_dir = tmp_path / "job"
    assert run_cli.prepare_run_dir(run_dir) is None and run_dir.is_dir()  # a new one: just made
    kept = []
    for attempt in range(3):
        (run_dir / "steps.jsonl").write_text(f"run {attempt}\n")
        kept.append(run_cli.prepare_run_dir(run_dir))
    assert [k.name for k in kept] == ["job-20261206-010203", "job-20261206-010203-1", "job-20261206-010203-2"]
    assert [(k / "steps.jsonl").read_text() for k in kept] == ["run 0\n", "run 1\n", "run 2\n"]
    assert list(run_dir.iterdir()) == []


def _refusal_of(run_dir: Path, manifest: Path | None, capsys: pytest.CaptureFixture[str]) -> str:
    """prepare_run_dir's stderr when it refuses `run_dir` (exit 2); fails the test when it does not."""
    with pytest.raises(typer.Exit) as refused:
        run_cli.prepare_run_dir(run_dir.resolve(), manifest)
    assert refused.value.exit_code == 2
    return capsys.readouterr().err


def test_a_run_dir_that_holds_the_users_files_is_refused_not_moved_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A previous run is renamed aside; `--run-dir .` once renamed the working directory itself."""
    project = tmp_path / "project"
    (project / "sub").mkdir(parents=True)
    manifest = project / "job.yaml"
    manifest.write_text("kind: TrainingJob\n")
    monkeypatch.chdir(project / "sub")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".bashrc").write_text("")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    cases = [
        (Path("."), None, "the current directory"),
        (Path(".."), None, "a directory above the current one"),
        (tmp_path / "home", None, "your home directory"),
        (project, None, "a directory above the current one"),
        (tmp_path / "notes", None, "a directory of other files"),
    ]
    for run_dir, given, why in cases:
        err = _refusal_of(run_dir, given, capsys)
        assert f"error: --run-dir {run_dir.resolve()}: is {why}" in err, err
    monkeypatch.chdir(tmp_path)  # the manifest's directory, neither the current one nor above it
    err = _refusal_of(project, manifest, capsys)
    assert f"is the directory that holds {manifest}" in err and "give a new or empty directory" in err
    # nothing was moved: every directory still holds what it held
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "notes", "project"]
    assert manifest.read_text() == "kind: TrainingJob\n" and (tmp_path / "notes" / "todo.txt").exists()


def test_huorn_run_refuses_the_manifests_own_directory_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "job.yaml"
    path.write_text(QUICKSTART.read_text())

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("a backend was started")

    monkeypatch.setattr(run_cli.local_backend, "LocalBackend", started)
    result = CliRunner().invoke(main.app, ["run", "job.yaml", "--run-dir", ".", "--no-watch"])
    assert result.exit_code == 2, result.output
    assert f"--run-dir {tmp_path}: is the current directory" in result.stderr
    assert path.exists() and [p.name for p in tmp_path.iterdir()] == ["job.yaml"]


def test_goodput_prices_the_steps_the_run_stops_at() -> None:
    """--steps stops the trainers; the allocator's remaining-work term read the spec's steps."""
    from huorn.api import manifests
    from huorn.graph import compile as compile_graph

    g = compile_graph(manifests.load_manifest(QUICKSTART))
    declared = yaml.safe_load(QUICKSTART.read_text())["spec"]["optimization"]["steps"]
    assert declared != 10
    (given,) = run_cli.build_policies(g, [], "goodput", 4, steps=10)
    assert given.total_steps == 10  # type: ignore[attr-defined]
    (default,) = run_cli.build_policies(g, [], "goodput", 4)
    assert default.total_steps == declared  # type: ignore[attr-defined]
    assert given.tokens is None and default.tokens is None  # type: ignore[attr-defined]


def test_goodput_prices_a_token_budget_by_the_tokens_left() -> None:
    """Under a `tokens` budget the batch may grow with the world (scale-with-replicas), so the
    allocator's work left is the tokens not trained, in samples of the model's context; it was
    priced in steps of the spec's globalBatch."""
    from huorn.api import manifests
    from huorn.graph import compile as compile_graph

    manifest = yaml.safe_load(QUICKSTART.read_text())
    manifest["spec"]["optimization"].pop("steps")
    manifest["spec"]["optimization"]["tokens"] = 204_800
    (policy,) = run_cli.build_policies(compile_graph(manifests.load_manifest(manifest)), [], "goodput", 4)
    assert (policy.tokens, policy.context) == (204_800, manifest["spec"]["model"]["context"])  # type: ignore[attr-defined]
    (capped,) = run_cli.build_policies(compile_graph(manifests.load_manifest(manifest)), [], "goodput", 4,
                                       steps=10)
    assert capped.tokens is None and capped.total_steps == 10  # type: ignore[attr-defined]


# A stand-in for `python -m huorn.runtime.serve`: it takes its config's path, and MODE says when it
# writes serve.json, the file huorn run polls for.
STUB_SERVER = """
import json, signal, sys, time
from pathlib import Path
run = Path(json.loads(Path(sys.argv[1]).read_text())["runDir"])
run.mkdir(parents=True, exist_ok=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
if MODE == "in-two-writes":  # how the server wrote it before: created, then filled
    (run / "serve.json").write_text('{"port": 123')
    time.sleep(1.5)
    (run / "serve.json").write_text(json.dumps({"port": 12345, "quantization": "none"}))
time.sleep(60)
"""


def _stub_serving(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> object:
    """An InferenceJob whose replica is STUB_SERVER in `mode`."""
    from huorn.cli import graph as graph_cli
    from huorn.cli import run_serve

    code = f"MODE = {mode!r}\n{STUB_SERVER}"
    monkeypatch.setattr(run_serve.launcher, "build_serve_command",
                        lambda config, *_: [sys.executable, "-c", code, str(config)])
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump(_chat(tmp_path)))
    return graph_cli.load_job(path)


def test_a_serve_json_caught_half_written_is_waited_for_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from huorn.cli import run_serve

    job = _stub_serving(tmp_path, monkeypatch, "in-two-writes")
    code = run_serve.run_serve(job, tmp_path / "run", 0, True, duration=3.0)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["url"] == "http://127.0.0.1:12345"


def test_serve_seconds_that_end_before_the_model_loaded_are_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing was served and no URL announced: exit 0 read as a run that served."""
    from huorn.cli import run_serve

    job = _stub_serving(tmp_path, monkeypatch, "never")
    code = run_serve.run_serve(job, tmp_path / "run", 0, False, duration=1.0)  # type: ignore[arg-type]
    captured = capsys.readouterr()
    assert code == 1 and captured.out == ""
    assert "error: --serve-seconds 1: the time ran out before the model had loaded" in captured.err


def _stub_controller(monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    from huorn.runtime import launcher

    monkeypatch.setattr(launcher, "build_rl_controller_command", lambda config: [sys.executable, "-c", code])


def test_a_refused_rl_job_says_why_on_stderr_with_json_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from huorn.cli import graph as graph_cli
    from huorn.cli import run_rl

    _stub_controller(monkeypatch, "print('error: spec.reward.dataset: no such set'); raise SystemExit(2)")
    job = graph_cli.load_job(_tiny_rl_job(tmp_path, steps=5))
    (tmp_path / "run").mkdir()
    code = run_rl.run_rl(job, tmp_path / "run", None, False, True)  # type: ignore[arg-type]
    captured = capsys.readouterr()
    assert code == 2 and json.loads(captured.out)["outcome"] == "refused"
    assert "error: spec.reward.dataset: no such set" in captured.err


def test_a_ctrl_c_anywhere_in_the_rl_loop_stops_the_controller_and_summarises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Ctrl-C while the step log was read (not in the sleep) escaped with no summary."""
    from huorn.cli import graph as graph_cli
    from huorn.cli import run_rl

    _stub_controller(monkeypatch, "import signal, sys, time\n"
                                  "signal.signal(signal.SIGINT, lambda *_: sys.exit(0))\ntime.sleep(60)")
    reads = []

    def interrupted_read(path: Path) -> list[dict]:
        reads.append(path)
        if len(reads) == 1:
            raise KeyboardInterrupt
        return []

    monkeypatch.setattr(run_rl, "_events", interrupted_read)
    job = graph_cli.load_job(_tiny_rl_job(tmp_path, steps=5))
    (tmp_path / "run").mkdir()
    started = time.monotonic()
    try:
        code = run_rl.run_rl(job, tmp_path / "run", None, False, True)  # type: ignore[arg-type]
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped run_rl: no summary, no exit code")
    assert code == 130 and json.loads(capsys.readouterr().out)["outcome"] == "interrupted"
    assert time.monotonic() - started < 30, "the controller was stopped by its SIGINT, not its timeout"
