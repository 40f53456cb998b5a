"""One GPU: our single-process step against plain PyTorch's, in bf16, side by side in one process.

    python -m benchmarks.gpu_vs_torch                  # GPT-2-style, 12 layers, d 1536, seq 2048 (~0.5 B)
    python -m benchmarks.gpu_vs_torch --layers 2 --d 64 --seq 32   # what the CPU dry run does

Ours is :class:`recipes.training.trainer.Trainer` at dp = pp = tp = 1, ZeRO-0, ``train.precision=bf16``
(bf16 compute weights, fp32 master weights and moments, fused AdamW). Theirs is the same model in
plain PyTorch (:class:`benchmarks.gpt.PlainGPT`, the same initial weights): fp32 parameters, the
forward under ``torch.autocast(bfloat16)``, the same fused AdamW; PyTorch's standard mixed
precision. Both take the same micro-batches (:func:`benchmarks.contenders._batches`), accumulate
over them and step; neither clips (the suite's rows do not). Rounds alternate which side goes first;
each round times ``--steps`` steps per side after ``--warmup``, synchronising the device.

Printed: per-round step times, the median ratio ours/theirs with its IQR, tokens/s, and each side's
first-step loss (the same weights and tokens: equal up to bf16 rounding, a check that both train the
same model). Without CUDA the same code runs on the CPU (bf16 autocast on the CPU), tiny.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def recipe(layers: int, d: int, heads: int, seq: int, micro_batch: int, global_batch: int):
    from recipes.config import RecipeConfig

    rc = RecipeConfig()
    rc.model.preset = "gpt_tiny"
    rc.model.n_layers, rc.model.d_model, rc.model.n_heads, rc.model.n_kv_heads = layers, d, heads, heads
    rc.model.d_ff, rc.model.seq_len, rc.model.tie_embeddings = 4 * d, seq, False
    rc.model.vocab_size = 50304
    rc.parallel.dp, rc.parallel.pp, rc.parallel.tp, rc.parallel.zero = 1, 1, 1, 0
    rc.train.precision = "bf16"
    rc.train.global_batch, rc.train.micro_batch, rc.train.max_steps = global_batch, micro_batch, 10_000
    rc.train.grad_clip, rc.train.eval_every = 0.0, 0
    rc.optim.weight_decay = 0.0  # one parameter group on both sides
    rc.logger.progress = False
    rc.data.embedded_mb = 0.25
    return rc


class Plain:
    """PyTorch's own single-device bf16 training step on :class:`PlainGPT` (autocast, fused AdamW)."""

    def __init__(self, trainer):
        from recipes.training.gpt_engine import FUSED_ADAMW_DEVICES

        from .gpt import plain_like_ours, suite_model

        rc, self.device, self.trainer = trainer.rc, trainer.device, trainer
        self.model = plain_like_ours(suite_model(rc), rc.train.seed).to(self.device)
        o = rc.optim
        fused = True if self.device.type in FUSED_ADAMW_DEVICES else None
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, fused=fused
        )

    def step(self, step: int) -> torch.Tensor:
        from .contenders import _batches
        from .gpt import plain_loss

        batches = _batches(self.trainer, step, 1, 0)
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for x, y in batches:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                loss = plain_loss(self.model(x), y) / len(batches)
            loss.backward()
            total += loss.detach()
        self.optimizer.step()
        return total


def _timed(fn, steps: int, start: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for i in range(steps):
        fn(start + i)
    sync()
    return (time.perf_counter() - t0) / steps


def main(argv=None) -> dict:
    from benchmarks.common import quantile
    from benchmarks.gpu_mfu import _single_process_env
    from recipes.training.trainer import Trainer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", help="write the result to this file")
    ap.add_argument("--compile", metavar="BACKEND", help="both sides under torch.compile: ours train.compile=true")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("No CUDA GPU here: the same comparison on the CPU, tiny (no figures worth reading).")
        a.layers, a.d, a.heads, a.seq, a.micro_batch, a.global_batch = 2, 64, 4, 32, 2, 4
        a.rounds, a.steps, a.warmup = 2, 1, 1
    _single_process_env()
    rc = recipe(a.layers, a.d, a.heads, a.seq, a.micro_batch, a.global_batch)
    if a.compile:  # ours: each block and the loss (parallel/compile.py); theirs: the whole model
        rc.train.compile, rc.train.compile_backend = True, a.compile
    trainer = Trainer(rc, run_dir=".")
    plain = Plain(trainer)
    if a.compile:
        plain.model = torch.compile(plain.model, backend=a.compile)
    first = {
        "ours": trainer.train_step(0)["loss"],
        "theirs": plain.step(0).item(),
    }
    sides = {
        "ours": lambda s: trainer.train_step(s, read=False),
        "theirs": plain.step,
    }
    for name, fn in sides.items():  # warm-up (the allocator, autotuning, the optimizer state)
        _timed(fn, a.warmup, 1, trainer.device)
    rounds, step = [], 1 + a.warmup
    for r in range(a.rounds):
        row = {}
        for name in ("ours", "theirs") if r % 2 == 0 else ("theirs", "ours"):
            row[name] = _timed(sides[name], a.steps, step, trainer.device)
        step += a.steps
        rounds.append(row)
    ratios = [row["ours"] / row["theirs"] for row in rounds]
    n_params = sum(p.numel() for p in plain.model.parameters())
    tokens = rc.train.global_batch * rc.model.seq_len
    out = {
        "device": torch.cuda.get_device_name() if trainer.device.type == "cuda" else "CPU",
        "params": n_params,
        "shape": dict(layers=a.layers, d=a.d, heads=a.heads, seq=a.seq, micro_batch=a.micro_batch),
        "global_batch": rc.train.global_batch,
        "ratio": statistics.median(ratios),
        "ratio_iqr": (quantile(ratios, 0.25), quantile(ratios, 0.75)),
        "ours_s": statistics.median(r["ours"] for r in rounds),
        "theirs_s": statistics.median(r["theirs"] for r in rounds),
        "first_loss": first,
        "compile": a.compile,
        "rounds": rounds,
    }
    print(
        f"{out['device']}: {n_params / 1e6:.0f} M-parameter GPT, bf16{f', compiled ({a.compile})' if a.compile else ''}, "
        f"{rc.train.global_batch} × {a.seq} tokens per "
        f"step in micro-batches of {a.micro_batch}: ours {out['ours_s'] * 1e3:.1f} ms/step "
        f"({tokens / out['ours_s']:,.0f} tokens/s), plain PyTorch (autocast) {out['theirs_s'] * 1e3:.1f} ms/step "
        f"({tokens / out['theirs_s']:,.0f} tokens/s); ours/theirs {out['ratio']:.3f} (IQR {out['ratio_iqr'][0]:.3f}"
        f"–{out['ratio_iqr'][1]:.3f}, {a.rounds} alternating rounds of {a.steps} steps); first-step loss ours "
        f"{first['ours']:.4f} vs theirs {first['theirs']:.4f}",
        flush=True,
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
