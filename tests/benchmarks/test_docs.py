"""``python -m benchmarks.docs``: the README's and docs' figures from a run, and the check that says when
they are stale (the dry-run blocks are checked in ``tests/recipes/test_dryrun.py``, from its ranks)."""

import shutil

import pytest

from benchmarks import docs, drills
from recipes.tools import docblocks


def test_the_plan_blocks_are_current():
    cheap = [n for n, (_, _, run) in docs.BLOCKS.items() if not run]
    assert cheap, "at least the README's plan table is written without a dry run"
    assert docs.stale(docs.render(cheap)) == [], "stale: run python -m benchmarks.docs and commit"


def test_every_block_is_marked_on_its_page():
    for name, (page, _, _) in docs.BLOCKS.items():
        docs.block((docs.ROOT / page).read_text(), name)  # raises when it is not


def test_a_changed_figure_is_stale_and_write_restores_it(tmp_path):
    (tmp_path / "README.md").write_text((docs.ROOT / "README.md").read_text())
    bodies = docs.render(["plan-gpt175b"])
    assert docs.stale(bodies, tmp_path) == []
    page = (tmp_path / "README.md").read_text()
    (tmp_path / "README.md").write_text(page.replace("11.96", "11.69", 1))
    assert docs.stale(bodies, tmp_path) == ["plan-gpt175b"]
    docs.write(bodies, tmp_path)
    assert (tmp_path / "README.md").read_text() == page
    with pytest.raises(ValueError, match="is not marked"):
        docs.block("no marks here", "plan-gpt175b")


def test_the_check_exits_1_on_a_stale_block(tmp_path, monkeypatch, capsys):
    shutil.copy(docs.ROOT / "README.md", tmp_path / "README.md")
    page = (tmp_path / "README.md").read_text()
    (tmp_path / "README.md").write_text(page.replace("11.96", "11.69", 1))
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    assert docs.main(["--check", "plan-gpt175b"]) == 1
    assert "stale: plan-gpt175b" in capsys.readouterr().out


def test_every_drill_is_marked_on_the_debugging_page():
    """The drills' blocks hold real jobs' output (minutes of 8 gloo ranks, pids and paths): no test reruns
    them; this checks that each block ``python -m benchmarks.drills --doc`` writes is marked once."""
    page = (docs.ROOT / "docs" / "debugging.md").read_text()
    for kind in (*drills.KINDS, "oom"):
        assert docblocks.read(page, drills.marks(kind)).startswith("```text\n$ python -m recipes.gpt_tiny")


def test_drills_write_doc_rewrites_only_its_block(tmp_path):
    page = tmp_path / "debugging.md"
    shutil.copy(docs.ROOT / "docs" / "debugging.md", page)
    before = page.read_text()
    result = dict(kind="straggle", rank=3, watchdog=[], progress=["step 3: …"], diagnose=["metrics.jsonl: …"])
    drills.write_doc(page, [result], "python -m recipes.gpt_tiny …")
    body = "```text\n$ python -m recipes.gpt_tiny …  # train.fault=straggle@3:…\nstep 3: …\nmetrics.jsonl: …\n```"
    assert page.read_text() == docblocks.replace(before, drills.marks("straggle"), body)
    assert page.read_text() != before
