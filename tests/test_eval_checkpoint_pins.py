"""An eval reading a checkpoint while the trainer prunes old ones: the eval pins the checkpoint it
reads and pruning spares it; one pruned before the eval got to it is replaced by the newest. Found
by review: with `intervalSteps: 2`, 9 of 10 evals failed on a checkpoint renamed away under them."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from test_runtime_evaluate import save_trained, write_config

from huorn.runtime import checkpoint, evaluate
from huorn.runtime import config as run_config


def fake_checkpoint(root: Path, step: int) -> Path:
    """A directory that counts as complete: the pin/prune protocol never reads the tensors."""
    path = root / checkpoint.checkpoint_name(step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"m")
    (path / checkpoint.META).write_text(json.dumps({"step": step}))
    return path


def write_pin(root: Path, name: str, host: str, pid: int, age_s: float = 0.0) -> Path:
    pin = root / f"{checkpoint.PIN_PREFIX}{name}.test{pid}"
    pin.write_text(json.dumps({"host": host, "pid": pid, "time": time.time()}))
    when = time.time() - age_s
    os.utime(pin, (when, when))
    return pin


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_pinned_checkpoint_is_spared_by_saves_until_the_pin_goes(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = checkpoint.save_checkpoint(tmp_path, 1, model, optimizer, {}, 0, lambda: None, keep=1)
    with checkpoint.pinned(first) as held:
        assert held.path == first and held.pin is not None and not held.fell_back
        checkpoint.save_checkpoint(tmp_path, 2, model, optimizer, {}, 0, lambda: None, keep=1)
        checkpoint.wait_for_clean_up()
        assert checkpoint.is_complete(first), "pruned while pinned"
    assert not list(tmp_path.glob(f"{checkpoint.PIN_PREFIX}*")), "the pin is removed after"
    checkpoint.save_checkpoint(tmp_path, 3, model, optimizer, {}, 0, lambda: None, keep=1)
    checkpoint.wait_for_clean_up()
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000003"]
    assert not list(tmp_path.glob(f"{checkpoint.PRUNE_PREFIX}*")), "the pruner's marks are removed"


def test_a_pin_after_the_pruner_marked_the_checkpoint_takes_the_newest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The eval pins between the pruner's mark and its rename: the eval sees the mark and moves
    to the newest checkpoint, and the pruner, which found no pin, renames the old one away."""
    old, newest = fake_checkpoint(tmp_path, 1), fake_checkpoint(tmp_path, 2)
    real_live_pins, looks, holds, held = checkpoint.live_pins, [], contextlib.ExitStack(), []

    def look(root: Path, name: str) -> list[Path]:
        found = real_live_pins(root, name)
        looks.append(found)
        if len(looks) == 2:  # the mark is down, the pins have been read: the eval comes now
            held.append(holds.enter_context(checkpoint.pinned(old)))
        return found

    monkeypatch.setattr(checkpoint, "live_pins", look)
    with holds:
        assert checkpoint._prune(tmp_path, old) == tmp_path / f"{checkpoint.TRASH_PREFIX}{old.name}"
        assert held[0].path == newest and held[0].fell_back and held[0].pin is not None
        assert checkpoint.is_complete(newest)
    assert looks == [[], []]


def test_a_pin_before_the_pruner_looks_again_spares_the_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The eval pins after the pruner's first look but before its mark: the pruner's second look,
    made after the mark, finds the pin, and the eval reads the checkpoint it was handed."""
    old = fake_checkpoint(tmp_path, 1)
    fake_checkpoint(tmp_path, 2)
    real_live_pins, holds, held = checkpoint.live_pins, contextlib.ExitStack(), []

    def look(root: Path, name: str) -> list[Path]:
        found = real_live_pins(root, name)
        if not held:
            held.append(holds.enter_context(checkpoint.pinned(old)))
        return found

    monkeypatch.setattr(checkpoint, "live_pins", look)
    with holds:
        assert checkpoint._prune(tmp_path, old) is None, "renamed a pinned checkpoint"
        assert held[0].path == old and not held[0].fell_back
        assert checkpoint.is_complete(old)


def test_pins_and_pruning_racing_in_threads_never_lose_a_held_checkpoint(tmp_path: Path) -> None:
    """Real directories, real threads: a reader pins and re-checks its checkpoint over and over
    while a pruner renames it away (and back, for the next round) whenever it finds no pin."""
    old = fake_checkpoint(tmp_path, 1)
    newest = fake_checkpoint(tmp_path, 2)
    trash = tmp_path / f"{checkpoint.TRASH_PREFIX}{old.name}"
    stop, lost, counts = threading.Event(), [], {"pruned": 0, "spared": 0, "held": 0, "fell back": 0}

    def prune() -> None:
        while not stop.is_set():
            if checkpoint._prune(tmp_path, old) is None:
                counts["spared"] += 1
            else:
                counts["pruned"] += 1
                os.rename(trash, old)

    pruner = threading.Thread(target=prune)
    pruner.start()
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            with checkpoint.pinned(old) as held:
                counts["held" if held.path == old else "fell back"] += 1
                for _ in range(3):
                    if not checkpoint.is_complete(held.path):
                        lost.append(held.path)
    finally:
        stop.set()
        pruner.join()
    assert lost == []
    assert held.path in (old, newest)
    assert min(counts.values()) > 0, f"the race was not exercised both ways: {counts}"


def test_a_pin_of_a_dead_or_silent_eval_does_not_keep_a_checkpoint(tmp_path: Path) -> None:
    old = fake_checkpoint(tmp_path, 1)
    here = socket.gethostname()
    live_elsewhere = write_pin(tmp_path, old.name, "another-pod", 1)
    assert checkpoint._prune(tmp_path, old) is None, "a fresh pin from another host holds"
    live_elsewhere.unlink()
    dead = write_pin(tmp_path, old.name, here, dead_pid())
    silent = write_pin(tmp_path, old.name, "another-pod", 2, age_s=checkpoint.PIN_TTL_S + 1)
    assert checkpoint._prune(tmp_path, old) is not None, "held by a dead process's or an expired pin"
    assert not dead.exists() and not silent.exists(), "stale pins are removed on the way"


def test_a_held_pin_is_refreshed_and_a_starts_sweep_removes_expired_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = fake_checkpoint(tmp_path, 1)
    monkeypatch.setattr(checkpoint, "PIN_REFRESH_S", 0.01)
    long_ago = time.time() - checkpoint.PIN_TTL_S - 1
    with checkpoint.pinned(old) as held:
        os.utime(held.pin, (long_ago, long_ago))
        deadline = time.monotonic() + 5
        while held.pin.stat().st_mtime < time.time() - 60 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert checkpoint.live_pins(tmp_path, old.name) == [held.pin], "not refreshed while held"
    expired = write_pin(tmp_path, old.name, "another-pod", 3, age_s=checkpoint.PIN_TTL_S + 1)
    fresh = write_pin(tmp_path, old.name, "another-pod", 4)
    killed = tmp_path / f"{checkpoint.PRUNE_PREFIX}{old.name}.x"  # a pruner killed mid-way
    killed.touch()
    stale = time.time() - checkpoint.STALE_MARK_SECONDS - 1
    os.utime(killed, (stale, stale))
    # and one at work now: another gang's pruner in the moments before two gangs merge
    working = tmp_path / f"{checkpoint.PRUNE_PREFIX}{old.name}.y"
    working.touch()
    checkpoint.remove_stale_temporaries(tmp_path)
    assert not expired.exists() and fresh.exists()
    assert not killed.exists() and working.exists()


def test_an_eval_of_a_pruned_checkpoint_evaluates_the_newest_and_says_so(tmp_path: Path, capsys) -> None:
    config_path = write_config(tmp_path)
    cfg = run_config.load_run_config(config_path)
    for step in (1, 2, 3, 4):  # keep=3: step 1 is pruned before its eval starts
        save_trained(cfg, step)
    checkpoint.wait_for_clean_up()
    handed = cfg.checkpoint_root / checkpoint.checkpoint_name(1)
    assert not handed.exists()
    assert evaluate.main(["--config", str(config_path), "--checkpoint", str(handed)]) == 0
    out = capsys.readouterr()
    assert "step 4: loss" in out.out and f"{handed} was pruned" in out.err
    written = json.loads((cfg.run_dir / "evals" / "eval-00000004.json").read_text())
    assert written["requested"] == str(handed)
    assert written["checkpoint"] == str(cfg.checkpoint_root / checkpoint.checkpoint_name(4))


def test_an_unpinned_eval_reads_the_newest_when_its_checkpoint_is_pruned_mid_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A read-only mount (an eval pod's checkpoint volume) cannot hold a pin: the checkpoint it
    reads may vanish under it, and it reads the newest instead of failing."""
    cfg = run_config.load_run_config(write_config(tmp_path))
    first, _ = save_trained(cfg, 1)
    save_trained(cfg, 2)

    def read_only(path: Path) -> Path:
        raise PermissionError(f"[Errno 30] Read-only file system: {path}")

    real_load, reads = checkpoint.load_checkpoint, []

    def pruned_mid_read(path: Path, model: torch.nn.Module, *args: object, **kwargs: object) -> dict:
        reads.append(Path(path))
        if len(reads) == 1:  # renamed away after the checks, while DCP reads: DCP's own error
            os.rename(path, path.with_name(f"{checkpoint.TRASH_PREFIX}{path.name}"))
            dcp, _ = checkpoint.dcp_modules()
            dcp.load({"model": model.state_dict()}, checkpoint_id=str(path), no_dist=True)
        return real_load(path, model, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "pin_checkpoint", read_only)
    monkeypatch.setattr(checkpoint, "load_checkpoint", pruned_mid_read)
    result = evaluate.evaluate(cfg, first, batches=1)
    assert reads == [first, cfg.checkpoint_root / checkpoint.checkpoint_name(2)]
    assert result["step"] == 2 and result["requested"] == str(first)
    assert "pruned while it was read" in capsys.readouterr().err


def test_a_broken_pinned_checkpoint_is_still_an_error(tmp_path: Path) -> None:
    """The fall-back is for a checkpoint that is gone, never for one that fails to load."""
    cfg = run_config.load_run_config(write_config(tmp_path))
    broken = fake_checkpoint(cfg.checkpoint_root, 7)
    dcp, _ = checkpoint.dcp_modules()
    with pytest.raises(dcp.CheckpointException, match="metadata"):
        evaluate.evaluate(cfg, broken, batches=1)
    assert checkpoint.is_complete(broken)
    assert not list(cfg.checkpoint_root.glob(f"{checkpoint.PIN_PREFIX}*"))
