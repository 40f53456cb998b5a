"""The house rules that keep the code readable in one sitting, checked on every file we ship.

* no Python file over :data:`MAX_FILE_LINES` lines, no function over :data:`MAX_FUNCTION_LINES`;
* no test asserts wall-clock time: a hang guard is the test's timeout, and a timing belongs in
  ``benchmarks/`` (a time compared in an ``assert`` fails on a loaded machine, not on a slow change).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("parallel", "models", "recipes", "launch", "benchmarks", "examples", "tests")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 120


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_no_file_over_the_limit():
    long = {str(p.relative_to(ROOT)): n for p in _sources() if (n := p.read_text().count("\n")) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines (split them by concept): {long}"


def test_no_function_over_the_limit():
    long = {}
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


# an assert that compares a clock reading or an elapsed time with a number
_CLOCK = re.compile(r"\belapsed\w*|perf_counter\(|monotonic\(|time\.time\(|\bwall\w*_s\b")


def _wall_clock_asserts(source: str) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assert) and isinstance(node.test, (ast.Compare, ast.BoolOp)):
            text = ast.get_source_segment(source, node.test) or ""
            if _CLOCK.search(text) and re.search(r"[<>]", text):
                lines.append(node.lineno)
    return lines


def test_the_wall_clock_check_catches_what_it_should():
    assert _wall_clock_asserts("assert elapsed < 90\n") == [1]
    assert _wall_clock_asserts("assert 0.9 < time.perf_counter() - t0 < 3.0\n") == [1]
    assert _wall_clock_asserts("assert n_steps < 90\n") == []


def test_no_test_asserts_wall_clock_time():
    found = {}
    for p in sorted((ROOT / "tests").rglob("*.py")):
        if p.name == Path(__file__).name:
            continue
        if hits := _wall_clock_asserts(p.read_text()):
            found[str(p.relative_to(ROOT))] = hits
    assert not found, f"tests that assert wall-clock time (use the test's timeout as the hang guard): {found}"
