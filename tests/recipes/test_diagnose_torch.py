"""``diagnose`` on torch's own flight-recorder dumps: real ones written by 3 gloo ranks (torch 2.13
records ProcessGroupGloo's collectives too) with a planted dtype mismatch and a rank that wrote none,
damaged and unsupported dumps, and a synthetic NCCL-format set checked against torch's own loader."""

import pickle

import torch
import torch.distributed as dist

from parallel.comm import flight
from parallel.testing import run_ranks
from recipes.tools import diagnose as diagnose_tool
from recipes.tools import diagnose_synthetic as synthetic
from recipes.tools.diagnose import diagnose
from recipes.training.flight import TORCH_DUMP_PREFIX, TORCH_NCCL_ENV


def _gloo_ranks_dump(folder):
    from pathlib import Path

    from parallel import comm

    r = dist.get_rank()
    tp = dist.new_group([0, 1], group_desc="tp")
    if r < 2:
        for i in range(3):
            flight.set_phase(f"step {i}")
            odd = r == 1 and i == 2  # rank 1's third all-reduce: int32 where rank 0 sends float32 (same bytes)
            comm.all_reduce(torch.ones(4, dtype=torch.int32 if odd else torch.float32), group=tp)
    comm.broadcast(torch.ones(2), 0)
    if r == 2:
        return None  # it wrote no dump (a dead rank)
    flight.dump(folder, "on demand")
    raw = torch._C._distributed_c10d._dump_fr_trace()
    path = Path(folder) / f"{TORCH_DUMP_PREFIX}{r}"
    path.write_bytes(raw)
    return str(path)


def test_real_gloo_dumps_name_the_mismatch_and_the_dead_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")  # read when the ranks' groups are made
    paths = run_ranks(_gloo_ranks_dump, 3, str(tmp_path / "flight"), timeout=60)
    assert pickle.loads(open(paths[0], "rb").read())["version"].startswith("2.")
    lines = diagnose(tmp_path)
    at = lines.index(next(line for line in lines if line.startswith("torch's flight recorder")))
    ours, theirs = lines[:at], lines[at:]
    assert theirs[0].startswith(f"torch's flight recorder ({TORCH_DUMP_PREFIX}<r>, version 2.")
    assert theirs[0].endswith("2 of 3 ranks dumped")
    assert "  no dump from ranks [2] (dead, or never reached a dump)" in theirs
    assert "no dump from ranks [2] (dead, or never reached a dump)" in ours
    # a two-member tie: the comparator names both sides, the dtypes as torch writes them
    assert any(
        "differ at collective #2: all_reduce(4 × " in line and "Float" in line and "Int" in line and "tp#" in line
        for line in theirs
    ), theirs
    assert sum(
        ": after broadcast #0 on default_pg#" in x or ": inside broadcast #0 on default_pg#" in x for x in theirs
    )


def test_nccl_format_dumps_are_torch_s_and_name_the_dead_the_skipper_and_the_odd_size(tmp_path):
    import argparse

    from torch.distributed.flight_recorder.components.builder import build_db
    from torch.distributed.flight_recorder.components.loader import read_dir

    synthetic.nccl(tmp_path / "flight", dead=(13,), odd_size=6, skipper=9)
    args = argparse.Namespace(trace_dir=str(tmp_path / "flight"), prefix=TORCH_DUMP_PREFIX, verbose=False,
                              just_print_entries=False, allow_incomplete_ranks=True, mismatch_cap=10)  # fmt: skip
    details, version = read_dir(args)  # torch's own loader and analyser take them
    db = build_db(details, args, version)
    assert version == "2.10" and len(details) == 15 and len(db.groups) == 1 + 4 + 4
    bad = [c for c in db.collectives if not c.pass_check and c.mismatch_collectives]
    assert 6 in bad[0].mismatch_collectives and bad[0].pg_desc == "7:dp"  # torch's analyser: rank 6, on dp
    lines = diagnose(tmp_path)
    assert lines == [
        f"torch's flight recorder ({TORCH_DUMP_PREFIX}<r>, version 2.10): 15 of 16 ranks dumped",
        "  no dump from ranks [13] (dead, or never reached a dump)",
        "  group dp#7: ranks [6] differ at collective #1: all_reduce(1000 × BFloat16) on dp#7, "
        "where ranks [2, 10, 14] issued all_reduce(1024 × BFloat16) on dp#7",
        "  group tp#3: ranks [9] never issued collective #5 (all_reduce(1024 × BFloat16) on tp#3) that [8, 10, 11] did",
        "  ranks [0, 1, … 15] (15 ranks): inside all_reduce #2 on 4 groups (dp#5, …)",
    ]


def test_damaged_and_unsupported_dumps_are_left_out_in_one_line_each(tmp_path, capsys):
    from recipes.tools.diagnose import main

    folder = tmp_path / "flight"
    synthetic.nccl(folder, world=4, tp=2)
    (folder / f"{TORCH_DUMP_PREFIX}1").write_bytes(b"\x80\x04 not a pickle")
    (folder / f"{TORCH_DUMP_PREFIX}2").write_bytes(pickle.dumps({"version": "3.0", "pg_config": {}, "entries": []}))
    (folder / f"{TORCH_DUMP_PREFIX}3").write_bytes(b"")
    lines = diagnose(tmp_path)
    assert lines[0].endswith("1 of 4 ranks dumped")
    left = [line for line in lines if line.endswith(", left out")]
    assert left[:2] == [
        "  damaged (EOFError: Ran out of input): ranks [3], left out",
        "  damaged (UnpicklingError: invalid load key, ' '.): ranks [1], left out",
    ]
    assert left[2] == "  version 3.0, which this reader (torch's analyser, 2.x) does not read: ranks [2], left out"
    for f in folder.iterdir():
        f.unlink()
    (folder / f"{TORCH_DUMP_PREFIX}0").write_bytes(b"")
    assert main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("no dump could be read")


def test_full_torch_rings_name_an_odd_size_deep_in_the_ring(tmp_path, monkeypatch):
    ring = int(TORCH_NCCL_ENV["TORCH_FR_BUFFER_SIZE"])
    synthetic.nccl(tmp_path / "flight", world=8, tp=2, steps=700, dead=(7,), skipper=2, odd_size=5, frames=0,
                   ring=ring, odd_step=350)  # fmt: skip
    assert len(pickle.loads((tmp_path / "flight" / f"{TORCH_DUMP_PREFIX}0").read_bytes())["entries"]) == ring
    lines = diagnose(tmp_path, workers=1)
    monkeypatch.setattr(diagnose_tool, "POOL_FROM", 2)
    assert diagnose(tmp_path, workers=2) == lines  # a process pool reads them into the same report
    assert lines[1:4] == [
        "  no dump from ranks [7] (dead, or never reached a dump)",
        "  group dp#6: ranks [5] differ at collective #350: all_reduce(1000 × BFloat16) on dp#6, "
        "where ranks [1, 3] issued all_reduce(1024 × BFloat16) on dp#6",
        "  group tp#2: ranks [2] never issued collective #1399 (all_reduce(1024 × BFloat16) on tp#2) that [3] did",
    ]
