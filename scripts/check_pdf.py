#!/usr/bin/env python3
"""Check the built PDF book as a reader of the printed page sees it.

1. No printed code or output line wraps: LaTeX marks the continuation of a wrapped
   verbatim line with a hook arrow, which pdftotext turns into "˓→".
2. Every line of every printed code cell is in the PDF. A code block that meets the
   foot of a page can lose lines in LaTeX's page breaking; this finds them. A cell
   folded in the HTML (tagged hide-input or hide-cell) is not printed: the PDF has a
   one-line note in its place (book/_ext/tangle_labels.py), one per folded cell.
3. At most MAX_RAISE printed lines start with ``raise``: validation is written with the
   shared check_* vocabulary, so the listings show the maths.
4. No exported cell's label ("→ npformer/....py") is left at the foot of a page, away
   from the code it names.
5. No printed listing is longer than MAX_LISTING_LINES lines: a code cell the PDF
   prints, or a literal code block of a chapter's text. A page of the PDF holds about
   68 lines of its 8-pt code, so a listing within the limit fits one printed page with
   the text that introduces it; a longer one keeps its maths in a visible cell and moves
   the plumbing (input checks, the cached inference path, imports) to a folded one.

Usage: python scripts/check_pdf.py [_build/latex/transformers-by-hand.pdf [chapter.md ...]]
(the chapters default to those of _toc.yml). Needs pdftotext (poppler-utils) and jupytext.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import jupytext
import yaml

ROOT = Path(__file__).resolve().parent.parent
MAX_RAISE = 40
MAX_LISTING_LINES = 60
# Fenced blocks of a chapter's text that print as code listings (directives such as
# graphviz, math or table print as something else).
LITERAL = re.compile(r"^$|^[\w+-]+$|^\{(?:code-block|code|sourcecode)\}")
WRAP_MARK = "˓→"
# pdftotext's typographic forms of what the code wrote in ASCII.
TYPOGRAPHIC = str.maketrans({"’": "'", "‘": "'", "“": '"', "”": '"', "−": "-"})
# Tags that fold a cell's input in the HTML, and the words of the PDF's note in its place.
FOLDED = {"hide-input", "hide-cell"}
FOLDED_NOTE = "folded in print"


def squeeze(text: str) -> str:
    return re.sub(r"\s+", " ", text.translate(TYPOGRAPHIC)).strip()


def chapters() -> list[Path]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [entry["file"] for entry in part.get("chapters", [])]
    return [ROOT / f"{f}.md" for f in files]


def fenced_blocks(markdown: str) -> list[tuple[str, list[str]]]:
    """The (info string, lines) of each fenced block of a markdown cell."""
    blocks, lines, i = [], markdown.splitlines(), 0
    while i < len(lines):
        m = re.match(r"\s*(`{3,}|~{3,})(.*)$", lines[i])
        if not m:
            i += 1
            continue
        fence, j = m.group(1), i + 1
        close = re.compile(rf"\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        blocks.append((m.group(2).strip(), lines[i + 1:j]))
        i = j + 1
    return blocks


def code_cells(path: Path) -> tuple[list[str], int, list[tuple[int, str]]]:
    """The lines of the code cells that the PDF prints, the number it folds, and the
    length and first line of each printed listing (code cells and literal blocks)."""
    lines, folded, listings = [], 0, []
    for cell in jupytext.read(path).cells:
        tags = set(cell.metadata.get("tags", []))
        if cell.cell_type == "markdown":
            listings += [(len(block), block[0] if block else "")
                         for info, block in fenced_blocks(cell.source) if LITERAL.match(info)]
        if cell.cell_type != "code" or {"remove-input", "remove-cell"} & tags:
            continue
        if FOLDED & tags:
            folded += bool(cell.source.strip())
        else:
            source = cell.source.splitlines()
            lines += source
            listings.append((len(source), source[0] if source else ""))
    return lines, folded, listings


def main(argv: list[str]) -> int:
    pdf = Path(argv[0]) if argv else ROOT / "_build/latex/transformers-by-hand.pdf"
    text = subprocess.run(["pdftotext", "-layout", str(pdf), "-"], check=True,
                          capture_output=True, text=True).stdout
    failures = []
    page_of = lambda pos: text.count("\f", 0, pos) + 1  # noqa: E731
    for m in re.finditer(WRAP_MARK, text):
        start = text.rfind("\n", 0, text.rfind("\n", 0, m.start())) + 1
        failures.append(f"p. {page_of(m.start())}: a wrapped line: "
                        f"{squeeze(text[start:m.start()])[:80]!r}")
    for number, page in enumerate(text.split("\f"), start=1):
        lines = [line.strip() for line in page.splitlines() if line.strip()]
        # The last two lines of a page are its footer; a label just above them is alone.
        # (A folded listing's label is a line complete in itself.)
        if any(line.startswith("→ npformer/") and FOLDED_NOTE not in line
               for line in lines[-3:]):
            failures.append(f"p. {number}: a module label is the last line of the page")
    flat = squeeze(text)
    raises = folded = longest = 0
    for path in [Path(p).resolve() for p in argv[1:]] or chapters():
        lines, n_folded, listings = code_cells(path)
        folded += n_folded
        for n_lines, first in listings:
            longest = max(longest, n_lines)
            if n_lines > MAX_LISTING_LINES:
                failures.append(f"{path.name}: a printed listing of {n_lines} lines (at most "
                                f"{MAX_LISTING_LINES}; fold its plumbing): {first.strip()[:60]!r}")
        for line in lines:
            raises += bool(re.match(r"\s*raise\b", line))
            want = squeeze(line)
            if len(want) >= 20 and want.isascii() and want not in flat:
                failures.append(f"{path.name}: a printed code line is missing "
                                f"from the PDF: {want[:80]!r}")
    if raises > MAX_RAISE:
        failures.append(f"{raises} printed lines start with raise (at most {MAX_RAISE})")
    notes = flat.count(FOLDED_NOTE)
    if notes != folded:
        failures.append(f"the chapters fold {folded} cells but the PDF has {notes} notes "
                        f"'... {FOLDED_NOTE} ...' in their place: a folded listing is printed "
                        f"(or a note is missing)")
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    print(f"{pdf.name}: {text.count(chr(12))} pages, {raises} printed raise lines, "
          f"{folded} folded listings, longest printed listing {longest} lines, "
          f"{len(failures)} problems")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
