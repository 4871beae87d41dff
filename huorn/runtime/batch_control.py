"""The allocator's global batch for a gang under batchRule goodput, from the run directory's
control file `batch.json` (the local backend writes it; in a cluster it is a key of the job's
ConfigMap, which every pod mounts):

    {"globalBatch": 64, "reason": "goodput allocator: ...", "version": 12}

As with remediation S2's counts (huorn.runtime.microbatches), only rank 0 reads the file; its
change rides on the step's statistics all-reduce and the batch follows in one broadcast, so every
rank switches at the same step boundary. A file mid-write or malformed reads as absent, so a
writer can never crash the trainer.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

CONTROL_FILE = "batch.json"


@dataclass(frozen=True)
class BatchChoice:
    global_batch: int
    reason: str = ""
    version: int = 0


def read_control_file(run_dir: Path) -> tuple[BatchChoice | None, int]:
    """The choice in the control file and a stamp of its content (0 when absent, -1 malformed),
    by content as microbatches.read_control_file (every pod's mounted copy has its own times)."""
    path = Path(run_dir) / CONTROL_FILE
    try:
        text = path.read_bytes()
        stamp = zlib.crc32(text) | 1
        raw = json.loads(text)
        batch = int(raw["globalBatch"])
        if batch < 1:
            return None, -1
        return BatchChoice(batch, str(raw.get("reason", "")), int(raw.get("version", 0))), stamp
    except FileNotFoundError:
        return None, 0
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, -1
