"""``python -m recipes.diagnose`` on dumps written by real ranks, and on 17,920 synthetic ones with a
dead rank, a rank that skipped a collective and one that sent another size: each named."""

import json

import torch
import torch.distributed as dist

from parallel.comm import flight
from parallel.testing import run_ranks
from recipes.tools import diagnose_synthetic as synthetic
from recipes.tools.diagnose import diagnose


def test_the_ring_keeps_the_last_calls_oldest_first_with_a_sequence_per_group():
    rec = flight.FlightRecorder(capacity=4)
    rec.ranks.update({"tp": (0, 1), "pp": (0, 2)})
    for i in range(6):
        rec.phase = f"step {i}"
        rec.record("tp", None, "all_reduce", 10 + i, "float32", None)
        rec.done()
    rec.record("pp", None, "send", 5, "float32", 2)  # p2p: counted per peer and direction
    e = rec.entries()
    assert e["numel"] == [13, 14, 15, 5] and e["seq"] == [3, 4, 5, 0] and e["phase"][0] == "step 3"
    assert all(t is not None for t in e["t_end"][:3]) and e["t_end"][3] is None  # the send never returned
    assert rec.seq == {"tp": 6, "pp:send:2": 1}


def _ranks_dump(folder):
    from parallel import comm

    g = dist.new_group([0, 1])
    for i in range(3):
        flight.set_phase(f"step {i}")
        comm.all_reduce(torch.ones(4), group=g)
    comm.broadcast(torch.ones(2), 0)
    return str(flight.dump(folder, "on demand"))


def test_real_ranks_dump_what_they_issued_and_agree(tmp_path):
    paths = run_ranks(_ranks_dump, 2, str(tmp_path / "flight"), timeout=60)
    dumps = [json.loads(open(p).read()) for p in paths]
    assert [d["rank"] for d in dumps] == [0, 1] and dumps[0]["phase"] == "step 2"
    ops = dumps[1]["entries"]["op"]
    assert ops[-4:] == ["all_reduce"] * 3 + ["broadcast"]
    lines = diagnose(tmp_path)
    assert lines[0] == "2 of 2 ranks dumped (on demand: 2)"
    assert "every group's members issued the same collectives" in lines
    assert any(line.startswith("ranks [0, 1]: after broadcast #0 on world") for line in lines)
    # a step time the recorder wrote as NaN (json.dumps' default; orjson refuses it) is still read
    dumps[1]["step_times"] = [[2, float("nan")]]
    open(paths[1], "w").write(json.dumps(dumps[1]))
    assert diagnose(tmp_path)[0] == "2 of 2 ranks dumped (on demand: 2)"


def test_17920_synthetic_dumps_name_the_dead_the_skipper_the_odd_size_and_the_straggler(tmp_path):
    world = synthetic.ours(tmp_path / "flight")
    lines = diagnose(tmp_path, workers=1)
    assert diagnose(tmp_path, workers=2) == lines  # a process pool reads them into the same report
    assert lines[0] == f"{world - 1} of {world} ranks dumped (timeout: {world - 1})"
    assert "no dump from ranks [17000] (dead, or never reached a dump)" in lines
    skipper_tp = "tp" + str(8_704 // (8 * 64)) + "." + str((8_704 // 8) % 64)
    assert any(line.startswith(f"group {skipper_tp}: ranks [8704] never issued collective #22") for line in lines)
    odd = [line for line in lines if "differ at collective" in line]
    assert len(odd) == 1 and "all_reduce(999 × bfloat16)" in odd[0] and "12345" in odd[0]
    stopped = [line for line in lines if ": inside " in line]
    assert stopped == [
        f"ranks [0, 1, … 17919] ({world - 1} ranks): inside all_reduce #3 on 280 groups (dp0.0, …) (step 3)"
    ]
    assert lines[-1].startswith("slowest rank 77: 2.000 s per step") and "+100%" in lines[-1]


def test_full_rings_name_an_odd_size_deep_in_the_ring_and_the_skipper_past_the_oldest_calls(tmp_path):
    synthetic.ours(tmp_path / "flight", dp=4, pp=1, tp=2, dead=7, skipper=2, other_size=5, steps=300,
                   ring=flight.CAPACITY, odd_step=150)  # fmt: skip
    dump = json.loads((tmp_path / "flight" / "rank0.json").read_text())
    assert len(dump["entries"]["seq"]) == flight.CAPACITY and dump["entries"]["seq"][0] > 0  # the oldest overwritten
    assert diagnose(tmp_path)[1:5] == [
        "no dump from ranks [7] (dead, or never reached a dump)",
        "group dp0.1: ranks [5] differ at collective #150: all_reduce(999 × bfloat16) on dp0.1 in step 150, "
        "where ranks [1, 3] issued all_reduce(1024 × bfloat16) on dp0.1 in step 150",
        "group tp0.1: ranks [2] never issued collective #1798 (all_reduce(1024 × bfloat16) on tp0.1 in step 299) "
        "that [3] did",
        "ranks [0, 1, 2, 3, 4, 5, 6]: inside all_reduce #299 on 2 groups (dp0.0, …) (step 299)",
    ]
