"""The book's chapters are valid notebooks, and failures point back into the book."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import tangle  # noqa: E402

jupytext = pytest.importorskip("jupytext")

CHAPTERS = [c for c in tangle.read_toc(ROOT) if "jupytext" in (ROOT / c).read_text()[:400]]
# jupytext stamps its own version into the front matter; that line may differ.
VERSION_LINE = re.compile(r"^\s*jupytext_version: .*$", re.M)


def test_every_toc_chapter_is_a_jupytext_notebook():
    assert len(CHAPTERS) >= 5
    for chapter in CHAPTERS:
        nb = jupytext.read(ROOT / chapter)
        assert nb.metadata["kernelspec"]["name"] == "python3", chapter


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_round_trips_through_ipynb_unchanged(chapter):
    text = (ROOT / chapter).read_text(encoding="utf-8")
    ipynb = jupytext.writes(jupytext.reads(text, fmt="md:myst"), fmt="ipynb")
    back = jupytext.writes(jupytext.reads(ipynb, fmt="ipynb"), fmt="md:myst")
    assert VERSION_LINE.sub("", back) == VERSION_LINE.sub("", text)


def test_round_trip_keeps_export_markers_in_cell_metadata():
    nb = jupytext.read(ROOT / "book/linear.md")
    exported = [c for c in nb.cells if "export" in c.metadata.get("tags", [])]
    assert {c.metadata.get("module", "linear") for c in exported} >= {"module", "linear"}
    assert nb.metadata["npformer"]["module"] == "linear"


def test_failure_report_names_the_book_line():
    """The conftest hook maps a frame in src/npformer to the chapter line that wrote it."""
    import conftest

    import npformer

    try:
        npformer.Linear(3, 2).forward(__import__("numpy").ones((2, 4), dtype="float32"))
    except ValueError as exc:
        tb = pytest.ExceptionInfo.from_exception(exc).traceback
    locations = conftest.book_locations(tb)
    assert any(re.search(r"src/npformer/module\.py:\d+ is written in book/linear\.md:\d+", s)
               for s in locations), locations
    # and the mapped book line of the innermost frame really is the line of code that raised
    loc = next(s for s in reversed(locations) if "module.py" in s).split(" is written in ")[1]
    path, line = loc.split(":")
    assert "raise ValueError" in (ROOT / path).read_text().splitlines()[int(line) - 1]


def _check_pdf():
    sys.path.insert(0, str(ROOT / "scripts"))
    import check_pdf

    return check_pdf


def test_no_printed_listing_is_longer_than_the_limit():
    """The PDF prints every code cell that is not folded: each fits about one page."""
    check_pdf = _check_pdf()
    long = [(chapter.name, n, first.strip()) for chapter in check_pdf.chapters()
            for n, first in check_pdf.code_cells(chapter)[2] if n > check_pdf.MAX_LISTING_LINES]
    assert long == []


def test_listing_lengths_count_printed_cells_and_code_blocks_but_not_folded_cells(tmp_path):
    check_pdf = _check_pdf()
    fence = "`" * 3
    body = "\n".join(f"x{i} = {i}" for i in range(7))
    text = (f"---\nkernelspec:\n  display_name: Python 3\n"
            f"  language: python\n  name: python3\n---\n\n# A chapter\n\n"
            f"{fence}{{code-cell}} ipython3\n{body}\n{fence}\n\n"
            f"{fence}{{code-cell}} ipython3\n:tags: [hide-input]\n\n{body}\n{body}\n{fence}\n\n"
            f"{fence}python\n{body}\n{body}\n{body}\n{fence}\n\n"
            f"{fence}{{graphviz}}\ndigraph g {{\n{body}\n{body}\n{body}\n{body}\n}}\n{fence}\n")
    chapter = tmp_path / "chapter.md"
    chapter.write_text(text, encoding="utf-8")
    lines, folded, listings = check_pdf.code_cells(chapter)
    assert folded == 1  # the hide-input cell is not printed
    assert sorted(n for n, _ in listings) == [7, 21]  # the printed cell and the python block
    assert len(lines) == 7
