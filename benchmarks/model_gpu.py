"""H200 benchmark of huorn.models: training throughput and MFU of a ~350M-parameter decoder in bf16
(Huorn's Decoder beside a plain reference model written simply below, eager and torch.compile),
then prefill (time to first token), per-token decode latency and KV-cache memory at 8k/16k/32k
context for standard, FusedKV and FusedKV-Lite.

    PYTHONPATH=. python3 benchmarks/model_gpu.py --out results.json        # on one H200
    python benchmarks/model_gpu.py --tiny --device cpu --out /tmp/x.json    # smoke run on CPU

Each phase appends to the JSON as soon as it finishes, so a run cut short still reports what it
measured. MFU uses PaLM's FLOP count (6N + 12·L·W·T per token) against 989 TFLOP/s, the H200's
dense bf16 datasheet peak; `mfu_measured_peak` divides by the matmul rate measured in the same run."""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from huorn import models

DATASHEET_BF16_FLOPS = 989e12


class ReferenceBlock(nn.Module):
    """The same layer as Huorn's standard Block, in the plainest nanoGPT/Llama style."""

    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.RMSNorm(width, eps=1e-6), nn.RMSNorm(width, eps=1e-6)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.w2 = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        h = self.n1(x)

        def rope(z: torch.Tensor) -> torch.Tensor:
            z = z.view(b, t, self.heads, -1).transpose(1, 2)
            z1, z2 = z.chunk(2, dim=-1)
            return z * cos + torch.cat([-z2, z1], dim=-1) * sin

        q, k = rope(self.q(h)), rope(self.k(h))
        v = self.v(h).view(b, t, self.heads, -1).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, w))
        h = self.n2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class ReferenceModel(nn.Module):
    def __init__(self, cfg: models.ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocabulary, cfg.width)
        self.blocks = nn.ModuleList(
            ReferenceBlock(cfg.width, cfg.heads, cfg.ffn_hidden) for _ in range(cfg.layers)
        )
        self.norm = nn.RMSNorm(cfg.width, eps=1e-6)
        self.head = nn.Linear(cfg.width, cfg.vocabulary, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.cfg.head_dim
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, d, 2, device=tokens.device).float() / d))
        ang = torch.outer(torch.arange(tokens.shape[1], device=tokens.device).float(), inv)
        ang = torch.cat([ang, ang], dim=-1)
        x = self.embed(tokens)
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        return logits, F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure_matmul_flops(device: str) -> float:
    if device != "cuda":
        return float("nan")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    synchronize(device)
    return 10 * 2 * 8192**3 / (time.perf_counter() - start)


def time_training(
    model: nn.Module,
    step: Callable[[], None] | None,
    args: argparse.Namespace,
    flops_per_token: float,
    peak: float,
) -> dict:
    device = args.device
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(
        0, model.cfg.vocabulary, (args.batch, args.sequence + 1), device=device, generator=gen
    )
    x, y = tokens[:, :-1], tokens[:, 1:]
    forward = step if step is not None else model
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    losses = []

    def one_step() -> None:
        with torch.autocast(device_type=device, dtype=dtype, enabled=device == "cuda"):
            _, loss = forward(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    start = time.perf_counter()
    for _ in range(args.warmup):
        one_step()
    synchronize(device)
    warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.steps):
        one_step()
    synchronize(device)
    elapsed = time.perf_counter() - start
    tokens_per_s = args.steps * args.batch * args.sequence / elapsed
    return {
        "tokens_per_s": tokens_per_s,
        "step_ms": 1000 * elapsed / args.steps,
        "warmup_s": warmup_s,
        "mfu": tokens_per_s * flops_per_token / DATASHEET_BF16_FLOPS,
        "mfu_measured_peak": tokens_per_s * flops_per_token / peak if peak == peak else None,
        "last_loss": losses[-1].item(),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
    }


def run_training(
    args: argparse.Namespace, cfg: models.ModelConfig, results: dict, save: Callable[[], None]
) -> None:
    peak = measure_matmul_flops(args.device)
    results["measured_matmul_tflops"] = peak / 1e12
    torch.manual_seed(0)
    with torch.device(args.device):
        huorn_model = models.build_model(cfg)
    results["params"] = huorn_model.count_parameters()
    flops = huorn_model.flops_per_token(args.sequence)
    results["flops_per_token"] = flops
    builders = {"huorn": lambda: huorn_model, "reference": lambda: ReferenceModel(cfg)}
    variants = [("huorn", False), ("reference", False)]
    if not args.no_compile:
        variants += [("huorn", True), ("reference", True)]
    for name, compiled in variants:
        key = f"train_{name}_{'compiled' if compiled else 'eager'}"
        if time.perf_counter() - args.t0 > args.budget_s:
            results[key] = {"skipped": "time budget"}
            continue
        with torch.device(args.device):
            model = builders[name]()
        if name == "reference":
            results["reference_params"] = sum(p.numel() for p in model.parameters())
        try:
            step = torch.compile(model) if compiled else None
            results[key] = time_training(model, step, args, flops, peak)
        except Exception as error:  # report and go on: one failing variant must not hide the rest
            results[key] = {"error": f"{type(error).__name__}: {error}"[:500]}
        print(key, results[key], flush=True)
        save()
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()


def run_decoding(
    args: argparse.Namespace, cfg: models.ModelConfig, results: dict, save: Callable[[], None]
) -> None:
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    rows = []
    for mode in ["none", "fusedkv", "fusedkv-lite"]:
        torch.manual_seed(0)
        mode_cfg = models.ModelConfig(
            **{**cfg.__dict__, "kv_sharing": mode, "context": max(args.contexts) + 64}
        )
        with torch.device(args.device):
            model = models.build_model(mode_cfg).to(dtype).eval()
        for batch, context in [(b, c) for b in args.decode_batches for c in args.contexts]:
            prompt = torch.randint(0, cfg.vocabulary, (batch, context), device=args.device)
            with torch.no_grad():
                for attempt in range(2):  # the first pass warms kernels and the allocator
                    cache = model.build_cache(batch, context + args.new_tokens)
                    if args.device == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    synchronize(args.device)
                    start = time.perf_counter()
                    logits = model.forward_step(prompt, cache, last_only=True)
                    synchronize(args.device)
                    ttft = time.perf_counter() - start
                    token = logits.argmax(-1)
                    start = time.perf_counter()
                    for _ in range(args.new_tokens):
                        token = model.forward_step(token, cache, last_only=True).argmax(-1)
                    synchronize(args.device)
                    per_token = (time.perf_counter() - start) / args.new_tokens
                    del attempt
            rows.append(
                {
                    "mode": mode,
                    "context": context,
                    "batch": batch,
                    "ttft_ms": 1000 * ttft,
                    "decode_ms_per_token": 1000 * per_token,
                    "kv_cache_bytes": cache.nbytes(),
                    "fusion_weight_bytes": model.fusion_nbytes(),
                    "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30
                    if args.device == "cuda"
                    else None,
                }
            )
            print(rows[-1], flush=True)
            results["decode"] = rows
            save()
            del cache
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a small config for a CPU smoke run")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--sequence", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument(
        "--budget-s", type=float, default=330.0, help="skip training variants that would start after this"
    )
    parser.add_argument("--skip-training", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        args.batch, args.sequence, args.warmup, args.steps = 2, 64, 1, 2
        args.contexts, args.new_tokens = [64, 128], 4
    return args


def main() -> None:
    args = parse_args()
    args.t0 = time.perf_counter()
    if args.tiny:
        cfg = models.ModelConfig(layers=4, width=64, heads=4, vocabulary=512, context=256)
    else:  # ~368M parameters: 24 × (4·1024² + 3·1024·2736) + 2 × 32000·1024
        cfg = models.ModelConfig(layers=24, width=1024, heads=16, vocabulary=32000, context=args.sequence)
    torch.backends.cuda.matmul.allow_tf32 = True
    results: dict = {
        "config": {k: v for k, v in cfg.__dict__.items() if k != "extra"},
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "batch": args.batch,
        "sequence": args.sequence,
    }

    def save() -> None:
        args.out.write_text(json.dumps(results, indent=2, default=str))

    # Decoding first: it is short and bounded, while compiling the training variants is not.
    run_decoding(args, cfg, results, save)
    if not args.skip_training:
        run_training(args, cfg, results, save)
    results["wall_s"] = time.perf_counter() - args.t0
    save()
    print(json.dumps({k: v for k, v in results.items() if k != "decode"}, indent=1, default=str))
    assert math.isfinite(results["wall_s"])


if __name__ == "__main__":
    main()
