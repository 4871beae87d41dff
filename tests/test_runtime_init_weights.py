"""Continual pre-training's starting weights (`task.initCheckpoint`) are checked against
`spec.model` when the trainer starts: a checkpoint of another shape failed in DCP's load with a
traceback and exit 1 (under `huorn run`, a replacement every few seconds), one of other `heads`
loaded silently and computed another function."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import runtime_harness as harness

from huorn.api import training
from huorn.runtime import init_weights

BASE = {"layers": 2, "width": 32, "heads": 2, "context": 32}


def _checkpoint(root: Path, model: dict | None) -> Path:
    directory = root / "step-00000004"
    directory.mkdir(parents=True)
    (directory / ".metadata").write_bytes(b"")
    (directory / "huorn.json").write_text(json.dumps({"step": 4, **({"model": model} if model else {})}))
    return root


def _spec(**fields: object) -> training.ModelSpec:
    return training.ModelSpec.model_validate({**BASE, **fields})


def test_a_checkpoint_of_the_same_shape_is_taken_and_a_longer_context_allowed(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "base", BASE)
    assert init_weights.starting_checkpoint(str(root), _spec()) == root / "step-00000004"
    assert init_weights.starting_checkpoint(str(root), _spec(context=128)) == root / "step-00000004"
    assert init_weights.starting_checkpoint(str(root), _spec(kvHeads=2)) == root / "step-00000004"  # = heads


@pytest.mark.parametrize(("fields", "named"), [
    ({"heads": 4}, "heads 2 there, 4 in spec.model"),
    ({"layers": 3}, "layers 2 there, 3 in spec.model"),
    ({"kvSharing": "fusedkv"}, "kvSharing none there, fusedkv in spec.model"),
    ({"moe": {"experts": 4}}, "moe None there, {'experts': 4, 'prototypes': 1} in spec.model"),
])
def test_another_architecture_is_refused_naming_the_field_and_what_differs(
        tmp_path: Path, fields: dict, named: str) -> None:
    root = _checkpoint(tmp_path / "base", BASE)
    with pytest.raises(ValueError, match=r"^spec\.task\.initCheckpoint: .* holds a model of another "
                                         r"architecture") as caught:
        init_weights.starting_checkpoint(str(root), _spec(**fields))
    assert named in str(caught.value) and "set spec.model to the base run's" in str(caught.value)


def test_a_missing_or_foreign_checkpoint_is_refused_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^spec\.task\.initCheckpoint: .*point it at the base run's"):
        init_weights.starting_checkpoint(str(tmp_path / "nothing"), _spec())
    root = _checkpoint(tmp_path / "foreign", None)
    with pytest.raises(ValueError, match=r"^spec\.task\.initCheckpoint: .* names no model"):
        init_weights.starting_checkpoint(str(root), _spec())


def test_the_trainer_exits_2_naming_the_field_instead_of_a_load_traceback(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "base", {**BASE, "layers": 3})
    spec = harness.build_spec(steps=2, interval_steps=None)
    spec["task"] = {"kind": "cpt", "initCheckpoint": str(root)}
    config = harness.write_config(tmp_path, harness.shared_data_dir(), spec)
    log = tmp_path / "train.log"
    with open(log, "wb") as out:
        code = subprocess.run(harness.trainer_command(config, 1), cwd=harness.REPO, env=harness.child_env(),
                              stdout=out, stderr=subprocess.STDOUT, timeout=120).returncode
    text = log.read_text()
    assert code != 0, text[-2000:]
    assert "error: spec.task.initCheckpoint:" in text and "another architecture" in text, text[-2000:]


def test_a_run_with_its_own_checkpoint_resumes_though_the_base_is_gone(tmp_path: Path) -> None:
    """The check ran at every start: a cpt run whose base checkpoint was pruned since (the base run
    keeps 3) exited 2 at every restart instead of resuming from its own checkpoint."""
    spec = harness.build_spec(steps=2, interval_steps=None)
    config = harness.write_config(tmp_path, harness.shared_data_dir(), spec)
    assert harness.start_trainer(config, tmp_path / "first.log").wait(timeout=120) == 0
    spec = harness.build_spec(steps=3, interval_steps=None)
    spec["task"] = {"kind": "cpt", "initCheckpoint": str(tmp_path / "base-pruned")}
    config = harness.write_config(tmp_path, harness.shared_data_dir(), spec)
    process = harness.start_trainer(config, tmp_path / "again.log")
    assert process.wait(timeout=120) == 0, (tmp_path / "again.log").read_text()[-2000:]
    starts = [e for e in harness.read_events(tmp_path / "run") if e["event"] == "start"]
    assert starts[-1]["resumed_from"] == 2
