"""The live view of `huorn run`: step, loss, tokens/s, replicas and the latest events.

On a terminal it is a rich Live panel redrawn each monitor tick; otherwise (CI, a pipe, or
`--no-watch`) it prints one line per event and a progress line every few steps, so logs stay
readable and grep-able.
"""

from __future__ import annotations

import collections
import time
from types import TracebackType

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table

from huorn.api import training
from huorn.backends import monitor
from huorn.graph import model

PLAIN_EVERY_STEPS = 10


class RunView:
    def __init__(self, graph: model.Graph, total_steps: int | None, enabled: bool) -> None:
        """`total_steps`: where the trainers stop when a step limit (--steps) overrides the spec's
        budget. Without one, a budget in `optimization.tokens` is shown as tokens trained: the
        trainer ends on them, and a batch grown by `scale-with-replicas` ends it in fewer steps
        than the spec's globalBatch makes of them, so no step count is its end."""
        self.graph = graph
        spec = training.TrainingJobSpec.model_validate(graph.vertex("trainer").params["spec"])
        self.token_budget = training.token_budget(spec) if total_steps is None else None
        self.total = total_steps or (None if self.token_budget is not None else training.declared_steps(spec))
        self.tokens: int | None = None  # trained so far, as the newest step record says
        self.enabled = enabled
        self.console = Console(stderr=True)  # stdout stays for --json's one document
        self.step = 0
        self.loss: float | None = None
        self.tokens_per_second: float | None = None
        self.world_size = 0
        self.events: collections.deque[str] = collections.deque(maxlen=6)
        self.started = time.monotonic()
        self._live: Live | None = None
        self._printed = -1
        self.ranks: dict[str, dict] = {}

    def __enter__(self) -> RunView:
        if self.enabled:
            self._live = Live(self.render(), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._live is not None:
            self._live.update(self.render())
            self._live.__exit__(kind, error, trace)
            self._live = None

    def _event(self, text: str) -> None:
        stamped = f"{time.monotonic() - self.started:6.1f}s  {text}"
        self.events.append(stamped)
        if not self.enabled:
            self.console.print(stamped, highlight=False, soft_wrap=True)

    def update(self, result: monitor.TickResult) -> None:
        before = self.step
        for record in result.observation.steps:
            self.step = int(record["step"])
            self.loss = float(record["loss"])
            self.tokens_per_second = float(record["tokens_per_second"])
            self.world_size = int(record["world_size"])
            if record.get("tokens") is not None:
                self.tokens = int(record["tokens"])
        self.ranks = result.observation.telemetry
        for mutation in result.mutations:
            self._event(f"v{mutation.version} {mutation.action} {mutation.target}: {mutation.reason}")
        for action in result.actions:
            self._event(action)
        if self._live is not None:
            self._live.update(self.render())
        elif self.step != self._printed and (
            self.step // PLAIN_EVERY_STEPS > before // PLAIN_EVERY_STEPS or result.observation.finished
        ):
            self._printed = self.step
            self.console.print(self.summary_line(), highlight=False)

    def update_final(self, observation: monitor.Observation) -> None:
        """Fold in what arrived while stopping (the last steps and the stop checkpoint)."""
        before = self.step
        observation.finished = False
        self.update(monitor.TickResult(observation, [], [], []))
        if self._live is None and self.step not in (before, self._printed):
            self._printed = self.step
            self.console.print(self.summary_line(), highlight=False)

    def summary_line(self) -> str:
        loss = f"{self.loss:.4f}" if self.loss is not None else "-"
        tps = f"{self.tokens_per_second:,.0f}" if self.tokens_per_second is not None else "-"
        return (
            f"step {self.describe_steps()}  loss {loss}  tokens/s {tps}  "
            f"replicas {self.world_size}  graph v{self.graph.version}"
        )

    def describe_steps(self) -> str:
        """'12/30' against a budget in steps; '12 (tokens 24,576/204,800, 12%)' against one in
        tokens, whose step count is not known ahead."""
        if self.token_budget is None:
            return f"{self.step}/{self.total or '?'}"
        if self.tokens is None:
            return f"{self.step} (tokens ?/{self.token_budget:,})"
        share = min(100, 100 * self.tokens // self.token_budget)
        return f"{self.step} (tokens {self.tokens:,}/{self.token_budget:,}, {share}%)"

    def progress(self) -> tuple[float, float]:
        """The bar's (total, completed): steps, or tokens for a budget in tokens."""
        if self.token_budget is not None:
            return float(self.token_budget), float(self.tokens or 0)
        return float(self.total or max(self.step, 1)), float(self.step)

    def describe_ranks(self) -> str:
        """One word per rank from its /telemetry: heartbeat age and the last collective entered
        and completed, the numbers a hang shows first."""
        now = time.time()
        parts = []
        for name, snap in sorted(self.ranks.items()):
            beat = snap.get("heartbeat")
            age = f"{now - beat:.0f}s" if beat else "?"
            seq = snap.get("collective", {})
            parts.append(
                f"{name}: rank {snap.get('rank')} beat {age} ago, "
                f"coll {seq.get('entered')}/{seq.get('completed')}"
            )
        return "; ".join(parts) or "-"

    def render(self) -> Group:
        table = Table.grid(padding=(0, 2))
        table.add_row("job", f"{self.graph.kind} {self.graph.name}  (graph v{self.graph.version})")
        table.add_row("step", f"{self.step} / {self.total or '?'}" if self.token_budget is None
                      else self.describe_steps())
        table.add_row("loss", f"{self.loss:.4f}" if self.loss is not None else "-")
        table.add_row("tokens/s", f"{self.tokens_per_second:,.0f}" if self.tokens_per_second else "-")
        table.add_row(
            "replicas", f"{self.world_size} running, {self.graph.vertex('trainer').replicas} desired"
        )
        table.add_row("elapsed", f"{time.monotonic() - self.started:.0f} s")
        table.add_row("ranks", self.describe_ranks())
        events = Table.grid()
        for line in self.events:
            events.add_row(line)
        total, completed = self.progress()
        bar = ProgressBar(total=total, completed=completed, width=50)
        return Group(bar, table, "latest events:", events)
