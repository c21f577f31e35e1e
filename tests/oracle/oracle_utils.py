"""Shared helpers for the PyTorch parity tests (the ``oracle`` extra).

Each test module starts with ``torch = pytest.importorskip("torch", reason=REASON)``
so that, without torch, it is reported as skipped with that reason. CI installs
the extra (``torch==2.13.0``, a CPU build) and runs them all.

Both sides compute in float64 on the same weights and inputs, so differences
are pure rounding: outputs and gradients must agree to ``RTOL = 1e-10``
(with ``ATOL = 1e-12`` for entries that are zero up to rounding).
"""

from __future__ import annotations

import numpy as np

REASON = "PyTorch is not installed: pip install -e '.[oracle]' to run the parity tests"
RTOL = 1e-10
ATOL = 1e-12


def t(x: np.ndarray, grad: bool = False):
    """A float64 torch tensor holding a copy of ``x``, optionally requiring grad."""
    import torch

    return torch.tensor(np.array(x), dtype=torch.float64, requires_grad=grad)


def assert_close(actual, expected, name: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Assert ``actual`` (NumPy) equals ``expected`` (NumPy or torch) within the bounds."""
    if hasattr(expected, "detach"):
        expected = expected.detach().numpy()
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=name)
