"""Sphinx extension: label every exported code cell with the module it goes to.

A reader of the HTML or PDF book sees, above each exported cell, a line such as
``→ npformer/softmax.py``, so it is always clear which code is the library and
which is a demonstration.
"""

from __future__ import annotations

import sys
from pathlib import Path

from docutils import nodes


def _chapter_default_module(srcdir: Path, docname: str) -> str | None:
    root = str(srcdir)
    if root not in sys.path:
        sys.path.insert(0, root)
    import tangle

    path = srcdir / f"{docname}.md"
    if not path.exists():
        return None
    lines = path.read_text(encoding="utf-8").splitlines()
    meta, _ = tangle.parse_front_matter(lines, f"{docname}.md")
    return (meta.get(tangle.PACKAGE) or {}).get("module")


def label_exported_cells(app, doctree) -> None:
    docname = app.env.docname
    default = None
    for node in list(doctree.findall(nodes.container)):
        if node.get("nb_element") != "cell_code":
            continue
        meta = node.get("cell_metadata") or {}
        tags = meta.get("tags") or []
        if "export" not in tags:
            continue
        module = meta.get("module")
        if module is None:
            default = default or _chapter_default_module(Path(app.srcdir), docname)
            module = default
        target = f"npformer/{str(module).replace('.', '/')}.py"
        para = nodes.paragraph(classes=["tangle-target"])
        para += nodes.Text("\u2192 ")
        para += nodes.literal(text=target)
        # In the PDF the label stays on the page of the code it names: it starts a new
        # page unless a few lines of the listing fit below it.
        node.parent.insert(node.parent.index(node),
                           nodes.raw("", r"\Needspace{6\baselineskip}", format="latex"))
        node.parent.insert(node.parent.index(node), para)


def setup(app):
    app.connect("doctree-read", label_exported_cells)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
