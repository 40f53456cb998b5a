"""Checkpoints you can always resume from: a damaged one is skipped by ``resume=auto``, refused by
name, counted out by pruning, and the sums are read once per resume.

The checkpoints are real (the small two-rank job of ``test_faults``, saving at steps 2, 4 and 6);
the damage is real too: a flipped byte in a shard a save wrote. The user-facing cases run as
``python -m recipes.gpt_tiny`` / ``python -m recipes.inspect_checkpoint`` and fill
``docs/errors.md``'s "Damaged checkpoints" section (``GRIDTRAIN_WRITE_ERRORS_DOC=1`` rewrites it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from parallel.checkpoint import DAMAGED, find_damage, latest_checkpoint, published
from parallel.testing import run_ranks

from .test_faults import cli_overrides, metrics, small_recipe
from .test_storage_faults import _row, left_behind, replace_section
from .test_train_e2e import _train

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "errors.md"
SECTION = "## Damaged checkpoints"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run directory with the checkpoints of steps 2, 4 and 6 (two ranks, synchronous saves)."""
    d = tmp_path_factory.mktemp("saved")
    rc = small_recipe(train__max_steps=6, train__ckpt_every=2, train__ckpt_keep=0, train__ckpt_async=False)
    run_ranks(_train, 2, rc, str(d), timeout=180)
    assert [p.name for p in published(d / "checkpoints")] == ["step_00000002", "step_00000004", "step_00000006"]
    return d


def _copy(saved: Path, dest: Path, *flip: int) -> Path:
    """A copy of the run with a byte flipped in the middle of rank 0's shard of each step in ``flip``."""
    shutil.copytree(saved, dest)
    for step in flip:
        shard = dest / "checkpoints" / f"step_{step:08d}" / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    return dest


def _cli(args: list[str]) -> dict:
    p = subprocess.Popen(
        [sys.executable, "-m", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    out, err = p.communicate(timeout=300)  # the hang guard
    assert "Traceback" not in out + err, err[-3000:]
    assert left_behind(p.pid) == [], "processes of the run survive it"
    return {"code": p.returncode, "out": out, "err": err}


@pytest.fixture(scope="module")
def cases(saved, tmp_path_factory):
    """The user's cases, each on its own copy of the run, in flight together (the inspection of the
    named run after that run's refusal, as a user would type them)."""
    base = tmp_path_factory.mktemp("damaged")
    newest, named, every = (
        _copy(saved, base / "newest", 6),
        _copy(saved, base / "named", 6),
        _copy(saved, base / "all", 2, 4, 6),
    )
    commands = {
        "auto": [["recipes.gpt_tiny", *cli_overrides(newest, max_steps=8, ckpt_every=2, resume="auto")]],
        "named": [
            ["recipes.gpt_tiny", *cli_overrides(base / "into", max_steps=8, resume=str(named))],
            ["recipes.inspect_checkpoint", str(named)],
        ],
        "all": [["recipes.gpt_tiny", *cli_overrides(every, max_steps=8, resume="auto")]],
    }
    with ThreadPoolExecutor(len(commands)) as pool:  # each thread runs its commands one after the other
        done = dict(zip(commands, pool.map(lambda cmds: [_cli(c) for c in cmds], commands.values())))
    runs = {"auto": {**done["auto"][0], "dir": newest}, "named": done["named"][0], "inspect": done["named"][1]}
    runs["all"] = {**done["all"][0], "dir": every}
    return {"base": base, "runs": runs}


def test_resume_auto_takes_the_newest_intact_checkpoint_and_names_the_damaged_one(cases):
    run = cases["runs"]["auto"]
    assert run["code"] == 0, run["err"][-3000:]
    warned = [line for line in run["err"].splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "skipping damaged checkpoint" in warned[0] and "step_00000006" in warned[0], warned
    assert "__0_0.distcp has CRC32" in warned[0] and "(corrupted)" in warned[0]
    assert "step_00000004 (step 4)" in run["out"]  # resuming from …
    root = run["dir"] / "checkpoints"
    assert latest_checkpoint(root).name == "step_00000008"
    assert all(find_damage(p) == [] for p in published(root))  # step 6 saved again, over the damaged one
    assert not (root / "step_00000006" / DAMAGED).exists()
    assert [m["step"] for m in metrics(run["dir"])][-4:] == [5, 6, 7, 8]


def test_a_damaged_checkpoint_named_explicitly_is_still_refused(cases):
    run = cases["runs"]["named"]
    last = run["err"].strip().splitlines()[-1]
    assert run["code"] == 2 and last.startswith("error: train.resume="), run["err"][-2000:]
    assert "step_00000006 is damaged" in last and "(corrupted)" in last and "train.resume=auto skips" in last


def test_resume_auto_with_every_checkpoint_damaged_is_refused(cases):
    run = cases["runs"]["all"]
    lines = run["err"].strip().splitlines()
    assert run["code"] == 2 and lines[-1].startswith("error: train.resume=auto: every checkpoint in"), lines
    assert "step_00000006, step_00000004, step_00000002" in lines[-1]
    assert sum("skipping damaged checkpoint" in line for line in lines) == 3
    assert all((p / DAMAGED).exists() for p in published(run["dir"] / "checkpoints"))  # marked: not read again


def test_inspect_checkpoint_on_a_damaged_checkpoint_is_one_error_line(cases):
    run = cases["runs"]["inspect"]
    assert run["code"] == 2 and run["out"] == ""
    lines = run["err"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: checkpoint ") and "is damaged" in lines[0]


# --- the workers' own choice (torchrun with several ranks: no launcher chose for them) -----------------
def test_workers_choose_the_same_intact_checkpoint_together(saved, tmp_path):
    run = _copy(saved, tmp_path / "run", 6)
    rc = small_recipe(train__max_steps=5, train__resume="auto")  # no save after the resume: the mark stays
    summaries = run_ranks(_train, 2, rc, str(run), timeout=180)
    assert [s["steps"] for s in summaries] == [5, 5]
    assert [m["step"] for m in metrics(run)][-1:] == [5]
    marker = run / "checkpoints" / "step_00000006" / DAMAGED
    assert "__0_0.distcp has CRC32" in marker.read_text()  # rank 1 read that shard and marked it; rank 0 names it


# --- the sums are read once per resume -----------------------------------------------------------------
def _count_reads(fn, *args):
    """``fn(*args)`` in this process; return the bytes the checkpoint verification read (CRC32s)."""
    from parallel.checkpoint import verify

    read, real = [0], verify._digest

    def counting(path):
        got = real(path)
        read[0] += got["bytes"]
        return got

    verify._digest = counting
    try:
        fn(*args)
    finally:
        verify._digest = real
    return read[0]


def _preflight_then_train(rc, run_dir, torchrun):
    """A worker: under torchrun its own preflight first (rank/world), then training; bytes verified in each."""
    import torch.distributed as dist

    from recipes.training.preflight import check_resume
    from recipes.validation import validate

    rank, world = dist.get_rank(), dist.get_world_size()
    before = (
        _count_reads(check_resume, rc, validate(rc, world_size=world).model, run_dir, rank, world) if torchrun else 0
    )
    return before, _count_reads(_train, rc, run_dir)


@pytest.mark.parametrize(
    "resume, torchrun",
    [("named", False), ("auto", False), ("named", True), ("auto", True)],
    ids=["launcher-named", "launcher-auto", "torchrun-named", "torchrun-auto"],
)
def test_the_sums_are_read_once_per_resume(saved, tmp_path, monkeypatch, resume, torchrun):
    """Before: the launcher's (or each torchrun rank's) preflight and load() each read every byte."""
    from recipes.training.preflight import check_resume
    from recipes.training.resume import VERIFIED_ENV
    from recipes.validation import validate

    monkeypatch.delenv(VERIFIED_ENV, raising=False)  # what preflight hands on goes with this test
    run = _copy(saved, tmp_path / "run")
    ckpt = run / "checkpoints" / "step_00000006"
    size = sum(f["bytes"] for f in json.loads((ckpt / "checkpoint.json").read_text())["files"].values())
    rc = small_recipe(train__max_steps=6, train__resume="auto" if resume == "auto" else str(ckpt))
    launcher = 0 if torchrun else _count_reads(check_resume, rc, validate(rc, world_size=None).model, str(run))
    got = run_ranks(_preflight_then_train, 2, rc, str(run), torchrun, timeout=180)
    total = launcher + sum(a + b for a, b in got)
    assert total == size, (launcher, got, size)


# --- pruning counts intact checkpoints only --------------------------------------------------------------
def _save_steps(root, steps, keep):
    from parallel.checkpoint import save_checkpoint

    from ..parallel.checkpoint.test_store import flat_half_state

    for step in steps:
        save_checkpoint(flat_half_state(step), root, step, keep=keep)


@pytest.mark.parametrize("keep, left", [(2, [4, 5]), (3, [1, 4, 5])])
def test_pruning_keeps_the_newest_intact_checkpoints_and_drops_damaged_ones(tmp_path, keep, left):
    from parallel.checkpoint import mark_damaged

    run_ranks(_save_steps, 2, tmp_path, [1, 2, 3, 4], 0, timeout=120)
    mark_damaged(tmp_path / "step_00000003", "a CRC32 mismatch found by a resume")
    (tmp_path / "step_00000002" / "__1_0.distcp").unlink()  # a file gone
    run_ranks(_save_steps, 2, tmp_path, [5], keep, timeout=120)
    assert [int(p.name[5:]) for p in published(tmp_path)] == left
    assert latest_checkpoint(tmp_path).name == "step_00000005"


def test_the_issue_case_ckpt_keep_3_with_a_damaged_newest_keeps_three_intact(saved, tmp_path):
    """Resumed from step 4 into a run whose step 6 is damaged, saving every 2 steps to 10 with
    ckpt_keep=3: before, step 6 (damaged) was kept as "already published" and two intact ones pruned."""
    run = _copy(saved, tmp_path / "run", 6)
    ckpt = run / "checkpoints" / "step_00000004"
    rc = small_recipe(train__max_steps=10, train__ckpt_every=2, train__ckpt_keep=3, train__resume=str(ckpt))
    run_ranks(_train, 2, rc, str(run), timeout=300)
    root = run / "checkpoints"
    assert [p.name for p in published(root)] == ["step_00000006", "step_00000008", "step_00000010"]
    assert all(find_damage(p) == [] for p in published(root))


# --- docs/errors.md: this section ---------------------------------------------------------------------
ROWS = [
    ("auto", "`train.resume=auto`, the newest checkpoint (step 6) with a flipped byte"),
    ("named", "`train.resume=<run>` naming that run: its latest is the damaged one"),
    ("all", "`train.resume=auto`, every checkpoint damaged"),
    ("inspect", "`python -m recipes.inspect_checkpoint <run>` on that run"),
]


def _said(run: dict) -> str:
    """Its warnings (the launcher's, before any worker), what the workers say, its error, in that order."""
    err, out = run["err"].splitlines(), run["out"].splitlines()
    lines = [x for x in err if x.startswith("warning:")] + [x for x in out if x.startswith(("resuming from", "done:"))]
    return " ⏎ ".join(lines + [x for x in err if x.startswith("error:")])


def test_docs_errors_md_shows_these_cases(cases):
    import re

    base = str(cases["base"])
    rows = ""
    for name, what in ROWS:
        text = _said(cases["runs"][name]).replace(base, "<tmp>")
        text = re.sub(r"0x[0-9a-f]{8}", "0x…", re.sub(r"final loss [\d.]+", "final loss …", text))
        rows += _row(what, cases["runs"][name]["code"], text)
    text = (
        f"{SECTION}\n\nDriven by `tests/recipes/test_resume_fallback.py` (`GRIDTRAIN_WRITE_ERRORS_DOC=1` rewrites "
        "this section) on real checkpoints of the small two-rank job (steps 2, 4, 6), damaged by flipping one "
        "byte of a shard; ⏎ separates the lines a case prints. A checkpoint `resume=auto` skips is marked "
        "(`DAMAGED` in its directory: pruning counts it out, the next resume does not read it again).\n\n"
        "| case | exit | what it says |\n| --- | --- | --- |\n" + rows
    )
    if os.environ.get("GRIDTRAIN_WRITE_ERRORS_DOC"):
        DOC.write_text(replace_section(DOC.read_text(), SECTION, text))
    assert replace_section(DOC.read_text(), SECTION, text) == DOC.read_text(), (
        "docs/errors.md's damaged-checkpoint section is stale: rerun with GRIDTRAIN_WRITE_ERRORS_DOC=1 (and -n 0) "
        "and commit it"
    )
