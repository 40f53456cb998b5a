"""``python -m recipes.diagnose`` on synthetic dumps at scale: its CPU, wall time and peak memory.

    python -m benchmarks.diagnose_scale                                  # 17,920 ranks, full rings, ours
    python -m benchmarks.diagnose_scale --format torch --entries 2000    # torch's NCCL dumps (no frames)
    python -m benchmarks.diagnose_scale --ranks 2240 --entries 512 --dir /tmp/dumps --keep

The dumps are :mod:`recipes.tools.diagnose_synthetic`'s (the tests' generators): ``ours``, the GPT-3
layout (tp 8, pp 35 where the ranks divide by 280, dp the rest), or ``torch``, torch's NCCL pickles
(tp 8, dp the rest), ``--entries`` calls per rank (the ring full: ours holds
:data:`parallel.comm.flight.CAPACITY`, torch's ``TORCH_FR_BUFFER_SIZE`` in
:data:`recipes.training.flight.TORCH_NCCL_ENV`), with a dead rank, a rank that skipped a collective
and one that sent another size half-way through the ring. ``diagnose`` runs in a child process;
``--workers`` is diagnose's own (default: one per CPU); reported: its CPU seconds (user + sys, its workers included), wall seconds, its peak RSS and its
largest worker's (``getrusage``), the dumps' size, and whether the report named the
three planted faults. ``--dir`` keeps (``--keep``) or reuses dumps already written there.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from parallel.comm.flight import CAPACITY
from recipes.tools import diagnose_synthetic as synthetic
from recipes.training.flight import TORCH_NCCL_ENV


def faults(ranks: int) -> dict[str, int]:
    """The planted faults' ranks: dead, skipper (a tp group's first rank), other size."""
    return {"dead": ranks * 17 // 18, "skipper": ranks // 2 // 8 * 8, "other_size": ranks // 3 + 1}


def write(folder: Path, fmt: str, ranks: int, entries: int, frames: int) -> None:
    """The synthetic dumps of ``ranks`` ranks with ``entries`` calls in each ring."""
    f = faults(ranks)
    if fmt == "ours":
        pp = 35 if ranks % 280 == 0 else 1
        steps = entries // 7 + 2  # 7 calls per step: the ring full, the oldest calls overwritten
        synthetic.ours(folder, dp=ranks // (pp * 8), pp=pp, tp=8, steps=steps, ring=entries, odd_step=steps // 2, **f)
    else:
        steps = entries // 3 + 2  # 3 calls per step
        synthetic.nccl(
            folder, world=ranks, tp=8, steps=steps, dead=(f["dead"],), odd_size=f["other_size"],
            skipper=f["skipper"], frames=frames, ring=entries, odd_step=steps // 2,
        )  # fmt: skip


# the child: diagnose's own command, then its peak RSS and its workers' largest (KiB) on stderr
_CHILD = """import resource, sys
from recipes.tools.diagnose import main
code = main(sys.argv[1:])
print("rusage", *(resource.getrusage(w).ru_maxrss for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)), file=sys.stderr)
sys.exit(code)
"""


def run(folder: Path, workers: int | None) -> tuple[list[str], float, float, float, float]:
    """``diagnose`` on ``folder`` in a child: its report, CPU s (its workers' included), wall s, its
    peak RSS and its largest worker's (MiB)."""
    more = [] if workers is None else ["--workers", str(workers)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CHILD, str(folder), *more], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode:
        raise RuntimeError(f"diagnose failed ({out.returncode}): {out.stderr[-2000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    own, kids = (int(x) / 1024 for x in out.stderr.split("rusage")[-1].split())
    return out.stdout.splitlines(), cpu, wall, own, kids


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=17_920)
    ap.add_argument("--entries", type=int, default=None, help=f"calls per ring (default: full, {CAPACITY} ours)")
    ap.add_argument("--format", choices=("ours", "torch"), default="ours")
    ap.add_argument("--frames", type=int, default=0, help="stack frames per torch entry")
    ap.add_argument("--workers", type=int, default=None, help="diagnose's --workers (default: its own, one per CPU)")
    ap.add_argument("--dir", default=None, help="where the dumps go (default: a temporary folder, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the dumps in --dir (reused by the next run)")
    a = ap.parse_args(argv)
    entries = a.entries or (CAPACITY if a.format == "ours" else int(TORCH_NCCL_ENV["TORCH_FR_BUFFER_SIZE"]))
    root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="diagnose_scale_"))
    folder = root / "flight"
    try:
        t0 = time.perf_counter()
        if not folder.is_dir():
            root.mkdir(parents=True, exist_ok=True)
            write(folder, a.format, a.ranks, entries, a.frames)
        made = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in folder.iterdir())
        lines, cpu, wall, rss, worker_rss = run(root, a.workers)
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    f = faults(a.ranks)
    named = {
        "dead": any(f"no dump from ranks [{f['dead']}]" in x for x in lines),
        "skipper": any(f"ranks [{f['skipper']}] never issued" in x for x in lines),
        "other_size": any(f"ranks [{f['other_size']}] differ at" in x for x in lines),
    }
    row = {"format": a.format, "ranks": a.ranks, "entries": entries, "frames": a.frames, "workers": a.workers,
           "dumps_mb": size / 2**20, "written_s": made, "cpu_s": cpu, "wall_s": wall, "peak_rss_mb": rss,
           "worker_peak_rss_mb": worker_rss, "named": named}  # fmt: skip
    print("\n".join(lines))
    print(
        f"{a.format}: {a.ranks:,} ranks x {entries:,} entries ({size / 2**30:.2f} GiB of dumps, written in {made:.0f} s), "
        f"workers {a.workers or 'one per CPU'}: "
        f"diagnose {cpu:.1f} s CPU, {wall:.1f} s wall, peak RSS {rss:.0f} MiB (a worker's {worker_rss:.0f}); "
        f"faults named: {named}"
    )
    return row


if __name__ == "__main__":
    main()
