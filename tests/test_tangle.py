"""Tests for ``tangle.py``: the book -> package contract (DESIGN.md, "The literate contract").

Each test builds a tiny throwaway book in ``tmp_path`` (a ``_toc.yml`` and a few
jupytext MyST chapters) and tangles it. Line numbers in expected error locations
are computed from the chapter text, so every assertion names the exact line.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import io
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]


def _load_tangle():
    if "tangle" in sys.modules:  # tests/conftest.py may have imported it already
        return sys.modules["tangle"]
    spec = importlib.util.spec_from_file_location("tangle", REPO / "tangle.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["tangle"] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


tangle = _load_tangle()

SRC = "src/npformer"

FRONT_MATTER = """\
---
jupytext:
  notebook_metadata_filter: npformer
  text_representation:
    extension: .md
    format_name: myst
    format_version: 0.13
    jupytext_version: 1.19.6
kernelspec:
  display_name: Python 3
  language: python
  name: python3
{npformer}---
"""


# --------------------------------------------------------------------------- helpers


def chapter(*parts: str, module: str | None = None, modules: tuple[str, ...] = (),
            forward: tuple[str, ...] = ()) -> str:
    """A chapter: jupytext front matter (declaring its modules), then the parts."""
    conf = ""
    if module or modules or forward:
        conf = "npformer:\n"
        if module:
            conf += f"  module: {module}\n"
        if modules:
            conf += f"  modules: [{', '.join(modules)}]\n"
        if forward:
            conf += f"  forward: [{', '.join(forward)}]\n"
    return FRONT_MATTER.format(npformer=conf) + "\n" + "\n".join(parts)


def cell(source: str, *, export: bool = False, module: str | None = None) -> str:
    """A ``{code-cell}`` as jupytext writes it: options, one blank line, code."""
    opts = ([f":module: {module}"] if module else []) + ([":tags: [export]"] if export else [])
    head = "```{code-cell} ipython3\n" + "".join(o + "\n" for o in opts) + ("\n" if opts else "")
    return head + textwrap.dedent(source).strip("\n") + "\n```\n"


def prose(text: str) -> str:
    return textwrap.dedent(text).strip("\n") + "\n"


def write_book(root: Path, chapters: dict[str, str]) -> Path:
    """Write ``_toc.yml`` (first chapter is the root, the rest in one part) and chapters."""
    names = list(chapters)
    toc = f"format: jb-book\nroot: book/{names[0]}\n"
    if names[1:]:
        toc += 'parts:\n  - caption: "Part I"\n    chapters:\n'
        toc += "".join(f"      - file: book/{n}\n" for n in names[1:])
    (root / "book").mkdir(parents=True, exist_ok=True)
    (root / "_toc.yml").write_text(toc, encoding="utf-8")
    for name, text in chapters.items():
        (root / "book" / f"{name}.md").write_text(text, encoding="utf-8")
    for old in (root / "book").glob("*.md"):  # a chapter dropped from the dict is removed
        if old.stem not in chapters:
            old.unlink()
    return root


def run(root: Path, *args: str) -> int:
    return tangle.main([*args, "--root", str(root)])


def tangled(root: Path, chapters: dict[str, str]) -> Path:
    """Write the book and tangle it, asserting success."""
    write_book(root, chapters)
    assert run(root) == 0
    return root


def src_bytes(root: Path) -> dict[str, bytes]:
    base = root / SRC
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(base.rglob("*.py"))}


def tree_state(root: Path) -> dict[str, tuple[bytes, int, int]]:
    """Every file under root: (bytes, mtime_ns, inode); equal states mean nothing was written."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            st_ = p.stat()
            out[p.relative_to(root).as_posix()] = (p.read_bytes(), st_.st_mtime_ns, st_.st_ino)
    return out


def line_of(root: Path, rel: str, needle: str) -> int:
    """1-based number of the one line of ``root/rel`` that contains ``needle``."""
    lines = (root / rel).read_text(encoding="utf-8").splitlines()
    hits = [n for n, line in enumerate(lines, 1) if needle in line]
    assert len(hits) == 1, f"{needle!r} occurs on lines {hits} of {rel}"
    return hits[0]


def expect_error(root: Path, capsys, where: str) -> str:
    """Tangling fails with an error at exactly ``where`` and writes nothing; returns it."""
    capsys.readouterr()
    before = tree_state(root)
    assert run(root) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{where}: error: "), err
    assert tree_state(root) == before
    return err


def two_chapter_book() -> dict[str, str]:
    return {
        "alpha": chapter(
            prose("# Alpha\n\nSome prose.\n\n## First section"),
            cell(
                """
                from __future__ import annotations


                def one() -> int:
                    return 1
                """,
                export=True,
            ),
            cell("one()"),
            module="alpha",
        ),
        "beta": chapter(
            prose("# Beta\n\n## Using alpha"),
            cell(
                """
                from npformer.alpha import one


                def two() -> int:
                    return one() + one()
                """,
                export=True,
            ),
            module="beta",
        ),
    }


# --------------------------------------------------------------------------- determinism


def test_first_run_writes_each_module_and_the_package_init(tmp_path, capsys):
    root = tangled(tmp_path, two_chapter_book())
    out = capsys.readouterr().out
    assert sorted(src_bytes(root)) == [
        f"{SRC}/__init__.py",
        f"{SRC}/alpha.py",
        f"{SRC}/beta.py",
    ]
    for rel in src_bytes(root):
        assert f"wrote {rel}" in out


def test_second_run_writes_nothing_and_leaves_every_byte_and_mtime_unchanged(tmp_path, capsys):
    root = tangled(tmp_path, two_chapter_book())
    before = tree_state(root)
    capsys.readouterr()
    assert run(root) == 0
    assert capsys.readouterr().out == ""
    assert tree_state(root) == before


def test_two_fresh_roots_with_the_same_book_get_identical_bytes(tmp_path):
    a = tangled(tmp_path / "a", two_chapter_book())
    b = tangled(tmp_path / "b", two_chapter_book())
    assert src_bytes(a) == src_bytes(b)
    assert src_bytes(a)  # not vacuous


def test_check_exits_zero_and_prints_nothing_on_a_clean_tree(tmp_path, capsys):
    root = tangled(tmp_path, two_chapter_book())
    capsys.readouterr()
    assert run(root, "--check") == 0
    assert capsys.readouterr() == ("", "")


# --------------------------------------------------------------------------- --check


def test_check_reports_an_edited_chapter_cell_as_stale_with_a_unified_diff(tmp_path, capsys):
    book = two_chapter_book()
    root = tangled(tmp_path, book)
    book["alpha"] = book["alpha"].replace("return 1", "return 10")
    write_book(root, book)
    before = tree_state(root)
    capsys.readouterr()
    assert run(root, "--check") == 1
    out = capsys.readouterr().out
    assert f"{SRC}/alpha.py: stale" in out
    assert f"--- a/{SRC}/alpha.py" in out and f"+++ b/{SRC}/alpha.py" in out
    assert "\n-    return 1\n" in out and "\n+    return 10\n" in out
    assert f"{SRC}/beta.py" not in out  # only the stale file is reported
    assert "run `python tangle.py`" in out
    assert tree_state(root) == before


def test_check_reports_a_missing_generated_file(tmp_path, capsys):
    root = tangled(tmp_path, two_chapter_book())
    (root / SRC / "beta.py").unlink()
    capsys.readouterr()
    assert run(root, "--check") == 1
    out = capsys.readouterr().out
    assert f"{SRC}/beta.py: missing" in out
    assert "+    return one() + one()" in out
    assert not (root / SRC / "beta.py").exists()


def test_check_reports_an_orphan_when_a_chapter_leaves_the_toc(tmp_path, capsys):
    book = two_chapter_book()
    root = tangled(tmp_path, book)
    del book["beta"]
    write_book(root, book)
    before = tree_state(root)
    capsys.readouterr()
    assert run(root, "--check") == 1
    out = capsys.readouterr().out
    assert f"{SRC}/beta.py: orphan" in out
    assert "-    return one() + one()" in out
    assert f"{SRC}/__init__.py: stale" in out  # it no longer re-exports two()
    assert tree_state(root) == before


def test_check_writes_nothing_even_when_files_are_stale_missing_and_orphaned(tmp_path, capsys):
    book = two_chapter_book()
    root = tangled(tmp_path, book)
    book["alpha"] = book["alpha"].replace("return 1", "return 10")
    del book["beta"]
    write_book(root, book)
    (root / SRC / "alpha.py").unlink()
    (root / SRC / "zeta.py").write_text("# not produced by any chapter\n", encoding="utf-8")
    before = tree_state(root)
    assert run(root, "--check") == 1
    assert tree_state(root) == before


# --------------------------------------------------------------------------- orphans


def test_a_normal_run_deletes_a_module_no_chapter_produces_any_more(tmp_path, capsys):
    book = two_chapter_book()
    root = tangled(tmp_path, book)
    del book["beta"]
    write_book(root, book)
    capsys.readouterr()
    assert run(root) == 0
    assert f"deleted {SRC}/beta.py" in capsys.readouterr().out
    assert sorted(src_bytes(root)) == [f"{SRC}/__init__.py", f"{SRC}/alpha.py"]
    assert "two" not in (root / SRC / "__init__.py").read_text(encoding="utf-8")
    assert run(root, "--check") == 0


def test_a_normal_run_removes_an_emptied_sub_package_directory(tmp_path):
    def book(module):
        return {"gpt": chapter(prose("# GPT"), cell("def gpt(): ...", export=True), module=module)}

    root = tangled(tmp_path, book("models.gpt"))
    models = root / SRC / "models"
    assert (models / "gpt.py").exists() and (models / "__init__.py").exists()
    (models / "__pycache__").mkdir()
    (models / "__pycache__" / "gpt.cpython-312.pyc").write_bytes(b"stale bytecode")
    tangled(tmp_path, book("gpt"))
    assert not models.exists()
    assert sorted(src_bytes(root)) == [f"{SRC}/__init__.py", f"{SRC}/gpt.py"]
    assert run(root, "--check") == 0


def test_a_main_module_is_generated_but_never_imported_by_the_package(tmp_path):
    book = {
        "cli": chapter(
            prose("# CLI"),
            cell("def main():\n    return 0", export=True),
            cell("from npformer.cli import main\n\nif __name__ == '__main__':\n    main()",
                 export=True, module="__main__"),
            module="cli",
            modules=("__main__",),
        )
    }
    root = tangled(tmp_path, book)
    assert (root / SRC / "__main__.py").exists()
    init = (root / SRC / "__init__.py").read_text(encoding="utf-8")
    assert "from npformer.cli import main" in init and "__main__" not in init


# --------------------------------------------------------------------------- write only if changed


def test_editing_one_chapter_rewrites_only_the_module_it_produces(tmp_path, capsys):
    book = two_chapter_book()
    root = tangled(tmp_path, book)
    before = tree_state(root)
    book["beta"] = book["beta"].replace("one() + one()", "2 * one()")
    write_book(root, book)
    capsys.readouterr()
    assert run(root) == 0
    assert capsys.readouterr().out == f"wrote {SRC}/beta.py\n"
    after = tree_state(root)
    for rel in (f"{SRC}/alpha.py", f"{SRC}/__init__.py"):
        assert after[rel] == before[rel]  # same bytes, same mtime, same inode
    assert after[f"{SRC}/beta.py"][0] != before[f"{SRC}/beta.py"][0]


# --------------------------------------------------------------------------- hand edits


def hand_edit(root: Path) -> tuple[Path, str]:
    path = root / SRC / "beta.py"
    text = path.read_text(encoding="utf-8").replace("one() + one()", "one() + one()  # my fix")
    path.write_text(text, encoding="utf-8")
    return path, text


def test_a_hand_edit_is_refused_names_the_chapter_and_is_kept_on_disk(tmp_path, capsys):
    book = two_chapter_book()
    root = tangled(tmp_path, book)
    path, edited = hand_edit(root)
    book["alpha"] = book["alpha"].replace("return 1", "return 10")  # also a real change
    write_book(root, book)
    before = tree_state(root)
    capsys.readouterr()
    rc = run(root)
    err = capsys.readouterr().err
    assert rc != 0
    assert f"{SRC}/beta.py: edited by hand" in err
    assert "Move the edit into book/beta.md" in err
    assert "--force" in err
    assert "\n-    return one() + one()  # my fix\n" in err  # the diff shows what to move
    assert path.read_text(encoding="utf-8") == edited
    assert tree_state(root) == before  # nothing at all is written while an edit is pending


def test_check_reports_a_hand_edited_file(tmp_path, capsys):
    root = tangled(tmp_path, two_chapter_book())
    path, edited = hand_edit(root)
    capsys.readouterr()
    assert run(root, "--check") == 1
    out = capsys.readouterr().out
    assert f"{SRC}/beta.py: edited by hand" in out
    assert "-    return one() + one()  # my fix" in out
    assert path.read_text(encoding="utf-8") == edited


def test_force_overwrites_a_hand_edited_file_with_the_book(tmp_path):
    root = tangled(tmp_path, two_chapter_book())
    fresh = (root / SRC / "beta.py").read_bytes()
    path, _ = hand_edit(root)
    assert run(root, "--force") == 0
    assert path.read_bytes() == fresh
    assert run(root, "--check") == 0


def test_a_generated_file_whose_hash_line_was_edited_counts_as_edited_by_hand(tmp_path, capsys):
    root = tangled(tmp_path, two_chapter_book())
    path = root / SRC / "alpha.py"
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace("# tangle-sha256: ", "# sha: "), encoding="utf-8")
    capsys.readouterr()
    assert run(root) == 2
    assert f"{SRC}/alpha.py: edited by hand" in capsys.readouterr().err


def test_an_edit_to_the_header_lines_counts_as_edited_by_hand(tmp_path, capsys):
    root = tangled(tmp_path, two_chapter_book())
    path = root / SRC / "alpha.py"
    edited = path.read_text(encoding="utf-8").replace("# Do not edit:", "# I did edit:")
    path.write_text(edited, encoding="utf-8")
    capsys.readouterr()
    assert run(root) == 2
    assert f"{SRC}/alpha.py: edited by hand" in capsys.readouterr().err
    assert path.read_text(encoding="utf-8") == edited


def test_a_hand_written_file_in_the_package_is_never_touched_even_by_force(tmp_path, capsys):
    """tangle deletes and overwrites only files it generated (they carry its header)."""
    root = tangled(tmp_path, two_chapter_book())
    mine = root / SRC / "mine.py"
    mine.write_text("def helper(): ...\n", encoding="utf-8")
    assert run(root) == 0 and run(root, "--check") == 0
    assert run(root, "--force") == 0
    assert mine.read_text(encoding="utf-8") == "def helper(): ...\n"


def test_force_refuses_to_overwrite_a_hand_written_file_a_chapter_now_produces(tmp_path, capsys):
    book = two_chapter_book()
    del book["beta"]
    root = tangled(tmp_path, book)
    mine = root / SRC / "beta.py"
    mine.write_text("def helper(): ...\n", encoding="utf-8")
    write_book(root, two_chapter_book())
    capsys.readouterr()
    assert run(root, "--force") == 2
    assert "not written by tangle" in capsys.readouterr().err
    assert mine.read_text(encoding="utf-8") == "def helper(): ...\n"


# --------------------------------------------------------------------------- errors at book lines


def test_a_syntax_error_in_an_exported_cell_is_reported_at_the_offending_line(tmp_path, capsys):
    root = write_book(
        tmp_path,
        {
            "alpha": chapter(
                prose("# Alpha"),
                cell(
                    """
                    import math


                    def broken(x):
                        return math.sqrt(x) +


                    y = 1
                    """,
                    export=True,
                ),
                module="alpha",
            )
        },
    )
    line = line_of(root, "book/alpha.md", "return math.sqrt(x) +")
    err = expect_error(root, capsys, f"book/alpha.md:{line}")
    assert "syntax error" in err


def test_a_syntax_error_on_the_first_code_line_is_reported_there(tmp_path, capsys):
    root = write_book(
        tmp_path,
        {"alpha": chapter(cell("def (:\n    pass", export=True), module="alpha")},
    )
    expect_error(root, capsys, f"book/alpha.md:{line_of(root, 'book/alpha.md', 'def (:')}")


def test_a_demo_cell_that_is_not_python_such_as_a_magic_is_allowed(tmp_path):
    root = tangled(
        tmp_path,
        {"alpha": chapter(cell("def f(): ...", export=True), cell("%timeit f()"), module="alpha")},
    )
    assert (root / SRC / "alpha.py").exists()


def test_an_undeclared_target_module_is_reported_at_its_module_option(tmp_path, capsys):
    root = write_book(
        tmp_path,
        {
            "alpha": chapter(
                prose("# Alpha"),
                cell("def f(): ...", export=True),
                cell("def g(): ...", export=True, module="foo"),
                module="alpha",
            )
        },
    )
    line = line_of(root, "book/alpha.md", ":module: foo")
    err = expect_error(root, capsys, f"book/alpha.md:{line}")
    assert "unknown target module 'foo'" in err and "modules:" in err


def test_a_target_module_in_a_yaml_option_block_is_located_too(tmp_path, capsys):
    text = chapter(
        "```{code-cell} ipython3\n---\ntags: [export]\nmodule: foo\n---\n\ndef g(): ...\n```\n",
        module="alpha",
    )
    root = write_book(tmp_path, {"alpha": text})
    line = line_of(root, "book/alpha.md", "module: foo")
    expect_error(root, capsys, f"book/alpha.md:{line}")


def test_a_declared_extra_module_is_an_allowed_target(tmp_path):
    root = tangled(
        tmp_path,
        {
            "alpha": chapter(
                cell("def f(): ...", export=True),
                cell("def g(): ...", export=True, module="extra"),
                module="alpha",
                modules=("extra",),
            )
        },
    )
    assert "def g()" in (root / SRC / "extra.py").read_text(encoding="utf-8")


def test_a_module_option_on_a_cell_not_tagged_export_is_an_error(tmp_path, capsys):
    text = chapter("```{code-cell} ipython3\n:module: alpha\n\nx = 1\n```\n", module="alpha")
    root = write_book(tmp_path, {"alpha": text})
    line = line_of(root, "book/alpha.md", ":module: alpha")
    assert "not tagged 'export'" in expect_error(root, capsys, f"book/alpha.md:{line}")


def test_an_exported_cell_in_a_chapter_without_a_module_is_an_error(tmp_path, capsys):
    root = write_book(tmp_path, {"alpha": chapter(prose("# A"), cell("x = 1", export=True))})
    line = line_of(root, "book/alpha.md", "{code-cell}")
    assert "has no target" in expect_error(root, capsys, f"book/alpha.md:{line}")


def test_a_duplicate_top_level_name_in_two_cells_is_reported_at_the_second(tmp_path, capsys):
    root = write_book(
        tmp_path,
        {
            "alpha": chapter(
                cell("def f():\n    return 1", export=True),
                cell("x = 2\n\n\ndef f():\n    return 2", export=True),
                module="alpha",
            )
        },
    )
    first = line_of(root, "book/alpha.md", "return 1") - 1
    second = line_of(root, "book/alpha.md", "return 2") - 1
    err = expect_error(root, capsys, f"book/alpha.md:{second}")
    assert "duplicate top-level name 'f' in module 'alpha'" in err
    assert f"already defined at book/alpha.md:{first}" in err


def test_a_duplicate_top_level_name_across_two_chapters_is_reported(tmp_path, capsys):
    root = write_book(
        tmp_path,
        {
            "alpha": chapter(cell("LIMIT = 3", export=True), module="alpha"),
            "beta": chapter(
                prose("# Beta"),
                cell("a, LIMIT = 1, 4", export=True, module="alpha"),
                modules=("alpha",),
            ),
        },
    )
    line = line_of(root, "book/beta.md", "a, LIMIT")
    err = expect_error(root, capsys, f"book/beta.md:{line}")
    assert "already defined at book/alpha.md:" in err


def test_the_same_name_in_two_different_modules_is_not_a_duplicate(tmp_path):
    root = tangled(
        tmp_path,
        {
            "alpha": chapter(cell("_EPS = 1e-5", export=True), module="alpha"),
            "beta": chapter(cell("_EPS = 1e-6", export=True), module="beta"),
        },
    )
    assert run(root, "--check") == 0


def test_subscript_and_attribute_assignments_define_no_new_names(tmp_path):
    root = tangled(
        tmp_path,
        {
            "alpha": chapter(
                cell(
                    "import types\n\n_REGISTRY = {}\nkey = 'a'\nNS = types.SimpleNamespace()",
                    export=True,
                ),
                cell("_REGISTRY[key] = 1\nNS.attr = 2", export=True),
                cell("_REGISTRY['b'] = 3", export=True),
                module="alpha",
            )
        },
    )
    assert "_REGISTRY['b'] = 3" in (root / SRC / "alpha.py").read_text(encoding="utf-8")


LATER_USES = {
    "from-module": ("from npformer.later import thing", "npformer.later.thing"),
    "from-package": ("from npformer import thing", "npformer.thing"),
    "attribute": ("import npformer as npf\n\nnpf.thing()", "npformer.thing"),
    "import-module": ("import npformer.later", "npformer.later"),
    "from-package-module": ("from npformer import later", "npformer.later"),
    "importlib": ('import importlib\n\nimportlib.import_module("npformer.later")',
                  "npformer.later"),
}


@pytest.mark.parametrize("exported", [True, False], ids=["exported-cell", "demo-cell"])
@pytest.mark.parametrize("use", sorted(LATER_USES))
def test_using_a_later_chapters_name_is_reported_at_the_use(tmp_path, capsys, use, exported):
    code, what = LATER_USES[use]
    root = write_book(
        tmp_path,
        {
            "early": chapter(
                prose("# Early"),
                cell("def first(): ...", export=True),
                cell("import numpy\n\n" + code, export=exported),
                module="early",
            ),
            "later": chapter(
                prose("# Later"), cell("def thing(): ...", export=True), module="later"
            ),
        },
    )
    needle = code.splitlines()[-1]
    line = line_of(root, "book/early.md", needle)
    err = expect_error(root, capsys, f"book/early.md:{line}")
    assert f"{what} is used before the chapter that defines it (book/later.md:" in err


PREVIEW_FRONT = FRONT_MATTER.format(npformer="npformer:\n  preview: true\n")


@pytest.mark.parametrize("use", sorted(LATER_USES))
def test_a_preview_chapter_may_use_any_chapters_names(tmp_path, use):
    code, _ = LATER_USES[use]
    root = tangled(
        tmp_path,
        {
            "index": chapter(prose("# Book")),
            "preview": PREVIEW_FRONT + "\n" + prose("# At work") + cell("import numpy\n\n" + code),
            "later": chapter(prose("# Later"), cell("def thing(): ...", export=True),
                             module="later"),
        },
    )
    assert "def thing" in (root / SRC / "later.py").read_text(encoding="utf-8")


def test_a_preview_chapter_still_needs_the_names_to_exist(tmp_path, capsys):
    root = write_book(
        tmp_path,
        {
            "index": chapter(prose("# Book")),
            "preview": PREVIEW_FRONT + "\n" + prose("# At work")
            + cell("from npformer.later import missing"),
            "later": chapter(prose("# Later"), cell("def thing(): ...", export=True),
                             module="later"),
        },
    )
    line = line_of(root, "book/preview.md", "import missing")
    err = expect_error(root, capsys, f"book/preview.md:{line}")
    assert "defines no name 'missing'" in err


def test_a_preview_chapter_exports_nothing(tmp_path, capsys):
    root = write_book(
        tmp_path,
        {
            "index": chapter(prose("# Book")),
            "preview": PREVIEW_FRONT + "\n" + prose("# At work")
            + cell("def thing(): ...", export=True),
        },
    )
    line = line_of(root, "book/preview.md", ":tags: [export]")
    err = expect_error(root, capsys, f"book/preview.md:{line}")
    assert "a preview chapter exports nothing" in err


def test_using_a_name_from_a_later_cell_of_the_same_chapter_is_reported(tmp_path, capsys):
    root = write_book(
        tmp_path,
        {
            "alpha": chapter(
                cell("from npformer.alpha import g\n\ng()"),
                cell("def g(): ...", export=True),
                module="alpha",
            )
        },
    )
    line = line_of(root, "book/alpha.md", "from npformer.alpha import g")
    err = expect_error(root, capsys, f"book/alpha.md:{line}")
    assert "used before the cell that defines it" in err


def test_using_an_earlier_chapters_names_in_any_form_is_fine(tmp_path):
    uses = "\n".join(code for code, _ in LATER_USES.values())
    root = tangled(
        tmp_path,
        {
            "later": chapter(cell("def thing(): ...", export=True), module="later"),
            "early": chapter(
                cell(uses), cell(uses.replace("npf.thing()", "x = 1"), export=True), module="early"
            ),
        },
    )
    assert run(root, "--check") == 0


@pytest.mark.parametrize(
    "code, message",
    [
        ("from npformer.alpha import nothing", "'npformer.alpha' defines no name 'nothing'"),
        ("from npformer.nowhere import f", "no chapter exports module 'npformer.nowhere'"),
        ("from npformer import nothing", "'npformer.nothing' is not defined by any chapter"),
    ],
)
def test_using_a_name_no_chapter_defines_is_reported(tmp_path, capsys, code, message):
    root = write_book(
        tmp_path, {"alpha": chapter(cell("def f(): ...", export=True), cell(code), module="alpha")}
    )
    line = line_of(root, "book/alpha.md", code)
    assert message in expect_error(root, capsys, f"book/alpha.md:{line}")


def test_two_chapters_with_the_same_default_module_are_an_error(tmp_path, capsys):
    root = write_book(
        tmp_path,
        {
            "alpha": chapter(cell("def f(): ...", export=True), module="shared"),
            "beta": chapter(cell("def g(): ...", export=True), module="shared"),
        },
    )
    line = line_of(root, "book/beta.md", "module: shared")
    err = expect_error(root, capsys, f"book/beta.md:{line}")
    assert "already the module of book/alpha.md" in err and "modules:" in err


def test_a_second_chapter_may_add_to_a_module_it_declares(tmp_path):
    root = tangled(
        tmp_path,
        {
            "alpha": chapter(prose("# A"), cell("def f(): ...", export=True), module="shared"),
            "beta": chapter(
                prose("# B"),
                cell("def g(): ...", export=True, module="shared"),
                modules=("shared",),
            ),
        },
    )
    text = (root / SRC / "shared.py").read_text(encoding="utf-8")
    assert text.startswith("# Generated by tangle.py from book/alpha.md, book/beta.md.\n")
    assert text.index("def f()") < text.index("def g()")


def _forward_book(device_code: str = "def here(): ...") -> dict[str, str]:
    """An early chapter that uses the module 'device' of a later chapter, declared forward."""
    return {
        "early": chapter(
            prose("# Early"),
            cell("from npformer.device import here\n\n\ndef first():\n    return here()",
                 export=True),
            cell("import npformer.device\n\nnpformer.device.here()"),
            module="early",
        ),
        "later": chapter(
            prose("# Later"),
            cell(device_code, export=True, module="device"),
            cell("def thing(): ...", export=True),
            module="later", modules=("device",), forward=("device",),
        ),
    }


def test_earlier_chapters_may_import_a_module_declared_forward(tmp_path, capsys):
    root = tangled(tmp_path, _forward_book())
    assert "from npformer.device import here" in (root / SRC / "early.py").read_text()
    book = _forward_book()
    book["later"] = book["later"].replace("  forward: [device]\n", "")  # now refused
    write_book(tmp_path, book)
    line = line_of(tmp_path, "book/early.md", "from npformer.device import here")
    err = expect_error(tmp_path, capsys, f"book/early.md:{line}")
    assert "npformer.device.here is used before the chapter that defines it" in err


def test_a_module_declared_forward_may_import_nothing_of_the_package(tmp_path, capsys):
    root = write_book(tmp_path, _forward_book("from npformer.early import first\n\n\n"
                                              "def here(): ..."))
    line = line_of(root, "book/later.md", "from npformer.early import first")
    err = expect_error(root, capsys, f"book/later.md:{line}")
    assert "'device' is declared forward" in err and "circle" in err


def test_a_forward_module_must_be_a_module_of_its_chapter(tmp_path, capsys):
    book = _forward_book()
    book["later"] = book["later"].replace("forward: [device]", "forward: [early]")
    root = write_book(tmp_path, book)
    err = expect_error(root, capsys, "book/later.md:1")
    assert "forward module 'early' is not a module of this chapter" in err


def test_a_future_import_in_a_later_cell_is_hoisted_to_the_top_of_the_module(tmp_path):
    root = tangled(
        tmp_path,
        {
            "alpha": chapter(
                cell("def f(): ...", export=True),
                cell("from __future__ import annotations\n\n\ndef g(): ...", export=True),
                module="alpha",
            )
        },
    )
    gen = (root / SRC / "alpha.py").read_text(encoding="utf-8").splitlines()
    assert gen[3] == "from __future__ import annotations"
    assert gen.count("from __future__ import annotations") == 1


def test_imports_are_hoisted_merged_deduplicated_and_sorted(tmp_path):
    root = tangled(
        tmp_path,
        {
            "beta": chapter(cell("ONE = 1\n\n\nclass One: ...\n\n\ndef two(): ...",
                                 export=True), module="beta"),
            "alpha": chapter(
                cell("import numpy as np\nfrom npformer.beta import two\n\n\ndef f():\n"
                     "    return np.pi", export=True),
                cell("import math\nimport numpy as np\nfrom collections import OrderedDict\n"
                     "from npformer.beta import ONE, One\n\nX = math.e", export=True),
                module="alpha",
            ),
        },
    )
    gen = (root / SRC / "alpha.py").read_text(encoding="utf-8").split("\n")
    assert gen[3:11] == [
        "import math",
        "from collections import OrderedDict",
        "",
        "import numpy as np",
        "",
        "from npformer.beta import ONE, One, two",
        "",
        "",
    ]
    assert gen[11].startswith("# [book/alpha.md")
    assert "X = math.e" in gen and sum(line.startswith(("import", "from")) for line in gen) == 4


def test_a_future_import_in_the_first_cell_of_each_module_is_fine(tmp_path):
    future = "from __future__ import annotations\n\n\n"
    tangled(
        tmp_path,
        {
            "alpha": chapter(cell(future + "def f(): ...", export=True), module="alpha"),
            "beta": chapter(cell(future + "def g(): ...", export=True), module="beta"),
        },
    )


def test_a_public_name_exported_by_two_modules_is_an_error(tmp_path, capsys):
    root = write_book(
        tmp_path,
        {
            "alpha": chapter(cell("def f(): ...", export=True), module="alpha"),
            "beta": chapter(cell("x = 1\n\n\ndef f(): ...", export=True), module="beta"),
        },
    )
    err = expect_error(root, capsys, f"book/beta.md:{line_of(root, 'book/beta.md', 'def f')}")
    assert "exported by both npformer.alpha and npformer.beta" in err


def test_a_code_fence_that_is_never_closed_is_reported_at_its_opening(tmp_path, capsys):
    text = chapter(prose("# A"), "```{code-cell} ipython3\n:tags: [export]\n\nx = 1\n", module="a")
    root = write_book(tmp_path, {"alpha": text})
    line = line_of(root, "book/alpha.md", "{code-cell}")
    assert "never closed" in expect_error(root, capsys, f"book/alpha.md:{line}")


def test_a_chapter_listed_in_the_toc_but_missing_is_an_error(tmp_path, capsys):
    root = write_book(tmp_path, {"alpha": chapter(prose("# A"))})
    (root / "_toc.yml").write_text("root: book/alpha\nchapters:\n  - file: book/gone\n")
    expect_error(root, capsys, "_toc.yml")


def test_code_cells_inside_a_longer_markdown_fence_are_examples_not_cells(tmp_path):
    example = "````md\n" + cell("def example(): ...", export=True) + "````\n"
    root = tangled(
        tmp_path, {"alpha": chapter(example, cell("def f(): ...", export=True), module="alpha")}
    )
    text = (root / SRC / "alpha.py").read_text(encoding="utf-8")
    assert "def f()" in text and "example" not in text


# --------------------------------------------------------------------------- headers and anchors


def test_a_generated_file_starts_with_a_header_and_a_hash_of_header_and_body(tmp_path):
    root = tangled(tmp_path, two_chapter_book())
    text = (root / SRC / "alpha.py").read_text(encoding="utf-8")
    l0, l1, l2, body = text.split("\n", 3)
    assert l0 == "# Generated by tangle.py from book/alpha.md."
    assert l1 == "# Do not edit: edit the book, then run `python tangle.py`."
    signed = f"{l0}\n{l1}\n{body}"
    assert l2 == "# tangle-sha256: " + hashlib.sha256(signed.encode()).hexdigest()[:16]
    init = (root / SRC / "__init__.py").read_text(encoding="utf-8")
    assert init.startswith("# Generated by tangle.py from _toc.yml.\n")


def test_each_exported_cell_is_preceded_by_a_back_reference_to_its_section(tmp_path):
    root = tangled(
        tmp_path,
        {
            "alpha": chapter(
                cell("def before_any_heading(): ...", export=True),
                prose("# The `alpha` chapter\n\n## Softmax, *stable*"),
                cell("def f(): ...", export=True),
                cell("def g(): ...", export=True),
                cell("print(g())"),
                prose("## The `zero_grad` method"),
                cell("def h(): ...", export=True),
                module="alpha",
            )
        },
    )
    refs = [
        line
        for line in (root / SRC / "alpha.py").read_text(encoding="utf-8").splitlines()
        if line.startswith("# [")
    ]
    assert refs == [
        "# [book/alpha.md § alpha]",  # no heading yet: the chapter's file name
        "# [book/alpha.md § Softmax, stable]",
        "# [book/alpha.md § Softmax, stable (2)]",
        "# [book/alpha.md § The zero_grad method]",  # code spans are kept verbatim
    ]


def test_prose_or_demos_added_above_do_not_change_a_modules_bytes(tmp_path):
    book = two_chapter_book()
    root = tangled(tmp_path, book)
    before = src_bytes(root)
    book["alpha"] = book["alpha"].replace(
        "Some prose.\n", "Some prose.\n\nA new paragraph\nover two lines.\n\n" + cell("1 + 1")
    )
    book["beta"] = book["beta"].replace("one() + one()", "2 * one()")  # an unrelated chapter
    tangled(tmp_path, book)
    after = src_bytes(root)
    assert after[f"{SRC}/alpha.py"] == before[f"{SRC}/alpha.py"]
    assert after[f"{SRC}/__init__.py"] == before[f"{SRC}/__init__.py"]
    assert after[f"{SRC}/beta.py"] != before[f"{SRC}/beta.py"]


# --------------------------------------------------------------------------- where


def where_book() -> dict[str, str]:
    return {
        "alpha": chapter(
            prose("# Alpha\n\n## Part one"),
            cell("import math\n\n\ndef root2():\n    return math.sqrt(2)", export=True),
            prose("Prose between.\n\n## Part two"),
            cell("```python\nnot a cell\n```".replace("`", "~")),  # a demo with odd content
            cell("\n\ndef half(x):\n    # halve it\n    return x / 2\n", export=True),
            module="alpha",
        )
    }


def test_where_maps_every_code_line_to_the_identical_book_line(tmp_path):
    root = tangled(tmp_path, where_book())
    gen = (root / SRC / "alpha.py").read_text(encoding="utf-8").splitlines()
    book = (root / "book/alpha.md").read_text(encoding="utf-8").splitlines()
    mapped = 0
    for n, line in enumerate(gen, 1):
        loc = tangle.where(root, f"{SRC}/alpha.py:{n}")
        if loc.startswith("book/"):
            chapter_path, _, book_line = loc.rpartition(":")
            assert chapter_path == "book/alpha.md"
            target = book[int(book_line) - 1]
            if line.startswith("# ["):
                assert target.startswith("```{code-cell}")  # back-reference -> the cell fence
            else:
                assert target == line
                mapped += 1
        else:
            assert "boilerplate" in loc
    assert mapped == 6  # import math (hoisted), root2's two lines, half's three


def test_where_on_the_command_line_prints_the_exact_book_line(tmp_path, capsys):
    root = tangled(tmp_path, where_book())
    gen = (root / SRC / "alpha.py").read_text(encoding="utf-8").splitlines()
    n = gen.index("    return x / 2") + 1
    capsys.readouterr()
    assert tangle.main(["where", f"{SRC}/alpha.py:{n}", "--root", str(root)]) == 0
    expected = line_of(root, "book/alpha.md", "return x / 2")
    assert capsys.readouterr().out == f"book/alpha.md:{expected}\n"


def test_where_accepts_an_absolute_path(tmp_path, capsys):
    root = tangled(tmp_path, where_book())
    gen = (root / SRC / "alpha.py").read_text(encoding="utf-8").splitlines()
    n = gen.index("    return math.sqrt(2)") + 1
    capsys.readouterr()
    assert run(root, "where", f"{root / SRC / 'alpha.py'}:{n}") == 0
    assert capsys.readouterr().out == f"book/alpha.md:{line_of(root, 'book/alpha.md', 'sqrt')}\n"


@pytest.mark.parametrize(
    "rel, n", [(f"{SRC}/alpha.py", 1), (f"{SRC}/alpha.py", 3), (f"{SRC}/__init__.py", 5)]
)
def test_where_reports_header_and_init_lines_as_boilerplate(tmp_path, capsys, rel, n):
    root = tangled(tmp_path, where_book())
    capsys.readouterr()
    assert run(root, "where", f"{rel}:{n}") == 0
    assert capsys.readouterr().out == f"{rel}:{n} is generated boilerplate (header or spacing)\n"


@pytest.mark.parametrize(
    "location, message",
    [
        (f"{SRC}/alpha.py", "expected <file>:<line>"),
        (f"{SRC}/alpha.py:x", "expected <file>:<line>"),
        (f"{SRC}/alpha.py:0", "generated lines; got line 0"),
        (f"{SRC}/alpha.py:999", "generated lines; got line 999"),
        (f"{SRC}/nope.py:1", "is not generated by any chapter"),
        ("/elsewhere/alpha.py:1", "is not inside"),
    ],
)
def test_where_rejects_bad_locations_with_a_clear_error(tmp_path, capsys, location, message):
    root = tangled(tmp_path, where_book())
    capsys.readouterr()
    assert run(root, "where", location) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err


def test_where_without_a_location_is_a_usage_error(tmp_path):
    root = tangled(tmp_path, where_book())
    with pytest.raises(SystemExit) as exc:
        run(root, "where")
    assert exc.value.code == 2


# --------------------------------------------------------------------------- __init__.py


def test_the_package_init_reexports_public_defs_sorted_as_isort_sorts_them(tmp_path):
    root = tangled(
        tmp_path,
        {
            "alpha": chapter(
                cell("def zeta(): ...\n\n\ndef _hidden(): ...\n\n\nCONSTANT = 1", export=True),
                cell("class Alpha: ...", export=True),
                cell("def extra(): ...", export=True, module="extra"),
                module="alpha",
                modules=("extra",),
            ),
            "beta": chapter(cell("async def beta(): ...", export=True), module="beta"),
        },
    )
    init = (root / SRC / "__init__.py").read_text(encoding="utf-8")
    body = init.split('"""\n\n', 1)[1]
    assert body == (
        "from npformer.alpha import Alpha, zeta\n"
        "from npformer.beta import beta\n"
        "from npformer.extra import extra\n"
        "\n"
        "__all__ = [\n"
        '    "Alpha",\n'
        '    "beta",\n'
        '    "extra",\n'
        '    "zeta",\n'
        "]\n"
    )


def test_a_long_reexport_is_wrapped_one_name_per_line(tmp_path):
    names = [f"function_number_{k}" for k in range(8)]
    code = "\n\n\n".join(f"def {n}(): ..." for n in names)
    root = tangled(tmp_path, {"alpha": chapter(cell(code, export=True), module="alpha")})
    init = (root / SRC / "__init__.py").read_text(encoding="utf-8")
    block = "from npformer.alpha import (\n" + "".join(f"    {n},\n" for n in names) + ")\n"
    assert block in init
    assert max(len(line) for line in init.splitlines()) <= 100


def test_a_sub_package_module_gets_its_own_init(tmp_path):
    root = tangled(
        tmp_path,
        {
            "gpt": chapter(
                cell("class GPT: ...", export=True),
                cell("_CACHE = {}", export=True, module="models.util"),
                module="models.gpt",
                modules=("models.util",),
            )
        },
    )
    assert sorted(src_bytes(root)) == [
        f"{SRC}/__init__.py",
        f"{SRC}/models/__init__.py",
        f"{SRC}/models/gpt.py",
        f"{SRC}/models/util.py",
    ]
    sub = (root / SRC / "models" / "__init__.py").read_text(encoding="utf-8")
    assert "from npformer.models.gpt import GPT\n" in sub
    top = (root / SRC / "__init__.py").read_text(encoding="utf-8")
    assert "from npformer.models.gpt import GPT\n" in top
    # a module without public names is still imported, as a valid statement
    assert "from npformer.models import util  # noqa: F401\n" in top


def test_the_tangled_package_imports_in_a_fresh_interpreter(tmp_path):
    book = two_chapter_book()
    book["gpt"] = chapter(
        cell("from npformer.beta import two\n\n\nclass GPT:\n    size = two()", export=True),
        cell("_CACHE = {}", export=True, module="models.util"),
        module="models.gpt",
        modules=("models.util",),
    )
    root = tangled(tmp_path, book)
    code = (
        "import npformer, npformer.models as m\n"
        "assert npformer.GPT.size == 2 and m.GPT is npformer.GPT\n"
        "assert npformer.models.util._CACHE == {}\n"
        "assert npformer.__all__ == ['GPT', 'one', 'two']\n"
    )
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


# --------------------------------------------------------------------------- the real book


def test_the_real_book_is_tangled_and_src_is_up_to_date(capsys):
    rc = tangle.main(["--check", "--root", str(REPO)])
    assert rc == 0, "src/ is stale; run `python tangle.py`:\n" + capsys.readouterr().out


def test_the_real_packages_modules_import_one_another_without_a_circle():
    """Every import of the package, at the top or inside a function, by name or through
    importlib, points to a module the importing one does not lead back to."""
    src = REPO / SRC
    names = {".".join(p.relative_to(src).with_suffix("").parts): p for p in src.rglob("*.py")
             if p.name != "__init__.py"}
    imports: dict[str, set[str]] = {}
    for name, path in names.items():
        refs = tangle.package_references(ast.parse(path.read_text(encoding="utf-8")), name)
        imports[name] = set()
        for mod, member, _ in refs:
            mod = f"{mod}.{member}" if f"{mod}.{member}" in names else mod
            if mod in names and mod != name:
                imports[name].add(mod)
    assert {"softmax", "module"} <= imports["kernels"]  # the graph is really read

    def path_back(start: str) -> list[str] | None:
        stack = [[start]]
        seen = set()
        while stack:
            trail = stack.pop()
            for nxt in imports[trail[-1]]:
                if nxt == start:
                    return trail + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(trail + [nxt])
        return None

    circles = [trail for name in sorted(names) if (trail := path_back(name))]
    assert circles == []


# --------------------------------------------------------------------------- property


NAMES = st.from_regex(r"[a-z][a-z0-9]{0,6}", fullmatch=True)
HEADINGS = st.from_regex(r"[A-Z][a-z]{0,8}( [a-z]{1,6}){0,2}", fullmatch=True)


@st.composite
def small_books(draw):
    """1-3 chapters, each with headings, exported functions and demo cells."""
    n_chapters = draw(st.integers(1, 3))
    funcs = draw(st.lists(NAMES, min_size=n_chapters, max_size=8, unique=True))
    split = sorted(
        draw(st.lists(st.integers(0, len(funcs)), min_size=n_chapters - 1, max_size=n_chapters - 1))
    )
    groups = [funcs[a:b] for a, b in zip([0, *split], [*split, len(funcs)])]
    chapters, defined = {}, []  # defined: (module, function) from earlier chapters and cells
    for k, group in enumerate(groups):
        module = f"ch{k}"
        parts = [prose(f"# {draw(HEADINGS)}\n\nSome prose for chapter {k}.")]
        for name in group:
            if draw(st.booleans()):
                parts.append(prose(f"## {draw(HEADINGS)}"))
            value = draw(st.integers(-5, 5))
            doc = draw(st.sampled_from(["", '    """Docstring."""\n']))
            parts.append(cell(f"def f_{name}(x=0):\n{doc}    return x + {value}", export=True))
            defined.append((module, f"f_{name}"))
            if draw(st.booleans()):
                mod, fn = draw(st.sampled_from(defined))
                parts.append(cell(f"from npformer.{mod} import {fn}\n\n{fn}(1)"))
        chapters[f"c{k}"] = chapter(*parts, module=module)
    return chapters


@settings(max_examples=25, deadline=None)
@given(book=small_books())
def test_any_small_book_tangles_deterministically_and_idempotently(book):
    with tempfile.TemporaryDirectory() as tmp:
        roots = [write_book(Path(tmp) / name, book) for name in ("a", "b")]
        for root in roots:
            assert tangle.tangle(root, out=io.StringIO()) == 0
        first = src_bytes(roots[0])
        assert first == src_bytes(roots[1])
        before = tree_state(roots[0])
        out = io.StringIO()
        assert tangle.tangle(roots[0], out=out) == 0
        assert out.getvalue() == ""
        assert tree_state(roots[0]) == before
        assert tangle.tangle(roots[0], check=True, out=io.StringIO()) == 0
        _, linemap = tangle.render(tangle.load_book(roots[0]))
        chapters = {f"book/{name}.md": text.splitlines() for name, text in book.items()}
        for rel, data in first.items():
            compile(data, rel, "exec", dont_inherit=True)
            lines = data.decode().splitlines()
            assert lines[0].startswith("# Generated by tangle.py from ")
            assert len(linemap[rel]) == len(lines)
            for line, loc in zip(lines, linemap[rel]):  # code maps to the same chapter line
                if loc is not None and not line.startswith("# ["):
                    path, _, at = loc.rpartition(":")
                    assert chapters[path][int(at) - 1] == line


# --------------------------------------------------------------------------- malformed books


def test_an_empty_toc_or_a_toc_that_is_a_list_deletes_nothing_and_exits_2(tmp_path, capsys):
    root = tangled(tmp_path, two_chapter_book())
    for text in ("", "# nothing here\n", "- file: book/alpha\n"):
        (root / "_toc.yml").write_text(text, encoding="utf-8")
        before = tree_state(root)
        capsys.readouterr()
        assert run(root) == 2
        assert capsys.readouterr().err.startswith("_toc.yml:1: error: ")
        assert tree_state(root) == before


@pytest.mark.parametrize("toc, where, says", [
    ("root: book/alpha\nparts: [\n", "_toc.yml:3", "not valid YAML"),
    ("root: book/alpha\nparts: 5\n", "_toc.yml:1", "toc.parts: expected a list, got 5"),
    ("root: book/alpha\nparts:\n  - chapters: [7]\n", "_toc.yml:1",
     "toc.parts[0].chapters[0]: expected a mapping"),
    ("root: book/alpha\nroot: book/beta\n", "_toc.yml:2", "duplicate key 'root'"),
])
def test_a_malformed_toc_is_a_named_error_at_its_line(tmp_path, capsys, toc, where, says):
    root = tangled(tmp_path, two_chapter_book())
    (root / "_toc.yml").write_text(toc, encoding="utf-8")
    assert says in expect_error(root, capsys, where)


def test_a_bad_byte_is_reported_at_its_file_and_line(tmp_path, capsys):
    root = tangled(tmp_path, two_chapter_book())
    path = root / "book" / "beta.md"
    line = line_of(root, "book/beta.md", "return one() + one()")
    data = path.read_bytes().replace(b"return one() + one()", b"return one() + \xff")
    path.write_bytes(data)
    err = expect_error(root, capsys, f"book/beta.md:{line}")
    assert "not valid UTF-8: byte 0xff" in err
    toc = root / "_toc.yml"
    toc.write_bytes(toc.read_bytes().replace(b"Part I", b"Part \xff"))
    path.write_bytes(data.replace(b"\xff", b"one()"))
    assert "byte 0xff" in expect_error(root, capsys, "_toc.yml:4")


def test_a_bad_byte_in_a_generated_file_is_a_hand_edit_that_force_repairs(tmp_path, capsys):
    root = tangled(tmp_path, two_chapter_book())
    path = root / SRC / "alpha.py"
    good = path.read_bytes()
    path.write_bytes(good.replace(b"return 1", b"return \xff"))
    capsys.readouterr()
    assert run(root) == 2
    assert f"{SRC}/alpha.py: edited by hand" in capsys.readouterr().err
    assert run(root, "--force") == 0 and path.read_bytes() == good


def test_a_byte_order_mark_is_rejected_by_name_not_misread(tmp_path, capsys):
    root = tangled(tmp_path, two_chapter_book())
    path = root / "book" / "beta.md"
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert "byte-order mark" in expect_error(root, capsys, "book/beta.md:1")


def test_a_deleted_closing_fence_is_named_as_such(tmp_path, capsys):
    book = two_chapter_book()
    book["beta"] = book["beta"] + cell("x = 1")
    root = tangled(tmp_path, book)
    text = (root / "book" / "beta.md").read_text(encoding="utf-8")
    first_close = text.index("\n```\n", text.index("{code-cell}"))
    (root / "book" / "beta.md").write_text(text[:first_close] + text[first_close + 4:],
                                           encoding="utf-8")
    fence = text[:text.index("{code-cell}")].count("\n") + 1
    err = expect_error(root, capsys, f"book/beta.md:{fence}")
    assert "is not closed before the next code cell" in err


def test_a_yaml_error_in_front_matter_is_reported_at_its_own_line(tmp_path, capsys):
    root = tangled(tmp_path, two_chapter_book())
    path = root / "book" / "beta.md"
    path.write_text(path.read_text(encoding="utf-8").replace(
        "  module: beta\n", "  module: [beta\n"), encoding="utf-8")
    line = line_of(root, "book/beta.md", "module: [beta")
    assert "not valid YAML" in expect_error(root, capsys, f"book/beta.md:{line}")


def test_a_duplicate_front_matter_key_is_an_error_not_a_silent_override(tmp_path, capsys):
    root = tangled(tmp_path, two_chapter_book())
    path = root / "book" / "beta.md"
    path.write_text(path.read_text(encoding="utf-8").replace(
        "npformer:\n  module: beta\n", "npformer:\n  module: beta\nnpformer:\n  module: gamma\n"),
        encoding="utf-8")
    line = line_of(root, "book/beta.md", "module: gamma") - 1
    assert "duplicate key 'npformer'" in expect_error(root, capsys, f"book/beta.md:{line}")


@pytest.mark.parametrize("typo", ["exprot", "exports", "Export", "expor"])
def test_a_tag_that_looks_like_export_is_an_error(tmp_path, capsys, typo):
    root = tangled(tmp_path, two_chapter_book())
    path = root / "book" / "beta.md"
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace(":tags: [export]", f":tags: [{typo}]", 1), encoding="utf-8")
    line = line_of(root, "book/beta.md", f":tags: [{typo}]")
    err = expect_error(root, capsys, f"book/beta.md:{line}")
    assert f"unknown tag {typo!r}: did you mean 'export'?" in err


def test_other_jupyter_book_tags_are_accepted(tmp_path):
    book = two_chapter_book()
    book["beta"] += cell("print(1)").replace("```{code-cell} ipython3\n",
                                             "```{code-cell} ipython3\n:tags: [hide-input, "
                                             "remove-output, raises-exception]\n\n")
    tangled(tmp_path, book)


def test_a_chapter_leaving_the_toc_and_a_vanishing_name_are_reported(tmp_path, capsys):
    book = two_chapter_book()
    root = tangled(tmp_path, book)
    toc = (root / "_toc.yml").read_text(encoding="utf-8")
    (root / "_toc.yml").write_text(toc.replace("      - file: book/beta\n", ""), "utf-8")
    capsys.readouterr()
    assert run(root, "--check") == 1
    err = capsys.readouterr().err
    assert "warning: book/beta.md has exported cells but is not in _toc.yml" in err
    assert f"warning: {SRC}/beta.py will be deleted" in err
    assert f"warning: {SRC}/__init__.py: public name 'two' is no longer produced" in err


def test_a_run_that_would_delete_most_of_the_package_is_refused(tmp_path, capsys):
    book = {n: chapter(prose(f"# {n}"), cell(f"def f_{n}(): ...", export=True), module=n)
            for n in ("alpha", "beta", "gamma", "delta", "eps")}
    root = tangled(tmp_path, book)
    write_book(root, {"alpha": book["alpha"], "beta": book["beta"]})  # 3 of 5 modules go
    before = tree_state(root)
    capsys.readouterr()
    assert run(root) == 2
    assert "would delete 3 of the" in capsys.readouterr().err
    assert tree_state(root) == before
