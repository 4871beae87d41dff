"""KV sharing on CPU, side by side in one run: standard, FusedKV, FusedKV-Lite and a GQA baseline
(kv_heads = heads/2, width raised to the standard model's parameter count) train on the same
byte tokens in the same order. Reports validation loss, KV-cache bytes and parameter counts,
and writes a PNG of the loss curves.

    .venv/bin/python benchmarks/kv_sharing_cpu.py                      # ~5-15 min on the 2-core VM
    .venv/bin/python benchmarks/kv_sharing_cpu.py --steps 40 --seeds 1  # smoke run

Data: the runtime's `code` corpus (Python stdlib sources, huorn.runtime.data) when it can be
built here, else the same kind of bytes read directly from the stdlib, so the benchmark never
depends on another part being finished. Validation uses held-out documents."""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import matplotlib
import numpy as np
import torch
from rich.progress import Progress

from huorn import models
from huorn.models import decay

matplotlib.use("Agg")
from matplotlib import pyplot  # after choosing the headless backend

MODES = ["none", "fusedkv", "fusedkv-lite", "gqa"]


def load_tokens() -> tuple[np.ndarray, np.ndarray, str]:
    """Train and validation byte tokens and a description of where they came from."""
    try:
        from huorn.runtime.data import build

        directory = build.ensure_corpus("code")
        train = np.fromfile(directory / "train.bin", dtype=np.uint8)
        val = np.fromfile(directory / "val.bin", dtype=np.uint8)
        return train, val, f"huorn.runtime.data 'code' corpus ({directory})"
    except (ImportError, OSError, ValueError, AttributeError) as error:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.glob("*.py"))
        val_files, train_files = files[::20], [f for i, f in enumerate(files) if i % 20]

        def read(paths: list[Path]) -> np.ndarray:
            return np.frombuffer(b"\n\n".join(p.read_bytes() for p in paths), dtype=np.uint8)

        return read(train_files), read(val_files), f"stdlib *.py bytes (runtime corpus unavailable: {error})"


def sample_batch(
    data: np.ndarray, rng: np.random.Generator, batch: int, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    starts = rng.integers(0, len(data) - context - 1, size=batch)
    window = torch.from_numpy(np.stack([data[s : s + context + 1] for s in starts]).astype(np.int64))
    return window[:, :-1], window[:, 1:]


def build_configs(args: argparse.Namespace) -> dict[str, models.ModelConfig]:
    base = models.ModelConfig(layers=args.layers, width=args.width, heads=args.heads, context=args.context)
    configs = {mode: models.ModelConfig(**{**base.__dict__, "kv_sharing": mode}) for mode in MODES[:3]}
    target = models.build_model(configs["none"]).count_parameters()
    step = 2 * args.heads  # width must stay a multiple of heads with an even head size
    widths = range(args.width - 4 * step, args.width + 8 * step, step)

    def gqa(width: int) -> models.ModelConfig:
        return models.ModelConfig(**{**base.__dict__, "width": width, "kv_heads": args.heads // 2})

    best = min(widths, key=lambda w: abs(models.build_model(gqa(w)).count_parameters() - target))
    # Widths move in steps of 2·heads, too coarse at this scale; the SwiGLU hidden size (in
    # steps of 8) then closes the remaining gap to the standard model's parameter count.
    hiddens = range(8, 8 * gqa(best).ffn_hidden, 8)

    def with_hidden(hidden: int) -> models.ModelConfig:
        return models.ModelConfig(**{**gqa(best).__dict__, "ffn_multiplier": (hidden - 0.5) / best})

    hidden = min(hiddens, key=lambda h: abs(models.build_model(with_hidden(h)).count_parameters() - target))
    configs["gqa"] = with_hidden(hidden)
    return configs


def evaluate(model: models.Decoder, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    with torch.no_grad():
        loss = sum(model(x, y)[1].item() for x, y in batches) / len(batches)
    model.train()
    return loss


def learning_rate(step: int, args: argparse.Namespace) -> float:
    warmup = max(1, args.steps // 20)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def run_seed(
    seed: int,
    args: argparse.Namespace,
    configs: dict[str, models.ModelConfig],
    train: np.ndarray,
    val_batches: list,
    progress: Progress,
) -> dict:
    trained = {}
    for mode, cfg in configs.items():
        torch.manual_seed(seed)
        model = models.build_model(cfg)
        # the trainers' AdamW (no decay on norm gains and FusedKV's fusion weights), with this
        # benchmark's own betas, those of its first runs
        trained[mode] = (model, decay.adamw(model, args.lr, 0.1, betas=(0.9, 0.999)))
    curves: dict[str, dict[str, list]] = {m: {"step": [], "val": [], "train": []} for m in configs}
    rng = np.random.default_rng(seed)
    task = progress.add_task(f"seed {seed}", total=args.steps)
    for step in range(args.steps):
        x, y = sample_batch(train, rng, args.batch, args.context)  # the same tokens for every model
        for mode, (model, optimizer) in trained.items():
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, args)
            _, loss = model(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            curves[mode]["train"].append(loss.item())
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                curves[mode]["step"].append(step + 1)
                curves[mode]["val"].append(evaluate(model, val_batches))
        progress.advance(task)
    return {mode: {"final_val": curves[mode]["val"][-1], **curves[mode]} for mode in configs}


def cache_bytes(cfg: models.ModelConfig, context: int) -> tuple[int, int]:
    model = models.build_model(cfg)
    return model.build_cache(batch=1, max_length=context).nbytes(), model.fusion_nbytes()


def plot(results: dict, path: Path, title: str) -> None:
    figure, axis = pyplot.subplots(figsize=(7, 4.2))
    for mode, runs in results.items():
        steps = runs[0]["step"]
        mean = np.mean([r["val"] for r in runs], axis=0)
        axis.plot(steps, mean, marker="o", markersize=3, label=f"{mode} (final {mean[-1]:.3f})")
    axis.set_xlabel("step")
    axis.set_ylabel("validation loss (nats/byte)")
    axis.set_title(title, fontsize=9)
    axis.grid(alpha=0.3)
    axis.legend()
    lower = min(np.mean([r["val"] for r in runs], axis=0)[-1] for runs in results.values())
    axis.set_ylim(lower - 0.1, lower + 1.2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=8)
    # NOTE: one thread. On a loaded 2-core VM, two OpenMP threads spin-wait on each other and a
    # step costs 5-20x more CPU time than with one.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_sharing_cpu.json"))
    parser.add_argument("--png", type=Path, default=Path("docs/figures/kv_sharing_cpu.png"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    train, val, source = load_tokens()
    configs = build_configs(args)
    val_rng = np.random.default_rng(12345)
    val_batches = [sample_batch(val, val_rng, args.batch, args.context) for _ in range(args.eval_batches)]
    results: dict[str, list] = {mode: [] for mode in configs}
    with Progress() as progress:
        for seed in range(args.seeds):
            for mode, run in run_seed(seed, args, configs, train, val_batches, progress).items():
                results[mode].append(run)
    summary = {}
    standard_cache, _ = cache_bytes(configs["none"], args.context)
    for mode, cfg in configs.items():
        finals = [r["final_val"] for r in results[mode]]
        kv, fusion = cache_bytes(cfg, args.context)
        summary[mode] = {
            "width": cfg.width,
            "ffn_hidden": cfg.ffn_hidden,
            "kv_heads": cfg.n_kv_heads,
            "params": models.build_model(cfg).count_parameters(),
            "val_loss_mean": float(np.mean(finals)),
            "val_loss_min": min(finals),
            "val_loss_max": max(finals),
            "kv_cache_bytes": kv,
            "kv_cache_ratio": kv / standard_cache,
            "fusion_weight_bytes": fusion,
        }
    wall = time.perf_counter() - started
    report = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "data": source,
        "wall_s": wall,
        "summary": summary,
        "curves": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    args.png.parent.mkdir(parents=True, exist_ok=True)
    plot(
        results,
        args.png,
        f"{args.layers}L×{args.width} byte LM, {args.steps} steps × {args.batch}×"
        f"{args.context} tokens, {args.seeds} seed(s)",
    )
    print(f"data: {source}\nwall: {wall:.0f} s, {args.seeds} seed(s) × {args.steps} steps")
    print(
        f"{'mode':14}{'width':>6}{'ffn':>5}{'params':>10}{'val loss':>10}{'(min..max)':>16}{'KV bytes':>11}"
        f"{'ratio':>7}{'fusion B':>9}"
    )
    for mode, row in summary.items():
        print(
            f"{mode:14}{row['width']:>6}{row['ffn_hidden']:>5}{row['params']:>10}{row['val_loss_mean']:>10.4f}"
            f"{row['val_loss_min']:>8.4f}..{row['val_loss_max']:.4f}{row['kv_cache_bytes']:>11}"
            f"{row['kv_cache_ratio']:>7.2f}{row['fusion_weight_bytes']:>9}"
        )
    delta = summary["fusedkv"]["val_loss_mean"] - summary["none"]["val_loss_mean"]
    verdict = "<=" if delta <= 0 else ">"
    print(f"FusedKV val loss {verdict} standard (difference {delta:+.4f} nats/byte)")


if __name__ == "__main__":
    main()
