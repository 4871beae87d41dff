"""The live view of `huorn run`: plain lines off a terminal, a rich panel on one."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from huorn import graph
from huorn.api import manifests
from huorn.backends import monitor
from huorn.cli import live
from huorn.graph import mutate

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"


def tick(
    *steps: int, world: int = 1, mutations: list | None = None, finished: bool = False
) -> monitor.TickResult:
    records = [
        {"step": s, "loss": 2.0 + 1 / s, "tokens_per_second": 1000.0 * world, "world_size": world}
        for s in steps
    ]
    seen = monitor.Observation(time=0.0, steps=records, finished=finished)
    return monitor.TickResult(seen, [], mutations or [], [])


def test_plain_view_prints_events_and_a_line_every_ten_steps() -> None:
    g = graph.compile(manifests.load_manifest(QUICKSTART))
    view = live.RunView(g, total_steps=30, enabled=False)
    buffer = io.StringIO()
    view.console = Console(file=buffer, width=200)
    with view:
        view.update(tick(*range(1, 10)))
        assert buffer.getvalue() == ""
        m = mutate.resize(g, "trainer", 2, reason="goodput allocator: grow to 2")
        view.update(tick(10, 11, world=2, mutations=[m]))
        view.update(tick(12, world=2, finished=True))
        view.update_final(monitor.Observation(time=0.0))
    lines = buffer.getvalue().splitlines()
    assert lines[0].endswith("v2 resize trainer: goodput allocator: grow to 2")
    assert lines[1] == "step 11/30  loss 2.0909  tokens/s 2,000  replicas 2  graph v2"
    assert lines[2].startswith("step 12/30") and len(lines) == 3


def test_live_panel_shows_step_loss_throughput_replicas_and_events() -> None:
    g = graph.compile(manifests.load_manifest(QUICKSTART))
    view = live.RunView(g, total_steps=None, enabled=True)
    view.update(tick(1, 2, 3))
    view.ranks = {"trainer-0-0": {"rank": 0, "heartbeat": 0.0, "collective": {"entered": 7, "completed": 6}}}
    buffer = io.StringIO()
    Console(file=buffer, width=120).print(view.render())
    text = buffer.getvalue()
    assert "3 / 300" in text and "2.3333" in text and "1,000" in text
    assert "1 running, 1 desired" in text and "TrainingJob quickstart" in text
    assert "trainer-0-0: rank 0" in text and "coll 7/6" in text
