"""Atomic, resharding checkpoints with torch.distributed.checkpoint (DCP).

Layout under the checkpoint root:

    step-00000120/      complete checkpoints (DCP files + .metadata + huorn.json)
    .tmp-step-00000140/ a checkpoint being written; never read, removed on the next start
    latest              text file naming the newest complete checkpoint, replaced last

Every rank writes its shards into the temporary directory, a barrier makes sure all are done,
and only then does rank 0 rename the directory and replace `latest` (write + fsync + rename).
A crash at any point leaves either the previous `latest` or the new one, never a partial
checkpoint behind the pointer. Older checkpoints beyond `keep` are renamed out of the way at once
and deleted by a thread of rank 0's: deleted in line, a slow file system held rank 0 while its
peers waited in the save's last tracked barrier, which the hang detector reads as rank 0 hung
outside communication. DCP stores the model and optimizer as a sharded state dict
keyed by fully qualified names, so a checkpoint written by N ranks loads at any other world
size; under DDP the replicated tensors are de-duplicated on save.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from types import ModuleType

import torch


def dcp_modules() -> tuple[ModuleType, ModuleType]:
    """DCP and its state-dict helpers, imported on first use: importing them costs a process
    1.2-1.4 s of CPU (DTensor's operator tables), which the processes that never save or load a
    checkpoint's tensors (the RL rollout workers, a reference worker without initCheckpoint,
    anything that only finds checkpoints or reads their metadata) need not pay."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dcp_state
    return dcp, dcp_state


_NAME = re.compile(r"^step-(\d{8})$")
LATEST = "latest"
# A temporary checkpoint nothing was written into for this long is a save that was interrupted.
STALE_TEMPORARY_S = 600.0
META = "huorn.json"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def is_complete(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file() and (path / META).is_file()


def find_latest(root: Path) -> Path | None:
    """The newest complete checkpoint: the one `latest` names, else the highest complete step
    directory (covers a crash between the rename and the pointer update). Temporary and
    incomplete directories are never returned."""
    root = Path(root)
    try:
        named = root / (root / LATEST).read_text().strip()
        candidates = [named] if _NAME.match(named.name) and is_complete(named) else []
    except OSError:
        candidates = []
    if root.is_dir():
        candidates += [p for p in root.iterdir() if _NAME.match(p.name) and is_complete(p)]
    return max(candidates, key=lambda p: p.name, default=None)


def resolve(path: Path) -> Path:
    """A checkpoint directory itself, or the newest complete one under a checkpoint root."""
    path = Path(path)
    if is_complete(path):
        return path
    latest = find_latest(path)
    if latest is None:
        raise ValueError(f"{path} holds no complete Huorn checkpoint (neither a step-* directory with "
                         f".metadata and {META}, nor a root with one)")
    return latest


def read_meta(path: Path) -> dict:
    return json.loads((Path(path) / META).read_text())


def _write_atomically(path: Path, text: str) -> None:
    scratch = path.with_name(f".{path.name}.tmp")
    with open(scratch, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(scratch, path)


def remove_stale_temporaries(root: Path, idle_s: float = 0.0) -> list[Path]:
    """Delete leftovers of interrupted saves; call on one rank before any rank saves again.
    With `idle_s`, only those nothing was written into for that long: a save still in flight
    (another gang's, in the moments before two gangs on one store merge) is spared."""
    root = Path(root)
    stale = [p for p in root.glob(".tmp-step-*") if p.is_dir()] if root.is_dir() else []
    if idle_s > 0:
        now = time.time()
        stale = [p for p in stale if now - _last_write(p) >= idle_s]
    else:  # no save is in flight: old checkpoints a clean-up thread did not finish go too
        stale += [p for p in root.glob(f"{TRASH_PREFIX}*") if p.is_dir()] if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def _last_write(path: Path) -> float:
    """The newest modification time of a directory and the files in it; a directory renamed or
    removed meanwhile (a save that finished, another clean-up) counts as written now."""
    try:
        times = [path.stat().st_mtime]
        for child in path.rglob("*"):
            with contextlib.suppress(OSError):  # removed meanwhile
                times.append(child.stat().st_mtime)
    except OSError:
        return time.time()
    return max(times)


# Old checkpoints being deleted: out of the checkpoints' names, and out of the interrupted saves'
# (.tmp-step-*), whose idle sweep would otherwise walk a directory another thread is deleting.
TRASH_PREFIX = ".old-"
_clean_ups: list[threading.Thread] = []  # rank 0's deletions in flight (save_checkpoint)


def wait_for_clean_up(timeout: float | None = None) -> None:
    """Block until the deletions that earlier saves left to a thread are done (tests; a process
    also waits for them at exit, as they are not daemons)."""
    for thread in list(_clean_ups):
        thread.join(timeout)


def _clean_up_later(root: Path, old: list[Path]) -> None:
    """Move `old` checkpoints out of the checkpoints' names (a rename is instant) and delete them,
    and the leftovers of interrupted saves, in a thread. Renamed first, a checkpoint is never seen
    half deleted, and one a killed process leaves behind is a temporary the next start removes."""
    trash = []
    for path in old:
        target = root / f"{TRASH_PREFIX}{path.name}"
        with contextlib.suppress(OSError):  # gone already: a peer process of another run, by hand
            os.rename(path, target)
            trash.append(target)

    def remove() -> None:
        for path in trash:
            shutil.rmtree(path, ignore_errors=True)
        # Leftovers of saves a lost peer interrupted: a gang that resizes in place never starts
        # again to remove them (resume does), and each is a whole checkpoint's size.
        remove_stale_temporaries(root, idle_s=STALE_TEMPORARY_S)

    _clean_ups[:] = [t for t in _clean_ups if t.is_alive()]
    thread = threading.Thread(target=remove, name="checkpoint-clean-up")
    thread.start()
    _clean_ups.append(thread)


def build_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, flat: bool = False) -> dict:
    """Model and optimizer state in DCP's canonical (FQN-keyed, DDP-unwrapped) form.

    `flat` keys the optimizer's hyper-parameters per parameter too. A pipeline needs it: its
    stages hold different parameters, and the nested form's one `param_groups` list would be
    de-duplicated across ranks as if every rank held the same one."""
    _, dcp_state = dcp_modules()
    options = dcp_state.StateDictOptions(flatten_optimizer_state_dict=flat)
    model_state, optim_state = dcp_state.get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optimizer": optim_state}


def save_checkpoint(root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    meta: dict, rank: int, barrier: callable, keep: int = 3, flat: bool = False,
                    local: bool = False) -> Path:
    """Collective: every rank calls it with the same step. Returns the final directory.

    `local`: this process alone writes its whole state, even where a process group is up (the
    RL trainers' group, whose members hold the same state and whose rank 0 saves it)."""
    root = Path(root)
    final = root / checkpoint_name(step)
    scratch = root / f".tmp-{checkpoint_name(step)}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(scratch, ignore_errors=True)
    barrier()
    dcp, _ = dcp_modules()
    dcp.save(build_state(model, optimizer, flat), checkpoint_id=str(scratch), no_dist=local)
    if rank == 0:
        _write_atomically(scratch / META, json.dumps({**meta, "step": step}, indent=2) + "\n")
    barrier()
    if rank == 0:
        if is_complete(final):
            shutil.rmtree(scratch, ignore_errors=True)  # the same step was saved before a restart
        else:
            shutil.rmtree(final, ignore_errors=True)
            os.rename(scratch, final)
        _write_atomically(root / LATEST, final.name + "\n")
        complete = sorted(p for p in root.iterdir() if _NAME.match(p.name) and is_complete(p))
        _clean_up_later(root, complete[:-keep])
    barrier()
    return final


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    flat: bool = False, local: bool = False) -> dict:
    """Load into `model` (and `optimizer`) in place, at whatever world size is running now;
    returns the checkpoint's huorn.json. Collective when a process group is initialised, unless
    `local` (this process alone reads it)."""
    path = Path(path)
    if not is_complete(path):
        raise ValueError(f"{path} is not a complete Huorn checkpoint (no .metadata or {META})")
    dcp, dcp_state = dcp_modules()
    if optimizer is None:
        state = {"model": dcp_state.get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=str(path), no_dist=local)
        dcp_state.set_model_state_dict(model, state["model"])
    else:
        state = build_state(model, optimizer, flat)
        dcp.load(state, checkpoint_id=str(path), no_dist=local)
        dcp_state.set_state_dict(model, optimizer, model_state_dict=state["model"],
                                 optim_state_dict=state["optimizer"],
                                 options=dcp_state.StateDictOptions(flatten_optimizer_state_dict=flat))
    return read_meta(path)
