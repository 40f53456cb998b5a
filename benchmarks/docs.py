"""The README's and docs' figures that come from a run, written by the run.

    python -m benchmarks.docs            # rewrite every marked block (a few CPU-seconds of dry run)
    python -m benchmarks.docs --check    # exit 1 naming the blocks that differ from what it would write

A block is the text between ``<!-- run:NAME (python -m benchmarks.docs) -->`` and ``<!-- /run:NAME -->``
on the page :data:`BLOCKS` names; its body is what ``BLOCKS[NAME]`` renders. Only figures that a run
gives the same every time go in a block: the planner's tables, and the dry run's bytes (memory by kind,
bytes and calls per group: meta tensors and the fake process group make them exact). Wall and CPU
seconds differ from run to run and machine to machine: they stay outside the blocks, written as
measured figures with their date and command, and no test checks them.
``tests/recipes/test_dryrun.py`` (the dry-run blocks, from the ranks it runs anyway) and
``tests/benchmarks/test_docs.py`` (the rest) fail when a block is stale. Finding, replacing and
checking a block is :mod:`recipes.tools.docblocks`'s, as for the other generators of a page.
"""

from __future__ import annotations

import argparse
import sys
from functools import cache
from pathlib import Path

from recipes.tools import docblocks
from recipes.tools.docblocks import Marks

ROOT = Path(__file__).resolve().parents[1]
DRYRUN_RANKS = (0, 8704, 16896, 17919)  # GPT-3 175B: stages 0, 17 (README's excerpt), 33, 34
EXCERPT_RANK = 8704
PLAN_STAGES = (0, 1, 17, 27, 33, 34)


def gpt175b(overrides: tuple[str, ...] = ()):
    """The ``gpt175b`` recipe's config, as the command line composes it."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from recipes.main import register

    register()
    with initialize_config_module("recipes.conf", version_base="1.3"):
        return OmegaConf.to_object(compose("gpt175b", overrides=list(overrides)))


@cache
def _plan():
    from recipes.tools.plan import plan_from_config

    return plan_from_config(gpt175b())


def plan_table() -> str:
    """``python -m recipes.gpt175b mode=plan``'s table, the stages :data:`PLAN_STAGES`, and its footer."""
    from recipes.tools.plan import format_plain, plan_footer, plan_rows

    plan = _plan()
    header, rows = plan_rows(plan)
    rows = [r for r in rows if int(r[0]) in PLAN_STAGES]
    return "```\n" + format_plain(header, rows) + "\n" + "\n".join(plan_footer(plan)) + "\n```"


def dryrun_results() -> dict[int, dict]:
    """The dry run of :data:`DRYRUN_RANKS` (forked, two at a time)."""
    import tempfile

    from recipes.tools.dryrun_classes import run_forked

    rc = gpt175b()
    rc.data.source, rc.data.path = "embedded", None
    with tempfile.TemporaryDirectory(prefix="docs-dryrun-") as tmp:
        return run_forked(rc, list(DRYRUN_RANKS), 17920, tmp, jobs=2, timeout_s=300)


def dryrun_excerpt(results: dict[int, dict]) -> str:
    """The dry run's report of :data:`EXCERPT_RANK`, without its seconds."""
    from recipes.tools.dryrun import compare_with_plan, format_rank

    res = results[EXCERPT_RANK]
    return "```\n" + format_rank(res, compare_with_plan(res, _plan()), timings=False) + "\n```"


def dryrun_peaks(results: dict[int, dict]) -> str:
    """Each dry-run rank's peak beside the planner's, in MiB."""
    lines = [
        "| rank | stage | in flight | peak, dry run | planner | dry run / planner |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in DRYRUN_RANKS:
        res = results[r]
        stage = _plan().ranks[res["coords"]["pp"]]
        got, planned = res["memory"]["total"] / 2**20, stage.memory["total"] / 2**20
        lines.append(
            f"| {r} | {stage.stage} | {stage.in_flight} | {got:,.1f} MiB | {planned:,.1f} MiB | {got / planned:.3f} |"
        )
    return "\n".join(lines)


#: block name -> (page, renderer, whether it needs the dry run's results)
BLOCKS = {
    "plan-gpt175b": ("README.md", plan_table, False),
    "dryrun-gpt175b": ("README.md", dryrun_excerpt, True),
    "dryrun-peaks": ("docs/performance.md", dryrun_peaks, True),
}


def marks(name: str) -> Marks:
    """Block ``name``'s marker lines (the syntax of every block this module writes)."""
    return Marks(f"<!-- run:{name} (python -m benchmarks.docs) -->", f"<!-- /run:{name} -->")


def block(page: str, name: str) -> str:
    """The body of block ``name`` on ``page`` (ValueError when it is not marked there)."""
    return docblocks.read(page, marks(name))


def render(names, results: dict[int, dict] | None = None) -> dict[str, str]:
    """The bodies of blocks ``names``; the dry run runs once, when one needs it and ``results`` is None."""
    out = {}
    for name in names:
        _, fn, needs_run = BLOCKS[name]
        if needs_run and results is None:
            results = dryrun_results()
        out[name] = fn(results) if needs_run else fn()
    return out


def stale(bodies: dict[str, str], root: Path | None = None) -> list[str]:
    """The blocks whose page (under ``root``, default the repository) differs from ``bodies``."""
    root = root or ROOT
    return [
        n for n, body in bodies.items() if not docblocks.is_current((root / BLOCKS[n][0]).read_text(), marks(n), body)
    ]


def write(bodies: dict[str, str], root: Path | None = None) -> None:
    """Rewrite each block of ``bodies`` on its page (under ``root``, default the repository) with its body."""
    root = root or ROOT
    for name, body in bodies.items():
        docblocks.write(root / BLOCKS[name][0], marks(name), body)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a block is stale")
    ap.add_argument("names", nargs="*", default=list(BLOCKS), help=f"blocks (default: all of {list(BLOCKS)})")
    a = ap.parse_args(argv)
    bodies = render(a.names)
    if a.check:
        bad = stale(bodies)
        print("stale: " + ", ".join(bad) if bad else "every block is current")
        return 1 if bad else 0
    write(bodies)
    print("rewrote " + ", ".join(f"{n} ({BLOCKS[n][0]})" for n in bodies))
    return 0


if __name__ == "__main__":
    sys.exit(main())
