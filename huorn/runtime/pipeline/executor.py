"""One pipeline stage's share of a training step, driven by a schedule table.

The compute thread walks its row of the table. Sends go to a link per edge and direction
(`contention.make_link`: a host thread on gloo, a CUDA stream on NCCL), so they never hold up
the compute that follows. On gloo, receives are posted for the whole step before the first
action, so a message can land while the stage computes something else; on NCCL a receive is
posted when the schedule reaches it, which is still far ahead of the GPU (see
`post_receives_ahead`). Either way the stage only waits when the input it needs next has
truly not arrived: communication overlaps compute.

With `comm="lockstep"` there are no links: between two actions the stage posts one batched
exchange (`schedules.lockstep_exchanges`) with the sends that are ready and the next action's
receive, over the replica's pipeline communicator, and its compute waits for it, as
torch.distributed.pipelining does. On NVLink, where a message takes tens of microseconds,
that keeps NCCL kernels from running beside the GEMMs; on a slow link it exposes every
transfer, which is why the planner chooses the mode from measured step times.

Every wait that blocks on another rank (a receive, a lockstep exchange, draining the links at
the step's end, the data-parallel gradient all-reduce) counts on the rank's telemetry as one
collective operation through `ledger` (`comm.StepLedger`), naming the neighbour it waits for:
a stage blocked on a hung neighbour shows an operation in flight, as a DDP rank blocked in its
gradient all-reduce does, and the hang detector can tell who stopped the job. The ledger pads
each step's count to `2M + 2` (M: the step's micro-batches) on every stage, so that all ranks'
sequence numbers agree at step boundaries. On NCCL a receive's or a link's wait does not block
the host (the stream waits), so there they are not counted one by one (a few µs each, on a host
that launches the kernels) and the padding alone moves the count.

Saved-activation bytes are metered (autograd saved-tensor hooks, a Python call per saved
tensor) on the first step of each table only: a table's peak does not change from step to
step, and the hooks cost 6–26% of a step on two H200s, where the host launches the kernels.

A stage module is any `nn.Module` called as `module(*tensors)` that returns a tensor or a
tuple of tensors; everything it returns travels to the next stage as one flat buffer (the
decoder's hidden state plus the FusedKV tensors upper layers rebuild from), and the gradients
of all of them come back the same way. The last stage's outputs go to `loss_fn(outputs,
target)`. Each micro-batch's loss is scaled by 1/M (its backward starts at 1/M), so the summed
gradients equal those of the mean loss, as in single-process gradient accumulation.

Replicas may run tables of different lengths (remediation S2 gives a slow pipeline fewer
micro-batches). Averaging their gradients would then weigh a micro-batch of the short table
more than one of the long table, so with `run_step(total_microbatches=M)` the backward starts
at 1/M, the step's total over all replicas, and the replicas' gradients are summed: every
micro-batch weighs 1/M, as in the non-pipelined step. (Scaling each replica's average by its
share N_r/M instead is the same in exact arithmetic, but rounds 1/N_r in the loss's dtype:
gradients then differed from the reference's by 4e-9 in float64.) Without it (equal tables)
the seed stays 1/M_table and the replicas' gradients are averaged, bit for bit as before."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from huorn.runtime import comm as comm_accounting
from huorn.runtime.pipeline import contention, graphs, memory, schedules
from huorn.runtime.pipeline import topology as pp_topology

LossFn = Callable[[tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor]
HEADER_SLOTS = 64
COMM_MODES = ("overlap", "lockstep")


@dataclass
class StepStats:
    """What one step on this stage measured; the planner's inputs come from these."""

    loss: float | None
    seconds: float
    forward_s: float  # mean compute seconds of one forward
    backward_s: float
    recv_wait_s: float  # time blocked waiting for messages
    send_link: contention.LinkStats | None  # activations sent on (this stage to the next)
    grad_link: contention.LinkStats | None  # gradients sent back (this stage to the previous)
    peak_saved_bytes: int
    executed: list[str] = field(default_factory=list)  # the actions run, in order
    # this stage's MoE balancing losses (weighted, summed over its blocks), mean over the step's
    # micro-batches: the non-pipelined trainer reports CE plus these, so the step's reported
    # loss adds every stage's (training._reduce_step); 0.0 on a stage without them
    aux_loss: float = 0.0
    metered: bool = False  # the table's first step: saved tensors were metered, at a cost in time
    comm: str = "overlap"  # how messages moved: links in the background, or lockstep exchanges
    graphed: bool = False  # forwards and backwards replayed as CUDA graphs (graphs.py)
    # host seconds in the data-parallel gradient all-reduce: with replicas, a fast replica waits
    # there for a slow one, which is communication, not its own compute (remediation reads both)
    reduce_wait_s: float = 0.0
    # host seconds blocked at the end of the step until this stage's outgoing links had
    # delivered: a slow link holds its sender here, and counted as compute it would blame the
    # sender's GPU for its link
    send_wait_s: float = 0.0


@dataclass(frozen=True)
class _Layout:
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return sum(int(torch.Size(s).numel()) for s in self.shapes)


class StageExecutor:
    """Runs schedule tables for one stage; build once, call `run_step` every step."""

    def __init__(self, module: nn.Module, topology: pp_topology.PipelineTopology,
                 groups: pp_topology.PipelineGroups, loss_fn: LossFn, device: torch.device,
                 throttle: contention.Throttle | None = None, cuda_graphs: bool = False,
                 max_graph_slots: int = 8, ledger: comm_accounting.StepLedger | None = None) -> None:
        self.module, self.topology, self.groups, self.loss_fn = module, topology, groups, loss_fn
        self.device = device
        # counts blocking waits on the rank's telemetry (module docstring); none without one
        self.ledger = ledger or comm_accounting.StepLedger(None)
        self._host_waits = device.type != "cuda"  # whether a wait on a message blocks the host
        self.throttle = throttle or contention.Throttle()
        self.meter = memory.SavedTensorMeter(module.parameters())
        self.input_layout: _Layout | None = None
        self.output_layout: _Layout | None = None
        self.microbatch_bytes = 0
        self.negotiated = False
        # NB: on NCCL a posted receive is a kernel that holds the device until its data comes;
        # anything in a step that waits for the device (a lazy kernel load, a cudaMalloc that
        # synchronises) would then wait on data that only this rank's own later work releases.
        # Both 2×H200 stages hung so. There, each receive is posted when it is needed; gloo
        # receives run on the host, so they are all posted up front to overlap with compute.
        self.post_receives_ahead = device.type != "cuda"
        stage, replica = topology.stage, topology.replica
        self._next = topology.global_rank(replica, stage + 1) if not topology.is_last else None
        self._previous = topology.global_rank(replica, stage - 1) if not topology.is_first else None
        self.send_link = (contention.make_link(self._next, groups.to_next, self.throttle, device)
                          if self._next is not None else None)
        self.grad_link = (contention.make_link(self._previous, groups.to_previous, self.throttle, device)
                          if self._previous is not None else None)
        self.link_delays = (0.0, 0.0)  # forward, backward: set_link_delays
        self.measured_peaks: dict[tuple[str, int, int], int] = {}  # table -> peak saved bytes
        self._scales: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
        self._side_stream: torch.cuda.Stream | None = None  # lockstep contention delays
        self._cycles_per_s = 0.0
        # CUDA graphs (graphs.py) are set up in negotiate_shapes, once the input layout is known;
        # graph_note says why a stage that asked for them runs eagerly. `cuda_graphs` may be
        # turned off and on between steps (the benchmark runs both on one executor).
        self.cuda_graphs, self.max_graph_slots = cuda_graphs, max_graph_slots
        self.graphs: graphs.GraphedStage | None = None
        self.graph_note: str | None = None

    def set_link_delays(self, forward_s: float, backward_s: float) -> None:
        """Seconds added to every message this stage sends on (activations) and back (gradients)
        from the next step on: fault injection's `slow-link`, one direction of one edge, where
        the throttle's contention is shared by both (contention.py)."""
        if forward_s < 0 or backward_s < 0:
            raise ValueError(f"link delays must be >= 0 s, got forward {forward_s}, backward {backward_s}")
        self.link_delays = (float(forward_s), float(backward_s))
        for link, extra in ((self.send_link, forward_s), (self.grad_link, backward_s)):
            if link is not None:
                link.extra_s = float(extra)

    def close(self) -> None:
        for link in (self.send_link, self.grad_link):
            if link is not None:
                link.close()

    # --- set-up --------------------------------------------------------------------------------
    def negotiate_shapes(self, first_inputs: Sequence[torch.Tensor] | None,
                         first_target: torch.Tensor | None = None) -> None:
        """Learn the message layouts by running one forward in pipeline order (stage 0 first).

        Stage 0 passes a real micro-batch, the last stage a real target; the others build
        zeros of the announced shapes. The same forward measures the saved-activation bytes
        per micro-batch (loss included on the last stage) for the memory model; a stage whose
        saved bytes depend on the data (MoE routing, which zeros would skew) is measured at its
        worst case (`memory.measure_microbatch_bytes`)."""
        if self.topology.is_first:
            if first_inputs is None:
                raise ValueError("negotiate_shapes: stage 0 needs one micro-batch of inputs")
            inputs = [t.to(self.device, copy=True) for t in first_inputs]
        self.ledger.begin(2)  # a layout from the previous stage, one to the next: at most two
        if not self.topology.is_first:
            self.input_layout = self._receive_layout()
            # views of one flat buffer, as received: a saved view keeps the whole buffer alive
            flat = torch.zeros(self.input_layout.numel, dtype=self.input_layout.dtype, device=self.device)
            inputs = self._unpack(flat, self.input_layout)
        loss = None
        if self.topology.is_last:
            if first_target is None:
                raise ValueError("negotiate_shapes: the last stage needs one micro-batch of targets")
            target = first_target.to(self.device, copy=True)

            def loss(outputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
                return self.loss_fn(outputs, target)
        self.microbatch_bytes = memory.measure_microbatch_bytes(self.module, inputs, loss)
        if self.device.type == "cuda":
            self._warm_up_backward(inputs, loss)
        with torch.no_grad():
            outputs = _as_tuple(self.module(*inputs))
        if not self.topology.is_last:
            dtypes = {t.dtype for t in outputs}
            if len(dtypes) != 1 or not outputs[0].is_floating_point():
                raise ValueError(f"stage {self.topology.stage} outputs must share one floating dtype, "
                                 f"got {sorted(map(str, dtypes))}; cast them in the stage module")
            self.output_layout = _Layout(tuple(tuple(t.shape) for t in outputs), outputs[0].dtype)
            self._send_layout(self.output_layout)
        self.ledger.end()
        if self.cuda_graphs:
            self._set_up_graphs(inputs, target if self.topology.is_last else None)
        self.negotiated = True

    def _set_up_graphs(self, inputs: Sequence[torch.Tensor], target: torch.Tensor | None) -> None:
        blocker = graphs.graph_blocker(self.module)
        if self.device.type != "cuda":
            blocker = f"CUDA graphs need a CUDA device, this stage runs on {self.device.type}"
        if blocker is not None:
            self.graph_note = f"stage {self.topology.stage} runs eagerly: {blocker}"
            return
        samples = [t.detach().requires_grad_(t.is_floating_point() and not self.topology.is_first)
                   for t in inputs]
        if target is not None:
            samples.append(target)
        loss_fn = self.loss_fn if self.topology.is_last else None
        self.graphs = graphs.GraphedStage(self.module, loss_fn, samples, self.max_graph_slots)

    def _warm_up_backward(self, inputs: Sequence[torch.Tensor],
                          loss: Callable[[tuple[torch.Tensor, ...]], torch.Tensor] | None) -> None:
        """One local forward and backward before any receive is posted.

        NB: run_step posts the receives of every micro-batch up front; on NCCL each is a kernel
        that waits on the GPU until its peer sends. Loading a kernel module (CUDA loads them
        lazily, on first launch) or creating a cuBLAS workspace waits for the device, so a first
        backward inside run_step could wait on receives whose data needs that very backward: both
        stages hung this way on 2×H200. Running every kernel once here, with nothing pending,
        moves those one-time waits out of the step. Gradients are cleared again afterwards."""
        prepared = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
        outputs = _as_tuple(self.module(*prepared))
        if loss is not None:
            outputs = (loss(outputs),)
        floating = [t for t in outputs if t.is_floating_point() and t.requires_grad]
        if floating:
            torch.autograd.backward(floating, [torch.ones_like(t) for t in floating])
        self.module.zero_grad(set_to_none=True)
        torch.cuda.synchronize(self.device)

    def _send_layout(self, layout: _Layout) -> None:
        values = [_DTYPES.index(layout.dtype), len(layout.shapes)]
        for shape in layout.shapes:
            values += [len(shape), *shape]
        if len(values) > HEADER_SLOTS:
            raise ValueError(f"stage outputs too many tensors/dims for the {HEADER_SLOTS}-slot header")
        header = torch.zeros(HEADER_SLOTS, dtype=torch.int64, device=self.device)
        header[: len(values)] = torch.tensor(values, dtype=torch.int64)
        self.ledger.run("send-layout", self._next,
                        lambda: dist.send(header, dst=self._next, group=self.groups.to_next))

    def _receive_layout(self) -> _Layout:
        header = torch.zeros(HEADER_SLOTS, dtype=torch.int64, device=self.device)
        self.ledger.run("recv-layout", self._previous,
                        lambda: dist.recv(header, src=self._previous, group=self.groups.from_previous))
        values = header.tolist()
        dtype, count, position, shapes = _DTYPES[values[0]], values[1], 2, []
        for _ in range(count):
            ndim = values[position]
            shapes.append(tuple(values[position + 1: position + 1 + ndim]))
            position += 1 + ndim
        return _Layout(tuple(shapes), dtype)

    # --- one step ------------------------------------------------------------------------------
    def run_step(self, schedule: schedules.Schedule, inputs: Sequence[Sequence[torch.Tensor]] | None,
                 targets: Sequence[torch.Tensor] | None, comm: str = "overlap",
                 total_microbatches: int | None = None) -> StepStats:
        """Forward and backward of every micro-batch of this step; gradients accumulate into
        the module's .grad (data-parallel averaging included). The caller runs the optimizer.
        `comm` is "overlap" (links in the background) or "lockstep" (batched exchanges).
        `total_microbatches` is the step's micro-batches over all replicas when replicas run
        unequal counts (module docstring); None means equal counts."""
        stage, count = self.topology.stage, schedule.microbatches
        weigh = total_microbatches or count  # each micro-batch's share of the step's gradient
        if comm not in COMM_MODES:
            raise ValueError(f"comm must be one of {', '.join(COMM_MODES)}, got {comm!r}")
        lockstep = comm == "lockstep" and self.topology.stages > 1
        exchanges = schedules.lockstep_exchanges(schedule)[stage] if lockstep else ()
        outbox: dict[tuple[str, int], torch.Tensor] = {}
        inbox: dict[tuple[str, int], torch.Tensor] = {}
        exchange_s = 0.0
        if schedule.stages != self.topology.stages:
            raise ValueError(f"schedule has {schedule.stages} stages, the pipeline {self.topology.stages}")
        if self.topology.is_first and (inputs is None or len(inputs) != count):
            raise ValueError(f"stage 0 needs {count} micro-batches of inputs")
        if self.topology.is_last and (targets is None or len(targets) != count):
            raise ValueError(f"the last stage needs {count} micro-batches of targets")
        if not self.negotiated:
            raise RuntimeError("call negotiate_shapes before run_step")
        table_key = (schedule.name, schedule.k, count)
        metering = table_key not in self.measured_peaks
        # capturing comes first: it waits for the device, so no receive may be posted yet
        graphed = self.cuda_graphs and not metering and self._graphs_ready(schedule)
        started = time.perf_counter()
        # at most M receives from each neighbour and a drain per link, or 2M + 1 exchanges
        self.ledger.begin(2 * weigh + 2)
        ahead = self.post_receives_ahead and not lockstep
        pending_inputs = {m: self._post_receive(m, forward=True) for m in range(count)
                          } if ahead and not self.topology.is_first else {}
        pending_grads = {m: self._post_receive(m, forward=False) for m in range(count)
                         } if ahead and not self.topology.is_last else {}
        if graphed:
            self.graphs.ensure_grads()  # type: ignore[union-attr]
        self.meter.reset_peak()
        timer = _Timer(self.device)
        stored: dict[int, tuple[list[torch.Tensor], tuple[torch.Tensor, ...], int]] = {}
        losses: list[torch.Tensor] = []
        aux_losses: list[torch.Tensor] = []
        executed: list[str] = []
        wait_s = 0.0
        for position, action in enumerate(schedule.table[stage]):
            m = action.microbatch
            executed.append(str(action))
            if lockstep:
                exchange_s += self._exchange(exchanges[position], outbox, inbox)
            if action.kind == "F":
                if self.topology.is_first:
                    # metered steps copy, so that each micro-batch's saved inputs are its own
                    # storage even when the caller's micro-batches are views of one batch (the
                    # memory model counts bytes per micro-batch); other steps save a kernel
                    received = [t.to(self.device, copy=metering) for t in inputs[m]]  # type: ignore[index]
                else:
                    tick = time.perf_counter()
                    if lockstep:
                        buffer = inbox.pop(("F", m))
                    else:
                        pending = pending_inputs.pop(m, None) or self._post_receive(m, forward=True)
                        buffer = self._wait(pending, "recv-activations", self._previous)
                    received = self._unpack(buffer, self.input_layout)
                    wait_s += time.perf_counter() - tick
                    for tensor in received:
                        tensor.requires_grad_(True)
                slot = -1
                if graphed:
                    with timer.measure("F"):
                        args = [*received, targets[m]] if self.topology.is_last else received  # type: ignore[index]
                        outputs, slot = self.graphs.forward(args)  # type: ignore[union-attr]
                    if self.topology.is_last:
                        losses.append(outputs[0].detach().clone())  # the slot's next replay overwrites it
                else:
                    with timer.measure("F"), (self.meter.hooks() if metering else contextlib.nullcontext()):
                        outputs = _as_tuple(self.module(*received))
                        if self.topology.is_last:
                            target = targets[m].to(self.device, copy=metering)  # type: ignore[index]
                            loss = self.loss_fn(outputs, target)
                            losses.append(loss.detach())
                            outputs = (loss,)
                        aux = _aux_loss(self.module)
                        if aux is not None:
                            outputs = (*outputs, aux)
                            aux_losses.append(aux.detach())
                stored[m] = (received, outputs, slot)
                if self.send_link is not None:
                    payload = self._pack(outputs[: len(self.output_layout.shapes)])  # type: ignore[union-attr]
                    if lockstep:
                        outbox[("F", m)] = payload
                    else:
                        self.send_link.send(payload, tag=m)
            else:
                received, outputs, slot = stored.pop(m)
                grads: list[torch.Tensor | None] = []
                if not self.topology.is_last:
                    tick = time.perf_counter()
                    if lockstep:
                        buffer = inbox.pop(("B", m))
                    else:
                        pending = pending_grads.pop(m, None) or self._post_receive(m, forward=False)
                        buffer = self._wait(pending, "recv-gradients", self._next)
                    grads = list(self._unpack(buffer, self.output_layout))
                    wait_s += time.perf_counter() - tick
                # the loss and aux losses start their backward at 1/M rather than being divided
                # by M in the forward: the same gradients, without a division and its backward
                # node per micro-batch (on two H200s the last stage's host launches the kernels)
                grads += [self._scale(weigh, t) for t in outputs[len(grads):]]
                with timer.measure("B"):
                    torch.autograd.backward(outputs, grads)
                del outputs
                if graphed:
                    self.graphs.release(slot)  # type: ignore[union-attr]
                if self.grad_link is not None:
                    # a graphed backward leaves the slot's static buffer in .grad: send a copy
                    back = self._pack([t.grad if t.grad is not None else torch.zeros_like(t)
                                       for t in received], copy=graphed)
                    if lockstep:
                        outbox[("B", m)] = back
                    else:
                        self.grad_link.send(back, tag=m)
        if lockstep:
            exchange_s += self._exchange(exchanges[-1], outbox, inbox)
            if outbox or inbox:
                raise RuntimeError(f"stage {stage}: lockstep exchanges left {sorted(outbox)} unsent and "
                                   f"{sorted(inbox)} unused; the exchanges do not match {schedule.name}")
        tick = time.perf_counter()
        for link in (self.send_link, self.grad_link):
            # lockstep sends nothing over the links (its exchanges were counted): a counted drain
            # made a middle stage's 2M + 1 exchanges 2M + 3 operations, past the step's allotment
            if link is not None and self._host_waits and not lockstep:
                self.ledger.run("send-drain", link.peer, link.drain)
            elif link is not None:
                link.drain()
        self.ledger.end()
        send_wait_s = time.perf_counter() - tick
        tick = time.perf_counter()
        self._average_gradients(summed=total_microbatches is not None)
        reduce_wait_s = time.perf_counter() - tick
        if metering:
            self.measured_peaks[table_key] = self.meter.peak_bytes
        forward_s, backward_s = timer.means()
        return StepStats(
            loss=float(torch.stack(losses).sum()) / count if losses else None,
            aux_loss=float(torch.stack(aux_losses).sum()) / count if aux_losses else 0.0,
            seconds=time.perf_counter() - started, forward_s=forward_s, backward_s=backward_s,
            recv_wait_s=wait_s + exchange_s, comm="lockstep" if lockstep else "overlap",
            send_link=self.send_link.take_stats() if self.send_link else None,
            grad_link=self.grad_link.take_stats() if self.grad_link else None,
            peak_saved_bytes=self.measured_peaks[table_key], executed=executed, graphed=graphed,
            reduce_wait_s=reduce_wait_s, send_wait_s=send_wait_s, metered=metering,
        )

    def _graphs_ready(self, schedule: schedules.Schedule) -> bool:
        """Whether this step replays graphs: captures the slots the table keeps in flight on this
        stage first. A capture that fails turns graphs off for good (graph_note says why); a
        table that needs more slots than the cap, or than the free memory holds, runs eagerly."""
        if self.graphs is None:
            return False
        needed = schedules.count_in_flight(schedule)[self.topology.stage]
        try:
            return self.graphs.prepare(needed)
        except graphs.GraphUnavailable as error:
            self.graphs, self.graph_note = None, f"stage {self.topology.stage} runs eagerly: {error}"
            return False

    def _exchange(self, transfers: Sequence[schedules.Transfer], outbox: dict[tuple[str, int], torch.Tensor],
                  inbox: dict[tuple[str, int], torch.Tensor]) -> float:
        """One lockstep exchange: post its sends and receives as one batch and make compute
        wait for all of them. Returns the host seconds spent (on GPU the host does not block;
        the wait is the compute stream's). Contention holds the batch back by the throttle's
        delay for the bytes it sends, as the benchmark does for torch's batches."""
        if not transfers:
            return 0.0
        tick = time.perf_counter()
        group, replica = self.groups.pipeline, self.topology.replica
        ops, sent_bytes, extra_s = [], 0, 0.0
        for t in transfers:
            peer = self.topology.global_rank(replica, t.peer)
            if t.op == "send":
                extra_s = max(extra_s, self.link_delays[0 if t.kind == "F" else 1])
                tensor = outbox.pop((t.kind, t.microbatch))
                sent_bytes += tensor.numel() * tensor.element_size()
                ops.append(dist.P2POp(dist.isend, tensor, peer, group=group, tag=t.microbatch))
            else:
                layout = self.input_layout if t.kind == "F" else self.output_layout
                tensor = torch.empty(layout.numel, dtype=layout.dtype, device=self.device)  # type: ignore[union-attr]
                inbox[(t.kind, t.microbatch)] = tensor
                ops.append(dist.P2POp(dist.irecv, tensor, peer, group=group, tag=t.microbatch))
        # a slowed link holds back the batch it sends on, as the throttle does (set_link_delays)
        delay = self.throttle.delay_s(sent_bytes) + extra_s if sent_bytes else 0.0
        if self.device.type == "cuda" and delay > 0:
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(self.device)
                self._cycles_per_s = contention.gpu_sleep_rate(self.device)
            compute = torch.cuda.current_stream(self.device)
            self._side_stream.wait_stream(compute)
            with torch.cuda.stream(self._side_stream):
                torch.cuda._sleep(int(delay * self._cycles_per_s))
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            compute.wait_stream(self._side_stream)
        else:
            if delay > 0:
                time.sleep(delay)
            works = dist.batch_isend_irecv(ops)
            peers = {t.peer for t in transfers}
            peer = self.topology.global_rank(replica, peers.pop()) if len(peers) == 1 else None
            self.ledger.run("exchange", peer, lambda: [work.wait() for work in works])
        return time.perf_counter() - tick

    def _post_receive(self, microbatch: int, forward: bool) -> tuple[torch.Tensor, dist.Work]:
        layout = self.input_layout if forward else self.output_layout
        buffer = torch.empty(layout.numel, dtype=layout.dtype, device=self.device)  # type: ignore[union-attr]
        peer = self._previous if forward else self._next
        group = self.groups.from_previous if forward else self.groups.from_next
        return buffer, dist.irecv(buffer, src=peer, group=group, tag=microbatch)

    def _wait(self, pending: tuple[torch.Tensor, dist.Work], op: str, peer: int | None) -> torch.Tensor:
        buffer, work = pending
        if self._host_waits:
            self.ledger.run(op, peer, work.wait)
        else:
            work.wait()
        return buffer

    def _scale(self, count: int, like: torch.Tensor) -> torch.Tensor:
        """1/count as the gradient of a scalar loss, cached per (count, dtype, device)."""
        key = (count, like.dtype, like.device)
        scale = self._scales.get(key)
        if scale is None:
            scale = self._scales[key] = torch.full_like(like, 1.0 / count)
        return scale

    @staticmethod
    def _pack(tensors: Sequence[torch.Tensor], copy: bool = False) -> torch.Tensor:
        """One flat message. A single contiguous tensor goes as a view, without a copy (nothing
        writes to an activation or an eager gradient after it is sent), unless `copy`."""
        if len(tensors) == 1 and tensors[0].is_contiguous():
            flat = tensors[0].detach().view(-1)
            return flat.clone() if copy else flat
        return torch.cat([t.detach().reshape(-1) for t in tensors])

    @staticmethod
    def _unpack(buffer: torch.Tensor, layout: _Layout | None) -> list[torch.Tensor]:
        assert layout is not None
        out, offset = [], 0
        for shape in layout.shapes:
            size = int(torch.Size(shape).numel())
            out.append(buffer[offset: offset + size].view(shape))
            offset += size
        return out

    def _average_gradients(self, summed: bool = False) -> None:
        """Mean over replicas of equal tables; the sum when each seed was 1/M of the whole step."""
        group = self.groups.data_parallel
        if group is None:
            return
        params = [p for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self.ledger.once("grad-allreduce", None, lambda: dist.all_reduce(flat, group=group))
        if not summed:
            flat /= self.topology.replicas
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset: offset + p.grad.numel()].view_as(p.grad))
            offset += p.grad.numel()


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _as_tuple(outputs: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)


def _aux_loss(module: nn.Module) -> torch.Tensor | None:
    """A stage module may expose `pipeline_aux_loss()` (MoE balancing) to add to its backward."""
    hook = getattr(module, "pipeline_aux_loss", None)
    if hook is None:
        return None
    aux = hook()
    return aux if aux is not None and aux.requires_grad else None


class _Timer:
    """Compute time of forwards and backwards: wall clock on CPU, CUDA events on GPU (read at
    the end of the step, so timing never forces a synchronisation mid-step)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: dict[str, list] = {"F": [], "B": []}

    def measure(self, kind: str) -> _Span:
        return _Span(self, kind)

    def means(self) -> tuple[float, float]:
        if self.cuda:
            torch.cuda.synchronize()
        result = []
        for kind in ("F", "B"):
            spans = self.spans[kind]
            if self.cuda:
                values = [start.elapsed_time(end) / 1000.0 for start, end in spans]
            else:
                values = [end - start for start, end in spans]
            result.append(sum(values) / len(values) if values else 0.0)
        return result[0], result[1]


class _Span:
    def __init__(self, timer: _Timer, kind: str) -> None:
        self.timer, self.kind = timer, kind

    def __enter__(self) -> None:
        if self.timer.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.timer.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        self.timer.spans[self.kind].append((self.start, end))
