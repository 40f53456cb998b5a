"""What the flight recorder costs a step: recorder on against off, at gpt_tiny.

    python -m benchmarks.flight                      # gpt_tiny (4 layers, d 128), dp=2 tp=2, 20 rounds
    python -m benchmarks.flight --rounds 40 --dp 1 --tp 2

Two numbers, since on shared CPU cores the step-time ratio is noisier than the effect:

* **per call**: the recorder's own cost, timed in one process over 200,000 calls
  (``flight.RECORDER.record`` + ``done``, what ``parallel.comm`` adds per collective), and the calls a
  step makes (counted): ``calls × cost / step time`` is its share of the step, a bound free of noise;
* **per step**: every rank trains the gpt_tiny recipe's step (``Trainer.train_step``), rounds of one
  step with the recorder on and one with it off (``RECORDER.enabled``), alternating which goes first
  (:func:`benchmarks.common.time_alternating`); the ratio on/off per round, median [IQR], of the slowest
  rank. The issue's goal: ≤ 1 % of step time.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time


def per_call_seconds(calls: int = 200_000) -> float:
    """The recorder's cost of one call (record + done), seconds."""
    from parallel.comm import flight

    rec = flight.FlightRecorder()
    rec.ranks["tp"] = (0, 1)
    rec.phase = "step 1"
    t0 = time.perf_counter()
    for _ in range(calls):
        rec.record("tp", None, "all_reduce", 4096, "float32", None)
        rec.done()
    return (time.perf_counter() - t0) / calls


def _rank(dp: int, tp: int, rounds: int, run_dir: str) -> dict:
    from parallel.comm import flight
    from recipes.config import RecipeConfig
    from recipes.training.trainer import Trainer

    from .common import time_alternating

    rc = RecipeConfig()  # the gpt_tiny recipe's model and batch (recipes/conf/gpt_tiny.yaml)
    rc.model.preset = "gpt_tiny"
    rc.parallel.dp, rc.parallel.tp = dp, tp
    rc.train.global_batch, rc.train.micro_batch, rc.train.max_steps = 16, 4, 10_000
    rc.train.eval_every, rc.train.threads = 0, 1
    rc.logger.progress = False
    rc.data.embedded_mb = 0.25
    trainer = Trainer(rc, run_dir)

    def step(enabled: bool):
        def run():
            flight.RECORDER.enabled = enabled
            trainer.train_step(trainer.step, read=False)
            trainer.step += 1

        return run

    before = flight.RECORDER.count
    trainer.train_step(0, read=False)
    calls = flight.RECORDER.count - before  # the recorded calls of one unread step
    times = time_alternating({"on": step(True), "off": step(False)}, steps=rounds)
    flight.RECORDER.enabled = True
    return {"calls": calls, **times}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.flight", description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args(argv)
    from parallel.testing import run_ranks

    from .common import compare, slowest_rank

    cost = per_call_seconds()
    with tempfile.TemporaryDirectory() as d:
        ranks = run_ranks(_rank, a.dp * a.tp, a.dp, a.tp, a.rounds, d, timeout=1800)
    on, off = slowest_rank([r["on"] for r in ranks]), slowest_rank([r["off"] for r in ranks])
    cmp = compare(on, off)
    calls = max(r["calls"] for r in ranks)
    row = {
        "layout": f"dp{a.dp} tp{a.tp}",
        "per_call_us": 1e6 * cost,
        "calls_per_step": calls,
        "share_of_step": calls * cost / (cmp["theirs_ms"] / 1e3),
        **cmp,
    }
    print(
        f"flight recorder at gpt_tiny {row['layout']}: {row['per_call_us']:.2f} µs per call × {calls} calls per step "
        f"= {100 * row['share_of_step']:.3f} % of the {cmp['theirs_ms']:.1f} ms step; step on/off "
        f"{cmp['ratio']:.3f} [{cmp['ratio_lo']:.3f}–{cmp['ratio_hi']:.3f}] over {cmp['rounds']} rounds"
    )
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
