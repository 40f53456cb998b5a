"""A page's generated block: the text between two marker lines, found, read, replaced and checked here.

Every generator of a figure on a page (``python -m benchmarks.docs``, ``python -m recipes.tools.plan_scenarios``,
``python -m recipes.tools.plan_published``, ``python -m benchmarks.drills --doc``) names its block by a
:class:`Marks` pair and leaves the rest to this module, so what a block is (``begin`` on its own line, the
body, ``end``), how it is rewritten and when it is stale are defined once. Each generator keeps its own
marker strings (its one home), so the committed pages keep their markers byte for byte.

It lives in ``recipes/tools`` because every user can import it from there: the dependencies run
``benchmarks → recipes → models → parallel`` and ``recipes`` never imports ``benchmarks``, so a home under
``benchmarks/`` would be out of reach of the recipes' generators. It imports nothing of the project.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple


class Marks(NamedTuple):
    """The two marker lines around a block: ``begin`` and ``end``, each matched to the letter."""

    begin: str
    end: str


def find(page: str, marks: Marks) -> re.Match:
    """The one match of ``marks``'s block on ``page``; its group 1 is the body (without the newline after
    ``begin`` and the one before ``end``). ValueError when the block is not marked, or marked more than once."""
    found = list(re.finditer(re.escape(marks.begin) + r"\n(.*?)\n?" + re.escape(marks.end), page, flags=re.S))
    if len(found) != 1:
        what = "is not marked" if not found else f"is marked {len(found)} times"
        raise ValueError(f"block {marks.begin} … {marks.end} {what} on the page: mark it once, each marker on its line")
    return found[0]


def read(page: str, marks: Marks) -> str:
    """The body of ``marks``'s block on ``page`` (ValueError as :func:`find`)."""
    return find(page, marks).group(1)


def replace(page: str, marks: Marks, body: str) -> str:
    """``page`` with the body of ``marks``'s block replaced by ``body``, every other character kept
    (ValueError as :func:`find`). :func:`read` of the result gives ``body`` back."""
    found = find(page, marks)
    return page[: found.start()] + f"{marks.begin}\n{body}\n{marks.end}" + page[found.end() :]


def is_current(page: str, marks: Marks, body: str) -> bool:
    """Whether ``marks``'s block on ``page`` already holds ``body`` exactly (ValueError as :func:`find`)."""
    return read(page, marks) == body


def write(path: str | Path, marks: Marks, body: str) -> str:
    """Rewrite the file ``path`` with its block ``marks`` holding ``body`` (:func:`replace`); return the new text.
    The file is not touched when the block is current, nor when it is not marked (ValueError)."""
    path = Path(path)
    page = path.read_text()
    new = replace(page, marks, body)
    if new != page:
        path.write_text(new)
    return new
