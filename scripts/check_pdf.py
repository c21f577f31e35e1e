#!/usr/bin/env python3
"""Check the built PDF book as a reader of the printed page sees it.

1. No printed code or output line wraps: LaTeX marks the continuation of a wrapped
   verbatim line with a hook arrow, which pdftotext turns into "˓→".
2. Every line of every printed code cell is in the PDF. A code block that meets the
   foot of a page can lose lines in LaTeX's page breaking; this finds them.
3. At most MAX_RAISE printed lines start with ``raise``: validation is written with the
   shared check_* vocabulary, so the listings show the maths.
4. No exported cell's label ("→ npformer/....py") is left at the foot of a page, away
   from the code it names.

Usage: python scripts/check_pdf.py [_build/latex/transformers-by-hand.pdf]
Needs pdftotext (poppler-utils) and jupytext.
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
WRAP_MARK = "˓→"
# pdftotext's typographic forms of what the code wrote in ASCII.
TYPOGRAPHIC = str.maketrans({"’": "'", "‘": "'", "“": '"', "”": '"', "−": "-"})


def squeeze(text: str) -> str:
    return re.sub(r"\s+", " ", text.translate(TYPOGRAPHIC)).strip()


def chapters() -> list[Path]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [entry["file"] for entry in part.get("chapters", [])]
    return [ROOT / f"{f}.md" for f in files]


def printed_code_lines(path: Path) -> list[str]:
    """The lines of the code cells that the book prints (not removed or input-removed)."""
    lines = []
    for cell in jupytext.read(path).cells:
        tags = cell.metadata.get("tags", [])
        if cell.cell_type == "code" and not {"remove-input", "remove-cell"} & set(tags):
            lines += cell.source.splitlines()
    return lines


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
        if any(line.startswith("→ npformer/") for line in lines[-3:]):
            failures.append(f"p. {number}: a module label is the last line of the page")
    flat = squeeze(text)
    raises = 0
    for path in chapters():
        for line in printed_code_lines(path):
            raises += bool(re.match(r"\s*raise\b", line))
            want = squeeze(line)
            if len(want) >= 20 and want.isascii() and want not in flat:
                failures.append(f"{path.relative_to(ROOT)}: a printed code line is missing "
                                f"from the PDF: {want[:80]!r}")
    if raises > MAX_RAISE:
        failures.append(f"{raises} printed lines start with raise (at most {MAX_RAISE})")
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    print(f"{pdf.name}: {text.count(chr(12))} pages, {raises} printed raise lines, "
          f"{len(failures)} problems")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
