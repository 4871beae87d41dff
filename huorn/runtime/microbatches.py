"""Per-rank micro-batch counts (remediation S2) from the run directory's control file.

The control plane cannot reach into a running gang, so it writes a file and the trainer picks
it up at a step boundary: `<run_dir>/microbatches.json`,

    {"counts": [5, 5, 6, 0...], "reason": "S2: rank 2 is 1.8× slower", "version": 3}

`counts[r]` is how many of the step's micro-batches rank r computes. A plan changes who computes
which micro-batch, never which micro-batches make the step: rank r takes the contiguous indices
sum(counts[:r]) .. sum(counts[:r+1]) - 1, the union is still 0..M-1, and every micro-batch still
weighs 1/M, so the step's gradient is the even split's up to float summation order.

Only rank 0 reads the file (ranks reading it themselves could see two versions of it at the same
step); its change rides on the step's statistics all-reduce and the counts follow in one
broadcast, so all ranks switch at the same boundary. A plan that no longer fits the gang (its
length is not the world size after a resize, or its sum is not the step's micro-batches after
the global batch changed) is rejected with a reason and the even round-robin split applies.

A pipelined job reads the same file with one count per pipeline replica (all stages of a
replica run one table); it keeps the counts in force when it rejects a plan
(`huorn.runtime.pipeline.job`).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

from huorn.runtime.data import sampler

CONTROL_FILE = "microbatches.json"


@dataclass(frozen=True)
class MicroBatchPlan:
    counts: tuple[int, ...]
    reason: str = ""
    version: int = 0


def read_control_file(run_dir: Path) -> tuple[MicroBatchPlan | None, int]:
    """The plan in the control file and a stamp of its content (0 when absent, -1 malformed). A
    file that is mid-write or malformed reads as None, so a writer can never crash the trainer.

    The stamp is of the content, not the file's modification time: every pod mounts its own copy
    of the ConfigMap, with its own times, and after a regroup rank 0 may be another pod than the
    one that read the plan in force; by time, it read that plan again and applied it to ranks the
    new round had renumbered."""
    path = Path(run_dir) / CONTROL_FILE
    try:
        text = path.read_bytes()
        stamp = zlib.crc32(text) | 1  # never 0 (absent)
        raw = json.loads(text)
        counts = tuple(int(c) for c in raw["counts"])
        return MicroBatchPlan(counts, str(raw.get("reason", "")), int(raw.get("version", 0))), stamp
    except FileNotFoundError:
        return None, 0
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, -1


def write_control_file(run_dir: Path, counts: list[int], reason: str, version: int) -> Path:
    """Write atomically (write + rename): the trainer never reads half a plan."""
    path = Path(run_dir) / CONTROL_FILE
    scratch = path.with_name(f".{path.name}.tmp")
    scratch.write_text(json.dumps({"counts": list(counts), "reason": reason, "version": version}) + "\n")
    scratch.replace(path)
    return path


def check_plan(plan: MicroBatchPlan, world_size: int, micro_batches: int, unit: str = "rank") -> str | None:
    """Why `plan` cannot apply to this gang, or None when it can. `unit` is what takes a share
    of the step: a rank under DDP, a "pipeline replica" in a pipelined job (`world_size` of them)."""
    if len(plan.counts) != world_size:
        return (f"counts has {len(plan.counts)} entries but the gang has {world_size} {unit}s; "
                f"write one count per {unit}")
    if any(c < 1 for c in plan.counts):
        return f"counts {list(plan.counts)}: every {unit} needs at least one micro-batch"
    if sum(plan.counts) != micro_batches:
        return (f"counts sum to {sum(plan.counts)} but a step has {micro_batches} micro-batches; "
                "keep the global batch")
    return None


def assign(counts: tuple[int, ...] | None, total: int, world_size: int, rank: int) -> list[int]:
    """Micro-batch indices of `rank`: contiguous blocks under a plan, round-robin without one."""
    if counts is None:
        return sampler.assign_micro_batches(total, world_size, rank)
    start = sum(counts[:rank])
    return list(range(start, start + counts[rank]))
