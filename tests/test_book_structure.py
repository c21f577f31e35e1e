"""The PDF's Part structure: book/_ext/book_structure.py turns _toc.yml's parts into LaTeX."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("sphinx")  # the extension is a Sphinx extension (the book extra)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_ext"))
from book_structure import _part_latex  # noqa: E402


def latex_of_toc() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    return [_part_latex(p.get("caption"), bool(p.get("numbered")), i == 0)
            for i, p in enumerate(toc["parts"])]


def test_each_part_caption_makes_one_numbered_part_and_its_opener_is_unnumbered():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    latex = latex_of_toc()
    parts = [t for t in latex if r"\part{" in t]
    captions = [p["caption"] for p in toc["parts"] if p.get("caption")]
    assert len(parts) == len(captions)  # Parts I-IV and the appendices, once each
    for part, text in zip(toc["parts"], latex):
        caption = part.get("caption") or ""
        if caption.startswith("Part "):
            assert not part.get("numbered"), caption  # the opener's part is unnumbered
            assert text.index(r"\setcounter{secnumdepth}{2}") < text.index(r"\part{")
            assert r"\setcounter{secnumdepth}{-1}" in text  # the opener: no chapter number
            assert len(part["chapters"]) == 1


def test_caption_less_numbered_parts_continue_numbering_without_a_new_part():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    for part, text in zip(toc["parts"], latex_of_toc()):
        if part.get("numbered") and not part.get("caption"):
            assert r"\part" not in text
            assert r"\setcounter{secnumdepth}{2}" in text


def test_front_matter_and_appendices_are_unnumbered():
    latex = latex_of_toc()
    assert latex[0].startswith(r"\setcounter{secnumdepth}{-2}") and r"\part" not in latex[0]
    assert r"\setcounter{secnumdepth}{-2}" in latex[-1] and r"\part{Appendices}" in latex[-1]
    assert _part_latex("Part II: four models, trained", False, False).count(
        r"\part{Four models, trained}") == 1
