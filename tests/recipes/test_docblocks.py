"""``recipes.tools.docblocks``: the one reading, replacing and checking of a generated block on a page,
shared by every generator (``benchmarks.docs``, ``benchmarks.drills``, ``plan_scenarios``, ``plan_published``)."""

import pytest

from recipes.tools import docblocks
from recipes.tools.docblocks import Marks

MARKS = Marks("<!-- x:begin -->", "<!-- x:end -->")
PAGE = "# Title\n\nbefore\n<!-- x:begin -->\n| a |\n| 1 |\n<!-- x:end -->\nafter\n"


@pytest.mark.parametrize("body", ["| a |\n| 2 |", "", "trailing newline\n", "\nleading newline"])
def test_replace_keeps_the_rest_of_the_page_and_reads_back(body):
    new = docblocks.replace(PAGE, MARKS, body)
    assert docblocks.read(new, MARKS) == body and docblocks.is_current(new, MARKS, body)
    head, tail = PAGE.split(MARKS.begin)[0], PAGE.split(MARKS.end)[1]
    assert new == f"{head}{MARKS.begin}\n{body}\n{MARKS.end}{tail}"
    assert docblocks.replace(new, MARKS, "| a |\n| 1 |") == PAGE


def test_a_changed_body_is_stale():
    assert docblocks.read(PAGE, MARKS) == "| a |\n| 1 |"
    assert not docblocks.is_current(PAGE, MARKS, "| a |\n| 2 |")


@pytest.mark.parametrize(
    "page, said",
    [("no marks", "is not marked"), (PAGE + PAGE, "is marked 2 times"), ("<!-- x:begin --> <!-- x:end -->", "not")],
)
def test_a_block_not_marked_once_is_refused(page, said):
    with pytest.raises(ValueError, match=said):
        docblocks.replace(page, MARKS, "body")


def test_write_rewrites_only_a_stale_file(tmp_path):
    path = tmp_path / "page.md"
    path.write_text(PAGE)
    assert docblocks.write(path, MARKS, "| a |\n| 1 |") == PAGE
    assert docblocks.write(path, MARKS, "new") == path.read_text() == docblocks.replace(PAGE, MARKS, "new")
    path.write_text("unmarked")
    with pytest.raises(ValueError, match="is not marked"):
        docblocks.write(path, MARKS, "new")
    assert path.read_text() == "unmarked"
