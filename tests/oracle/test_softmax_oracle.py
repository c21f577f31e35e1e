"""Softmax, log-softmax and cross-entropy against torch autograd, float64,
rtol 1e-10 (atol 1e-12): torch.softmax, torch.log_softmax and
F.cross_entropy averaged over the valid (mask true) positions."""

from __future__ import annotations

import numpy as np
import pytest
from oracle_utils import REASON, assert_close, t

torch = pytest.importorskip("torch", reason=REASON)

import torch.nn.functional as F  # noqa: E402

import npformer as npf  # noqa: E402
from npformer.softmax import cross_entropy_backward, log_softmax_backward, softmax_backward  # noqa: E402

# shift 1000: exp(x) alone would overflow; both sides must subtract the row max.
SHIFTS = [0.0, 1000.0]


def _logits(seed: int, shift: float, shape=(3, 5, 8)) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape) * 3 + shift, rng.standard_normal(shape)


@pytest.mark.parametrize("shift", SHIFTS)
def test_softmax_and_backward_match_torch(shift):
    x, dout = _logits(0, shift)

    p = npf.softmax(x)
    dx = softmax_backward(dout, p)

    xt = t(x, grad=True)
    pt = torch.softmax(xt, dim=-1)
    pt.backward(t(dout))

    assert_close(p, pt, "p")
    assert_close(dx, xt.grad, "dx")


@pytest.mark.parametrize("shift", SHIFTS)
def test_softmax_module_matches_torch(shift):
    x, dout = _logits(1, shift)
    layer = npf.Softmax()

    p = layer.forward(x)
    layer.zero_grad()
    dx = layer.backward(dout)

    xt = t(x, grad=True)
    pt = torch.softmax(xt, dim=-1)
    pt.backward(t(dout))

    assert_close(p, pt, "p")
    assert_close(dx, xt.grad, "dx")


@pytest.mark.parametrize("shift", SHIFTS)
def test_log_softmax_and_backward_match_torch(shift):
    x, dout = _logits(2, shift)

    logp = npf.log_softmax(x)
    dx = log_softmax_backward(dout, logp)

    xt = t(x, grad=True)
    logpt = torch.log_softmax(xt, dim=-1)
    logpt.backward(t(dout))

    assert_close(logp, logpt, "logp")
    assert_close(dx, xt.grad, "dx")


@pytest.mark.parametrize("case", ["no_mask", "bool_mask", "int_mask", "one_valid"])
def test_cross_entropy_loss_and_gradient_match_torch(case):
    rng = np.random.default_rng(3)
    B, T, V = 3, 5, 8
    logits = rng.standard_normal((B, T, V)) * 3
    targets = rng.integers(0, V, size=(B, T))
    valid = rng.random((B, T)) < 0.5
    valid[0, 0] = True
    if case == "no_mask":
        valid[:] = True
        mask = None
    elif case == "bool_mask":
        mask = valid
    elif case == "int_mask":
        mask = valid.astype(np.int64)
    else:
        valid[:] = False
        valid[2, 3] = True
        mask = valid

    loss, dlogits = npf.cross_entropy(logits, targets, mask)
    dlogits_from_p = cross_entropy_backward(npf.softmax(logits), targets, mask)

    zt = t(logits, grad=True)
    labels = torch.tensor(np.where(valid, targets, -100))  # ignored rows leave the mean
    lt = F.cross_entropy(zt.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    lt.backward()

    assert isinstance(loss, float)
    assert_close(loss, lt, "loss")
    assert_close(dlogits, zt.grad, "dlogits")
    assert_close(dlogits_from_p, zt.grad, "cross_entropy_backward")
