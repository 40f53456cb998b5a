"""What a stopped or stuck job's ranks were doing, from their flight-recorder dumps, in a few lines.

    python -m recipes.diagnose outputs/<run>            # reads <run>/flight/rank*.json (and torch's dumps)
    python -m recipes.diagnose outputs/<run> --workers 1   # every dump read in this process alone

Says:

* the ranks that wrote no dump (dead before they could, or never reached a dump);
* the first call at which a group's members disagree: another op, size, dtype or phase (step,
  schedule action, bucket) at the same sequence number, or a member that never issued a call the
  others did (it is elsewhere: its own last call says where);
* for each pipeline pair, sends and receives that do not match (a send never received, a receive
  whose send was never issued), or a transfer both sides issued that never completed;
* where each rank stopped: its last call (op, group, sequence number, phase), ranks grouped;
* the slowest rank over the steps every dump holds, and its lag behind the median.

The comparison is the dry run's (:func:`parallel.comm.recorder.first_difference`), applied to the
calls every member still holds in its ring, matched by sequence number, on the members whose held
calls are not the same list (each distinct call is one shared tuple, so equal rings compare by
identity). Dumps are read one at a time (from :data:`POOL_FROM` on, by a process pool that returns
each dump's :func:`compact` form, in order: the same report); what is kept is one reference
per call held (8 bytes) and each distinct call once, not the ranks squared.
torch's own flight-recorder dumps beside ours (NCCL's, on CUDA) get the same report under their own
header line (:mod:`recipes.tools.diagnose_torch`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing as mp
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from itertools import compress
from pathlib import Path

import orjson

from parallel.comm.recorder import Call, first_difference


@dataclass(frozen=True)
class Entry(Call):
    """A recorded call with the phase it was issued in: members of a group issue each call in the
    same phase (the same step, schedule action and bucket), so a shifted sequence shows at once."""

    phase: str = ""

    def key(self) -> tuple:
        return (*super().key(), self.phase)

    def describe(self) -> str:
        return super().describe() + (f" in {self.phase}" if self.phase else "")


class Diagnosis:
    """Reads dumps one by one (:meth:`add`) and reports (:meth:`report`)."""

    def __init__(self):
        self.world = 0
        self.seen: set[int] = set()
        self.reasons: dict[str, list[int]] = {}
        self.members: dict[str, tuple[int, ...]] = {}
        self.issued: dict[str, dict[int, int]] = {}  # group -> rank -> collectives issued
        self.calls: dict[str, dict[int, tuple[int, list[tuple]]]] = {}  # group -> rank -> (first seq, calls)
        self.interned: dict[tuple, tuple] = {}  # (op, numel, dtype, phase) -> the one tuple every holder keeps
        self.last: dict[int, tuple] = {}
        self.steps: dict[int, dict[int, float]] = {}
        self.p2p: dict[tuple[int, int], dict[str, tuple[int, str]]] = {}  # (src, dst) -> side -> (issued, phase)

    def add(self, dump: dict) -> None:
        self.merge(compact(dump, self.interned), interned=True)

    def merge(self, c: dict, interned: bool = False) -> None:
        """Take in one dump's :func:`compact` form (``interned``: made with :attr:`interned`)."""
        r = c["rank"]
        self.world = max(self.world, c["world"])
        self.seen.add(r)
        self.reasons.setdefault(c["reason"], []).append(r)
        for group, (first, calls) in c["calls"].items():
            if not interned:  # a worker's tuples: the one object every holder keeps
                calls = list(map(self.interned.setdefault, calls, calls))
            self.calls.setdefault(group, {})[r] = (first, calls)
        for (pair, side), last in c["p2p"].items():
            self.p2p.setdefault(pair, {})[side] = last
        for group, ranks in c["groups"].items():
            self.members[group] = ranks if type(ranks) is tuple else tuple(ranks)
            self.issued.setdefault(group, {})[r] = c["issued"].get(group, 0)
        if c["last"] is not None:
            self.last[r] = c["last"]
        self.steps[r] = c["steps"]

    def _disagreements(self) -> list[str]:
        """Per group, its first bad collective; the groups ordered by the step of that call (the
        root cause first: a rank that skipped a call in step 3 then disagrees everywhere in step 4)."""
        found = []
        for group, by_rank in sorted(self.issued.items()):
            members = [m for m in self.members[group] if m in self.seen]
            if len(members) < 2:
                continue
            candidates = []
            most = max(by_rank.get(m, 0) for m in members)
            behind = [m for m in members if by_rank.get(m, 0) < most]
            if behind:
                n = min(by_rank.get(m, 0) for m in behind)
                ahead = [m for m in members if by_rank.get(m, 0) > n]
                call = self._call(group, ahead, n)
                what = f" ({call.describe()})" if call else ""
                line = (
                    f"group {group}: ranks {_ranks(behind)} never issued collective #{n}{what} that {_ranks(ahead)} did"
                )
                candidates.append((n, line, call.phase if call else ""))
            if (diff := self._first_mismatch(group, members)) is not None:
                candidates.append(diff)
            if candidates:
                i, line, phase = min(candidates)
                found.append((_step_of(phase), i, line))
        return [line for *_, line in sorted(found)]

    def _call(self, group: str, ranks: list[int], n: int) -> Entry | None:
        """Collective ``n`` of ``group`` as one of ``ranks`` holds it in its ring (None: none does)."""
        for m in ranks:
            first, calls = self.calls.get(group, {}).get(m, (0, []))
            if first <= n < first + len(calls):
                return _entry(group, calls[n - first])
        return None

    def _first_mismatch(self, group: str, members: list[int]) -> tuple[int, str, str] | None:
        """The first collective every member holds on which they differ (the dry run's comparator,
        :func:`first_difference`, against one member, on the pairs whose held calls are not the same
        objects): the odd ones out by majority, or, two against two, the side that is not stuck inside it."""
        held = self.calls.get(group, {})
        have = [m for m in members if m in held]
        if len(have) < 2:
            return None
        start = max(held[m][0] for m in have)
        n = max(0, min(held[m][0] + len(held[m][1]) for m in have) - start)
        seqs = {m: held[m][1][start - held[m][0] :][:n] for m in have}
        ref, first = seqs[have[0]], None
        for m in have[1:]:
            if seqs[m] == ref:  # interned calls: compared by identity, at C speed
                continue
            i = _common_prefix(ref, seqs[m])
            diff = first_difference([_entry(group, ref[i])], [_entry(group, seqs[m][i])])
            if diff is not None and (first is None or i + diff[0] < first):
                first = i + diff[0]
        if first is None:
            return None
        sides: dict[tuple, list[int]] = {}
        for m in have:
            sides.setdefault(seqs[m][first], []).append(m)
        ordered = sorted(sides.values(), key=len)
        odd, rest = ordered[0], [m for side in ordered[1:] for m in side]
        if len(odd) == len(rest) and all(self._inside(m, group, start + first) for m in odd):
            odd, rest = rest, odd  # a tie: the stuck side waits for the other
        i = start + first
        line = (
            f"group {group}: ranks {_ranks(odd)} differ at collective #{i}: {_entry(group, seqs[odd[0]][first]).describe()}, "
            f"where ranks {_ranks(rest)} issued {_entry(group, seqs[rest[0]][first]).describe()}"
        )
        return i, line, seqs[odd[0]][first][3]

    def _inside(self, rank: int, group: str, seq: int) -> bool:
        last = self.last.get(rank)
        return last is not None and last[1] == group and last[2] == seq and last[5]

    def _transfers(self, limit: int = 8) -> list[str]:
        """Pipeline pairs whose sender is stuck inside its send to the receiver: the receiver never
        posted that receive, or posted it and waits (a receive posted early, ahead of its send, is
        the pipeline's normal state and not reported by itself)."""
        out = []
        for (src, dst), sides in sorted(self.p2p.items()):
            if src not in self.seen or dst not in self.seen or not self._pending(src, "send", dst):
                continue
            (ns, ps), (nr, _) = sides.get("send", (0, "")), sides.get("recv", (0, ""))
            if ns > nr:
                line = f"p2p {src} → {dst}: rank {src} is inside send #{ns - 1} ({ps}); rank {dst} never posted its receive"
                out.append((1, line))
            else:  # a receiver waiting inside the receive first: the sender is what it waits for
                waiting = self._pending(dst, "recv", src)
                line = (
                    f"p2p {src} → {dst}: rank {src} is inside send #{ns - 1} ({ps}), rank {dst} "
                    f"{'waits inside it' if waiting else 'posted it'}: the transfer never completed"
                )
                out.append((0 if waiting else 2, line))
        return [line for _, line in sorted(out, key=lambda x: x[0])][:limit]

    def _pending(self, rank: int, op: str, peer: int) -> bool:
        last = self.last.get(rank)
        return last is not None and last[0] == op and last[3] == peer

    def _stopped(self, limit: int = 8) -> list[str]:
        """Ranks by where they stopped (op, sequence number, phase; the group's name aside, so that
        17,920 ranks in 2,240 alike groups make one line), the rarest first: the odd ones out."""
        where: dict[tuple, list[tuple[int, str]]] = {}
        for r, (op, group, seq, peer, phase, pending) in self.last.items():
            what = f"{op} #{seq}" + (f" with rank {peer}" if peer is not None else "")
            where.setdefault(("inside" if pending else "after", what, phase), []).append((r, group))
        lines = []
        for (state, what, phase), found in sorted(where.items(), key=lambda kv: (len(kv[1]), kv[1][0][0]))[:limit]:
            groups = sorted({g for _, g in found})
            on = f"on {groups[0]}" if len(groups) == 1 else f"on {len(groups)} groups ({groups[0]}, …)"
            lines.append(f"ranks {_ranks(r for r, _ in found)}: {state} {what} {on}" + (f" ({phase})" if phase else ""))
        if len(where) > limit:
            lines.append(f"… and {len(where) - limit} more places ({sum(map(len, where.values()))} ranks in all)")
        return lines

    def _slowest(self) -> str | None:
        common = set.intersection(*(set(s) for s in self.steps.values())) if self.steps else set()
        if not common:
            return None
        last = sorted(common)[-8:]
        mean = {r: statistics.fmean(s[k] for k in last) for r, s in self.steps.items()}
        slow = max(mean, key=mean.get)
        median = statistics.median(mean.values())
        lag = mean[slow] / median - 1 if median else 0.0
        return f"slowest rank {slow}: {mean[slow]:.3f} s per step over steps {last[0]}–{last[-1]}, {lag:+.0%} on the median"

    def report(self) -> list[str]:
        lines = [
            f"{len(self.seen)} of {self.world} ranks dumped ({', '.join(f'{k}: {len(v)}' for k, v in sorted(self.reasons.items()))})"
        ]
        missing = sorted(set(range(self.world)) - self.seen)
        if missing:
            lines.append(f"no dump from ranks {_ranks(missing)} (dead, or never reached a dump)")
        lines += self._transfers()  # a rank stuck inside a send: what the others wait for, first
        lines += self._disagreements() or ["every group's members issued the same collectives"]
        lines += self._stopped()
        if (slow := self._slowest()) is not None:
            lines.append(slow)
        return lines


def compact(dump: dict, interned: dict | None = None) -> dict:
    """What :class:`Diagnosis` keeps of one dump (:meth:`Diagnosis.merge`): per group the first
    sequence number its ring holds and its calls as (op, numel, dtype, phase) tuples, each
    distinct one a single object (``interned``: their table, shared by the dumps that pass it); each
    p2p pair's last call on this side (how many it issued, its phase); the last call; step times."""
    interned = {} if interned is None else interned
    r, e = dump["rank"], dump["entries"]
    seqs, groups, peers = e["seq"], e["group"], e["peer"]
    keys = list(zip(e["op"], e["numel"], e["dtype"], e["phase"]))
    keys = list(map(interned.setdefault, keys, keys))  # the same call on every member, every group: one object
    p2p = {}
    if peers.count(None) != len(peers):  # p2p calls: each pair's last call on this side, then dropped
        for seq, op, peer, phase in zip(seqs, e["op"], peers, e["phase"]):
            if peer is not None:
                p2p[((r, peer), "send") if op == "send" else ((peer, r), "recv")] = (seq + 1, phase)
        mask = [p is None for p in peers]
        seqs, groups, keys = (list(compress(c, mask)) for c in (seqs, groups, keys))
    held, calls = set(groups), {}
    for group in held:  # a group's calls in the ring are its last ones: consecutive sequence numbers
        calls[group] = (
            seqs[groups.index(group)],
            keys if len(held) == 1 else list(compress(keys, map(group.__eq__, groups))),
        )
    i = len(e["seq"]) - 1
    last = (
        (e["op"][i], e["group"][i], e["seq"][i], e["peer"][i], e["phase"][i], e["t_end"][i] is None) if i >= 0 else None
    )
    return {"rank": r, "world": dump["world"], "reason": dump["reason"].split(":")[0],  # "watchdog", "SIGTERM", …
            "groups": dump["groups"], "issued": dump["issued"], "calls": calls, "p2p": p2p, "last": last,
            "steps": dict(dump.get("step_times", []))}  # fmt: skip


def _entry(group: str, key: tuple) -> Entry:
    """The call on ``group`` an interned key (op, numel, dtype, phase) stands for, to compare or describe."""
    op, numel, dtype, phase = key
    return Entry(group, (), op, numel, dtype, "", phase=phase)


def _common_prefix(a: list, b: list) -> int:
    """How many leading items ``a`` and ``b`` share (equal slices, bisected: C-speed comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _step_of(phase: str) -> int:
    """The step a phase names (``"step 3 F mb1"`` → 3; none: after every step)."""
    words = phase.split()
    return int(words[1]) if len(words) > 1 and words[0] == "step" and words[1].isdigit() else 1 << 62


def _ranks(ranks) -> str:
    rs = sorted(ranks)
    return "[" + ", ".join(map(str, rs)) + "]" if len(rs) <= 8 else f"[{rs[0]}, {rs[1]}, … {rs[-1]}] ({len(rs)} ranks)"


def diagnose(run_dir: str | Path, workers: int | None = None) -> list[str]:
    """The report's lines for the dumps under ``<run_dir>/flight`` (or ``run_dir`` itself): ours,
    then torch's (:mod:`recipes.tools.diagnose_torch`) when there are any. Each kind is read by
    ``workers`` processes (default: one per CPU) from :data:`POOL_FROM` dumps on; the report is the same."""
    from recipes.tools.diagnose_torch import TorchDumps, torch_dumps

    folder = Path(run_dir)
    folder = folder / "flight" if (folder / "flight").is_dir() else folder
    files = sorted(folder.glob("rank*.json"))
    theirs = torch_dumps(folder) if folder.is_dir() else []
    if not files and not theirs:
        raise FileNotFoundError(f"no flight-recorder dumps (rank*.json, nor torch's) in {folder}")
    d = Diagnosis()
    workers = (os.cpu_count() or 1) if workers is None else workers
    with _no_cycle_collection():
        if workers > 1 and len(files) >= POOL_FROM:  # parsed and compacted on every core, merged here
            for chunk in in_pool(_read_ours, [str(f) for f in files], workers):
                for c in chunk:
                    d.merge(c)
        else:
            for f in files:
                d.add(_parse(f.read_bytes()))
    lines = d.report() if files else []
    if theirs:
        t = TorchDumps(world=d.world)
        with _no_cycle_collection():
            t.read_all(theirs, workers)
        lines += t.report()
    return lines


def _parse(raw: bytes) -> dict:
    """One of our dumps: ``orjson`` (twice ``json``'s speed, half of reading ours), or ``json`` for what
    ``orjson`` refuses and the recorder's ``json.dumps`` may write (``NaN``, ``Infinity``: a step time)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def _read_ours(paths: list[str]) -> list[dict]:
    """A worker's chunk of our dumps, each :func:`compact` (one table of calls per chunk: each distinct
    call pickled once back to the merging process)."""
    interned: dict[tuple, tuple] = {}
    return [compact(_parse(Path(p).read_bytes()), interned) for p in paths]


#: from how many dumps on :func:`diagnose` reads them in a process pool
POOL_FROM = 512
_CHUNK = 64  # dumps per task: their tuples pickled once per chunk


def in_pool(fn, items: list, workers: int):
    """``fn`` of each chunk of ``items``, by ``workers`` processes (forked where the platform can:
    nothing to import again), the results in the order of the chunks."""
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
    chunks = [items[i : i + _CHUNK] for i in range(0, len(items), _CHUNK)]
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        yield from pool.map(fn, chunks)


@contextlib.contextmanager
def _no_cycle_collection():
    """Python's cycle collector off while dumps are read: what a dump allocates holds no cycles (it
    is freed by reference counting), and each collection would walk every call kept so far."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m recipes.diagnose", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="the run directory (its flight/ folder holds the dumps)")
    ap.add_argument("--workers", type=int, default=None, help="processes reading the dumps (default: one per CPU)")
    a = ap.parse_args(argv)
    try:
        print("\n".join(diagnose(a.run_dir, a.workers)))
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
