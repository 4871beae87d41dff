"""Evaluate one checkpoint: what a TrainingJob's on-demand eval vertex runs when a checkpoint lands.

    python -m huorn.runtime.evaluate --config RUN_CONFIG --checkpoint PATH [--batches N]

It is one process with no process group, so it never joins or slows the training gang: it reads
the checkpoint the trainer finished writing (a complete one, or it refuses), rebuilds the model
from the same run config, and measures the loss on the held-out documents of every data source
separately and of the job's mixture. The per-source numbers are what a mixture change or a
continual-pre-training run is judged by; the mixture's is comparable with the trainer's own
`validation_loss` (same batches for the same seed).

While it reads the checkpoint it pins it (checkpoint.pinned), so the trainer's pruning of old
checkpoints spares it; one pruned before the eval got to it is replaced by the newest, and the
result names both (`checkpoint`, and `requested`, the one it was handed).

The result goes to `<runDir>/evals/eval-<step>.json` (atomically) and, as one `eval` record, to
the step log, where `huorn run`'s report and the monitor read it. In a pod, `--result-file
/dev/termination-log` also writes a compact copy (at most `RESULT_FILE_LIMIT` bytes) where the
kubelet turns it into the container's termination message: that is how the operator, which
cannot read the pod's files, gets the result. Exit codes: 0 done, 2 a bad config or checkpoint
(named in the message).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch

from huorn import models
from huorn.runtime import checkpoint, distill, mixture_plan
from huorn.runtime import config as run_config
from huorn.runtime.data import sampler

EVALS_DIR = "evals"
EVAL_EVENT = "eval"
# The kubelet keeps at most 4096 bytes of a termination message; past that it truncates, which
# would leave the operator unparseable JSON.
RESULT_FILE_LIMIT = 4096
# Reads of an unpinned checkpoint (a read-only mount) that may each find it pruned under them.
LOAD_ATTEMPTS = 3


def evaluate(cfg: run_config.RunConfig, checkpoint_path: Path, batches: int,
             sequences: int | None = None) -> dict:
    """Losses of the checkpoint at `checkpoint_path` on `batches` validation batches per source."""
    if batches < 1:
        raise ValueError(f"batches must be >= 1, got {batches}")
    spec = cfg.spec
    torch.manual_seed(spec.data.seed)
    model = models.build_model(run_config.build_model_config(spec.model))
    path, meta = load_pinned(Path(checkpoint_path), model)
    model.eval()
    sequences = sequences or spec.optimization.micro_batch
    # With mixture auto: the D-CPT plan's weights once made, else every listed source evenly
    # (DDK's weights move during the run).
    auto = spec.data.mixture == "auto"
    weights = mixture_plan.planned_weights(cfg) or [1.0 if auto else s.weight for s in spec.data.sources]
    sources = [(s.name, w, s.path) for s, w in zip(spec.data.sources, weights, strict=True)]
    mixture = sampler.build_mixture(sources, spec.data.seed, spec.model.context, cfg.data_dir)
    started = time.perf_counter()
    result: dict = {"step": int(meta.get("step", -1)), "checkpoint": str(path), "batches": batches,
                    "sequences": sequences, "sources": {}}
    if path != Path(checkpoint_path) and checkpoint.is_step_name(Path(checkpoint_path).name):
        result["requested"] = str(checkpoint_path)  # pruned before it could be read: a newer one was
    with torch.no_grad():
        result["loss"] = distill.mean_loss(model, mixture, batches, sequences)
        losses = distill.source_losses(model, mixture, batches, sequences)
        result["sources"] = {s.name: loss for s, loss in zip(mixture.sources, losses, strict=True)}
    result["perplexity"] = math.exp(min(result["loss"], 50.0))
    result["seconds"] = time.perf_counter() - started
    return result


def load_pinned(requested: Path, model: torch.nn.Module, attempts: int = LOAD_ATTEMPTS) -> tuple[Path, dict]:
    """Load the checkpoint at `requested` into `model` while it is pinned against pruning; the
    path read and its metadata. The trainer keeps only its newest few checkpoints, and the one an
    eval was handed may be pruned before the eval gets to it: the newest one is read instead (and
    named on stderr). Where no pin can be written (a read-only mount), a checkpoint pruned while
    it is read is noticed by its absence afterwards, and the newest is read instead."""
    dcp, _ = checkpoint.dcp_modules()
    # DCP's CheckpointException (a file gone mid-read, among others) is a BaseException
    failures = (Exception, dcp.CheckpointException)
    for attempt in range(attempts):
        with checkpoint.pinned(requested) as held:
            if held.fell_back:
                print(f"evaluate: {requested} was pruned before it could be read; evaluating "
                      f"{held.path}, the newest", file=sys.stderr)
            try:
                with warnings.catch_warnings():  # one process with no group is the point; DCP warns
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                    return held.path, checkpoint.load_checkpoint(held.path, model, None)
            except failures:
                if held.pin is not None or checkpoint.is_complete(held.path) or attempt == attempts - 1:
                    raise  # not a checkpoint pruned under an unpinned reader: a real failure
                print(f"evaluate: {held.path} was pruned while it was read (no pin: the checkpoint "
                      f"directory is not writable here); reading the newest", file=sys.stderr)
                requested = held.path
    raise AssertionError("unreachable: the last attempt returns or raises")


def write_result(run_dir: Path, result: dict) -> Path:
    """The JSON file (atomic), and one whole line in the step log."""
    out = Path(run_dir) / EVALS_DIR / f"eval-{result['step']:08d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = out.with_name(f".{out.name}.tmp")
    scratch.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(scratch, out)
    fields = {k: v for k, v in result.items() if k != "checkpoint"}
    record = {"time": time.time(), "event": EVAL_EVENT, **fields}
    with open(Path(run_dir) / run_config.STEPS_FILE, "a") as handle:
        handle.write(json.dumps(record) + "\n")
    return out


def build_compact_result(result: dict, limit: int = RESULT_FILE_LIMIT) -> str:
    """The result as one JSON line of at most `limit` bytes: sources that do not fit are dropped
    (largest names last) and counted in `sourcesOmitted`, so a job with many sources still
    reports its mixture loss rather than a truncated document."""
    compact = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in result.items() if k != "sources"}
    sources = {name: round(float(loss), 6) for name, loss in result.get("sources", {}).items()}
    kept: dict[str, float] = {}
    for name in sorted(sources, key=lambda n: (len(n), n)):
        trial = json.dumps({**compact, "sources": {**kept, name: sources[name]},
                            "sourcesOmitted": len(sources)}, separators=(",", ":"))
        if len(trial.encode()) > limit:
            break
        kept[name] = sources[name]
    text = json.dumps({**compact, "sources": kept, "sourcesOmitted": len(sources) - len(kept)},
                      separators=(",", ":"))
    if len(text.encode()) > limit:
        raise ValueError(f"the eval result does not fit in {limit} bytes even without sources")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m huorn.runtime.evaluate",
                                     description="Evaluate one checkpoint of a TrainingJob.")
    parser.add_argument("--config", type=Path, required=True, help="the run config the trainer ran with")
    parser.add_argument("--checkpoint", type=Path, required=True,
                        help="a checkpoint directory, or a checkpoint root (its latest complete one)")
    parser.add_argument("--batches", type=int, default=None,
                        help="validation batches per source (default: the config's validationBatches)")
    parser.add_argument("--result-file", type=Path, default=None,
                        help="also write the result as compact JSON here (a pod's /dev/termination-log)")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    try:
        cfg = run_config.load_run_config(args.config)
        batches = args.batches if args.batches is not None else cfg.validation_batches
        result = evaluate(cfg, args.checkpoint, batches)
    except (ValueError, FileNotFoundError) as error:
        print(f"evaluate: {error}", file=sys.stderr)
        return 2
    out = write_result(cfg.run_dir, result)
    if args.result_file is not None:
        args.result_file.write_text(build_compact_result(result))
    per_source = ", ".join(f"{name} {loss:.4f}" for name, loss in result["sources"].items())
    print(f"step {result['step']}: loss {result['loss']:.4f} (perplexity {result['perplexity']:.2f}); "
          f"{per_source}; {result['seconds']:.1f} s → {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
