"""InferenceJob replicas for operator tests: the serving runtime itself (`python -m
huorn.runtime.serve`, a process per replica as in a pod) on a tiny saved model, each at its own
loopback address (the pod IP the test reports), all on one shared port, as the operator's
autoscaler scrapes them; and a load generator that keeps them busy with real completions."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp

from huorn.api import training
from huorn.runtime import launcher, serve
from kube import builders
from kube.cluster import wait_for

ARCHITECTURE = {"layers": 2, "width": 32, "heads": 2, "context": 128}


def save_tiny_model(root: Path) -> Path:
    serve.save_untrained(root, training.ModelSpec.model_validate(ARCHITECTURE))
    return root


def make_inference_job(name: str, vc: str, *, checkpoint_path: str = "/checkpoints/chat", gpus: int = 2,
                       min_replicas: int = 1, max_replicas: int = 1, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "huorn.io/v1alpha1",
        "kind": "InferenceJob",
        "metadata": {"name": name},
        "spec": {
            "virtualCluster": vc,
            "resources": {"gpus": gpus, "cpu": "2", "memory": "4Gi"},
            "model": {"checkpoint": checkpoint_path, "architecture": ARCHITECTURE},
            "serving": {"maxBatch": 8, "maxTokens": 128},
            "autoscaling": {"minReplicas": min_replicas, "maxReplicas": max_replicas},
            **spec,
        },
    }


def _free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])


class Replicas:
    """Real serving replicas, each `python -m huorn.runtime.serve` in a process of its own (as in
    a pod) bound to its loopback address; `start(ip)` brings one up and waits until it serves."""

    def __init__(self, checkpoint_dir: Path, run_dir: Path) -> None:
        self.checkpoint_dir, self.run_dir = checkpoint_dir, run_dir
        self.port = _free_port("127.0.0.2")
        self.processes: list[subprocess.Popen] = []
        self.stop_load = threading.Event()
        self.load_threads: list[threading.Thread] = []

    def start(self, ip: str) -> None:
        run = self.run_dir / ip
        run.mkdir(parents=True, exist_ok=True)
        config = run / "config.json"
        spec = make_inference_job("chat", "serve", checkpoint_path=str(self.checkpoint_dir))["spec"]
        config.write_text(json.dumps({"jobName": "chat", "host": ip, "port": self.port, "runDir": str(run),
                                      "device": "cpu", "spec": spec}))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(run / "serve.log", "wb") as log:
            self.processes.append(subprocess.Popen(launcher.build_serve_command(config), env=env, stdout=log,
                                                   stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        while not (run / "serve.json").exists():
            if self.processes[-1].poll() is not None or time.monotonic() > deadline:
                log = (run / "serve.log").read_text()[-2000:]
                raise AssertionError(f"replica at {ip} did not start: {log}")
            time.sleep(0.1)

    def stop(self, ip: str) -> None:
        """The replica at `ip` goes away, as its pod's container does when the pod is deleted."""
        config = str(self.run_dir / ip / "config.json")
        for process in list(self.processes):
            if process.args[-1] == config:  # type: ignore[index]
                process.send_signal(signal.SIGTERM)
                process.wait(20)
                self.processes.remove(process)
        (self.run_dir / ip / "serve.json").unlink(missing_ok=True)

    def load(self, ip: str, clients: int = 3, max_tokens: int = 40) -> None:
        """`clients` loops each asking for completions back to back until `quiet`."""
        def client(index: int) -> None:
            async def go() -> None:
                async with aiohttp.ClientSession(f"http://{ip}:{self.port}") as session:
                    while not self.stop_load.is_set():
                        prompt = "Q: what is " + "1+" * (index + 1) + "1?\nA:"
                        async with session.post("/v1/completions",
                                                json={"prompt": prompt, "max_tokens": max_tokens}) as r:
                            assert r.status == 200, await r.text()
            asyncio.run(go())

        self.stop_load.clear()
        self.load_threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
        for t in self.load_threads:
            t.start()

    def quiet(self) -> None:
        self.stop_load.set()
        deadline = time.monotonic() + 30
        for t in self.load_threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self.quiet()
        for process in self.processes:
            process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()


class Activator:
    """A scaled-to-zero job's activator (`python -m huorn.runtime.activator`) in a process of its
    own at `ip`, forwarding to `upstream`, as the operator's activator pod runs it; given
    `replicas` (URLs) instead, the job's prefix router."""

    def __init__(self, run_dir: Path, ip: str, upstream: str | None, timeout_seconds: float = 60.0,
                 port: int = 0, replicas: tuple[str, ...] = (), **spec_fields: Any) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        spec = make_inference_job("chat", "serve", **spec_fields)["spec"]
        spec["autoscaling"]["activationTimeoutSeconds"] = timeout_seconds
        config = run_dir / "config.json"
        config.write_text(json.dumps({"jobName": "chat", "host": ip, "port": port, "runDir": str(run_dir),
                                      "spec": spec}))
        command = (launcher.build_activator_command(config, upstream) if upstream is not None
                   else launcher.build_router_command(config, replicas=replicas))
        with open(run_dir / "activator.log", "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not (run_dir / "activator.json").exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (run_dir / "activator.log").read_text()[-2000:]
                raise AssertionError(f"activator did not start: {log}")
            time.sleep(0.1)
        self.url = f"http://{ip}:{json.loads((run_dir / 'activator.json').read_text())['port']}"

    def close(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()


def complete(url: str, prompt: str = "Q: 1+1?\nA:", max_tokens: int = 8,
             timeout: float = 120.0) -> tuple[int, dict[str, Any]]:
    """One completion, as a client of the job's Service would ask it."""
    async def go() -> tuple[int, dict[str, Any]]:
        request = {"prompt": prompt, "max_tokens": max_tokens}
        async with aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=timeout)) as session, \
                session.post("/v1/completions", json=request) as r:
            return r.status, await r.json()
    return asyncio.run(go())


# ---------------------------------------------------------------- a borrower on the serving nodes
def nodes_of(kube: builders.Kube, ns: str, job: str) -> list[str]:
    return sorted(p.metadata.annotations["huorn.io/node"] for p in kube.pods(ns, job, "trainer"))


def resize_decisions(kube: builders.Kube, ns: str, job: str) -> list[dict]:
    return [d for d in kube.job_status(ns, job).get("decisions") or [] if d["action"] == "resize"]


def borrow_four_gpus_of_b0(kube: builders.Kube, ns: str) -> None:
    """Training's own nodes filled by a fixed job; an elastic job (2 replicas of 2 GPUs, at its
    minimum) running on the serving cluster's b0."""
    kube.create_job(ns, builders.make_training_job("fill", "train", replicas=2, max_replicas=2, gpus=4))
    wait_for(lambda: len(kube.pods(ns, "fill", "trainer")) == 2, what="the filler's pods")
    kube.create_job(ns, builders.make_training_job(
        "elastic", "train", replicas=2, max_replicas=2, gpus=2,
        elasticity={"minReplicas": 2, "maxReplicas": 2, "policy": "goodput"}))
    wait_for(lambda: nodes_of(kube, ns, "elastic") == ["b0", "b0"], what="the elastic job borrowing b0")
    kube.run_all_pods(ns, "elastic")
    wait_for(lambda: kube.get_vc("serve").get("status", {}).get("lent") == 4, what="serve lends 4")
