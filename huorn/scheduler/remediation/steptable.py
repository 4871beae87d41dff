"""The generic input of the fail-slow detector: a table of per-worker step times.

One row per (iteration, worker): ``iteration,worker,time`` and optionally ``compute`` and
``comm`` (seconds). The same table comes from the live telemetry, from a recorded trace or from
another framework's logs, which is what lets `huorn detect` run anywhere. ``time`` is the
worker's own busy time in the step (not time spent waiting for peers), so that a slow worker
stands out from its peers instead of dragging every worker's wall time with it.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

REQUIRED = ("iteration", "worker", "time")
OPTIONAL = ("compute", "comm")


class StepTableError(ValueError):
    """A malformed table; the message names the column and the line to fix."""


@dataclasses.dataclass
class StepTable:
    """Per-worker series, each sorted by iteration."""

    iterations: dict[str, np.ndarray]
    times: dict[str, np.ndarray]
    compute: dict[str, np.ndarray] | None = None
    comm: dict[str, np.ndarray] | None = None

    @property
    def workers(self) -> list[str]:
        return sorted(self.times, key=_natural_key)


def _natural_key(name: str) -> tuple:
    """Sort worker-10 after worker-9, as a person expects."""
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def _parse_number(text: str, column: str, line: int, integer: bool) -> float:
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise StepTableError(f"line {line}, column '{column}': {text!r} is not {kind}") from None
    if not integer and (not math.isfinite(value) or value < 0):
        raise StepTableError(f"line {line}, column '{column}': {text!r} must be a finite number >= 0")
    return value


def build_table(rows: Iterable[Mapping[str, object]], columns: Iterable[str]) -> StepTable:
    """Validate rows (dicts keyed by column) into a StepTable; `line` numbers count the header."""
    columns = [c.strip() for c in columns]
    missing = [c for c in REQUIRED if c not in columns]
    if missing:
        raise StepTableError(
            f"missing column(s) {', '.join(repr(c) for c in missing)}: the header must name "
            f"{','.join(REQUIRED)} (optional: {','.join(OPTIONAL)}); got {','.join(columns) or 'nothing'}"
        )
    extra = [c for c in OPTIONAL if c in columns]
    records: dict[str, list[tuple[int, float, float, float]]] = {}
    seen: set[tuple[str, int]] = set()
    for line, row in enumerate(rows, start=2):
        for col in (*REQUIRED, *extra):
            if row.get(col) in (None, ""):
                raise StepTableError(f"line {line}, column '{col}': value is empty")
        iteration = int(_parse_number(str(row["iteration"]).strip(), "iteration", line, integer=True))
        worker = str(row["worker"]).strip()
        time = _parse_number(str(row["time"]).strip(), "time", line, integer=False)
        if time <= 0:
            raise StepTableError(f"line {line}, column 'time': step time must be > 0, got {time}")
        compute = _parse_number(str(row["compute"]), "compute", line, False) if "compute" in extra else 0.0
        comm = _parse_number(str(row["comm"]), "comm", line, False) if "comm" in extra else 0.0
        if (worker, iteration) in seen:
            raise StepTableError(
                f"line {line}, columns 'iteration','worker': duplicate row for worker {worker!r} "
                f"at iteration {iteration}"
            )
        seen.add((worker, iteration))
        records.setdefault(worker, []).append((iteration, time, compute, comm))
    if not records:
        raise StepTableError("the table has a header but no rows of step times")
    table = StepTable(iterations={}, times={})
    if extra == list(OPTIONAL):
        table.compute, table.comm = {}, {}
    for worker, recs in records.items():
        recs.sort()
        arr = np.asarray(recs, dtype=float)
        table.iterations[worker] = arr[:, 0].astype(int)
        table.times[worker] = arr[:, 1]
        if table.compute is not None and table.comm is not None:
            table.compute[worker] = arr[:, 2]
            table.comm[worker] = arr[:, 3]
    return table


def parse_csv(text: str) -> StepTable:
    """Parse CSV text (header first) into a StepTable, refusing malformed input by column."""
    reader = csv.DictReader(io.StringIO(text.removeprefix("\ufeff")))  # a BOM: Excel's "CSV UTF-8"
    if reader.fieldnames is None:
        raise StepTableError(f"the file is empty: expected a header {','.join(REQUIRED)}")
    # "iteration, worker, time" names the same columns as "iteration,worker,time"
    reader.fieldnames = [name.strip() for name in reader.fieldnames]
    return build_table(reader, reader.fieldnames)


def read_csv(path: str | Path) -> StepTable:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise StepTableError(f"not UTF-8 text (byte {error.start}): expected a CSV with header "
                             f"{','.join(REQUIRED)}") from None
    return parse_csv(text)


def format_csv(table: StepTable) -> str:
    """Write a table back out in the same format (used to record live telemetry as a trace)."""
    out = io.StringIO()
    with_parts = table.compute is not None and table.comm is not None
    out.write(",".join((*REQUIRED, *OPTIONAL) if with_parts else REQUIRED) + "\n")
    for worker in table.workers:
        for k, iteration in enumerate(table.iterations[worker]):
            fields = [str(int(iteration)), worker, repr(float(table.times[worker][k]))]
            if with_parts:
                assert table.compute is not None and table.comm is not None
                fields += [repr(float(table.compute[worker][k])), repr(float(table.comm[worker][k]))]
            out.write(",".join(fields) + "\n")
    return out.getvalue()
