"""``dryrun.ranks=classes``: every rank class of a layout, and the DP peers, dry-run in processes forked
from the test's own (warmed) one; a planted extra all-reduce on the middle stage is named with its rank
and call. Every group and every send/receive pair is compared (parallel.comm.compare_sequences)."""

import json

import pytest
import torch

from parallel import comm
from parallel.topology import Topology
from recipes.tools import dryrun
from recipes.tools.dryrun_classes import class_ranks, rank_class

from .test_dryrun import recipe


def test_classes_cover_every_stage_tp_cp_and_expert_index_at_the_first_and_last_replica():
    topo = Topology(64, 35, 8)
    ranks = class_ranks(topo)
    assert len(ranks) == 35 * 8 * 2  # GPT-3 175B at DP64×PP35×TP8
    assert {(rank_class(topo, r)["pp"], rank_class(topo, r)["tp"]) for r in ranks} == {
        (p, t) for p in range(35) for t in range(8)
    }
    assert {rank_class(topo, r)["replica"] for r in ranks} == {"first", "last"}
    moe = Topology(16, 2, 2, cp=2, ep=4)
    got = class_ranks(moe)
    assert {moe.coords(r).dp for r in got} == {0, 1, 2, 3, 12, 13, 14, 15} and len(got) == 8 * 2 * 2 * 2
    for axis in ("dp", "pp", "tp", "cp", "ep", "edp"):  # every group of a recorded rank holds another one
        for r in got:
            assert len(set(moe.group_of(axis, r)) & set(got)) >= 2 or moe.size(axis) == 1, (axis, r)
    assert class_ranks(Topology(1, 3, 1)) == [0, 1, 2]


@pytest.fixture
def planted(monkeypatch):
    """The middle stage (pp index 1) issues one extra all-reduce on its PP group in the measured step."""
    real = dryrun.DryRunTrainer.train_step

    def train_step(self, step, **kw):
        out = real(self, step, **kw)
        if step == 1 and self.groups.coords.pp == 1:
            comm.all_reduce(torch.zeros(3, device="meta"), group=self.groups.pp)
        return out

    monkeypatch.setattr(dryrun.DryRunTrainer, "train_step", train_step)  # the forked ranks inherit it


def test_a_planted_extra_all_reduce_on_a_middle_stage_is_named(tmp_path, planted, capsys):
    rc = recipe(
        "gpt_tiny",
        ["parallel.dp=2", "parallel.pp=3", "train.global_batch=8", "train.micro_batch=2", "dryrun.ranks=classes"],
    )
    summary = dryrun.run_dryrun(rc, str(tmp_path))
    assert summary["ranks"] == list(range(6)) and summary["misplaced"] == 0
    report = json.loads((tmp_path / "dryrun.json").read_text())
    problems = report["sequence_problems"]
    # stage 1 of each replica (ranks 2 and 3) against stage 0 on its PP group; DP, embedding, p2p agree
    assert len(problems) == 2, problems
    for replica, problem in zip((0, 1), sorted(problems)):
        assert problem.startswith(
            f"group pp [{replica}, {replica + 2}, {replica + 4}]: ranks {replica} and {replica + 2}"
        )
        assert problem.endswith("collective 1: broadcast(1 × float32) on pp vs all_reduce(3 × float32) on pp")
    out = capsys.readouterr().out
    assert "6 ranks, one per class and DP replica" in out and "2 mismatches" in out
    for r, res in report["ranks"].items():  # the per-class table's figures: the planner's bytes and peak
        cmp = res["plan"]
        assert 0.92 <= res["memory"]["total"] / cmp["memory"]["plan"]["total"] <= 1.05, r  # 0.930-1.045
        if int(r) not in (2, 3):
            assert {g: round(b) for g, b in cmp["bytes"]["dryrun"].items()} == {
                g: round(cmp["bytes"]["plan"][g]) for g in cmp["bytes"]["dryrun"]
            }


def test_dryrun_ranks_other_than_a_list_or_classes_is_refused():
    from types import SimpleNamespace

    from recipes.config import ConfigError

    topo = Topology(2, 2, 1)
    rc = SimpleNamespace(dryrun=SimpleNamespace(ranks="every"))
    with pytest.raises(ConfigError, match=r"dryrun.ranks=every: is neither a list of ranks nor 'classes'; name ranks"):
        dryrun._chosen_ranks(rc, 4, topo)
    rc.dryrun.ranks = [0, 4]
    with pytest.raises(ConfigError, match=r"rank 4 is outside the world \[0, 4\)"):
        dryrun._chosen_ranks(rc, 4, topo)
    rc.dryrun.ranks = None
    assert dryrun._chosen_ranks(rc, 4, topo) == dryrun.default_ranks(4, 2, 2, 1)
