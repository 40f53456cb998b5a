"""``train.compile`` correctness at the layouts of issue 30: compiled vs eager, 10 steps, per step.

    python -m benchmarks.compile_parity [--backend aot_eager|inductor] [111 222 zero3 ring ep zbh1 full]

Each layout trains the tests' tiny GPT (``tests/recipes/test_train_e2e.tiny_recipe``: 4 layers,
d_model 64, seq 32, fp32; ``ring`` as llama_tiny, ``ep`` as mixtral_tiny, its MoE layers compiled as
regions with the dispatch eager between them) twice through the trainer, eager and with ``train.compile=true``, and
prints the largest per-step difference of the loss and of the gradient norm (metrics.jsonl), and
the compiled run's one ``torch.compile:`` line (graphs, seconds, graph breaks). The suite checks
cheaper versions of the same (tests/models/test_compile_blocks.py, tests/recipes/test_compile_e2e.py).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from parallel.testing import run_ranks
from tests.recipes.test_train_e2e import _train, losses, tiny_recipe

LAYOUTS = {
    "111": dict(),
    "222": dict(dp=2, pp=2, tp=2, zero=1, parallel__sequence_parallel=True),
    "zero3": dict(dp=2, zero=3),
    "ring": dict(parallel__cp=2, parallel__cp_impl="ring", model__preset="llama_tiny"),
    "ep": dict(dp=2, model__preset="mixtral_tiny", parallel__ep=2),  # MoE regions compiled, dispatch eager
    "zbh1": dict(pp=2, parallel__pp_schedule="zb-h1"),
    "full": dict(model__activation_checkpointing="full"),
}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--backend", default="aot_eager")
    a = ap.parse_args(argv)
    out = {}
    for name in a.layouts:
        kw = LAYOUTS[name]
        world = kw.get("dp", 1) * kw.get("pp", 1) * kw.get("tp", 1) * kw.get("parallel__cp", 1)
        runs = []
        for compiled in (False, True):
            d = tempfile.mkdtemp(prefix=f"compile-parity-{name}-")
            rc = tiny_recipe(**kw, train__compile=compiled, train__compile_backend=a.backend)
            run_ranks(_train, world, rc, d, timeout=1800)
            runs.append(losses(Path(d)))
        (le, ge), (lc, gc) = runs
        out[name] = (max(abs(x - y) for x, y in zip(le, lc)), max(abs(x - y) for x, y in zip(ge, gc)))
        print(f"{name}: {len(le)} steps, max |Δloss| {out[name][0]:.2e}, max |Δgrad_norm| {out[name][1]:.2e}")
    return out


if __name__ == "__main__":
    main()
