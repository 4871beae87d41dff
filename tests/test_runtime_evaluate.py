"""The eval vertex's process: one checkpoint in, per-source and mixture losses out, exactly the
losses of the model the trainer saved, and a clear refusal of anything that is not a checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from huorn import models
from huorn.runtime import checkpoint, evaluate
from huorn.runtime import config as run_config
from huorn.runtime.data import sampler

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"


def write_config(tmp_path: Path) -> Path:
    spec = yaml.safe_load(QUICKSTART.read_text())["spec"]
    spec["model"].update({"layers": 2, "width": 32, "heads": 2, "context": 32})
    config = {"jobName": "evaltest", "spec": spec, "runDir": str(tmp_path / "run"),
              "checkpointDir": str(tmp_path / "ck"), "validationBatches": 2}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def save_trained(cfg: run_config.RunConfig, step: int) -> tuple[Path, torch.nn.Module]:
    """A few real optimizer steps, then a checkpoint as the trainer writes it (world of one)."""
    torch.manual_seed(3)
    model = models.build_model(run_config.build_model_config(cfg.spec.model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sources = [(s.name, s.weight, s.path) for s in cfg.spec.data.sources]
    mixture = sampler.build_mixture(sources, cfg.spec.data.seed, cfg.spec.model.context, cfg.data_dir)
    for s in range(step):
        tokens, targets = mixture.micro_batch(s, 0, 4)
        optimizer.zero_grad()
        model(tokens, targets)[1].backward()
        optimizer.step()
    path = checkpoint.save_checkpoint(cfg.checkpoint_root, step, model, optimizer, {"job": "evaltest"},
                                      rank=0, barrier=lambda: None)
    return path, model


def test_eval_reports_the_saved_models_losses_per_source_and_mixture(tmp_path: Path) -> None:
    cfg = run_config.load_run_config(write_config(tmp_path))
    path, trained = save_trained(cfg, step=5)
    result = evaluate.evaluate(cfg, cfg.checkpoint_root, batches=2)  # a root: its latest checkpoint
    assert result["step"] == 5 and result["checkpoint"] == str(path)
    sources = [(s.name, s.weight, s.path) for s in cfg.spec.data.sources]
    mixture = sampler.build_mixture(sources, cfg.spec.data.seed, cfg.spec.model.context, cfg.data_dir)
    trained.eval()
    with torch.no_grad():
        want = sum(float(trained(*mixture.validation_batch(i, cfg.spec.optimization.micro_batch))[1])
                   for i in range(2)) / 2
    assert result["loss"] == pytest.approx(want, rel=1e-6)
    assert set(result["sources"]) == {s.name for s in cfg.spec.data.sources}
    assert len(set(result["sources"].values())) == len(result["sources"]), "each source is its own text"
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    # an untrained model of the same shape scores worse: the checkpoint really was loaded
    fresh = models.build_model(run_config.build_model_config(cfg.spec.model)).eval()
    with torch.no_grad():
        untrained = float(fresh(*mixture.validation_batch(0, cfg.spec.optimization.micro_batch))[1])
    assert result["loss"] < untrained


def test_main_writes_the_result_file_and_a_step_log_record(tmp_path: Path, capsys) -> None:
    config_path = write_config(tmp_path)
    cfg = run_config.load_run_config(config_path)
    save_trained(cfg, step=3)
    assert evaluate.main(["--config", str(config_path), "--checkpoint", str(cfg.checkpoint_root)]) == 0
    written = json.loads((cfg.run_dir / "evals" / "eval-00000003.json").read_text())
    records = [json.loads(line) for line in (cfg.run_dir / run_config.STEPS_FILE).read_text().splitlines()]
    assert records[-1]["event"] == "eval" and records[-1]["loss"] == written["loss"]
    assert "step 3: loss" in capsys.readouterr().out


def test_a_directory_without_a_checkpoint_is_refused_by_name(tmp_path: Path, capsys) -> None:
    config_path = write_config(tmp_path)
    (tmp_path / "empty").mkdir()
    assert evaluate.main(["--config", str(config_path), "--checkpoint", str(tmp_path / "empty")]) == 2
    assert "holds no complete Huorn checkpoint" in capsys.readouterr().err


def test_result_file_is_the_compact_result_a_pod_reports(tmp_path: Path) -> None:
    """`--result-file` (a pod's /dev/termination-log) holds the same losses as the result file."""
    config_path = write_config(tmp_path)
    cfg = run_config.load_run_config(config_path)
    save_trained(cfg, step=4)
    out = tmp_path / "termination-log"
    argv = ["--config", str(config_path), "--checkpoint", str(cfg.checkpoint_root), "--result-file", str(out)]
    assert evaluate.main(argv) == 0
    full = json.loads((cfg.run_dir / "evals" / "eval-00000004.json").read_text())
    compact = json.loads(out.read_text())
    assert compact["step"] == 4 and compact["sourcesOmitted"] == 0
    assert compact["loss"] == pytest.approx(full["loss"], abs=1e-6)
    assert compact["sources"] == pytest.approx(full["sources"], abs=1e-6)
    assert len(out.read_bytes()) <= evaluate.RESULT_FILE_LIMIT


def test_compact_result_drops_sources_that_do_not_fit_and_counts_them() -> None:
    result = {"step": 9, "loss": 2.5, "perplexity": 12.18, "checkpoint": "/c/step-9",
              "sources": {f"source-{i:03d}-{'x' * 40}": 2.0 + i / 100 for i in range(200)}}
    text = evaluate.build_compact_result(result, limit=1024)
    parsed = json.loads(text)
    assert len(text.encode()) <= 1024
    assert parsed["loss"] == 2.5 and 0 < len(parsed["sources"]) < 200
    assert parsed["sourcesOmitted"] == 200 - len(parsed["sources"])
    assert all(result["sources"][k] == pytest.approx(v) for k, v in parsed["sources"].items())
