"""Synthetic flight-recorder dumps with planted faults, for ``diagnose``'s tests and its scale benchmark.

* :func:`ours`: our own dumps (:func:`parallel.comm.flight.dump`'s JSON) of a GPT-3-shaped job,
  dp·pp·tp ranks: per step 6 all-reduces on the rank's tp group and 1 on its dp group, each rank's
  last call pending; a dead rank, one that skipped a tp all-reduce, one that sent another size on
  dp, one straggler.
* :func:`nccl`: torch's NCCL flight-recorder dumps (the pickle ProcessGroupNCCL writes, version 2.10),
  per step 2 all-reduces on the rank's tp group and 1 on its dp group (the ranks alike modulo tp).

``ring`` keeps only each rank's last calls, as a full ring would (:data:`parallel.comm.flight.CAPACITY`
slots in ours, ``TORCH_FR_BUFFER_SIZE`` in torch's); None keeps every call.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from parallel.comm import flight
from recipes.training.flight import TORCH_DUMP_PREFIX


def ours(
    folder: Path, dp=64, pp=35, tp=8, dead=17_000, skipper=8_704, other_size=12_345, steps=4, ring=None, odd_step=1
) -> int:
    """Write the dumps into ``folder`` (made here); returns the world size. The skipper leaves out its
    second-to-last tp all-reduce; ``other_size`` sends 999 elements on dp in step ``odd_step`` (1024
    elsewhere); rank 77 takes 2 s per step (1 s elsewhere; the last :data:`~parallel.comm.flight.STEP_TIMES`
    steps' times, as a recorder keeps them)."""
    folder.mkdir()
    world = dp * pp * tp
    for r in range(world):
        if r == dead:
            continue
        t, d = r % tp, (r // tp) % dp
        p = r // (tp * dp)
        tp_g, dp_g = f"tp{p}.{d}", f"dp{p}.{t}"
        rows, issued = [], {tp_g: 0, dp_g: 0}
        for step in range(steps):
            for group, n in ((tp_g, 6), (dp_g, 1)):
                for _ in range(n):
                    if r == skipper and step == steps - 1 and group == tp_g and issued[group] == 6 * steps - 2:
                        continue  # it skipped its second-to-last tp all-reduce
                    numel = 999 if (r == other_size and group == dp_g and step == odd_step) else 1024
                    rows.append((issued[group], group, "all_reduce", numel, "bfloat16", None, f"step {step}", 1.0, 1.1))
                    issued[group] += 1
        rows = rows[-ring:] if ring else rows
        cols = {k: list(c) for k, c in zip(flight.FIELDS, zip(*rows))}
        cols["t_end"][-1] = None
        groups = {
            tp_g: [p * tp * dp + d * tp + i for i in range(tp)],
            dp_g: [p * tp * dp + j * tp + t for j in range(dp)],
        }
        dump = {"rank": r, "world": world, "reason": "timeout", "groups": groups, "issued": issued,
                "entries": cols, "step_times": [[s, 2.0 if r == 77 else 1.0] for s in range(steps)][-flight.STEP_TIMES :]}  # fmt: skip
        (folder / f"rank{r}.json").write_text(json.dumps(dump))
    return world


def nccl(
    folder: Path, world=16, tp=4, steps=3, dead=(), odd_size=None, skipper=None, frames=2, ring=None, odd_step=1
) -> int:
    """Dumps in the structure ProcessGroupNCCL's writer emits (version 2.10: ``version``,
    ``pg_config``, ``pg_status``, ``entries`` with torch's fields; ``frames`` stack frames per entry,
    the frames' dicts shared by the entries, as torch's writer shares and its pickler memoizes them);
    every call completed but each rank's last. ``skipper`` never issues its group's last tp all-reduce;
    ``odd_size`` sends 1000 elements on dp in step ``odd_step`` (1024 elsewhere). Returns the world size."""
    folder.mkdir(parents=True, exist_ok=True)
    n_tp = world // tp
    default = {"name": "0", "desc": "default_pg", "ranks": str(list(range(world)))}
    dps = [{"name": str(1 + n_tp + g), "desc": "dp", "ranks": str(list(range(g, world, tp)))} for g in range(tp)]
    stack = [{"name": "all_reduce", "filename": "c10d.py", "line": i} for i in range(frames)]
    for r in range(world):
        if r in dead:
            continue
        tp_name, dp_name = str(1 + r // tp), str(1 + n_tp + r % tp)
        first = r // tp * tp
        mine = {"0": default, tp_name: {"name": tp_name, "desc": "tp", "ranks": str(list(range(first, first + tp)))},
                dp_name: dps[r % tp]}  # fmt: skip
        seq, entries = {}, []
        for step in range(steps):
            for name, n in ((tp_name, 2), (dp_name, 1)):
                for _ in range(n):
                    seq[name] = seq.get(name, 0) + 1
                    if r == skipper and name == tp_name and seq[name] == 2 * steps:
                        continue  # it never issued its group's last all-reduce
                    numel = 1000 if (r == odd_size and name == dp_name and step == odd_step) else 1024
                    entries.append({
                        "frames": list(stack), "record_id": len(entries), "pg_id": int(name),
                        "process_group": (name, mine[name]["desc"]), "collective_seq_id": seq[name],
                        "p2p_seq_id": 0, "op_id": seq[name], "profiling_name": "nccl:all_reduce",
                        "time_created_ns": 10**9 * step, "input_sizes": [[numel]], "input_dtypes": ["BFloat16"],
                        "output_sizes": [[numel]], "output_dtypes": ["BFloat16"], "state": "completed",
                        "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
                        "retired": True, "timeout_ms": 600_000, "is_p2p": False,
                    })  # fmt: skip
        entries = entries[-ring:] if ring else entries
        entries[-1].update(state="started", retired=False)
        status = {v: {"last_enqueued_collective": seq[v], "last_started_collective": seq[v],
                      "last_completed_collective": seq[v] - 1} for v in (tp_name, dp_name)}  # fmt: skip
        dump = {"version": "2.10", "pg_config": mine, "pg_status": status, "entries": entries}
        (folder / f"{TORCH_DUMP_PREFIX}{r}").write_bytes(pickle.dumps(dump))
    return world
