"""Shared pytest configuration.

Failures whose traceback passes through generated code in ``src/npformer`` get an
extra report section naming the book line that produced each frame, so a reader
goes straight from a failing test to the prose that explains the code.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "npformer"


@functools.lru_cache(maxsize=1)
def _linemap() -> dict[str, list[str | None]]:
    sys.path.insert(0, str(ROOT))
    try:
        import tangle

        return tangle.render(tangle.load_book(ROOT))[1]
    except Exception:  # a broken book must not hide the test failure itself
        return {}
    finally:
        sys.path.remove(str(ROOT))


def book_locations(tb) -> list[str]:
    """``src/npformer/x.py:N -> book/y.md:M`` for each frame in generated code."""
    out = []
    for entry in tb:
        path = Path(str(entry.path)).resolve()
        if SRC not in path.parents:
            continue
        rel = path.relative_to(ROOT).as_posix()
        line = entry.lineno + 1  # pytest's lineno is 0-based
        locs = _linemap().get(rel)
        if locs and 1 <= line <= len(locs) and locs[line - 1]:
            out.append(f"{rel}:{line} is written in {locs[line - 1]}")
    return out


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None:
        lines = book_locations(call.excinfo.traceback)
        if lines:
            report.sections.append(("book location (edit the book, then tangle)",
                                    "\n".join(lines)))


@pytest.fixture
def signal_after_step(monkeypatch):
    """``signal_after_step(signum, k)``: Trainer.train_step sends this process ``signum``
    right after step ``k``, as a user's Ctrl-C or ``kill`` would; returns an undo."""
    import os

    from npformer.train import Trainer

    step = Trainer.train_step

    def arm(signum: int, k: int):
        def train_step_then_signal(self):
            out = step(self)
            if self.step == k:
                os.kill(os.getpid(), signum)  # the handler asks the loop to stop
            return out

        monkeypatch.setattr(Trainer, "train_step", train_step_then_signal)
        return lambda: monkeypatch.setattr(Trainer, "train_step", step)

    return arm
