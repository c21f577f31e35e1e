"""Sphinx extension: label every exported code cell with the module it goes to.

A reader of the HTML or PDF book sees, above each exported cell, a line such as
``→ npformer/softmax.py``, so it is always clear which code is the library and
which is a demonstration.

A cell whose input is folded in the HTML (tagged ``hide-input`` or ``hide-cell``) is
plumbing: in the PDF its listing is replaced by a one-line note saying where to read
it (the module, the HTML edition, the notebook), and its outputs stay in place.
"""

from __future__ import annotations

import sys
from pathlib import Path

from docutils import nodes
from sphinx.transforms.post_transforms import SphinxPostTransform

# myst-nb's hide modes in which a cell's input is folded.
FOLDED_INPUT = {"input", "input+output", "all"}
FOLDED_NOTE = "listing folded in print: it is in the HTML edition and in the module"


def _repo_root(path: Path) -> Path:
    """The folder holding tangle.py: the source folder, or above it (a one-page build)."""
    for folder in [path, *path.parents]:
        if (folder / "tangle.py").exists():
            return folder
    return path


def _chapter_default_module(path: Path) -> str | None:
    root = _repo_root(path.parent)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import tangle

    if not path.exists():
        return None
    lines = path.read_text(encoding="utf-8").splitlines()
    meta, _ = tangle.parse_front_matter(lines, path.relative_to(root).as_posix())
    return (meta.get(tangle.PACKAGE) or {}).get("module")


def label_exported_cells(app, doctree) -> None:
    docname = app.env.docname
    path = Path(app.env.doc2path(docname))
    default = None
    for node in list(doctree.findall(nodes.container)):
        if node.get("nb_element") != "cell_code":
            continue
        # For the note that replaces a folded listing in print.
        node["npf_notebook"] = path.relative_to(_repo_root(path.parent)).as_posix()
        meta = node.get("cell_metadata") or {}
        tags = meta.get("tags") or []
        if "export" not in tags:
            continue
        module = meta.get("module")
        if module is None:
            default = default or _chapter_default_module(path)
            module = default
        target = f"npformer/{str(module).replace('.', '/')}.py"
        para = nodes.paragraph(classes=["tangle-target"])
        para += nodes.Text("\u2192 ")
        para += nodes.literal(text=target)
        # In the PDF the label stays on the page of the code it names: it starts a new
        # page unless a few lines of the listing fit below it.
        node.parent.insert(node.parent.index(node),
                           nodes.raw("", r"\Needspace{6\baselineskip}", format="latex",
                                     classes=["tangle-needspace"]))
        node.parent.insert(node.parent.index(node), para)


def _has_image(cell: nodes.Element) -> bool:
    return any(uri.get("uri", "").rsplit(".", 1)[-1] in {"png", "svg", "jpg", "pdf"}
               for uri in cell.findall(nodes.image))


class FoldListingsInPrint(SphinxPostTransform):
    """In the PDF, a folded cell's listing becomes one line; its outputs stay."""

    default_priority = 100
    builders = ("latex",)

    def run(self, **kwargs) -> None:
        for cell in list(self.document.findall(nodes.container)):
            if cell.get("nb_element") != "cell_code" or cell.get("hide_mode") not in FOLDED_INPUT:
                continue
            sources = [c for c in cell.children if c.get("nb_element") == "cell_code_source"]
            if not sources:
                continue
            parent = cell.parent
            at = parent.index(cell)
            label = parent[at - 1] if at > 0 else None
            if isinstance(label, nodes.paragraph) and "tangle-target" in label["classes"]:
                # An exported cell: its module label says where the code is.
                label += nodes.Text(f" ({FOLDED_NOTE})")
                label["classes"].append("tangle-folded")
                before = parent[at - 2] if at > 1 else None
                if isinstance(before, nodes.raw) and "tangle-needspace" in before["classes"]:
                    parent.remove(before)  # one line needs no room kept below it
                for source in sources:
                    cell.remove(source)
                continue
            what = "Plotting code" if _has_image(cell) else "Code"
            note = nodes.paragraph(classes=["folded-listing"])
            notebook = cell.get("npf_notebook", "its notebook")
            note += nodes.emphasis(
                text=f"{what} folded in print: it is in the HTML edition and in {notebook}.")
            for i, source in enumerate(sources):
                if i == 0:
                    cell.replace(source, note)
                else:
                    cell.remove(source)


def setup(app):
    app.connect("doctree-read", label_exported_cells)
    app.add_post_transform(FoldListingsInPrint)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
