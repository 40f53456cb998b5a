"""torch's own flight-recorder dumps (``<run>/flight/nccl_trace_rank_<r>``) in ``diagnose``'s report.

On CUDA the training loop turns on torch's NCCL flight recorder (``recipes/training/flight.py``); a
rank's dump is a pickle torch writes on a collective timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``), with
the device side our recorder cannot see: whether each collective started and completed on the GPU.

Each dump is read with torch's own loader (``torch.distributed.flight_recorder.components.loader
.read_dump``), its groups with torch's builder (``build_groups_memberships``: the pickle's
``pg_config``) and its entries with torch's parser (``types.Op``: the op, once per op name; each
p2p's peer), one dump at a time (torch's builder once per distinct group; by a process pool from
:data:`~recipes.tools.diagnose.POOL_FROM` dumps on); what is kept per rank is the compact form of our
own dumps, and the cross-rank comparison is the same :class:`~recipes.tools.diagnose.Diagnosis`
(the dry run's comparator). torch's
matcher (``builder.build_db``) is not used: it holds every rank's dump at once and compares each
collective against every rank.

A group is named ``<desc>#<pg name>`` (``tp#3``; torch's pg names are the same on every member).
Collective numbers count from 0 (torch's ``collective_seq_id`` less one). A call is pending
("inside") when torch had neither seen it complete nor retired it (``state``, ``retired``; torch's
loader does not pass ``pg_status`` on). ProcessGroupGloo's
dumps (torch 2.13) carry no ``pg_config``: a group's members are then the ranks whose dumps hold it
(the default group: the whole world).
"""

from __future__ import annotations

import logging
import math
import re
from functools import partial
from pathlib import Path

from parallel.comm.flight import FIELDS
from recipes.tools import diagnose
from recipes.tools.diagnose import Diagnosis, _ranks
from recipes.training.flight import TORCH_DUMP_PREFIX

#: the dump versions this reader is written for (torch's analyser reads the same: major 2)
SUPPORTED_MAJOR = 2
_NAME = re.compile(re.escape(TORCH_DUMP_PREFIX) + r"(\d+)$")
_COLUMNS = tuple(f for f in FIELDS if f != "t_start")  # what Diagnosis reads of our dumps' entries


def torch_dumps(folder: Path) -> list[Path]:
    """torch's dumps in ``folder``, by rank."""
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def _torch_fr():
    """torch's loader, builder and entry parser, imported on first use (and its 'tabulate is not
    installed' warning kept off the report)."""
    from torch.distributed.flight_recorder.components import loader

    logging.getLogger("Flight Recorder").setLevel(logging.ERROR)
    from torch.distributed.flight_recorder.components import builder, types, utils

    return loader, builder, types, utils


class TorchDumps:
    """Reads torch's dumps one by one (:meth:`add`) into a :class:`Diagnosis`; :meth:`report`."""

    def __init__(self, world: int = 0):
        self.d = Diagnosis()
        self.d.world = world
        self.version = ""
        self.left_out: dict[str, list[int]] = {}  # why -> ranks whose dump could not be used
        self.holders: dict[str, set[int]] = {}  # group -> ranks whose dumps hold it (no pg_config)
        self.known: set[str] = set()  # groups whose members a pg_config gave
        self.skipped = 0  # entries of ops torch's parser does not know
        self.kinds: dict[str, str] = {}  # profiling name ("nccl:all_reduce") -> op, as torch's parser read it
        self.names: dict[tuple, str] = {}  # process_group (pg name, desc) -> our group's name, "tp#3"
        self.dtypes: dict[tuple, str] = {}  # input dtypes -> "BFloat16" (several: joined by "/")
        self.built: dict[tuple, tuple] = {}  # (pg name, desc, ranks) -> (guid, ranks), torch's builder's

    def add(self, path: Path) -> None:
        self.take(self.read(path, self.d.interned), interned=True)

    def read_all(self, paths: list[Path], workers: int = 1) -> None:
        """:meth:`add` each dump, by rank; by ``workers`` processes from :data:`~recipes.tools.diagnose.POOL_FROM`
        dumps on (the same report: each worker reads a chunk, this process takes them in order)."""
        if workers < 2 or len(paths) < diagnose.POOL_FROM:
            for p in paths:
                self.add(p)
            return
        for chunk in diagnose.in_pool(partial(_read_files, self.d.world), [str(p) for p in paths], workers):
            for got in chunk:
                self.take(got)

    def read(self, path: Path, interned: dict) -> dict:
        """One dump as :meth:`take` takes it: its rank and either why it is left out, or its version,
        its :func:`~recipes.tools.diagnose.compact` form (``interned``: the table its calls go in),
        the groups a pg_config gave (``known``) or not (``held``) and the entries skipped."""
        loader, builder, types, utils = _torch_fr()
        rank = int(_NAME.match(path.name).group(1))
        try:
            dump = loader.read_dump(TORCH_DUMP_PREFIX, str(path))
            version = str(dump["version"])
            major, _ = utils.get_version_detail(version)
        except Exception as e:  # noqa: BLE001 - a damaged file of any kind: said in one line, left out
            return {
                "rank": rank,
                "left_out": f"damaged ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'})",
            }
        if major != SUPPORTED_MAJOR:
            why = f"version {version}, which this reader (torch's analyser, {SUPPORTED_MAJOR}.x) does not read"
            return {"rank": rank, "left_out": why}
        got = {"rank": rank, "version": version, "known": set(), "held": set(), "skipped": 0}
        try:
            got["dump"] = diagnose.compact(self._ours(rank, dump, builder, types, got), interned)
        except Exception as e:  # noqa: BLE001 - a pickle of another shape than torch's writer emits
            got["left_out"] = f"damaged ({type(e).__name__}: {e})"
        return got

    def take(self, got: dict, interned: bool = False) -> None:
        """One dump :meth:`read` (here, or by a worker: ``interned`` False)."""
        self.version = self.version or got.get("version", "")
        if "left_out" in got:
            self.left_out.setdefault(got["left_out"], []).append(got["rank"])
            return
        self.skipped += got["skipped"]
        self.known |= got["known"]
        for group in got["held"]:
            self.holders.setdefault(group, set()).add(got["rank"])
        self.d.merge(got["dump"], interned=interned)

    def _ours(self, rank: int, dump: dict, builder, types, got: dict) -> dict:
        """This dump in the columns of our own dumps (:func:`parallel.comm.flight.dump`); ``got``
        (:meth:`read`'s) counts what is known of its groups and what was skipped."""
        members, guids = self._memberships(rank, dump["pg_config"], builder)
        self.d.world = max([self.d.world, rank + 1, *(m[-1] + 1 for m in members.values() if m)])
        rows = []
        groups: dict[str, tuple[int, ...]] = {}
        issued: dict[str, int] = {}
        p2p: dict[tuple[str, int], int] = {}
        names, kinds, dtypes = self.names, self.kinds, self.dtypes
        for e in dump["entries"]:
            pg = e["process_group"]
            key = names.get(pg) or names.setdefault(pg, f"{pg[1] or 'pg'}#{pg[0]}")
            if key not in groups:
                groups[key] = self._ranks(rank, pg, key, members, guids, got)
            kind = kinds.get(e["profiling_name"])
            if kind in (None, "send", "recv"):  # torch's parser: once per op name, and for each p2p (its peer)
                try:
                    op = types.Op(e, {key: groups[key]}, key)
                except (AssertionError, ValueError, IndexError):
                    got["skipped"] += 1
                    continue
                kind = kinds[e["profiling_name"]] = op.type
            if kind in ("send", "recv"):
                peer = op._dst_g if kind == "send" else op._src_g
                seq = p2p[(kind, peer)] = p2p.get((kind, peer), -1) + 1
            else:
                peer, seq = None, e["collective_seq_id"] - 1
                if seq >= issued.get(key, 0):
                    issued[key] = seq + 1
            d = e["input_dtypes"]
            dtype = dtypes.get(t := tuple(d)) or dtypes.setdefault(t, "/".join(dict.fromkeys(d)) or "?")
            done = e["state"] == "completed" or e.get("retired")
            rows.append(
                (seq, key, kind, sum(map(math.prod, e["input_sizes"] or ())), dtype, peer, "", 1 if done else None)
            )
        cols = {k: list(c) for k, c in zip(_COLUMNS, zip(*rows) if rows else [()] * len(_COLUMNS))}
        return {"rank": rank, "world": self.d.world, "reason": f"torch {dump['version']}", "groups": groups,
                "issued": issued, "entries": cols}  # fmt: skip

    def _memberships(self, rank: int, pg_config: dict, builder) -> tuple[dict, dict]:
        """torch's builder on this rank's groups (``members``: guid -> its ranks, sorted; ``guids``: (pg
        name, rank) -> guid), once per distinct group: every rank's dump repeats the default group's ranks."""
        members, guids = {}, {}
        for name, v in pg_config.items():
            if v.get("ranks", "[]") == "[]":
                continue
            key = (name, v.get("desc"), v["ranks"])
            if key not in self.built:
                _, _, _, m, g = builder.build_groups_memberships({rank: {name: v}})
                self.built[key] = (g[(name, rank)], tuple(sorted(m[g[(name, rank)]])))
            guid, ranks = self.built[key]
            members[guid], guids[(name, rank)] = ranks, guid
        return members, guids

    def _ranks(self, rank: int, pg: tuple, key: str, members: dict, guids: dict, got: dict) -> tuple[int, ...]:
        """A group's members: its pg_config's, else (gloo: no pg_config) the world for the default
        group and this rank alone for the others (:meth:`report` widens them to the ranks holding it)."""
        name, desc = pg
        guid = guids.get((name, rank))
        ranks = members.get(guid) if guid else None
        if ranks:
            got["known"].add(key)
            return ranks
        got["held"].add(key)
        return tuple(range(self.d.world)) if desc == "default_pg" and self.d.world else (rank,)

    def report(self) -> list[str]:
        """A header line, then the diagnosis's lines indented under it."""
        d = self.d
        for group, ranks in self.holders.items():
            if group not in self.known and not group.startswith("default_pg#"):
                d.members[group] = tuple(sorted(ranks))
        d.world = max([d.world, *(r + 1 for r in d.seen), *(max(m) + 1 for m in d.members.values() if m)])
        head = f"torch's flight recorder ({TORCH_DUMP_PREFIX}<r>, version {self.version or '?'}): "
        lines = [f"{why}: ranks {_ranks(rs)}, left out" for why, rs in sorted(self.left_out.items())]
        if self.skipped:
            lines.append(f"{self.skipped} entries of ops torch's parser does not know, left out")
        if not d.seen:
            return [head + "no dump could be read", *("  " + line for line in lines)]
        body = d.report()
        return [head + body[0].split(" (")[0], *("  " + line for line in lines + body[1:])]


def _read_files(world: int, paths: list[str]) -> list[dict]:
    """A worker's chunk of dumps, each :meth:`TorchDumps.read` (the world: what our own dumps said)."""
    t, interned = TorchDumps(world=world), {}
    return [t.read(Path(p), interned) for p in paths]
