"""The local backend: a graph's desired resources as process trees and directories here.

volume → a directory under the run dir; endpoint → the loopback address the store listens on;
instance → a process tree (the store, or per trainer replica a torchrun agent or, when the
trainer resizes in place, the trainer process itself). `apply` diffs the running trees against
`desired.build_desired(graph)`, so a resize, a replacement or a restart of `huorn run` are all the
same reconcile. `observe` reads what the runtime publishes: the JSON-lines step log, the telemetry
endpoint files and the torchrun agents' own logs.

How a replica's exit reads: a torchrun agent restarts its workers itself (the runtime's exit
code 3 asks for that), so a worker's death shows only in the agent's log, and the agent exits
only when training is done (0) or it gave up (non-zero). An in-place replica has no agent: it
exits 0 when training is done or when it was asked to leave (SIGTERM, which this backend sends
only to instances it stops), and non-zero only when it could not go on, e.g. a lost peer it
could not regroup without. Either way, exit code 2 means the runtime refused its config, which
a new process would refuse again.
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huorn.backends import monitor
from huorn.backends.local import commands, processes
from huorn.graph import desired, jobs, model
from huorn.scheduler import telemetry

# torchrun's agent logs each failed worker as "failed (exitcode: -9) local_rank: 0 (pid: 123)".
# A negative exit code is a signal; SIGTERM (-15) is how agents and Huorn stop workers on purpose.
_WORKER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_SIGNALS = {-9: "SIGKILL", -6: "SIGABRT", -11: "SIGSEGV", -7: "SIGBUS", -4: "SIGILL", -8: "SIGFPE"}
# huorn.runtime.train's exit code for a config it refuses (the operator fails the job on it too).
CONFIG_REFUSED_EXIT = 2


def _killed(pid: int, instance: str, code: int) -> str:
    """The failure reason of a worker that a signal killed, the same words in both resize modes."""
    return f"worker pid {pid} of {instance} was killed by {_SIGNALS.get(code, code)}"


def replica_record(record: dict[str, Any], ranks_per_replica: int) -> dict[str, Any]:
    """A step record whose `world_size` counts replicas, as the operator's observation does
    (kubernetes.observe.build_observation): the goodput policy learned a 2-stage job's steps at
    twice its replicas and half their local batch, and priced its 2 replicas at 1.54× one
    replica's throughput where they ran 1.11×."""
    if not record.get("world_size"):
        return record
    return {**record, "world_size": telemetry.replicas_of(int(record["world_size"]), ranks_per_replica)}


def ranks_per_replica(graph: model.Graph) -> int:
    """The ranks one local replica runs, the unit of the step log's `world_size`: one per pipeline
    stage (commands.build_agent_command starts nproc_per_node = pipelineStages)."""
    trainer = graph.vertices.get("trainer")
    return max(1, int(trainer.params.get("pipelineStages", 1))) if trainer else 1


class LocalBackendError(RuntimeError):
    """Something on this machine prevented the graph from being materialised."""


@dataclass
class LocalSettings:
    python: str = sys.executable
    host: str = "127.0.0.1"
    step_limit: int | None = None
    stop_grace_s: float = 90.0
    store_start_timeout_s: float = 60.0
    # overrides of huorn.runtime.launcher.ElasticSettings' rendezvous and restart knobs
    tuning: dict[str, Any] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict)
    # what the spec's relative paths (data sources, checkpoints to start from) are relative to:
    # the directory huorn run was started in, where it checked them; the runtime runs in run_dir
    base_dir: Path = field(default_factory=Path.cwd)


class LocalBackend:
    """Materialises one TrainingJob graph on this machine and reports what it sees."""

    def __init__(self, graph: model.Graph, run_dir: Path, settings: LocalSettings | None = None) -> None:
        unsupported = sorted({v.role for v in graph.vertices.values()} - {"rendezvous", "trainer", "eval"})
        if graph.kind != "TrainingJob" or unsupported:
            raise LocalBackendError(
                f"the local backend runs TrainingJobs (rendezvous + trainer vertices); {graph.kind} "
                f"{graph.name!r} has roles {unsupported}: run it through the operator instead"
            )
        self.run_dir = Path(run_dir).resolve()
        self.settings = settings or LocalSettings()
        self.job = graph.name
        self.processes: dict[str, processes.ManagedProcess] = {}
        self.store_endpoint: str | None = None
        self.exit_codes: dict[str, int | None] = {}
        self.actions: list[dict[str, Any]] = []
        self._steps_offset = 0
        self._reported_failures: set[str] = set()
        self._current: list[desired.DesiredResource] = []
        self._inputs: dict[str, dict[str, Any] | None] = {}  # on-demand instance → its checkpoint
        self._applied_version = 0
        # A replica runs one rank per pipeline stage (commands.build_agent_command), and the
        # runtime logs the gang's ranks; the monitor and its policies count replicas.
        self.ranks_per_replica = ranks_per_replica(graph)

    # -- paths -----------------------------------------------------------------------------------
    def volume_path(self, name: str) -> Path:
        return self.run_dir / "volumes" / name

    @property
    def checkpoint_dir(self) -> Path:
        return self.volume_path(desired.volume_name_for(self.job, "trainer", "checkpoints"))

    # -- apply -----------------------------------------------------------------------------------
    def apply(self, graph: model.Graph) -> list[str]:
        want = desired.build_desired(graph)
        create, delete = desired.diff_desired(self._current, want)
        # A replaced instance is broken (kill it at once) unless the replacement says drain.
        for m in graph.log:
            if m.version > self._applied_version and m.action == "replace" and not m.detail.get("drain"):
                self._reported_failures.add(f"{self.job}-{m.detail['old']}")
        delivered = self._deliver_microbatches(graph) + self._deliver_batch(graph)
        restart = self._restart_for_resplit(graph, want, delete)
        self._applied_version = graph.version
        done = self._delete_all(delete + restart)
        if restart:
            done.append(f"restarting {len(restart)} trainer agent(s) with stageLayers "
                        f"{graph.vertex(restart[0].vertex).params['stageLayers']} from their checkpoint")
        for resource in create + restart:
            done.append(self._create(graph, resource))
        done += delivered
        self._current = want
        for line in done:
            self._record_action(graph.version, line)
        return done

    def _deliver_microbatches(self, graph: model.Graph) -> list[str]:
        """Remediation S2: the newest set-param of a trainer's `microbatches` since the last apply
        goes to the run directory's control file, which the trainer applies at a step boundary
        (the running gang is not restarted)."""
        m = self._newest_trainer_setting(graph, "microbatches")
        if m is None:
            return []
        counts = [int(c) for c in m.detail["new"]]
        commands.write_json_atomically(self.run_dir / commands.MICROBATCHES_FILE,
                                       {"counts": counts, "reason": m.reason, "version": m.version})
        return [f"wrote micro-batch counts {counts} to {commands.MICROBATCHES_FILE} ({m.reason})"]

    def _newest_trainer_setting(self, graph: model.Graph, key: str) -> model.Mutation | None:
        """The newest set-param of a trainer vertex's `key` since the last apply, if any."""
        latest = [m for m in graph.log if m.version > self._applied_version and m.action == "set-param"
                  and m.detail.get("key") == key and m.target in graph.vertices
                  and graph.vertices[m.target].role == "trainer"]
        return latest[-1] if latest else None

    def _deliver_batch(self, graph: model.Graph) -> list[str]:
        """batchRule goodput: the newest set-param of a trainer's `batch` since the last apply goes
        to the run directory's batch.json, which the trainer applies at a step boundary."""
        m = self._newest_trainer_setting(graph, "batch")
        if m is None:
            return []
        batch = int(m.detail["new"])
        commands.write_json_atomically(self.run_dir / commands.BATCH_FILE,
                                       {"globalBatch": batch, "reason": m.reason, "version": m.version})
        return [f"wrote global batch {batch} to {commands.BATCH_FILE} ({m.reason})"]

    def _restart_for_resplit(self, graph: model.Graph, want: list[desired.DesiredResource],
                             delete: list[desired.DesiredResource]) -> list[desired.DesiredResource]:
        """Remediation S3: a new `stageLayers` changes which modules every rank holds, which a
        running gang cannot do, so every running trainer agent is drained (SIGTERM: one agreed stop
        step and one coordinated checkpoint) and started again on the new run config. The
        checkpoint's undivided parameter names let the new stages load it."""
        changed = {m.target for m in graph.log if m.version > self._applied_version
                   and m.action == "set-param" and m.detail.get("key") == "stageLayers"
                   and m.target in graph.vertices and graph.vertices[m.target].role == "trainer"}
        going = {r.name for r in delete}
        running = {r.name for r in self._current}
        return [r for r in want if r.kind == "instance" and r.vertex in changed
                and r.name in running and r.name not in going]

    def _create(self, graph: model.Graph, resource: desired.DesiredResource) -> str:
        if resource.kind == "volume":
            self.volume_path(resource.name).mkdir(parents=True, exist_ok=True)
            return f"created volume {resource.name}"
        if resource.kind == "endpoint":
            return f"endpoint {resource.name} is served by its vertex's instance"
        if resource.role == "rendezvous":
            return self._start_store(resource)
        if resource.role == "trainer":
            return self._start_agent(graph, resource)
        if resource.role == "eval":
            return self._start_eval(graph, resource)
        msg = f"the local backend cannot run {resource.role!r} instances; this vertex waits"
        return msg

    def _delete_all(self, resources: list[desired.DesiredResource]) -> list[str]:
        """Stop instances that are going away: failed ones are killed at once; healthy ones get
        SIGTERM together (their workers agree on one stop step and checkpoint once), then each
        is waited for and its tree killed. Volumes and endpoints keep their data."""
        done, draining = [], []
        for resource in resources:
            proc = self.processes.get(resource.name)
            if resource.kind != "instance":
                done.append(f"kept {resource.kind} {resource.name} (its data outlives the instances)")
            elif proc is None:
                done.append(f"{resource.name} was not running")
            elif proc.role == "eval" and proc.exit_code() is not None:
                done.append(f"{resource.name} finished (exit code {proc.exit_code()})")
            elif resource.name in self._reported_failures or proc.exit_code() is not None:
                pids = processes.kill_tree(proc)
                self.exit_codes[proc.name] = proc.exit_code()
                done.append(f"killed {resource.name} (process tree {pids})")
            else:
                processes.send_terminate(proc)
                draining.append((resource.name, proc))
        # Either way the gang takes one agreed checkpoint at the leaver's step boundary; in place
        # the ranks that stay then go on in their processes instead of restarting.
        staying = any(p.role == "trainer" and not p.stopping and p.exit_code() is None
                      for p in self.processes.values())
        deadline = time.monotonic() + self.settings.stop_grace_s
        for name, proc in draining:
            code = processes.wait_exit(proc, max(0.0, deadline - time.monotonic()))
            processes.kill_tree(proc)
            self.exit_codes[proc.name] = code
            how = "checkpoint, left the gang in place" if proc.in_place and staying else "checkpoint"
            done.append(f"stopped {name} with SIGTERM ({how}, exit code {code})")
        return done

    def _start_store(self, resource: desired.DesiredResource) -> str:
        port_file = self.run_dir / commands.STORE_PORT_FILE
        port_file.unlink(missing_ok=True)
        old_port = int(self.store_endpoint.rpartition(":")[2]) if self.store_endpoint else 0
        argv = commands.build_store_command(self.settings.host, port_file, self.settings.python, old_port)
        instance = resource.name.removeprefix(f"{self.job}-")
        proc = processes.start_process(
            instance,
            resource.vertex,
            resource.role,
            argv,
            commands.build_agent_env(instance),
            self.run_dir / "logs" / f"{instance}.log",
            self.run_dir,
        )
        self.processes[resource.name] = proc
        deadline = time.monotonic() + self.settings.store_start_timeout_s
        while not port_file.exists():
            if proc.exit_code() is not None or time.monotonic() > deadline:
                raise LocalBackendError(
                    f"the rendezvous store did not start (exit code {proc.exit_code()}); see {proc.log_path}"
                )
            time.sleep(0.1)
        self.store_endpoint = f"{self.settings.host}:{int(port_file.read_text())}"
        return f"started rendezvous store {instance} on {self.store_endpoint} (pid {proc.pid})"

    def _start_agent(self, graph: model.Graph, resource: desired.DesiredResource) -> str:
        if self.store_endpoint is None:
            raise LocalBackendError("a trainer must start after its rendezvous store; the graph has none")
        trainer = graph.vertex(resource.vertex)
        config = commands.build_run_config(
            self.job, trainer, self.run_dir, self.checkpoint_dir, self.settings.step_limit,
            self.settings.base_dir,
        )
        config_path = commands.write_json_atomically(self.run_dir / commands.CONFIG_FILE, config)
        address = commands.replica_address(resource.ordinal or 0)
        in_place = jobs.resizes_in_place(trainer)
        argv = commands.build_agent_command(
            config_path,
            trainer,
            self.store_endpoint,
            self.job,
            address,
            # the agent stops its workers within this backend's grace, not torch's 30 s
            {"shutdown_timeout": commands.agent_shutdown_timeout(self.settings.stop_grace_s),
             **self.settings.tuning},
            self.settings.python,
        )
        instance = resource.name.removeprefix(f"{self.job}-")
        proc = processes.start_process(
            instance,
            resource.vertex,
            resource.role,
            argv,
            commands.build_agent_env(instance, self.settings.extra_env),
            self.run_dir / "logs" / f"{instance}.log",
            self.run_dir,
        )
        proc.in_place = in_place
        self.processes[resource.name] = proc
        what = "trainer (resizes in place)" if in_place else "agent"
        return f"started {what} {instance} on {address} (pid {proc.pid})"

    def _start_eval(self, graph: model.Graph, resource: desired.DesiredResource) -> str:
        """The eval vertex: one process on the checkpoint its edge handed it (the newest under
        the checkpoint directory when the edge did not name one), with the trainer's run config."""
        config_path = self.run_dir / commands.CONFIG_FILE
        if not config_path.exists():
            return f"{resource.name} waits: no trainer has written its run config yet"
        landed = graph.vertex(resource.vertex).params.get("checkpoint") or {}
        target = landed.get("path") or self.checkpoint_dir
        instance = resource.name.removeprefix(f"{self.job}-")
        proc = processes.start_process(
            instance,
            resource.vertex,
            resource.role,
            commands.build_eval_command(config_path, Path(target), self.settings.python),
            commands.build_agent_env(instance, self.settings.extra_env),
            self.run_dir / "logs" / f"{instance}.log",
            self.run_dir,
        )
        self.processes[resource.name] = proc
        self._inputs[proc.name] = dict(landed) if landed else None
        return f"started {instance} on the checkpoint of step {landed.get('step', '?')} (pid {proc.pid})"

    def _record_action(self, version: int, text: str) -> None:
        entry = {"time": time.time(), "graphVersion": version, "action": text}
        self.actions.append(entry)
        with open(self.run_dir / "actions.jsonl", "a") as handle:
            handle.write(json.dumps(entry) + "\n")

    # -- observe ---------------------------------------------------------------------------------
    def observe(self) -> monitor.Observation:
        observation = monitor.Observation(time=time.time())
        for key, proc in self.processes.items():
            observation.instances[proc.name] = self._instance_state(key, proc)
        records = self._read_new_records()
        observation.steps = [replica_record(r, self.ranks_per_replica) for r in records
                             if r.get("event") == "step"]
        checkpoints = [r for r in records if r.get("event") == "checkpoint"]
        if checkpoints:
            observation.checkpoint = {
                "vertex": "trainer",
                "step": checkpoints[-1]["step"],
                "path": checkpoints[-1].get("path"),
            }
        observation.telemetry = self._poll_telemetry()
        trainers = [p for p in self.processes.values() if p.role == "trainer" and not p.stopping]
        evaluating = any(r.role == "eval" for r in self._current)
        observation.finished = (bool(trainers) and all(p.exit_code() == 0 for p in trainers)
                                and not evaluating)
        return observation

    def _instance_state(self, key: str, proc: processes.ManagedProcess) -> monitor.InstanceState:
        if proc.stopping:
            return monitor.InstanceState(proc.name, proc.vertex, alive=False)
        proc.remember_descendants()
        code = proc.exit_code()
        if proc.role == "eval":  # batch work: its exit ends it, a failure is reported, not retried
            why = "" if code in (None, 0) else f"{proc.name} exited with code {code} (see {proc.log_path})"
            return monitor.InstanceState(proc.name, proc.vertex, alive=code is None, reason=why,
                                         completed=code is not None, input=self._inputs.get(proc.name))
        if proc.role == "trainer" and code == CONFIG_REFUSED_EXIT:
            # A replacement would be refused the same way, and in place it would be at once, in
            # a loop: stop the run instead, as the operator fails the job.
            errors = [line for line in proc.log_path.read_text(errors="replace").splitlines()
                      if line.startswith("error:")]
            why = f": {errors[-1].removeprefix('error:').strip()}" if errors else ""
            raise LocalBackendError(f"the trainer runtime refused its config (exit code {code} of "
                                    f"{proc.name}){why}; see {proc.log_path}")
        reason = ""
        if proc.in_place:  # the root is the worker: no agent logs its death, its exit code says it
            if code is not None and code < 0 and code != -15:
                reason = _killed(proc.pid, proc.name, code)
        else:
            for match in _WORKER_FAILED.finditer(proc.read_new_log()):
                exit_code, pid = int(match[1]), int(match[3])
                if exit_code < 0 and exit_code != -15:
                    reason = _killed(pid, proc.name, exit_code)
        if not reason and code is not None and code != 0:
            reason = f"{proc.role} process of {proc.name} exited with code {code}"
        if not reason and code == 0 and proc.role == "rendezvous":
            reason = f"rendezvous store {proc.name} exited"
        failed = bool(reason)
        if failed:
            self._reported_failures.add(key)
        return monitor.InstanceState(proc.name, proc.vertex, alive=code is None, failed=failed, reason=reason)

    def _read_new_records(self) -> list[dict[str, Any]]:
        path = self.run_dir / commands.STEPS_FILE
        try:
            with open(path, "rb") as handle:
                handle.seek(self._steps_offset)
                data = handle.read()
        except OSError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next look
        self._steps_offset += len(complete)
        records = []
        for line in complete.decode(errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
        return records

    def _poll_telemetry(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for path in sorted((self.run_dir / commands.ENDPOINTS_DIR).glob("*.json")):
            try:
                info = json.loads(path.read_text())
                url = f"http://{info['host']}:{info['port']}/telemetry"
                with urllib.request.urlopen(url, timeout=0.5) as response:
                    out[path.stem] = json.loads(response.read())
            except (OSError, ValueError, KeyError):
                continue  # a replica that is restarting or gone has a stale file; skip it
        return out

    # -- stop ------------------------------------------------------------------------------------
    def stop(self, graceful: bool = True) -> list[str]:
        """Stop everything: trainers first (with SIGTERM they checkpoint), the store last."""
        done = []
        running = [p for p in self.processes.values() if not (p.stopping and p.exit_code() is not None)]
        trainers = [p for p in running if p.role == "trainer" and p.exit_code() is None]
        if graceful:
            # All at once: the trainers agree on one stop step and take one collective checkpoint.
            for proc in trainers:
                processes.send_terminate(proc)
            deadline = time.monotonic() + self.settings.stop_grace_s
            for proc in trainers:
                code = processes.wait_exit(proc, max(0.0, deadline - time.monotonic()))
                done.append(f"stopped {proc.name} with SIGTERM (exit code {code})")
        for proc in sorted(running, key=lambda p: p.role == "rendezvous"):
            pids = processes.kill_tree(proc)
            if pids:
                done.append(f"killed {proc.name} (process tree {pids})")
            self.exit_codes[proc.name] = proc.exit_code()
        for line in done:
            self._record_action(-1, line)
        return done
