"""Run a test file's tests where pytest is not installed (a bare GPU machine).

    python3 scripts/plain_tests.py tests/test_gpu.py -m gpu --junitxml results.xml

A stand-in for the few pytest names such files use (``mark``, ``mark.parametrize``,
``importorskip``, ``skip``, ``approx``, ``raises`` and the ``tmp_path`` fixture) is put
in place of pytest, the file is imported, and each selected test (every combination of
its parameters) runs once. Each test is reported as PASS, FAIL or SKIP with its
traceback; the exit status is 1 when one failed and 5 when none ran, as pytest's.
``scripts/gpu_check.sh`` uses it only when ``python3 -m pytest`` is missing, and says so
in its results.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import re
import sys
import tempfile
import time
import traceback
import types
import xml.etree.ElementTree as ET
from pathlib import Path


class Skipped(Exception):
    """A test (or the whole file) skipped, with its reason."""


class Mark:
    """``pytest.mark.NAME`` or ``pytest.mark.NAME(args)``: a decorator that records itself."""

    def __init__(self, name: str, args: tuple = (), kwargs: dict | None = None) -> None:
        self.name, self.args, self.kwargs = name, args, kwargs or {}

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:  # as a decorator
            args[0].__dict__.setdefault("plain_marks", []).append(self)  # nearest first
            return args[0]
        return Mark(self.name, args, kwargs)


class MarkGenerator:
    def __getattr__(self, name: str) -> Mark:
        return Mark(name)


class approx:  # noqa: N801 (pytest's name)
    """pytest.approx for scalars: |got - expected| <= max(rel |expected|, abs), with
    pytest's defaults (rel 1e-6, abs 1e-12; abs alone means no relative part)."""

    def __init__(self, expected, rel=None, abs=None) -> None:  # noqa: A002
        self.expected, self.rel, self.abs = float(expected), rel, abs

    def tolerance(self) -> float:
        absolute = 1e-12 if self.abs is None else self.abs
        if self.rel is None and self.abs is not None:
            return absolute
        return max((1e-6 if self.rel is None else self.rel) * abs(self.expected), absolute)

    def __eq__(self, got) -> bool:
        return abs(float(got) - self.expected) <= self.tolerance()

    def __repr__(self) -> str:
        return f"{self.expected} ± {self.tolerance():.1e}"


@contextlib.contextmanager
def raises(kind, match: str | None = None):
    try:
        yield
    except kind as err:
        if match is not None and not re.search(match, str(err)):
            raise AssertionError(f"{kind.__name__} raised, but {match!r} is not in "
                                 f"{str(err)!r}") from err
    else:
        raise AssertionError(f"expected {kind.__name__}, nothing was raised")


def skip(reason: str = "", allow_module_level: bool = False):
    raise Skipped(reason)


def importorskip(name: str, minversion=None, reason: str | None = None):
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise Skipped(reason or f"could not import {name!r}: {err}") from None


def stand_in() -> types.ModuleType:
    """A module named pytest holding the stand-ins above."""
    module = types.ModuleType("pytest")
    module.mark, module.approx, module.raises = MarkGenerator(), approx, raises
    module.skip, module.importorskip = skip, importorskip
    return module


def cases(fn) -> list[tuple[str, dict]]:
    """Every (id, keyword arguments) of a test: the product of its parametrize marks."""
    axes = []
    for mark in getattr(fn, "plain_marks", []):
        if mark.name == "parametrize":
            names, values = mark.args[0], mark.args[1]
            names = [n.strip() for n in names.split(",")] if isinstance(names, str) else names
            axes.append([dict(zip(names, v if len(names) > 1 else (v,))) for v in values])
    out = []
    for combo in itertools.product(*axes):
        kwargs = {k: v for part in combo for k, v in part.items()}
        ident = "-".join(str(v) for part in combo for v in part.values())
        out.append((f"{fn.__name__}[{ident}]" if ident else fn.__name__, kwargs))
    return out


def run_file(path: Path, marker: str | None) -> list[dict]:
    """Import the file under the stand-in and run its selected tests: one record each."""
    sys.modules["pytest"] = stand_in()
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Skipped as why:
        return [{"name": path.stem, "outcome": "SKIP", "detail": str(why), "seconds": 0.0}]
    file_marks = getattr(module, "pytestmark", [])
    file_marks = {m.name for m in (file_marks if isinstance(file_marks, list) else
                                   [file_marks])}
    records = []
    for name, fn in vars(module).items():
        if not (name.startswith("test_") and callable(fn)):
            continue
        marks = file_marks | {m.name for m in getattr(fn, "plain_marks", [])}
        if marker is not None and marker not in marks:
            continue
        for ident, kwargs in cases(fn):
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                if "tmp_path" in fn.__code__.co_varnames[:fn.__code__.co_argcount]:
                    kwargs = {**kwargs, "tmp_path": Path(tmp)}
                try:
                    fn(**kwargs)
                    outcome, detail = "PASS", ""
                except Skipped as why:
                    outcome, detail = "SKIP", str(why)
                except Exception:
                    outcome, detail = "FAIL", traceback.format_exc()
            records.append({"name": ident, "outcome": outcome, "detail": detail,
                            "seconds": time.perf_counter() - t0})
            print(f"{outcome} {ident} ({records[-1]['seconds']:.2f} s)", flush=True)
            if detail and outcome == "FAIL":
                print(detail, flush=True)
    return records


def junit(records: list[dict], path: Path, suite: str) -> None:
    """The records as a JUnit XML file, the format pytest's --junitxml writes."""
    counts = {k: sum(r["outcome"] == k for r in records) for k in ("FAIL", "SKIP")}
    root = ET.Element("testsuite", name=suite, tests=str(len(records)),
                      failures=str(counts["FAIL"]), skipped=str(counts["SKIP"]), errors="0",
                      time=f"{sum(r['seconds'] for r in records):.3f}")
    for r in records:
        case = ET.SubElement(root, "testcase", classname=suite, name=r["name"],
                             time=f"{r['seconds']:.3f}")
        if r["outcome"] == "FAIL":
            ET.SubElement(case, "failure", message="failed").text = r["detail"]
        elif r["outcome"] == "SKIP":
            ET.SubElement(case, "skipped", message=r["detail"])
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("-m", dest="marker", help="run only the tests with this mark")
    ap.add_argument("--junitxml", type=Path, help="also write the results here")
    args = ap.parse_args()
    records = run_file(args.file.resolve(), args.marker)
    if args.junitxml is not None:
        junit(records, args.junitxml, args.file.stem)
    summary = {k: sum(r["outcome"] == k for r in records) for k in ("PASS", "FAIL", "SKIP")}
    print(f"plain_tests {args.file}: " + ", ".join(f"{v} {k}" for k, v in summary.items()))
    for r in records:
        if r["outcome"] == "SKIP":
            print(f"SKIP {r['name']}: {r['detail']}")
    return 1 if summary["FAIL"] else 0 if summary["PASS"] else 5


if __name__ == "__main__":
    sys.exit(main())
