"""Sphinx extension: give the PDF the structure the HTML sidebar shows.

Jupyter Book turns each part of ``_toc.yml`` into a toctree with a caption. The
HTML sidebar shows those captions, but Sphinx's LaTeX builder drops them when it
inlines the toctrees into one document. This extension puts them back:

- the first, unnumbered part (the Preface) is front matter: its chapter carries
  no number, exactly as in the HTML;
- every numbered part starts with ``\\part{...}`` ("Part I", "Part II", ...),
  and its chapters are numbered on from the previous part, as in the HTML;
- a later unnumbered part ("Appendices") is an unnumbered ``\\part`` whose
  chapters are unnumbered, as in the HTML.

The Bibliography page's entries are gathered by Sphinx's LaTeX writer at the end
of the PDF under their own heading, so its (then empty) chapter is dropped from
the PDF.

In the PDF a figure that a cell prints stays where the cell prints it (the
``figure_align: H`` of ``_config.yml``), but a Graphviz diagram may float.

It also gives the kernels that execute the chapters CurveZMQ keys when pyzmq
supports them, so they do not run over unencrypted TCP (which ipykernel warns
about once per chapter).
"""

from __future__ import annotations

import re

from docutils import nodes
from sphinx import addnodes

PART_RE = re.compile(r"^Part\s+([IVXLC]+)\s*[:.]\s*(.+)$")
SECNUMDEPTH = 2  # chapter.section.subsection, the depth the HTML numbers


def _part_latex(caption: str | None, numbered: bool, first: bool) -> str:
    if not numbered:
        # Front matter or appendices: nothing in these parts carries a number.
        lines = [r"\setcounter{secnumdepth}{-2}"]
        if first:
            # The HTML numbers the Preface's figures 1, 2, ...; so does the PDF.
            lines.append(r"\let\npfthefigure\thefigure\renewcommand{\thefigure}{\arabic{figure}}")
        if caption and not first:
            lines.append(r"\part{%s}" % caption)
        return "\n".join(lines) + "\n"
    title = caption or ""
    match = PART_RE.match(title)
    if match:
        title = match.group(2)
    title = title[:1].upper() + title[1:]
    restore = r"\ifdefined\npfthefigure\let\thefigure\npfthefigure\fi"
    return "\\setcounter{secnumdepth}{%d}%s\n\\part{%s}\n" % (SECNUMDEPTH, restore, title)


def add_part_markers(app, doctree) -> None:
    """Before each toctree of the root document, insert its LaTeX part command."""
    if app.env.docname != app.config.root_doc:
        return
    toctrees = list(doctree.findall(addnodes.toctree))
    for i, toctree in enumerate(toctrees):
        latex = _part_latex(toctree.get("caption"), bool(toctree.get("numbered")), i == 0)
        raw = nodes.raw("", latex, format="latex")
        toctree.parent.insert(toctree.parent.index(toctree), raw)


def drop_empty_bibliography_chapter(app, doctree, docname) -> None:
    """LaTeX only: the bibliography chapter is empty once its entries are gathered."""
    if app.builder.format != "latex" or docname != app.config.root_doc:
        return
    for sof in list(doctree.findall(addnodes.start_of_file)):
        if not sof.get("docname", "").endswith("bibliography"):
            continue
        if not any(True for _ in sof.findall(nodes.citation)):
            # Keep the chapter's label, so that links to it reach the gathered entries.
            label = r"\phantomsection\label{\detokenize{%s::doc}}" % sof["docname"]
            sof.parent.replace(sof, nodes.raw("", label + "\n", format="latex"))


def _encrypt_kernels() -> None:
    try:
        import zmq
        from jupyter_client.manager import KernelManager
    except ImportError:  # pragma: no cover - the book extra installs both
        return
    # jupyter_client 8.10 added the policy; older versions have no such trait.
    trait = getattr(KernelManager, "transport_encryption", None)
    if trait is not None and zmq.has("curve"):
        trait.default_value = "auto"


def float_diagrams(app) -> None:
    """In the PDF, a cell's figure stays where the cell prints it (``figure_align: H``);
    a Graphviz diagram, which no cell prints, may float to the top of a page instead of
    leaving a gap where it does not fit."""
    if app.builder.format != "latex":
        return
    from sphinx.ext.graphviz import graphviz

    base = app.registry.get_translator_class(app.builder) or app.builder.default_translator_class

    class Translator(base):
        def visit_figure(self, node):
            align = self.elements["figure_align"]
            if next(iter(node.findall(graphviz)), None) is not None:
                self.elements["figure_align"] = "htbp"
            try:
                super().visit_figure(node)
            finally:
                self.elements["figure_align"] = align

    app.set_translator(app.builder.name, Translator, override=True)


def setup(app):
    _encrypt_kernels()
    app.connect("builder-inited", float_diagrams)
    app.connect("doctree-read", add_part_markers)
    app.connect("doctree-resolved", drop_empty_bibliography_chapter)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
