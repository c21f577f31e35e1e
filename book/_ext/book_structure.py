"""Sphinx extension: give the PDF the structure the HTML sidebar shows.

Jupyter Book turns each part of ``_toc.yml`` into a toctree with a caption. The
HTML sidebar shows those captions, but Sphinx's LaTeX builder drops them when it
inlines the toctrees into one document. This extension puts them back:

- the first, unnumbered part (the Preface, the overview, the Notation page) is front
  matter: its chapters carry no number, exactly as in the HTML;
- a Part is written in ``_toc.yml`` as two parts: an unnumbered part whose caption
  names it ("Part I: the building blocks") and holds only its opener page, then a
  numbered part without a caption that holds its chapters. The pair becomes one
  ``\\part{...}`` ("Part I", "Part II", ...) whose first, unnumbered chapter is the
  opener; the chapters after it are numbered on from the previous Part, as in the HTML
  (sphinx-multitoc-numbering skips the unnumbered parts). A numbered part with a caption
  (a Part without an opener) starts its ``\\part`` itself;
- a later unnumbered part whose caption names no Part ("Appendices") is an unnumbered
  ``\\part`` whose chapters are unnumbered, as in the HTML.

Sphinx numbers the figures and tables of every unnumbered page (front matter, Part
openers, appendices) with one counter, 1, 2, 3, ..., in the order of the pages; the PDF
prints the same numbers.

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


_ARABIC = (r"\ifdefined\npfthefigure\else\let\npfthefigure\thefigure"
           r"\let\npfthetable\thetable\fi"
           r"\renewcommand{\thefigure}{\arabic{figure}}\renewcommand{\thetable}{\arabic{table}}")
_RESTORE = r"\ifdefined\npfthefigure\let\thefigure\npfthefigure\let\thetable\npfthetable\fi"


def _part_title(caption: str) -> str:
    match = PART_RE.match(caption)
    title = match.group(2) if match else caption
    return title[:1].upper() + title[1:]


def _part_latex(caption: str | None, numbered: bool, first: bool) -> str:
    if numbered:
        latex = r"\setcounter{secnumdepth}{%d}%s" % (SECNUMDEPTH, _RESTORE)
        if caption:  # a Part without an opener page starts here
            latex += "\n\\part{%s}" % _part_title(caption)
        # Without a caption, the chapters continue the Part their opener began.
        return latex + "\n"
    if caption and PART_RE.match(caption):
        # A Part's opener: a numbered \part, then the opener as an unnumbered chapter.
        return "\\setcounter{secnumdepth}{%d}\\part{%s}\n\\setcounter{secnumdepth}{-1}%s\n" % (
            SECNUMDEPTH, _part_title(caption), _ARABIC)
    # Front matter or appendices: nothing in these parts carries a number.
    latex = r"\setcounter{secnumdepth}{-2}" + _ARABIC
    if caption and not first:
        latex += "\n\\part{%s}" % caption
    return latex + "\n"


def add_part_markers(app, doctree) -> None:
    """Before each toctree of the root document, insert its LaTeX part command."""
    if app.env.docname != app.config.root_doc:
        return
    toctrees = list(doctree.findall(addnodes.toctree))
    for i, toctree in enumerate(toctrees):
        latex = _part_latex(toctree.get("caption"), bool(toctree.get("numbered")), i == 0)
        raw = nodes.raw("", latex, format="latex")
        toctree.parent.insert(toctree.parent.index(toctree), raw)


def number_unnumbered_figures(app, doctree, docname) -> None:
    """LaTeX only: a page outside the numbered parts starts its figure and table
    counters where the HTML's numbers for it start (one sequence over all such pages)."""
    if app.builder.format != "latex" or docname != app.config.root_doc:
        return
    for sof in list(doctree.findall(addnodes.start_of_file)):
        numbers = app.env.toc_fignumbers.get(sof.get("docname", ""), {})
        latex = ""
        for figtype, counter in (("figure", "figure"), ("table", "table")):
            firsts = [n for n in numbers.get(figtype, {}).values() if len(n) == 1]
            if firsts:
                latex += r"\setcounter{%s}{%d}" % (counter, min(firsts)[0] - 1)
        if latex:
            sof.insert(0, nodes.raw("", latex + "\n", format="latex"))


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
    app.connect("doctree-resolved", number_unnumbered_figures)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
