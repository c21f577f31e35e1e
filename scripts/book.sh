#!/usr/bin/env bash
# Set up .venv, tangle the book, execute every chapter and build the HTML book;
# build the PDF too when TeX is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "${NPFORMER_EXTRAS:-book,dev,mpi}"
source .venv/bin/activate
# One BLAS thread: the training cells then reproduce the committed logs of the full
# runs step for step, and a busy machine cannot oversubscribe its cores.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
python tangle.py
# -W: warnings are errors; -n: nitpicky cross-references. Chapters run in fresh
# kernels and their outputs are cached in _build/.jupyter_cache.
jupyter-book build -W -n --keep-going .
echo "HTML book: _build/html/index.html"

missing=()
for tool in pdflatex latexmk; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
for sty in fncychap.sty tgtermes.sty; do
    command -v kpsewhich >/dev/null 2>&1 && [ -n "$(kpsewhich "$sty" 2>/dev/null)" ] \
        || missing+=("$sty")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "PDF skipped: TeX is not installed (missing: ${missing[*]})."
    echo "On Debian/Ubuntu install it with:"
    echo "  sudo apt-get install --no-install-recommends texlive-latex-recommended \\"
    echo "    texlive-latex-extra texlive-fonts-recommended texlive-xetex latexmk tex-gyre"
    exit 0
fi
jupyter-book build . --builder pdflatex
pdf=_build/latex/transformers-by-hand.pdf
test -s "$pdf"
echo "PDF book: $pdf"
