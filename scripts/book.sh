#!/usr/bin/env bash
# Set up .venv, tangle the book, execute every chapter and build the HTML book and
# the PDF. The diagrams need Graphviz and the PDF needs TeX: both come from
# Debian/Ubuntu packages, which this script installs with apt-get when it may (as
# root, or with sudo that needs no password); otherwise it says what to run.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES="texlive-latex-recommended texlive-latex-extra texlive-fonts-recommended \
texlive-xetex latexmk tex-gyre graphviz"
missing_tools() {
    missing=()
    for tool in dot pdflatex latexmk; do
        command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
    done
    for sty in fncychap.sty tgtermes.sty emptypage.sty; do
        command -v kpsewhich >/dev/null 2>&1 && [ -n "$(kpsewhich "$sty" 2>/dev/null)" ] \
            || missing+=("$sty")
    done
}
missing_tools
if [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            SUDO="sudo -n"
        else
            SUDO="none"
        fi
    fi
    if [ "$SUDO" != "none" ]; then
        echo "Installing Graphviz and TeX (missing: ${missing[*]}); about a minute..."
        # shellcheck disable=SC2086
        if ! { $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq \
            && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
                --no-install-recommends $APT_PACKAGES >/dev/null; }; then
            echo "apt-get could not install them."
        fi
        missing_tools
    fi
fi
how_to_install() {
    echo "On Debian/Ubuntu install them with:"
    echo "  sudo apt-get install --no-install-recommends $APT_PACKAGES"
    echo "then run this script again."
}
if ! command -v dot >/dev/null 2>&1; then
    echo "The book's diagrams need Graphviz's dot, which is not installed."
    how_to_install
    exit 1
fi

bash scripts/setup.sh "${NPFORMER_EXTRAS:-book,dev,mpi,fast}"
source .venv/bin/activate
# One BLAS thread: the training cells then reproduce the committed logs of the full
# runs step for step, and a busy machine cannot oversubscribe its cores.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
python tangle.py
# -W: warnings are errors; -n: nitpicky cross-references. Chapters run in fresh
# kernels and their outputs are cached in _build/.jupyter_cache.
jupyter-book build -W -n --keep-going .
echo "HTML book: _build/html/index.html"

if [ ${#missing[@]} -gt 0 ]; then
    echo "PDF skipped: TeX is not installed (missing: ${missing[*]})."
    how_to_install
    exit 0
fi
# latexmk -silent: pdflatex's page-by-page chatter (and the undefined references
# of its first pass, which later passes resolve) stays in the .log file.
pdf=_build/latex/transformers-by-hand.pdf
if ! LATEXMKOPTS="${LATEXMKOPTS:--silent}" jupyter-book build . --builder pdflatex \
    || [ ! -s "$pdf" ]; then
    echo "The PDF build failed; the details are in ${pdf%.pdf}.log" >&2
    exit 1
fi
echo "PDF book: $pdf"
