#!/usr/bin/env python3
"""Check the built HTML book as a reader's browser sees it, with no network.

1. No page loads a script or stylesheet from off the machine.
2. Headless Chromium opens each chapter from file:// and MathJax (served from
   _build/html/_static/mathjax) typesets its maths: the rendered DOM holds
   <mjx-container> elements and no raw TeX (``$$``, ``\\frac``, ``\\[``) is left
   in the visible text.

Usage: python scripts/check_html.py [_build/html] [chapter.html ...]
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REMOTE = re.compile(r"""<(?:script|link)\b[^>]*\b(?:src|href)\s*=\s*["']?(?:https?:)?//""", re.I)
RAW_TEX = ("$$", "\\frac", "\\[", "\\begin{")


def remote_assets(build: Path) -> list[str]:
    bad = []
    for page in sorted(build.rglob("*.html")):
        for m in REMOTE.finditer(page.read_text(encoding="utf-8", errors="replace")):
            tag = page.read_text(encoding="utf-8")[m.start() : m.start() + 160].split(">")[0]
            bad.append(f"{page.relative_to(build)}: {tag}>")
    return bad


def visible_text(dom: str) -> str:
    hidden = r"<(script|style|pre|mjx-assistive-mml|math)\b.*?</\1>"  # code and MathML
    dom = re.sub(hidden, " ", dom, flags=re.S | re.I)
    return html.unescape(re.sub(r"<[^>]+>", " ", dom))


def render(chromium: str, page: Path) -> str:
    with tempfile.TemporaryDirectory() as profile:
        cmd = [
            chromium, "--headless", "--no-sandbox", "--disable-gpu",
            "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run", "--disable-quic",
            f"--user-data-dir={profile}", "--virtual-time-budget=20000",
            "--dump-dom", page.resolve().as_uri(),
        ]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        raise RuntimeError(f"chromium failed on {page}: {run.stderr[-2000:]}")
    return run.stdout


def main(argv: list[str]) -> int:
    build = Path(argv[0]) if argv else Path("_build/html")
    pages = [build / p for p in argv[1:]] or sorted((build / "book").glob("*.html"))
    failures = remote_assets(build)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("error: chromium not found (Debian package: chromium)", file=sys.stderr)
        return 1
    for page in pages:
        source = page.read_text(encoding="utf-8")
        has_math = 'class="math' in source
        dom = render(chromium, page)
        n = dom.count("<mjx-container")
        raw = [t for t in RAW_TEX if t in visible_text(dom)]
        status = "ok"
        if has_math and n == 0:
            status = "maths NOT typeset"
            failures.append(f"{page}: {status}")
        if raw:
            status = f"raw TeX left in text: {raw}"
            failures.append(f"{page}: {status}")
        print(f"{page.relative_to(build)}: {n} typeset formulas, {status}")
    for f in failures:
        print(f"FAIL {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
