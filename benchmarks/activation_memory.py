"""Activation memory of one micro-batch, measured, beside the planner's figure.

    python -m benchmarks.activation_memory                       # the ~1.1B GPT of benchmarks.gpu_mfu, bf16
    python -m benchmarks.activation_memory --micro-batches 1,2,4 --checkpointing full

For each micro-batch size: the model (``models.build_model``, bf16 weights as the engine computes
with) runs one forward and backward of its loss on random tokens. Measured: the bytes allocated
after the forward beyond the weights (what autograd holds for backward plus the loss), the peak
during backward, and the tensors autograd saved, grouped by shape (``saved_tensors_hooks``, each
storage counted once). The planner's figure is ``recipes.tools.plan.plan_from_config``'s activations of
the same layout (dp = pp = tp = 1). On CUDA, SDPA is limited to the flash / memory-efficient / cuDNN
kernels, as in :mod:`benchmarks.gpu_mfu`; on the CPU the same code runs on a small model.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

GB = 1e9


def probe(rc, device: torch.device, top: int = 8) -> dict:
    """Measure one micro-batch of ``rc``'s model on ``device``; see the module docstring."""
    from benchmarks.gpu_mfu import _sdpa_without_math_kernel
    from models.transformer import build_model
    from recipes.config import model_config
    from recipes.tools.plan import plan_from_config

    mc = model_config(rc.model)
    dtype = torch.bfloat16 if rc.train.precision == "bf16" else torch.float32
    cuda = device.type == "cuda"
    model = build_model(mc, device=device, dtype=dtype)
    ids = torch.randint(mc.vocab_size, (rc.train.micro_batch, mc.seq_len), device=device)
    saved: dict[tuple, int] = collections.Counter()
    seen: set[int] = {p.untyped_storage().data_ptr() for p in model.parameters()}  # weights are not activations

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            saved[(tuple(t.shape), str(t.dtype).removeprefix("torch."))] += storage.nbytes()
        return t

    def allocated() -> int:
        return torch.cuda.memory_allocated() if cuda else 0

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = allocated()
    with _sdpa_without_math_kernel(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(model(ids), ids)
    held = allocated() - base
    loss.backward()
    peak = (torch.cuda.max_memory_allocated() - base) if cuda else 0
    del loss, model
    planned = plan_from_config(rc).ranks[0].memory
    return {
        "micro_batch": rc.train.micro_batch,
        "checkpointing": mc.activation_checkpointing,
        "held_after_forward_GB": held / GB,
        "peak_in_backward_GB": peak / GB,
        "saved_GB": sum(saved.values()) / GB,
        "planner_activations_GB": planned["activations"] / GB,
        "top_saved": [{"shape": list(shape), "dtype": dt, "GB": n / GB} for (shape, dt), n in saved.most_common(top)],
    }


def main(argv=None) -> list[dict]:
    from benchmarks.gpu_mfu import recipe

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", default="1,2,4")
    ap.add_argument("--checkpointing", default="none")
    ap.add_argument("--json", help="write the results to this file")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    rows = []
    for mb in (int(v) for v in a.micro_batches.split(",")):
        for ckpt in a.checkpointing.split(","):
            rc = recipe(1, 1, 1, dry_run=not cuda, micro_batch=mb, global_batch=mb, checkpointing=ckpt)
            r = probe(rc, device)
            rows.append(r)
            shapes = "; ".join(f"{t['shape']} {t['dtype']} {t['GB']:.2f}" for t in r["top_saved"][:5])
            print(
                f"micro-batch {mb}, checkpointing {ckpt}: held after forward {r['held_after_forward_GB']:.2f} GB, "
                f"peak in backward {r['peak_in_backward_GB']:.2f} GB, saved by autograd {r['saved_GB']:.2f} GB; "
                f"planner activations {r['planner_activations_GB']:.2f} GB; largest saved: {shapes}",
                flush=True,
            )
            if cuda:
                torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
