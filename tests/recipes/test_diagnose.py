"""``python -m recipes.diagnose`` on dumps written by real ranks, and on 17,920 synthetic ones with a
dead rank, a rank that skipped a collective and one that sent another size: each named."""

import json

import torch
import torch.distributed as dist

from parallel.comm import flight
from parallel.testing import run_ranks
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


def _synthetic(folder, dp=64, pp=35, tp=8, dead=17_000, skipper=8_704, other_size=12_345, steps=4):
    """A GPT-3-shaped job's dumps: per step 6 all-reduces on the rank's tp group and 1 on its dp group."""
    folder.mkdir()
    world = dp * pp * tp
    for r in range(world):
        if r == dead:
            continue
        t, d = r % tp, (r // tp) % dp
        p = r // (tp * dp)
        tp_g, dp_g = f"tp{p}.{d}", f"dp{p}.{t}"
        cols = {k: [] for k in flight.FIELDS}
        issued = {tp_g: 0, dp_g: 0}
        for step in range(steps):
            for group, n in ((tp_g, 6), (dp_g, 1)):
                for _ in range(n):
                    if r == skipper and step == steps - 1 and group == tp_g and issued[group] == 6 * steps - 2:
                        continue  # it skipped its second-to-last tp all-reduce
                    numel = 999 if (r == other_size and group == dp_g and step == 1) else 1024
                    for k, v in zip(
                        flight.FIELDS,
                        (issued[group], group, "all_reduce", numel, "bfloat16", None, f"step {step}", 1.0, 1.1),
                    ):
                        cols[k].append(v)
                    issued[group] += 1
        cols["t_end"][-1] = None
        groups = {
            tp_g: [p * tp * dp + d * tp + i for i in range(tp)],
            dp_g: [p * tp * dp + j * tp + t for j in range(dp)],
        }
        dump = {"rank": r, "world": world, "reason": "timeout", "groups": groups, "issued": issued,
                "entries": cols, "step_times": [[s, 2.0 if r == 77 else 1.0] for s in range(steps)]}  # fmt: skip
        (folder / f"rank{r}.json").write_text(json.dumps(dump))
    return world


def test_17920_synthetic_dumps_name_the_dead_the_skipper_the_odd_size_and_the_straggler(tmp_path):
    world = _synthetic(tmp_path / "flight")
    lines = diagnose(tmp_path)
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
