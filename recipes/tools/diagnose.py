"""What a stopped or stuck job's ranks were doing, from their flight-recorder dumps, in a few lines.

    python -m recipes.diagnose outputs/<run>            # reads <run>/flight/rank*.json

Says:

* the ranks that wrote no dump (dead before they could, or never reached a dump);
* the first call at which a group's members disagree: another op, size or dtype at the same
  sequence number, or a member that never issued a call the others did (it is elsewhere: its own
  last call says where);
* where each rank stopped: its last call (op, group, sequence number, phase), ranks grouped;
* the slowest rank over the steps every dump holds, and its lag behind the median.

The comparison is the dry run's (:func:`parallel.comm.recorder.first_difference`), applied to the
calls every member still holds in its ring, matched by sequence number. Dumps are read one at a
time; memory grows with the number of groups and the ring size, not the number of ranks squared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from parallel.comm.recorder import Call, first_difference


class Diagnosis:
    """Reads dumps one by one (:meth:`add`) and reports (:meth:`report`)."""

    def __init__(self):
        self.world = 0
        self.seen: set[int] = set()
        self.reasons: dict[str, list[int]] = {}
        self.members: dict[str, tuple[int, ...]] = {}
        self.issued: dict[str, dict[int, int]] = {}  # group -> rank -> collectives issued
        self.calls: dict[str, dict[int, tuple[int, list[Call]]]] = {}  # group -> rank -> (first seq, calls)
        self.last: dict[int, tuple] = {}
        self.steps: dict[int, dict[int, float]] = {}

    def add(self, dump: dict) -> None:
        r = dump["rank"]
        self.world = max(self.world, dump["world"])
        self.seen.add(r)
        self.reasons.setdefault(dump["reason"], []).append(r)
        e = dump["entries"]
        mine: dict[str, tuple[int, list[Call]]] = {}
        for seq, group, op, numel, dtype, peer in zip(e["seq"], e["group"], e["op"], e["numel"], e["dtype"], e["peer"]):
            if peer is None:
                first, calls = mine.setdefault(group, (seq, []))
                calls.append(Call(group, (), op, numel, dtype, ""))
        for group, ranks in dump["groups"].items():
            self.members[group] = tuple(ranks)
            self.issued.setdefault(group, {})[r] = dump["issued"].get(group, 0)
        for group, pair in mine.items():
            self.calls.setdefault(group, {})[r] = pair
        if e["seq"]:
            i = len(e["seq"]) - 1
            self.last[r] = (e["op"][i], e["group"][i], e["seq"][i], e["peer"][i], e["phase"][i], e["t_end"][i] is None)
        self.steps[r] = dict(dump.get("step_times", []))

    def _disagreements(self) -> list[str]:
        out = []
        for group, by_rank in sorted(self.issued.items()):
            members = [m for m in self.members[group] if m in self.seen]
            if len(members) < 2:
                continue
            most = max(by_rank.get(m, 0) for m in members)
            behind = [m for m in members if by_rank.get(m, 0) < most]
            if behind:
                n = min(by_rank.get(m, 0) for m in behind)
                out.append(
                    f"group {group}: ranks {_ranks(behind)} never issued collective #{n} that "
                    f"{_ranks([m for m in members if by_rank.get(m, 0) > n])} did"
                )
            held = self.calls.get(group, {})
            start = max((held[m][0] for m in members if m in held), default=0)
            ref = next((m for m in members if m in held), None)
            for m in members:
                if m == ref or m not in held or ref is None:
                    continue
                a, b = held[ref][1][start - held[ref][0] :], held[m][1][start - held[m][0] :]
                n = min(len(a), len(b))
                diff = first_difference(a[:n], b[:n])
                if diff is not None:
                    i, ca, cb = diff
                    out.append(f"group {group}: ranks {ref} and {m} differ at collective #{start + i}: {ca} vs {cb}")
                    break
        return out

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
        lines += self._disagreements() or ["every group's members issued the same collectives"]
        lines += self._stopped()
        if (slow := self._slowest()) is not None:
            lines.append(slow)
        return lines


def _ranks(ranks) -> str:
    rs = sorted(ranks)
    return "[" + ", ".join(map(str, rs)) + "]" if len(rs) <= 8 else f"[{rs[0]}, {rs[1]}, … {rs[-1]}] ({len(rs)} ranks)"


def diagnose(run_dir: str | Path) -> list[str]:
    """The report's lines for the dumps under ``<run_dir>/flight`` (or ``run_dir`` itself)."""
    folder = Path(run_dir)
    folder = folder / "flight" if (folder / "flight").is_dir() else folder
    files = sorted(folder.glob("rank*.json"))
    if not files:
        raise FileNotFoundError(f"no flight-recorder dumps (rank*.json) in {folder}")
    d = Diagnosis()
    for f in files:
        d.add(json.loads(f.read_text()))
    return d.report()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m recipes.diagnose", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="the run directory (its flight/ folder holds the dumps)")
    a = ap.parse_args(argv)
    try:
        print("\n".join(diagnose(a.run_dir)))
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
