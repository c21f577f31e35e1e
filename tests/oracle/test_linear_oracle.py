"""npformer.Linear against torch autograd, float64, rtol 1e-10."""

from __future__ import annotations

import numpy as np
import pytest
from oracle_utils import REASON, assert_close, t

torch = pytest.importorskip("torch", reason=REASON)

import npformer as npf  # noqa: E402


@pytest.mark.parametrize("bias", [True, False])
def test_linear_output_and_gradients_match_torch(bias):
    rng = np.random.default_rng(0)
    layer = npf.Linear(6, 4, bias=bias, seed=1, dtype="float64")
    if bias:
        layer.b[:] = rng.standard_normal(4)
    x = rng.standard_normal((3, 5, 6))
    dout = rng.standard_normal((3, 5, 4))

    y = layer.forward(x)
    layer.zero_grad()
    dx = layer.backward(dout)

    xt, Wt = t(x, grad=True), t(layer.W, grad=True)
    bt = t(layer.b, grad=True) if bias else None
    yt = torch.nn.functional.linear(xt, Wt.T, bt)  # torch stores (out, in)
    yt.backward(t(dout))

    assert_close(y, yt, "y")
    assert_close(dx, xt.grad, "dx")
    assert_close(layer.dW, Wt.grad, "dW")
    if bias:
        assert_close(layer.db, bt.grad, "db")
