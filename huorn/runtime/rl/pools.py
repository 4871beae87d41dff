"""A role's replicas as Ray actors that a running RL job adds and stops between steps.

The controller re-reads `spec.roles.*.replicas` at every step boundary (in a cluster the config
file is the job's ConfigMap, which the kubelet refreshes in the running head pod), and each role
follows without a restart:

- rollout, reference and reward workers are stateless between steps (a rollout worker gets the
  weights at every sync, a reference worker holds the frozen starting policy): an `ActorPool`
  asks Ray for new actors, lets each join once Ray has started it (a new Ray node may still be
  joining: the job goes on with those it has meanwhile), and stops the newest first;
- the training actors (`TrainerGroup`) are one data-parallel group: a resize waits until the
  new actors are up, then the group's rank 0 hands its policy and optimiser state to them
  through Ray's object store (no checkpoint is written or read), every member leaves the old
  process group and all form one at the new size. Each step's update is the same whatever the
  size (`algorithms.Totals`), so a resize changes how fast a step trains, not what it learns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from huorn.runtime.rl import workers


class ActorPool:
    """The running actors of one role (`members`) and those asked for that Ray has not started
    yet (`starting`, each with the ref its readiness is awaited on)."""

    def __init__(self, role: str, new_actor: Callable[[], Any], replicas: int) -> None:
        self.role = role
        self._new_actor = new_actor
        self.members: list[Any] = [new_actor() for _ in range(replicas)]
        self.starting: list[tuple[Any, Any]] = []
        self.failed: list[str] = []  # why actors asked for never started, until the controller reads it

    @property
    def wanted(self) -> int:
        return len(self.members) + len(self.starting)

    def resize(self, replicas: int) -> None:
        """Ask for `replicas` in all: new actors start; surplus ones stop, not started ones first,
        then the newest members (actors hold nothing another lacks between steps)."""
        for _ in range(replicas - self.wanted):
            actor = self._new_actor()
            self.starting.append((actor, actor.__ray_ready__.remote()))
        for _ in range(self.wanted - replicas):
            actor = self.starting.pop()[0] if self.starting else self.members.pop()
            ray.kill(actor)

    def ready(self) -> list[Any]:
        """The starting actors that Ray has started by now, out of `starting`.

        One whose start failed (its node gone while it started, its constructor raising) is
        dropped, with the reason in `failed`, and is asked for again at the next step boundary
        (the pool then wants fewer than the config file says). Admitted, it failed the first
        call the controller made of it, and so the whole job, to be run again from its last
        checkpoint; a trainer took the group down with it (`gather` stops every member)."""
        if not self.starting:
            return []
        done, _ = ray.wait([ref for _, ref in self.starting], num_returns=len(self.starting), timeout=0)
        up = []
        for actor, ref in self.starting:
            if ref not in done:
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayError as error:
                lines = str(getattr(error, "cause", None) or error).strip().splitlines()
                self.failed.append(lines[-1] if lines else type(error).__name__)
                ray.kill(actor)
            else:
                up.append(actor)
        self.starting = [(actor, ref) for actor, ref in self.starting if ref not in done]
        return up

    def admit(self) -> None:
        self.members.extend(self.ready())

    def deal(self, items: list[Any]) -> list[list[Any]]:
        """Items split over the members in contiguous chunks, which keep them in order; their
        sizes differ by at most one (no member idles while another takes two more), as a
        trainer's share of a mini-batch."""
        return [workers.share(items, k, len(self.members)) for k in range(len(self.members))]


class TrainerGroup(ActorPool):
    """The training actors (huorn.runtime.rl.workers.PolicyTrainer) as one data-parallel group:
    rank i is `members[i]`; a group of one has no process group at all."""

    def __init__(self, role: str, new_actor: Callable[[], Any], replicas: int) -> None:
        super().__init__(role, new_actor, replicas)
        self.formed = 1  # the size the process group was last formed at (1: none)

    def form(self, joiners: list[Any] | None = None) -> None:
        """(Re)form the process group over `members`. `joiners`, members new to it, first take
        rank 0's state (the others hold the same: each update leaves every member alike)."""
        if joiners:
            state = self.members[0].state.remote()
            ray.get([actor.load_state.remote(state) for actor in joiners])
        ray.get([actor.leave_group.remote() for actor in self.members])
        self.formed = len(self.members)
        if len(self.members) < 2:
            return
        host, port = ray.get(self.members[0].host_group.remote())
        self.gather([actor.join_group.remote(rank, self.formed, host, port)
                     for rank, actor in enumerate(self.members)])

    def resize(self, replicas: int) -> None:
        """As ActorPool's, but members that stop leave the process group first, with the others:
        none is left in a collective with a peer that is gone."""
        if replicas < len(self.members):
            ray.get([actor.leave_group.remote() for actor in self.members])
            self.formed = 1
        super().resize(replicas)

    def admit(self) -> None:
        """Between steps: trainers that Ray has started join, and the group is formed again if
        its size changed (surplus members have left it in `resize`)."""
        joiners = self.ready()
        self.members.extend(joiners)
        if joiners or self.formed != len(self.members):
            self.form(joiners)

    def resume(self) -> int:
        """Rank 0 loads the newest checkpoint and hands its state to the others, as to joiners:
        only its node needs to see the checkpoint volume."""
        step = ray.get(self.members[0].resume.remote())
        if len(self.members) > 1:
            state = self.members[0].state.remote()
            ray.get([actor.load_state.remote(state) for actor in self.members[1:]])
        return step

    def weights(self) -> Any:
        """Rank 0's weights, as an object ref that every rollout worker reads once."""
        return self.members[0].weights.remote()

    def update(self, batch: list[dict[str, Any]]) -> dict[str, float]:
        """One step's update: the batch goes into the object store once, each member takes its
        share; the members return the same (summed) metrics, rank 0's are kept."""
        ref = ray.put(batch)
        return self.gather([actor.update.remote(ref) for actor in self.members])[0]

    def gather(self, refs: list[Any]) -> list[Any]:
        """Every member's answer to a collective call. When one member fails (its actor died, its
        node went, an exception), the others are stopped at once and the error raised: left
        alone they would wait in the collective for the group's timeout (300 s) before the
        controller could fail and be run again from the last checkpoint."""
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except ray.exceptions.RayError:
                for actor in self.members:
                    ray.kill(actor)
                raise
        return ray.get(refs)

    def save(self, step: int, job: str) -> str:
        return ray.get(self.members[0].save.remote(step, job))
