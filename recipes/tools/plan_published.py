"""Published runs against the planner: Narayanan et al. 2021 (SC21, arXiv 2104.04473), Table 1.

GPT models from 1.7B to 1T parameters on A100 80 GB (Selene), sequence 2048, vocabulary 51,200,
mixed precision, tensor × pipeline × data parallelism as published; every row planned with the
stock ``a100_80gb`` profile and the same settings (no per-row tuning). The paper's TFLOP/s per GPU
count ``F = 96·B·s·l·h²(1 + s/6h + V/16lh)`` FLOPs per step (its Eq. 3: full activation
recomputation included), so ours divide the same ``F`` by our predicted step time.

``python -m recipes.tools.plan_published`` regenerates the table in ``docs/planner.md``; a test checks it
is current and every row is within ±10 %.
"""

from __future__ import annotations

import dataclasses
import sys
from functools import cache
from pathlib import Path

from parallel.plan import plan_layout

from ..config import model_config
from . import docblocks
from .docblocks import Marks
from .plan import _hardware, _layout, _training, meta_param_counter
from .plan_scenarios import scenario_config

#: (parameters in billions, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU), Table 1
NARAYANAN_TABLE_1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)
SEQ, VOCAB = 2048, 51200
#: the settings every row shares (the paper: fp16 mixed precision, full recomputation, micro-batch 1)
COMMON = [
    "model.preset=gpt3_175b",
    f"model.seq_len={SEQ}",
    f"model.vocab_size={VOCAB}",
    "model.activation_checkpointing=full",
    "train.precision=fp16",
    "train.micro_batch=1",
    "plan.hardware=a100_80gb",
]
MARKS = Marks("<!-- BEGIN published (generated) -->", "<!-- END published (generated) -->")
DOC = Path(__file__).resolve().parents[2] / "docs" / "planner.md"


def paper_flops(batch: int, layers: int, hidden: int) -> float:
    """Eq. 3 of the paper: FLOPs per step with full recomputation."""
    return 96 * batch * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


@cache
def rows() -> tuple[dict, ...]:
    """Every row: published and predicted TFLOP/s per GPU and the plan behind it."""
    out = []
    for size, heads, hidden, layers, tp, pp, gpus, batch, published in NARAYANAN_TABLE_1:
        rc = scenario_config(
            COMMON
            + [
                f"model.n_layers={layers}",
                f"model.d_model={hidden}",
                f"model.n_heads={heads}",
                f"model.n_kv_heads={heads}",
                f"model.d_ff={4 * hidden}",
                f"parallel.tp={tp}",
                f"parallel.pp={pp}",
                f"parallel.dp={gpus // (tp * pp)}",
                f"parallel.sequence_parallel={'false'}",
                f"train.global_batch={batch}",
            ]
        )
        mc = model_config(rc.model)
        training = dataclasses.replace(_training(rc, mc), attention="unfused")  # Megatron-LM 2021
        plan = plan_layout(mc, _layout(rc, mc), training, _hardware(rc), meta_param_counter(mc))
        ours = paper_flops(batch, layers, hidden) / plan.step["step_time_s"] / gpus / 1e12
        out.append(dict(size=size, tp=tp, pp=pp, gpus=gpus, batch=batch, published=published, ours=ours, plan=plan))
    return tuple(out)


def render() -> str:
    lines = [
        "| parameters | tp | pp | GPUs | batch | published TFLOP/s | ours | difference | fits | bubble |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---:|",
    ]
    for r in rows():
        p = r["plan"]
        lines.append(
            f"| {r['size']:g}B | {r['tp']} | {r['pp']} | {r['gpus']:,} | {r['batch']:,} | {r['published']} | "
            f"{r['ours']:.0f} | {r['ours'] / r['published'] - 1:+.1%} | {'yes' if p.fits else 'no'} | "
            f"{p.step['bubble_fraction']:.1%} |"
        )
    return "\n".join(lines)


def main() -> None:
    """Rewrite the table's block in ``docs/planner.md`` (ValueError when the page has none) and print it."""
    body = render()
    docblocks.write(DOC, MARKS, body)
    print(body, file=sys.stdout)


if __name__ == "__main__":
    main()
