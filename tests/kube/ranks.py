"""Trainer replicas' telemetry, served as the runtime serves it, for operator tests: one
telemetry server per replica at its own loopback address (the pod IP the test reports), all on
one shared port, as the operator's monitor reaches them."""

from __future__ import annotations

from typing import Any

from huorn.runtime import telemetry as runtime_telemetry

IPS = {"trainer-0": "127.0.0.2", "trainer-1": "127.0.0.3"}


class Ranks:
    def __init__(self, job: str, gpus_per_replica: int = 1, replicas: int | None = None) -> None:
        # `replicas`: the gang the ranks say they are in (every replica by default). A job started
        # smaller must say so: the goodput policy learns a step only from a gang that answers whole.
        world = (len(IPS) if replicas is None else replicas) * gpus_per_replica
        self.by_replica: dict[str, runtime_telemetry.Telemetry] = {}
        self.port = 0
        for rank, (replica, ip) in enumerate(IPS.items()):
            t = runtime_telemetry.Telemetry(job, rank * gpus_per_replica, world, replica)
            self.port = t.serve(ip, self.port)
            self.by_replica[replica] = t

    def advance(self, replica: str, collectives: int) -> None:
        t = self.by_replica[replica]
        for _ in range(collectives):
            t.complete_collective(t.enter_collective("allreduce"))

    def checkpoint(self, step: int) -> dict[str, Any]:
        """What the trainer publishes after a checkpoint (huorn.runtime.train.Trainer.save)."""
        landed = {"step": step, "path": f"/checkpoints/step-{step:08d}", "time": "2026-11-30T12:00:00Z"}
        for t in self.by_replica.values():
            t.set_parameter("checkpoint", dict(landed))
        return landed

    def close(self) -> None:
        for t in self.by_replica.values():
            t.close()
