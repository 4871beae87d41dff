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

An evaluator reading a checkpoint pins it (`pinned`): a `.pin-step-N.<token>` file beside it that
pruning respects. The two sides follow one protocol, so that neither can miss the other: the
evaluator creates its pin and only then checks the checkpoint is neither gone nor marked for
pruning; the pruner creates a `.prune-step-N.<token>` mark and only then checks for pins, renaming
the checkpoint away only when it found none. A pin whose owner stopped refreshing it (a killed
evaluator) expires, so it never keeps a checkpoint for long.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
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


def is_step_name(name: str) -> bool:
    """A trainer's checkpoint directory's name (step-NNNNNNNN), the only ones pruning removes."""
    return bool(_NAME.match(name))


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


STALE_MARK_SECONDS = 30.0  # a pruner marks, checks for pins and renames within milliseconds


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
        # and the marks of a pruner that was killed before it removed them, and expired pins;
        # a mark younger than STALE_MARK_SECONDS may be another gang's pruner at work (the
        # moments before two gangs on one store merge): removed, an eval could pin the
        # checkpoint past it and lose it to the rename
        now = time.time()
        for mark in root.glob(f"{PRUNE_PREFIX}*") if root.is_dir() else []:
            with contextlib.suppress(OSError):
                if now - mark.stat().st_mtime >= STALE_MARK_SECONDS:
                    mark.unlink(missing_ok=True)
        for pin in root.glob(f"{PIN_PREFIX}*") if root.is_dir() else []:
            if not _pin_is_live(pin, now):
                pin.unlink(missing_ok=True)
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


# Pins: an evaluator's claim on a checkpoint it reads, which pruning respects.
PIN_PREFIX = ".pin-"
PRUNE_PREFIX = ".prune-"  # a pruner's mark: this checkpoint is about to be renamed away
# A pin not refreshed for this long belongs to an evaluator that died without removing it.
PIN_TTL_S = 600.0
PIN_REFRESH_S = 60.0
# The longest a holder refreshes its pin: a hung evaluator does not keep a checkpoint for ever.
PIN_HOLD_LIMIT_S = 6 * 3600.0


def _pin_is_live(pin: Path, now: float) -> bool:
    """Fresh, and where its owner ran on this host, owned by a live process. A pin whose content
    cannot be read yet (being written) counts as live: it is one the moment it exists."""
    try:
        if now - pin.stat().st_mtime >= PIN_TTL_S:
            return False
    except OSError:  # removed meanwhile
        return False
    try:
        owner = json.loads(pin.read_text())
        host, pid = str(owner["host"]), int(owner["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return True
    return host != socket.gethostname() or _process_alive(pid)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):  # someone else's, or not a pid we can ask
        return True
    return True


def live_pins(root: Path, name: str) -> list[Path]:
    """The live pins on checkpoint `name` under `root`; expired ones found on the way are removed."""
    now, live = time.time(), []
    for pin in Path(root).glob(f"{PIN_PREFIX}{name}.*"):
        if _pin_is_live(pin, now):
            live.append(pin)
        else:
            pin.unlink(missing_ok=True)
    return live


def pin_checkpoint(path: Path) -> Path | None:
    """Pin the checkpoint at `path`; the pin file, or None when the checkpoint is gone or being
    pruned (the caller picks another). Raises OSError where the root is not writable (a read-only
    mount). The pin is created before the checks: a pruner that marked the checkpoint after they
    passed finds the pin when it looks for pins, which it does after marking."""
    path = Path(path)
    pin = path.parent / f"{PIN_PREFIX}{path.name}.{uuid.uuid4().hex}"
    owner = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()})
    try:
        with open(pin, "x") as handle:
            handle.write(owner)
    except OSError:
        pin.unlink(missing_ok=True)  # a pin half written (a full disk) would hold until it expired
        raise
    if any(path.parent.glob(f"{PRUNE_PREFIX}{path.name}.*")) or not is_complete(path):
        pin.unlink(missing_ok=True)
        return None
    return pin


def _refresh_pin(pin: Path, stop: threading.Event) -> None:
    started = time.monotonic()
    while not stop.wait(PIN_REFRESH_S) and time.monotonic() - started < PIN_HOLD_LIMIT_S:
        with contextlib.suppress(OSError):
            os.utime(pin)


@dataclass(frozen=True)
class Held:
    """What `pinned` holds: `path`, the checkpoint to read; `pin`, None where none could be
    written (a read-only mount: the reader must cope with the checkpoint vanishing); `requested`,
    what the caller asked for, which differs from `path` where that was pruned first."""

    path: Path
    pin: Path | None
    requested: Path

    @property
    def fell_back(self) -> bool:
        return is_step_name(self.requested.name) and self.path != self.requested


def _choose(requested: Path) -> Path:
    """`requested` when complete; for a step directory that is not (pruned before its reader
    came), the newest complete checkpoint beside it; for a root, its newest."""
    if is_complete(requested):
        return requested
    if is_step_name(requested.name):
        newest = find_latest(requested.parent)
        if newest is None:
            raise ValueError(f"{requested} is gone or incomplete, and {requested.parent} holds no complete "
                             f"Huorn checkpoint to evaluate instead")
        return newest
    return resolve(requested)


@contextlib.contextmanager
def pinned(requested: Path, attempts: int = 5) -> Iterator[Held]:
    """The checkpoint at `requested` (a step directory, or a root: its newest), pinned so that no
    save prunes it while the block runs. A step directory pruned (or being pruned) before the pin
    is replaced by the newest complete checkpoint beside it, which no pruning touches until
    newer ones exist. The pin is refreshed every PIN_REFRESH_S while held, and removed after."""
    requested = Path(requested)
    path, pin = _choose(requested), None
    for _ in range(attempts):
        if not is_step_name(path.name):
            break  # not one of the trainer's step directories: nothing prunes it
        try:
            pin = pin_checkpoint(path)
        except OSError:
            break  # read-only: held without a pin
        if pin is not None:
            break
        path = _choose(path.parent)
    else:
        raise ValueError(f"could not pin a checkpoint under {path.parent} in {attempts} attempts: each was "
                         f"pruned first (saves faster than a pin takes?)")
    stop = threading.Event()
    if pin is not None:
        threading.Thread(target=_refresh_pin, args=(pin, stop), name="checkpoint-pin", daemon=True).start()
    try:
        yield Held(path, pin, requested)
    finally:
        stop.set()
        if pin is not None:
            pin.unlink(missing_ok=True)


def _prune(root: Path, path: Path) -> Path | None:
    """Rename `path` out of the checkpoints' names unless a reader pinned it; the new name, or
    None when it was spared or gone. The mark goes down before the pins are read: a reader that
    pins after this read sees the mark and goes elsewhere."""
    if live_pins(root, path.name):
        return None
    mark = root / f"{PRUNE_PREFIX}{path.name}.{uuid.uuid4().hex}"
    target = root / f"{TRASH_PREFIX}{path.name}"
    try:
        mark.touch(exist_ok=False)
        if live_pins(root, path.name):
            return None
        os.rename(path, target)
        return target
    except OSError:  # gone already: a peer process of another run, by hand
        return None
    finally:
        mark.unlink(missing_ok=True)


def _clean_up_later(root: Path, old: list[Path]) -> None:
    """Move `old` checkpoints out of the checkpoints' names (a rename is instant) and delete them,
    and the leftovers of interrupted saves, in a thread. Renamed first, a checkpoint is never seen
    half deleted, and one a killed process leaves behind is a temporary the next start removes.
    A checkpoint an evaluator pinned is kept until a later save finds it unpinned."""
    trash = [target for target in (_prune(root, path) for path in old) if target is not None]

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
        # The optimizer's moments come from the checkpoint; its hyper-parameters (param_groups)
        # stay the running optimizer's, which the spec set: the learning rate is set every step
        # anyway, an edited weightDecay applies on resume, and a checkpoint written while every
        # parameter sat in one group (before huorn.models.decay exempted gains and fusion
        # weights) loads into the two groups now, where DCP would miss the second one's keys.
        running = _pop_param_groups(state["optimizer"], flat)
        dcp.load(state, checkpoint_id=str(path), no_dist=local)
        state["optimizer"].update(running)
        dcp_state.set_state_dict(model, optimizer, model_state_dict=state["model"],
                                 optim_state_dict=state["optimizer"],
                                 options=dcp_state.StateDictOptions(flatten_optimizer_state_dict=flat))
    return read_meta(path)


def _pop_param_groups(optim_state: dict, flat: bool) -> dict:
    """Take the hyper-parameters out of an optimizer state dict (nested: its `param_groups` list;
    flat: the `param_groups.<fqn>.<name>` keys); returns them."""
    if not flat:
        return {"param_groups": optim_state.pop("param_groups")}
    return {k: optim_state.pop(k) for k in [k for k in optim_state if k.startswith("param_groups.")]}
