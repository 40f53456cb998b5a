"""Storage faults as a user meets them: a real full disk (a small tmpfs), a real read-only run directory.

Each case is a true ``python -m recipes.gpt_tiny`` job (the small two-rank model of
``test_faults``): the disk full at the second save, stopping the run (background saves) or
training on (``train.ckpt_on_error=continue``, synchronous saves); a file system without room
for one checkpoint; a read-only run directory. Promises: the exit code, one line that names the
path and the bytes, no traceback, no partial save left, the previous checkpoint still the
latest and intact, no process left behind. ``docs/errors.md``'s "Storage faults" section is
generated from them (``GRIDTRAIN_WRITE_ERRORS_DOC=1`` rewrites it).

The library cases check the agreement itself: one rank alone failing, and a real ``EROFS``
during a background save.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallel.checkpoint import CheckpointStorageError, find_damage, latest_checkpoint
from parallel.testing import run_ranks

from .storage_faults_cases import mount_tmpfs, readonly_run_dir, remount_readonly, unmount
from .test_errors_catalogue import _session_members
from .test_faults import cli_overrides, small_recipe

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "errors.md"
SECTION = "## Storage faults"


def _needed() -> int:
    """One checkpoint of the small job, as preflight computes it."""
    from recipes.training.storage import checkpoint_size
    from recipes.validation import validate

    return checkpoint_size(validate(small_recipe(), world_size=2).model, "adamw", 2)


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _alive(pids: list[int]) -> list[int]:
    """Those not dead: a zombie (state Z, a finished worker init has yet to reap) holds nothing."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


def left_behind(sid: int, grace_s: float = 5.0) -> list[int]:
    """The live processes of session ``sid`` once ``grace_s`` has let a worker that is exiting finish."""
    deadline = time.monotonic() + grace_s
    while (alive := _alive(_session_members(sid))) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def _finish(p: subprocess.Popen, timeout: int = 300) -> dict:
    out, err = p.communicate(timeout=timeout)  # the hang guard
    return {"code": p.returncode, "out": out, "err": err, "left": left_behind(p.pid)}


def _job(run_dir: Path, *extra: str, **train) -> list[str]:
    return [sys.executable, "-m", "recipes.gpt_tiny", *cli_overrides(run_dir, **train), *extra]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Every CLI case, run once, the four in flight together (each on its own file system or directory)."""
    base = tmp_path_factory.mktemp("storage")
    needed, mounts, runs, skipped = _needed(), [], {}, {}
    roomy = int(1.5 * needed) + (256 << 10)  # one checkpoint and the run's small files fit, two do not
    plan = {"full_stop": roomy, "full_continue": roomy, "too_small": needed // 2}
    for name, size in plan.items():
        if (why := mount_tmpfs(base / name, size)) is not None:
            skipped[name] = why
        else:
            mounts.append(base / name)
    ro, mechanism, why = readonly_run_dir(base)
    if mechanism == "mount":
        mounts.append(base / "ro")
    if ro is None:
        skipped["read_only"] = why
    try:
        started = {}
        if "too_small" not in skipped:
            started["too_small"] = _start(_job(base / "too_small" / "run", max_steps=4, ckpt_every=2))
        if ro is not None:
            started["read_only"] = _start(_job(ro, max_steps=4, ckpt_every=2))
        if "full_stop" not in skipped:  # background saves (the default), dp=2
            started["full_stop"] = _start(_job(base / "full_stop" / "run", max_steps=6, ckpt_every=2, ckpt_keep=0))
        if "full_continue" not in skipped:
            started["full_continue"] = _start(
                _job(
                    base / "full_continue" / "run",
                    max_steps=6,
                    ckpt_every=2,
                    ckpt_async="false",
                    ckpt_on_error="continue",
                )
            )
        runs.update({k: _finish(p) for k, p in started.items()})
        for name in ("full_stop", "full_continue"):
            if name in runs:
                runs[name]["checkpoints"] = _listing(base / name / "run" / "checkpoints")
        yield {"base": base, "needed": needed, "runs": runs, "skipped": skipped, "ro": ro, "mechanism": mechanism}
    finally:
        for m in mounts:
            unmount(m)


def _listing(root: Path) -> dict:
    """What a run left in its checkpoint root, read before the tmpfs goes."""
    latest = latest_checkpoint(root)
    return {
        "names": sorted(p.name for p in root.iterdir()),
        "latest": latest.name if latest else None,
        "damage": find_damage(latest) if latest else None,
        "bytes": {p.name: sum(f.stat().st_size for f in p.iterdir()) for p in root.glob("step_*")},
    }


def _run(cases, name) -> dict:
    if name in cases["skipped"]:
        pytest.skip(cases["skipped"][name])
    return cases["runs"][name]


def _clean(run: dict) -> list[str]:
    """Common promises: no traceback, no process left; return every output line."""
    text = run["out"] + run["err"]
    assert "Traceback" not in text, text[-3000:]
    assert run["left"] == [], f"processes of the run survive it: {run['left']}"
    return text.splitlines()


def test_full_disk_during_a_background_save_stops_with_one_line_and_keeps_the_previous(cases):
    run = _run(cases, "full_stop")
    lines = _clean(run)
    assert run["code"] == 1, run["err"][-3000:]
    said = [line for line in lines if "No space left on device" in line]
    assert len(said) == 1, lines
    assert re.search(
        r"checkpoint step_00000004 not saved: No space left on device \(ENOSPC\) writing \S+/checkpoints", said[0]
    )
    assert "a checkpoint needs" in said[0] and "free there" in said[0] and "still step_00000002" in said[0]
    last = run["err"].strip().splitlines()[-1]
    assert last.startswith("error: stopped after step") and "train.resume=auto" in last, last
    left = run["checkpoints"]
    assert left["names"] == ["latest", "step_00000002"] and left["latest"] == "step_00000002" and left["damage"] == []
    assert len(lines) < 40  # the run printed 351 lines and 14 tracebacks


def test_full_disk_with_ckpt_on_error_continue_trains_on_without_saving(cases):
    run = _run(cases, "full_continue")
    lines = _clean(run)
    assert run["code"] == 0, run["err"][-3000:]
    warned = [line for line in lines if line.startswith("warning: checkpoint")]
    assert [w.split()[2] for w in warned] == ["step_00000004", "step_00000006"], lines  # each later save tried
    assert all("No space left on device" in w and "training goes on" in w for w in warned)
    assert "done: 6 steps" in run["out"]
    left = run["checkpoints"]
    assert left["names"] == ["latest", "step_00000002"] and left["damage"] == []


def test_the_computed_checkpoint_size_is_what_a_save_writes(cases):
    run = _run(cases, "full_continue")
    written = run["checkpoints"]["bytes"]["step_00000002"]  # two ranks, ZeRO-1: a few more chunks than tensors
    assert 0.9 * written <= cases["needed"] <= written, (cases["needed"], written)


def test_a_file_system_without_room_for_one_checkpoint_is_refused_before_training(cases):
    run = _run(cases, "too_small")
    _clean(run)
    last = run["err"].strip().splitlines()[-1]
    assert run["code"] == 2 and last.startswith("error: hydra.run.dir="), run["err"][-2000:]
    assert "one checkpoint of this model needs" in last and "free" in last
    assert not (cases["base"] / "too_small" / "run" / "checkpoints").exists()


def test_a_read_only_run_directory_is_one_line(cases):
    run = _run(cases, "read_only")
    _clean(run)
    last = run["err"].strip().splitlines()[-1]
    assert run["code"] == 2 and last.startswith(f"error: hydra.run.dir={cases['ro']}: cannot write into"), run["err"]
    assert ("Read-only file system (EROFS)" if cases["mechanism"] == "mount" else "Permission denied") in last
    assert len(run["err"].strip().splitlines()) == 1


# --- docs/errors.md: this section ---------------------------------------------------------------------
ROWS = [
    ("read_only", "a read-only run directory (`hydra.run.dir` on a read-only mount)"),
    ("too_small", "a file system without room for one checkpoint (`train.ckpt_every=2`)"),
    ("full_stop", "the disk fills at the second save (background saves, dp=2)"),
    ("full_continue", "the same with `train.ckpt_on_error=continue` (synchronous saves)"),
]


def _said(run: dict) -> str:
    """The run's lines about the fault: its `error:` / `warning:` lines, in order."""
    lines = [line for line in (run["out"] + run["err"]).splitlines() if line.startswith(("error:", "warning:"))]
    if run["code"] == 0:
        lines.append(next(line for line in run["out"].splitlines() if line.startswith("done:")))
    return " ⏎ ".join(lines)


def _sanitize(text: str, base: Path) -> str:
    text = text.replace(str(base), "<tmpfs>")
    text = re.sub(r"on rank \d+", "on rank N", text)  # whichever rank's write failed first
    text = re.sub(r"after step \d+", "after step N", text)  # one step after the failure was seen, or at the next save
    text = re.sub(r"[\d.]+ (\w?B) free", r"N \1 free", text)  # a file system's own accounting (pages, inodes)
    return re.sub(r"final loss [\d.]+", "final loss …", text)  # the CPU's rounding


def _row(*cells) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |\n"


def section(cases) -> str:
    runs, base = cases["runs"], cases["base"]
    rows = "".join(_row(what, runs[name]["code"], _sanitize(_said(runs[name]), base)) for name, what in ROWS)
    return (
        f"{SECTION}\n\nDriven for real by `tests/recipes/test_storage_faults.py` (`GRIDTRAIN_WRITE_ERRORS_DOC=1` "
        "rewrites this section): the run directory on a tmpfs the test mounts (`<tmpfs>`), small enough to "
        "fill, or remounted read-only; the small two-rank job of `tests/recipes/test_faults.py` "
        "(`train.ckpt_every=2`). A save the storage refuses removes its partial directory, keeps the "
        "previous checkpoint as the latest, and stops the run (exit 1) or, with `train.ckpt_on_error=continue`, "
        "trains on; ⏎ separates the lines a case prints, N stands for what varies from run to run (the rank "
        "that failed first, the step it was seen at, the bytes free).\n\n"
        "| case | exit | what it says |\n| --- | --- | --- |\n" + rows
    )


def replace_section(doc: str, title: str, text: str) -> str:
    """``doc`` with the section headed ``title`` (to the next ``## `` or the end) replaced by ``text``, or appended."""
    start = doc.find("\n" + title + "\n")
    if start < 0:
        return doc.rstrip("\n") + "\n\n" + text
    end = doc.find("\n## ", start + 1)
    return doc[: start + 1] + text + (doc[end:] if end >= 0 else "")


def test_docs_errors_md_shows_these_cases(cases):
    missing = [name for name, _ in ROWS if name in cases["skipped"]]
    if missing or cases["mechanism"] != "mount":
        pytest.skip(f"the section is written from every case on a mounted tmpfs; not here: {cases['skipped']}")
    text = section(cases)
    if os.environ.get("GRIDTRAIN_WRITE_ERRORS_DOC"):
        DOC.write_text(replace_section(DOC.read_text(), SECTION, text))
    assert replace_section(DOC.read_text(), SECTION, text) == DOC.read_text(), (
        "docs/errors.md's storage section is stale: rerun with GRIDTRAIN_WRITE_ERRORS_DOC=1 (and -n 0) and commit it"
    )


# --- the library: every rank fails alike ----------------------------------------------------------------
def _one_rank_fills_the_disk(root, background):
    import errno

    import torch.distributed as dist

    from parallel.checkpoint import BackgroundSaver, save_checkpoint

    from ..parallel.checkpoint.test_store import flat_half_state

    save_checkpoint(flat_half_state(1), root, 1)

    def full():  # rank 1's shard write hits a full disk; rank 0's is fine
        if dist.get_rank() == 1:
            raise OSError(errno.ENOSPC, "No space left on device")

    try:
        if background:
            saver = BackgroundSaver(timeout_s=60)
            saver.save(flat_half_state(2), root, 2, on_written=full, needed=12345)
            saver.wait()
        else:
            save_checkpoint(flat_half_state(2), root, 2, on_written=full, needed=12345)
    except CheckpointStorageError as e:
        return str(e), e.rank, e.errno
    return None


@pytest.mark.parametrize("background", [False, True], ids=["sync", "background"])
def test_a_full_disk_on_one_rank_fails_the_save_on_every_rank_alike(tmp_path, background):
    import errno

    got = run_ranks(_one_rank_fills_the_disk, 2, tmp_path, background, timeout=120)
    for message, rank, code in got:  # both ranks, neither left in a barrier
        assert rank == 1 and code == errno.ENOSPC
        assert "checkpoint step_00000002 not saved: No space left on device (ENOSPC)" in message
        assert "a checkpoint needs 12.3 kB" in message and "still step_00000001" in message
        assert "\n" not in message
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]  # the partial save removed


def _save_onto(root, remount):
    import torch.distributed as dist

    from parallel.checkpoint import BackgroundSaver, save_checkpoint

    from ..parallel.checkpoint.test_store import flat_half_state

    save_checkpoint(flat_half_state(1), root, 1)
    dist.barrier()
    if dist.get_rank() == 0:
        remount()
    dist.barrier()
    saver = BackgroundSaver(timeout_s=60)
    saver.save(flat_half_state(2), root, 2)
    try:
        saver.wait()
    except CheckpointStorageError as e:
        return str(e)
    return None


def test_a_read_only_file_system_during_a_background_save_is_one_line_on_every_rank(tmp_path):
    if (why := mount_tmpfs(tmp_path / "fs", 4 << 20)) is not None:
        pytest.skip(why)
    try:
        root = tmp_path / "fs" / "checkpoints"
        got = run_ranks(_save_onto, 2, root, lambda: remount_readonly(tmp_path / "fs"), timeout=120)
        for message in got:
            assert message is not None and "Read-only file system (EROFS)" in message, got
            assert "checkpoint step_00000002 not saved" in message and "still step_00000001" in message
        assert latest_checkpoint(root).name == "step_00000001"
    finally:
        unmount(tmp_path / "fs")


def test_torchs_zip_writer_on_a_full_file_system_counts_as_enospc(tmp_path):
    """torch.save on a full disk raises "[enforce fail at inline_container.cc] unexpected pos …", not
    an OSError with ENOSPC: the one the issue's 351-line output ended with."""
    import errno

    import torch

    from parallel.checkpoint import storage_errno

    if (why := mount_tmpfs(tmp_path / "fs", 64 << 10)) is not None:
        pytest.skip(why)
    try:
        with pytest.raises(RuntimeError, match="unexpected pos") as caught:
            with open(tmp_path / "fs" / "shard", "wb") as f:
                torch.save(torch.zeros(100_000), f)
        assert storage_errno(caught.value, tmp_path / "fs") == errno.ENOSPC
        assert storage_errno(RuntimeError("unexpected pos 1 vs 2"), tmp_path) is None  # a disk with room: not ours
    finally:
        unmount(tmp_path / "fs")
