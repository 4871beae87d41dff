"""The goodput policy of the monitor loop: telemetry in, the allocator's replica count out.

Every step record the runtime logs (replicas, step time) becomes a sample of the job's Pollux
performance model; every few steps the allocator, the same one the operator and the simulator
use, picks the replica count with the best predicted goodput on what this backend can offer, and
a different count becomes a scheduler.decision event for the trainer's manager. Locally the
"GPUs" the allocator hands out are replica slots (a CPU core each by default), which keeps the
decision code identical to a cluster's.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from huorn.api import training
from huorn.backends import monitor
from huorn.graph import managers, model
from huorn.scheduler import allocator, perfmodel, placement, snapshot, telemetry

# Each policy's models are numbered apart: an arbiter's allocator caches a job's goodput table by
# its name and model version, and a policy rebuilt for an edited spec (its sample count back at 0)
# would otherwise be handed the old policy's table, with the old replica bounds.
_EPOCHS = itertools.count(1)
EPOCH_STRIDE = 1 << 32


@dataclass
class GoodputPolicy:
    job: str
    virtual_cluster: str
    slots: int  # replicas this backend can run at once
    global_batch: float
    vertex: str = "trainer"
    # GPUs per replica, for the arbiter's placement
    gpus_per_replica: int = 1
    # The processes of one replica (training.processes_per_replica: a pod's GPUs, or a CPU
    # replica's pipeline stages), to count the replicas of a gang from its ranks' telemetry (step
    # records count replicas already: the operator's observation divides the ranks by it). Read
    # as the GPUs, a CPU pod of a 2-stage pipeline looked like two replicas, and no gang's span
    # was ever learned.
    ranks_per_replica: int = 1
    priority: int = 50  # among the other jobs an arbiter weighs it with
    perf: perfmodel.PerfModel = field(
        default_factory=lambda: perfmodel.PerfModel("transformer-tiny", params_b=0.001, gpu_type="cpu")
    )
    # the allocator Huorn runs everywhere (the simulator's "huorn" policy too); one local "node"
    decider: allocator.Allocator = field(
        default_factory=lambda: allocator.Allocator(
            dataclasses.replace(allocator.HUORN_RUNTIME, gpus_per_node=1 << 10))
    )
    total_steps: int | None = None  # the job's optimizer steps: its remaining work, for the JCT terms
    # A budget in tokens (training.token_budget) and the model's context: the work left is then the
    # tokens not trained yet (the step records' `tokens`), in samples of `context` tokens. The
    # trainer ends such a run on them, in fewer steps than total_steps once scale-with-replicas
    # grows the batch, so steps left × globalBatch overstated it by the batch's growth.
    tokens: int | None = None
    context: int | None = None
    decide_every_steps: int = 5
    min_samples: int = 3
    restart_seconds: float = 20.0  # a restart of the gang from its checkpoint (torchrun's way)
    # The trainer resizes in place (huorn.graph.jobs.resizes_in_place): a resize that keeps the
    # staying replicas where they run then costs allocator.IN_PLACE_RESIZE_SHARE of a restart, as
    # the simulator charges it, and HUORN_RUNTIME's greedy prices every resize so. Before, every
    # resize was priced as a full restart: on a quiet host the quickstart's 300 steps of 0.137 s
    # (41 s of work) did not pay 20 s for a second replica, and the main demo stayed at one.
    in_place: bool = False
    clock: Callable[[], float] = time.time
    # Decides for the job among others: (this job's view, now) → its decision. The operator's
    # runs the allocator over every elastic job of the cluster at once (huorn.operator.allocation);
    # None: the job alone on `slots`, as a local run has it.
    arbiter: Callable[[allocator.JobView, float], allocator.Decision] | None = None
    noise_scale: float = 0.0
    # What the trainer does with its batch as the gang resizes (allocator.BATCH_RULES; the spec's
    # optimization.batchRule, see batch_rule_priced): the allocator prices the job at that batch.
    batch_rule: str = "fixed-global"
    # The spec's microBatch: a chosen global batch is whole micro-batches, and a step is priced
    # and learned at its slowest rank's share of them (step_local_batch, JobView.micro_batch).
    micro_batch: int = 1
    # The data-parallel ranks of one replica: a pod of 8 GPUs runs 8, and the runtime deals the
    # micro-batches over every rank of the gang, so a replica's slowest share comes in units of
    # micro_batch × this. Counted per replica, 5 and 6 pods of 8 GPUs (512 in micro-batches of 8)
    # were priced at 104 and 88 samples a pod where each ran 128, as 4 pods do. Locally a replica
    # is one data-parallel rank (its processes, if several, are pipeline stages).
    data_ranks_per_replica: int = 1
    # The spec's nodeSelector: the allocator places the job's gangs on such nodes only.
    node_selector: Mapping[str, str] | None = None
    # batchRule goodput: how far the allocator may grow a replica's batch over globalBatch (the
    # trainer accumulates micro-batches, so memory does not bound it; the statistical efficiency
    # and this cap do). The other rules' replicas never run more than globalBatch.
    max_batch_scale: float = 8.0
    batch_cooldown_seconds: float = 300.0  # between two changes of the batch (batch_event)
    # Step times kept per configuration (replicas, nodes, local batch): the model fits their
    # median. One sample per step, kept for good, refitted on every decision inside the operator's
    # event loop: 0.8 s a decision at 5,000 steps, 3.3 s at 20,000, for five configurations.
    window: int = 32
    # Steps left out after the configuration changes (a resize, a new batch, a restart's first
    # step at a new size): they pay for warm-up and a new process group, not for the
    # configuration; an outlier test needed three steps of the new size first and so kept them.
    skip_after_change: int = 2
    view: allocator.JobView | None = None  # the job as the allocator last saw it (the arbiter's peers)
    last_decision: allocator.Decision | None = None
    _last_step: int = 0
    _trained: int | None = None  # tokens trained, as the newest step record with them says
    _times: dict[tuple[int, int, float], collections.deque[float]] = field(default_factory=dict)
    _config: tuple[int, int, float] | None = None  # the newest record's configuration
    _since_change: int = 0  # records of that configuration in a row
    # The nodes each gang spanned when last seen whole, by its replicas: records of a gang read
    # after it moved to another span at the same size are left out (which span ran them?).
    _spans: dict[int, int] = field(default_factory=dict)
    _learned: int = 0  # step records the model has learned from
    # Changes of the noise scale: the allocator's goodput table is built at one, and records left
    # out of the model still bring a new one (model_version).
    _noise_changes: int = 0
    _epoch: int = field(default_factory=lambda: next(_EPOCHS))

    def model_version(self) -> int:
        """Changes whenever the model learns or the noise scale changes, and differs from every
        other policy's. The allocator keeps a job's goodput table while its version stands, and
        the table holds the noise scale it was built at: counting the steps learned alone, a noise
        scale read from steps left out (warm-up, a gang not seen whole) reached the job's view and
        not its table, which kept the batch the old noise scale had chosen."""
        return self._epoch * EPOCH_STRIDE + self._learned + self._noise_changes

    def learn(self, steps: list[dict], nodes: int | Mapping[int, int] = 1) -> None:
        """Feed step records to the performance model: the median step time of each
        configuration, over its last `window` steps, less the first `skip_after_change` steps of
        each run of one configuration.

        A record's replicas are its own `world_size` (the operator's observation converts each
        record's ranks): steps taken before an in-place resize and read after it were learned at
        the new size, and made the grow look worthless for good. Its nodes are those of the gang
        that took it (`nodes`: gang_spans' replicas → nodes, or one span for every gang, as on one
        host); a record whose gang was not seen whole is left out, and so are the records of a
        gang read after it moved to another span at the same size, since nothing says which span
        ran them (all were one node, so a gang across nodes was fitted to the intra-node terms
        and the model ranked spreading it above packing it).

        A sample's local batch is the step's own global batch (the record's `global_batch`) over
        its replicas: under batchRule scale-with-replicas the batch grows with the gang, and the
        spec's globalBatch ÷ replicas put the step times of a grown gang at a local batch it never
        ran (at 2 replicas of globalBatch 16, 8 a replica where each computed 16), so the model
        saw a larger gang as slower per sample than it is; it is then that of the slowest rank,
        whole micro-batches (step_local_batch). A step time or noise scale that is not
        a finite positive number is skipped: one infinite step time made every later fit fail."""
        spans = _spans_by_world(nodes, steps)
        moved = {w for w, n in spans.items() if self._spans.get(w, n) != n}
        self._spans.update(spans)
        learned = False
        for record in steps:
            if record.get("tokens") is not None:
                self._trained = int(record["tokens"])
            noise = _positive(record.get("gradient_noise_scale"))
            if noise is not None and noise != self.noise_scale:
                self.noise_scale, self._noise_changes = noise, self._noise_changes + 1
            world, seconds = int(record.get("world_size") or 0), _positive(record.get("step_seconds"))
            if world < 1 or seconds is None or world not in spans:
                continue
            local = self.step_local_batch(float(record.get("global_batch") or self.global_batch), world)
            config = (world, spans[world], local)
            if config != self._config:
                self._config, self._since_change = config, 0
            self._since_change += 1
            if world in moved or self._since_change <= self.skip_after_change:
                continue
            self._times.setdefault(config, collections.deque(maxlen=self.window)).append(seconds)
            self._learned += 1
            learned = True
        if learned:
            self.perf.set_samples([perfmodel.Sample(w, n, b, statistics.median(times))
                                   for (w, n, b), times in sorted(self._times.items())])

    def step_local_batch(self, global_batch: float, world: int) -> float:
        """The local batch a step's time is that of: its slowest rank's whole micro-batches
        (allocator.slowest_local_batch), the configuration the allocator prices. At M / world,
        13 replicas of a 512 batch in micro-batches of 8 put the time of 40 samples at 39.4."""
        return float(allocator.slowest_local_batch(global_batch / world, self.replica_micro_batch()))

    def replica_micro_batch(self) -> int:
        """The unit a replica's slowest share comes in: a micro-batch on each of its ranks."""
        return max(1, self.micro_batch) * max(1, self.data_ranks_per_replica)

    def decide(self, graph: model.Graph, observation: monitor.Observation) -> list[managers.Event]:
        spans = gang_spans(observation, self.ranks_per_replica)
        self.learn(observation.steps, 1 if spans is None else spans)
        step = observation.last_step
        if step is None or self._learned < self.min_samples:
            return []
        if step - self._last_step < self.decide_every_steps:
            return []
        self._last_step = step
        v = graph.vertex(self.vertex)
        now = self.clock()
        last_resize, last_direction = last_resize_of(graph, self.vertex)
        job = self.job_view(v.min_replicas, v.max_replicas, v.replicas, self.remaining_work(step),
                            last_resize, last_direction)
        self.view = job
        if self.arbiter is not None:
            decision = self.arbiter(job, now)
        else:
            snap = snapshot.ClusterSnapshot(
                [placement.NodeView("local", self.slots, self.slots, virtual_cluster=self.virtual_cluster)],
                [snapshot.VirtualClusterView(self.virtual_cluster)],
            )
            (decision,) = self.decider.allocate(snap, [job], now)
        self.last_decision = decision
        if not v.min_replicas <= decision.replicas <= v.max_replicas:
            return []
        events = []
        if decision.replicas != v.replicas:
            reason = f"goodput allocator: {decision.action} to {decision.replicas} ({decision.reason})"
            data: dict[str, Any] = {"replicas": decision.replicas, "reason": reason[:1000]}
            data.update(repack(v, decision, observation.nodes))
            events.append(managers.Event(managers.SCHEDULER_DECISION, self.vertex, data))
        batch = self.batch_event(graph, decision, now)
        return events + ([batch] if batch is not None else [])

    def job_view(self, min_replicas: int, max_replicas: int, replicas: int, remaining_work: float | None,
                 last_resize: float = -math.inf, last_direction: int = 0) -> allocator.JobView:
        """The job as the allocator sees it, at its model as it stands: what `decide` hands over,
        and what the operator ranks a job in line by (allocation.rank_view)."""
        return allocator.JobView(
            name=self.job,
            virtual_cluster=self.virtual_cluster,
            perf=self.perf,
            gpus_per_replica=self.gpus_per_replica,
            priority=self.priority,
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            replicas=replicas,
            noise_scale=self.noise_scale,
            base_batch=self.global_batch,
            max_local_batch=self.global_batch * (self.max_batch_scale if self.batch_rule == "goodput"
                                                 else 1.0),
            restart_seconds=self.restart_seconds,
            resizes_in_place=self.in_place,
            batch_rule=self.batch_rule,
            micro_batch=self.replica_micro_batch(),
            node_selector=self.node_selector,
            last_resize=last_resize,
            last_direction=last_direction,
            model_version=self.model_version(),
            remaining_work=remaining_work,
        )

    def batch_event(self, graph: model.Graph, decision: allocator.Decision, now: float
                    ) -> managers.Event | None:
        """batchRule goodput: the allocator's global batch for its replicas, in whole
        micro-batches and never below the spec's globalBatch, as a `batch` parameter the backend
        hands to the running gang (huorn.runtime.batch_control). Not within `batch_cooldown_seconds`
        of the last change: the noise scale the choice rests on moves step by step, and a batch
        that flapped between two neighbours would move the learning rate with it."""
        if self.batch_rule != "goodput" or decision.global_batch is None:
            return None
        micro = max(1, self.micro_batch)
        chosen = max(int(self.global_batch), int(decision.global_batch) // micro * micro)
        current = int(graph.vertex(self.vertex).params.get("batch") or self.global_batch)
        if chosen == current or now - last_batch_change(graph, self.vertex) < self.batch_cooldown_seconds:
            return None
        scale = math.sqrt(chosen / self.global_batch)
        reason = (f"goodput allocator: global batch {current} -> {chosen} at {decision.replicas} replicas "
                  f"(noise scale {self.noise_scale:.3g}; peak learning rate x{scale:.3g})")
        return managers.Event(managers.PARAMETER_DECISION, self.vertex,
                              {"key": "batch", "value": chosen, "reason": reason})

    def remaining_work(self, step: int) -> float | None:
        """Samples left, in the unit of the performance model's throughput (samples per second):
        the tokens of a budget in tokens not trained yet over the context, or the steps left of
        the spec's globalBatch; None when the job's length is unknown. A trainer that reports no
        tokens (an image from before) is counted in steps, as it was."""
        if self.tokens is not None and self.context and self._trained is not None:
            return max(self.tokens - self._trained, 0) / self.context
        if self.total_steps is None:
            return None
        return max(self.total_steps - step, 0) * self.global_batch


def gang_spans(observation: monitor.Observation, ranks_per_replica: int) -> dict[int, int] | None:
    """The nodes of each gang whose every replica answered, by the gang's replicas; None where
    the backend names no nodes (one host: every gang spans one). A gang is the replicas whose
    telemetry says its world: the span of all trainer pods counted a grow's new pods from the
    moment they were placed, and dropped a shrink's leaving ones as they were deleted, while
    the old gang still trained, so its steps were learned at a span it never ran on and the
    inter-node cost vanished from the model. A gang missing a replica (one not started, not
    answering, or leaving) is left out: nothing says where its steps ran."""
    if not observation.nodes:
        return None
    members: dict[int, set[str]] = {}
    for key, snap in observation.telemetry.items():
        ranks = int(snap.get("world_size") or 0)
        if ranks > 0:  # `<replica>/<local rank>` for a pod's other ranks: the pod is the replica
            members.setdefault(telemetry.replicas_of(ranks, ranks_per_replica), set()).add(key.split("/")[0])
    spans = {}
    for world, replicas in members.items():
        where = {observation.nodes.get(r) for r in replicas}
        if len(replicas) == world and None not in where:
            spans[world] = len(where)
    return spans


def _spans_by_world(nodes: int | Mapping[int, int], steps: list[dict]) -> dict[int, int]:
    """learn()'s `nodes` as replicas → nodes for the records' worlds; one span is every gang's."""
    if not isinstance(nodes, int):
        return dict(nodes)
    worlds = {int(r.get("world_size") or 0) for r in steps}
    return {w: min(max(1, nodes), w) for w in worlds if w >= 1}


def _positive(value: object) -> float | None:
    """`value` as a finite number above 0, else None (absent, NaN, infinite, 0 or below)."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) and number > 0 else None


def batch_rule_priced(spec: training.TrainingJobSpec) -> str:
    """The batch the allocator prices a job at (allocator.BATCH_RULES): the batch its trainer
    will run. batchRule goodput takes the allocator's (batch_event) except in a pipelined job,
    whose schedules are built for its micro-batches: it keeps globalBatch, as fixed-global."""
    rule = spec.optimization.batch_rule
    if rule == training.BatchRule.SCALE_WITH_REPLICAS:
        return "scale-with-replicas"
    if rule == training.BatchRule.GOODPUT and spec.parallelism.pipeline_stages == 1:
        return "goodput"
    return "fixed-global"


def prior_model(spec: training.TrainingJobSpec, gpu_type: str = "", gpus_per_replica: int | None = None
                ) -> perfmodel.PerfModel:
    """A job's performance model before its first step: the prior of its model family scaled to
    its size (transformer, or moe) and to `gpu_type` (a `perfmodel.GPU_SPEED` key: the operator
    reads it from its cluster's nodes, `huorn run` from the CUDA device; "" for an H200, the GPU
    the family priors are set at); a job of no GPUs takes the prior measured on CPU with the
    shipped tiny models. Every job started from that CPU prior, so a cold 7B job on GPUs was
    priced as scaling almost linearly (7.9× at 8 replicas, 3.1× on its family's prior) until
    measurements at several sizes pinned it down. The prior is anchored to the measured level
    (PerfModel.anchor_prior): its shape is the family's, its level only a guess. The GPU type
    moves the shape too: on a slower GPU compute weighs more against the gradient exchange, and
    a job scales further (a 7B transformer's prior, 8 replicas of local batch 8 on one node:
    4.3× one replica's throughput on an H200, 6.5× on an A100). A replica of several GPUs
    computes its batch on all of them (perfmodel.scale_prior's `gpus`): priced as one GPU, it
    scaled as far as a one-GPU replica, where its exchange weighs `gpus` times more.
    `gpus_per_replica`: the GPUs a replica really computes on, the spec's `resources.gpus` in a
    cluster (a rank per GPU); `huorn run` starts one rank a replica whatever the spec asks, and
    passes 1."""
    if not spec.resources.gpus:
        return perfmodel.PerfModel("transformer-tiny", params_b=0.001, gpu_type="cpu", anchor_prior=True)
    family = perfmodel.runtime_prior_family(spec.model.moe is not None)
    prior = perfmodel.scale_prior(family, training.approximate_parameters(spec.model) / 1e9, gpu_type,
                                  gpus=spec.resources.gpus if gpus_per_replica is None else gpus_per_replica)
    return perfmodel.PerfModel(family, prior=prior, anchor_prior=True)


def repack(vertex: model.Vertex, decision: allocator.Decision, nodes: dict[str, str]) -> dict[str, Any]:
    """The resize's `remove` and `nodes`, so that the gang lands where the allocator placed it:
    the allocator priced the new size at its placement's span (and the simulator's Huorn runs
    there). Kept where they run, the replicas of a cluster's gang grew across ever more nodes and
    shrank by replicas whose GPUs no gang could use: 8.6-12.1 % more mean JCT in the simulator
    (docs/scheduling.md, "Resizes that keep their replicas"). Nothing when the backend did not say
    where every instance runs (one host), or the decision names no nodes."""
    running = {i.name: nodes[i.name] for i in vertex.instances if i.name in nodes}
    if len(running) != len(vertex.instances) or len(decision.assignments) != decision.replicas:
        return {}
    leaving, new_nodes = placement.match_replicas(running, decision.assignments)
    return {"remove": leaving, "nodes": new_nodes}


def last_batch_change(graph: model.Graph, vertex: str) -> float:
    """When the vertex's `batch` was last set (the graph's log, so a restarted operator keeps
    the cooldown); -inf if never or no longer in the bounded log."""
    for m in reversed(graph.log):
        if m.action == "set-param" and m.target == vertex and m.detail.get("key") == "batch":
            return m.time
    return float("-inf")


def last_resize_of(graph: model.Graph, vertex: str) -> tuple[float, int]:
    """When the vertex was last resized and which way (+1 grown, -1 shrunk), from the graph's
    mutation log; (-inf, 0) if never. The allocator's cooldown needs both: no regrowth right after
    a shrink, no voluntary shrink right after a growth. Read from the graph, not kept in the
    policy, so it counts resizes that others made (a reclaim, a preemption) and survives a
    restarted operator or a policy rebuilt for an edited spec. Before, the policy passed only the
    time of its own last decision and no direction, so the cooldown the simulator's Huorn runs
    never applied in a cluster or a local run."""
    for m in reversed(graph.log):
        if m.action == "resize" and m.target == vertex:
            grew = int(m.detail.get("to", 0)) > int(m.detail.get("from", 0))
            return m.time, 1 if grew else -1
    return float("-inf"), 0

