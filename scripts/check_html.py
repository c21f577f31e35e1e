#!/usr/bin/env python3
"""Check the built HTML book as a reader's browser sees it, with no network.

1. No page loads a script or stylesheet from off the machine.
2. Headless Chromium opens each chapter from file:// and MathJax (served from
   _build/html/_static/mathjax) typesets its maths: the rendered DOM holds
   <mjx-container> elements and no raw TeX (``$$``, ``\\frac``, ``\\[``) is left
   in the visible text.
3. Listings and display equations fit the page, measured in the browser with every
   folded cell unfolded:
   - in a window WIDE px wide (1300), no listing (code or output, at most 100
     columns) and no display equation is wider than its box: nothing scrolls;
   - in a window NARROW px wide (800), a box wider than the text scrolls inside
     itself (no content is clipped) and nothing makes the page scroll sideways.
   A copy of each page with a measuring script added is written to a temporary
   folder (with a <base> pointing at the page's folder), so the build is not touched.

Usage: python scripts/check_html.py [_build/html] [chapter.html ...]
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REMOTE = re.compile(r"""<(?:script|link)\b[^>]*\b(?:src|href)\s*=\s*["']?(?:https?:)?//""", re.I)
RAW_TEX = ("$$", "\\frac", "\\[", "\\begin{")
WIDE, NARROW = 1300, 800
REPORT_ID = "npf-width-report"
# Runs once MathJax has typeset the page: opens every folded cell, then measures every
# listing and display equation of the article, and writes the result into the DOM.
MEASURE = """
<script>
(function () {
  function scroller(el, stop) {  // the box that clips el's overflow: el or an ancestor
    for (var e = el; e && e !== stop; e = e.parentElement) {
      var ox = getComputedStyle(e).overflowX;
      if (ox !== "visible") return {el: e, ox: ox};
    }
    return null;
  }
  function measure() {
    var art = document.querySelector("article") || document.body;
    var doc = document.documentElement, boxes = [];
    art.querySelectorAll("pre, div.math, mjx-container[display='true']").forEach(function (el) {
      if (el.getClientRects().length === 0) return;  // not displayed
      var sw = el.scrollWidth, cw = el.clientWidth;
      var clip = scroller(el, art.parentElement);
      var section = el.closest("section[id]");
      var inner = document.createRange();  // the width the content needs
      inner.selectNodeContents(el.querySelector("mjx-math") || el);
      boxes.push({kind: el.tagName.toLowerCase() === "pre" ? "listing" : "equation",
                  what: (el.textContent || "").trim().replace(/\\s+/g, " ").slice(0, 60),
                  section: section ? section.id : "", scroll: sw, client: cw,
                  need: Math.ceil(inner.getBoundingClientRect().width),
                  clip: clip ? clip.ox : "none",
                  right: Math.round(el.getBoundingClientRect().right)});
    });
    var out = document.createElement("script");
    out.type = "application/json";
    out.id = "%s";
    out.textContent = JSON.stringify({width: window.innerWidth, page: doc.scrollWidth,
                                      view: doc.clientWidth, boxes: boxes});
    document.body.appendChild(out);
  }
  window.addEventListener("load", function () {
    document.querySelectorAll("details").forEach(function (d) { d.open = true; });
    var mj = window.MathJax && window.MathJax.startup && window.MathJax.startup.promise;
    (mj || Promise.resolve()).then(function () { setTimeout(measure, 500); });
  });
})();
</script>
""" % REPORT_ID


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


def render(chromium: str, page: Path, width: int) -> str:
    """The DOM of page after a browser window `width` px wide ran it, with MEASURE added."""
    source = page.read_text(encoding="utf-8")
    base = f'<base href="{page.resolve().parent.as_uri()}/">'
    source = re.sub(r"<head>", lambda m: m.group(0) + base, source, count=1)
    source = re.sub(r"</body>", lambda m: MEASURE + m.group(0), source, count=1)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / page.name
        copy.write_text(source, encoding="utf-8")
        cmd = [
            chromium, "--headless", "--no-sandbox", "--disable-gpu",
            "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run", "--disable-quic",
            f"--user-data-dir={tmp}/profile", "--virtual-time-budget=20000",
            f"--window-size={width},1000", "--dump-dom", copy.as_uri(),
        ]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        raise RuntimeError(f"chromium failed on {page}: {run.stderr[-2000:]}")
    return run.stdout


def width_report(dom: str) -> dict:
    m = re.search(rf'<script type="application/json" id="{REPORT_ID}">(.*?)</script>', dom, re.S)
    if m is None:
        raise RuntimeError("the page's width measurement did not run")
    return json.loads(html.unescape(m.group(1)))


def width_problems(report: dict, wide: bool) -> list[str]:
    """What does not fit: at WIDE any box wider than itself; at NARROW a page that scrolls
    sideways or a box whose overflow is cut off instead of scrolling."""
    bad = []
    if report["page"] > report["view"] + 1:
        bad.append(f"the page is {report['page']} px wide in a {report['view']} px window")
    for box in report["boxes"]:
        where = f"{box['kind']} in #{box['section']} ({box['what'][:40]!r})"
        over = box["scroll"] - box["client"]
        if over <= 1:
            continue
        if wide:
            bad.append(f"{where} is {over} px wider than its {box['client']} px box")
        elif box["clip"] not in ("auto", "scroll"):
            bad.append(f"{where} overflows its box by {over} px (overflow: {box['clip']})")
    return bad


def main(argv: list[str]) -> int:
    build = Path(argv[0]) if argv else Path("_build/html")
    pages = [build / p for p in argv[1:]] or sorted((build / "book").glob("*.html"))
    failures = remote_assets(build)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("error: chromium not found (Debian package: chromium)", file=sys.stderr)
        return 1
    # Two browsers at a time (CI has two cores); each page in its two window widths.
    with ThreadPoolExecutor(max_workers=2) as pool:
        doms = {(page, width): pool.submit(render, chromium, page, width)
                for page in pages for width in (WIDE, NARROW)}
    for page in pages:
        source = page.read_text(encoding="utf-8")
        has_math = 'class="math' in source
        dom = doms[page, WIDE].result()
        n = dom.count("<mjx-container")
        raw = [t for t in RAW_TEX if t in visible_text(dom)]
        status = "ok"
        if has_math and n == 0:
            status = "maths NOT typeset"
            failures.append(f"{page}: {status}")
        if raw:
            status = f"raw TeX left in text: {raw}"
            failures.append(f"{page}: {status}")
        wide = width_report(dom)
        narrow = width_report(doms[page, NARROW].result())
        for report, is_wide in ((wide, True), (narrow, False)):
            for problem in width_problems(report, is_wide):
                failures.append(f"{page.relative_to(build)} at {report['width']} px: {problem}")
        widest = {kind: max([b["need"] for b in wide["boxes"] if b["kind"] == kind] or [0])
                  for kind in ("listing", "equation")}
        box = min([b["client"] for b in wide["boxes"]] or [0])
        print(f"{page.relative_to(build)}: {n} typeset formulas, {status}; at {WIDE} px the "
              f"widest listing needs {widest['listing']} px and the widest equation "
              f"{widest['equation']} px (boxes: {box} px)")
    for f in failures:
        print(f"FAIL {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
