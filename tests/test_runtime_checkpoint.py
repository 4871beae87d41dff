"""Checkpoints: atomic publication, partial checkpoints never picked up, and DCP resharding to a
different world size; plus the DDP comm hook checked against a single-process reference."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from huorn import models
from huorn.runtime import checkpoint, comm, faults, telemetry

_CFG = models.ModelConfig(layers=2, width=32, heads=2, context=16)
_MICRO_BATCHES = 3  # deliberately not a multiple of the world size


def _batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + index)
    data = torch.randint(0, 256, (2, _CFG.context + 1), generator=generator)
    return data[:, :-1], data[:, 1:]


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = models.build_model(_CFG)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _reference_gradients() -> dict[str, torch.Tensor]:
    """Mean gradient over all micro-batches, computed in one process with no communication."""
    model, _ = _fresh()
    for index in range(_MICRO_BATCHES):
        (model(*_batch(index))[1] / _MICRO_BATCHES).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": v.clone() for i, s in optimizer.state_dict()["state"].items() for k, v in s.items()
            if torch.is_tensor(v)}


def _worker(rank: int, world: int, store: str, root: str, out: str, mode: str) -> None:
    torch.set_num_threads(1)  # an OpenMP pool inherited through fork must not be used
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model, optimizer = _fresh()
        state = comm.HookState(telemetry.Telemetry("t", rank, world, None),
                               faults.FaultInjector([], Path(out), rank, None))
        if mode == "save":
            ddp = DistributedDataParallel(model)
            ddp.register_comm_hook(state, comm.allreduce_hook)
            mine = list(range(rank, _MICRO_BATCHES, world))
            for i, index in enumerate(mine):
                context = ddp.no_sync() if i < len(mine) - 1 else torch.enable_grad()
                with context:
                    (ddp(*_batch(index))[1] / _MICRO_BATCHES).backward()
            torch.save({n: p.grad.clone() for n, p in model.named_parameters()}, f"{out}/grads-{rank}.pt")
            optimizer.step()
            checkpoint.save_checkpoint(Path(root), 1, model, optimizer, {"world_size": world}, rank,
                                       lambda: comm.barrier(state))
            if rank == 0:
                torch.save({"model": model.state_dict(), "optim": _optimizer_tensors(optimizer),
                            "entered": state.telemetry.snapshot()["collective"]}, f"{out}/saved.pt")
        else:
            meta = checkpoint.load_checkpoint(checkpoint.find_latest(Path(root)), model, optimizer)
            torch.save({"model": model.state_dict(), "optim": _optimizer_tensors(optimizer), "meta": meta},
                       f"{out}/loaded-{rank}.pt")
    finally:
        dist.destroy_process_group()


def _spawn(world: int, *args: str) -> None:
    # NB: fork, not spawn: re-importing torch in every child costs 10+ s on a loaded machine, and
    # the parent never initialises a process group, so forking it is safe.
    mp.start_processes(_worker, args=(world, *args), nprocs=world, start_method="fork")


@pytest.fixture(scope="module")
def saved_at_two(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("dcp")
    _spawn(2, str(tmp / "store-save"), str(tmp / "ckpt"), str(tmp), "save")
    (tmp / "w3").mkdir()
    _spawn(3, str(tmp / "w3" / "store"), str(tmp / "ckpt"), str(tmp / "w3"), "load")
    return tmp


def test_comm_hook_sum_equals_the_single_process_mean_gradient(saved_at_two: Path) -> None:
    reference = _reference_gradients()
    for rank in range(2):
        grads = torch.load(saved_at_two / f"grads-{rank}.pt")
        for name, value in reference.items():
            torch.testing.assert_close(grads[name], value, rtol=1e-5, atol=1e-6, msg=name)
    collectives = torch.load(saved_at_two / "saved.pt")["entered"]
    assert collectives["entered"] == collectives["completed"] >= 1


@pytest.mark.parametrize("world", [1, 3])
def test_checkpoint_from_two_ranks_loads_at_another_world_size(saved_at_two: Path, world: int) -> None:
    saved = torch.load(saved_at_two / "saved.pt")
    out = saved_at_two / f"w{world}"
    if world == 1:
        model, optimizer = _fresh()  # no process group at all: DCP's single-process path
        meta = checkpoint.load_checkpoint(checkpoint.find_latest(saved_at_two / "ckpt"), model, optimizer)
        loaded = [{"model": model.state_dict(), "optim": _optimizer_tensors(optimizer), "meta": meta}]
    else:  # loaded by the fixture, before this process ran any torch kernel (fork safety)
        loaded = [torch.load(out / f"loaded-{rank}.pt") for rank in range(world)]
    for state in loaded:
        assert state["meta"]["step"] == 1 and state["meta"]["world_size"] == 2
        for name, value in saved["model"].items():
            torch.testing.assert_close(state["model"][name], value, rtol=0, atol=0, msg=name)
        assert state["optim"].keys() == saved["optim"].keys() and saved["optim"]
        for name, value in saved["optim"].items():
            torch.testing.assert_close(state["optim"][name], value, rtol=0, atol=0, msg=name)


def _save_single(root: Path, step: int) -> Path:
    model, optimizer = _fresh()
    return checkpoint.save_checkpoint(root, step, model, optimizer, {}, 0, lambda: None, keep=10)


def test_partial_and_temporary_checkpoints_are_never_picked_up(tmp_path: Path) -> None:
    good = _save_single(tmp_path, 4)
    assert checkpoint.find_latest(tmp_path) == good
    (tmp_path / ".tmp-step-00000009").mkdir()  # a save killed half way
    (tmp_path / ".tmp-step-00000009" / ".metadata").write_bytes(b"x")
    (tmp_path / "step-00000008").mkdir()  # renamed by hand without metadata
    assert checkpoint.find_latest(tmp_path) == good
    (tmp_path / "latest").write_text("step-00000008\n")  # pointer to an incomplete checkpoint
    assert checkpoint.find_latest(tmp_path) == good
    assert checkpoint.remove_stale_temporaries(tmp_path) == [tmp_path / ".tmp-step-00000009"]
    with pytest.raises(ValueError, match="not a complete Huorn checkpoint"):
        checkpoint.load_checkpoint(tmp_path / "step-00000008", *_fresh())


def test_a_crash_before_the_rename_keeps_the_previous_checkpoint(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    first = _save_single(tmp_path, 2)

    real_rename = os.rename

    def crash(source: object, target: object) -> None:
        if Path(target).name.startswith("step-"):  # DCP's own renames inside the save go through
            raise OSError("simulated power loss")
        real_rename(source, target)

    monkeypatch.setattr(checkpoint.os, "rename", crash)
    with pytest.raises(OSError, match="power loss"):
        _save_single(tmp_path, 3)
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text().strip() == first.name
    assert checkpoint.find_latest(tmp_path) == first
    assert (tmp_path / ".tmp-step-00000003").is_dir()  # the leftover that the next start removes
    # ... or the next save, for a gang that resizes in place and never starts again, once nothing
    # has been written into it for STALE_TEMPORARY_S (a save in flight is spared)
    _save_single(tmp_path, 4)
    assert (tmp_path / ".tmp-step-00000003").is_dir(), "written into just now"
    old = time.time() - checkpoint.STALE_TEMPORARY_S - 1
    for path in (tmp_path / ".tmp-step-00000003", *(tmp_path / ".tmp-step-00000003").rglob("*")):
        os.utime(path, (old, old))
    _save_single(tmp_path, 5)
    checkpoint.wait_for_clean_up()  # rank 0 deletes in a thread
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")) == []


def test_only_the_newest_checkpoints_are_kept(tmp_path: Path) -> None:
    model, optimizer = _fresh()
    for step in range(1, 6):
        checkpoint.save_checkpoint(tmp_path, step, model, optimizer, {}, 0, lambda: None, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000004", "step-00000005"]
    assert checkpoint.read_meta(checkpoint.find_latest(tmp_path))["step"] == 5


def test_old_checkpoints_are_deleted_off_the_saving_thread(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 deletes the checkpoints beyond `keep` while its peers wait in the save's last tracked
    barrier. Deleted in line, a slow file system (a big checkpoint, many files) held it there past
    hangTimeout, and the hang detector named rank 0 hung outside communication. The old one is
    renamed away at once, so it is never picked up half deleted."""
    model, optimizer = _fresh()
    release, started, deleting = threading.Event(), threading.Event(), []
    real_rmtree = shutil.rmtree

    def slow_rmtree(path: object, *args: object, **kwargs: object) -> None:
        # the old checkpoint, not the save's scratch nor the final name it clears before the rename
        if Path(str(path)).name in ("step-00000001", ".old-step-00000001") and Path(str(path)).exists():
            deleting.append(threading.current_thread() is threading.main_thread())
            started.set()
            release.wait(timeout=5)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", slow_rmtree)
    checkpoint.save_checkpoint(tmp_path, 1, model, optimizer, {}, 0, lambda: None, keep=1)
    newest = checkpoint.save_checkpoint(tmp_path, 2, model, optimizer, {}, 0, lambda: None, keep=1)
    try:
        assert started.wait(timeout=10)
        assert deleting == [False], "the save deleted the old checkpoint itself"
        assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002"]
        assert checkpoint.find_latest(tmp_path) == newest
    finally:
        release.set()
        checkpoint.wait_for_clean_up()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".latest")) == [
        "latest", "step-00000002"]



def test_a_sweep_never_walks_an_old_checkpoint_another_clean_up_is_deleting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saves faster than the deletes: the next save's idle sweep of interrupted saves walked the
    previous clean-up's old checkpoint while it was deleted, and its thread died on a file gone
    (found by review). The old ones are out of the sweep's names; a start removes what is left."""
    model, optimizer = _fresh()
    release, errors = threading.Event(), []
    real_rmtree = shutil.rmtree
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))

    def slow_rmtree(path: object, *args: object, **kwargs: object) -> None:
        if Path(str(path)).name.startswith(checkpoint.TRASH_PREFIX):
            release.wait(timeout=5)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", slow_rmtree)
    for step in (1, 2, 3):
        checkpoint.save_checkpoint(tmp_path, step, model, optimizer, {}, 0, lambda: None, keep=1)
    assert not [p for p in tmp_path.glob(".tmp-step-*")], "nothing old under the sweep's names"
    release.set()
    checkpoint.wait_for_clean_up()
    assert errors == []
    (tmp_path / f"{checkpoint.TRASH_PREFIX}step-00000009").mkdir()  # a killed process's leftover
    checkpoint.remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".latest")) == [
        "latest", "step-00000003"]

def test_resolve_accepts_a_checkpoint_or_a_root(tmp_path: Path) -> None:
    newest = [_save_single(tmp_path, step) for step in (1, 2)][-1]
    assert checkpoint.resolve(tmp_path) == newest == checkpoint.resolve(newest)
    with pytest.raises(ValueError, match="no complete Huorn checkpoint"):
        checkpoint.resolve(tmp_path / "elsewhere")
