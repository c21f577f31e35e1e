"""Activations against torch autograd, float64, rtol 1e-10 (atol 1e-12): ReLU vs
torch.relu, GELU (exact and tanh) vs F.gelu, SiLU vs F.silu, SwiGLU vs
F.silu(a) * b with the gate a the first half."""

from __future__ import annotations

import numpy as np
import pytest
from oracle_utils import REASON, assert_close, t

torch = pytest.importorskip("torch", reason=REASON)

import torch.nn.functional as F  # noqa: E402

import npformer as npf  # noqa: E402
from npformer.activations import sigmoid  # noqa: E402

# Far from 0 on both sides: GELU's erf / tanh saturate, the clips in GELU.forward act.
TAILS = np.array([-50.0, -12.0, -9.5, -6.0, 6.0, 9.5, 12.0, 50.0])


def _inputs(seed: int, shape=(3, 5, 8)) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 3
    x.reshape(-1)[: TAILS.size] = TAILS
    return x, rng.standard_normal(x.shape)


def _check_elementwise(layer, torch_fn, x, dout) -> None:
    y = layer.forward(x)
    layer.zero_grad()
    dx = layer.backward(dout)

    xt = t(x, grad=True)
    yt = torch_fn(xt)
    yt.backward(t(dout))

    assert_close(y, yt, "y")
    assert_close(dx, xt.grad, "dx")


def test_relu_output_and_gradient_match_torch():
    x, dout = _inputs(0)
    assert np.all(x != 0)  # the derivative at exactly 0 is a convention, not compared
    _check_elementwise(npf.ReLU(dtype="float64"), torch.relu, x, dout)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_output_and_gradient_match_torch(approximate):
    x, dout = _inputs(1)
    _check_elementwise(npf.GELU(approximate, dtype="float64"),
                       lambda xt: F.gelu(xt, approximate=approximate), x, dout)


def test_silu_output_and_gradient_match_torch():
    x, dout = _inputs(2)
    _check_elementwise(npf.SiLU(dtype="float64"), F.silu, x, dout)


def test_sigmoid_matches_torch():
    x, _ = _inputs(3)
    assert_close(sigmoid(x), torch.sigmoid(t(x)), "sigmoid")


def test_swiglu_output_and_gradient_match_torch_with_gate_first():
    rng = np.random.default_rng(4)
    h = 4
    x = rng.standard_normal((3, 5, 2 * h)) * 2
    dout = rng.standard_normal((3, 5, h))
    layer = npf.SwiGLU(dtype="float64")

    y = layer.forward(x)
    layer.zero_grad()
    dx = layer.backward(dout)

    xt = t(x, grad=True)
    yt = F.silu(xt[..., :h]) * xt[..., h:]  # gate a = first half, value b = second half
    yt.backward(t(dout))

    assert_close(y, yt, "y")
    assert_close(dx, xt.grad, "dx")


def test_gelu_float32_fast_path_matches_torch_float32():
    """Float32 GELU (Hastings' erfc) against F.gelu in float32: a few float32 roundings."""
    x64, dout64 = _inputs(7, shape=(4, 64, 96))
    x, dout = x64.astype(np.float32), dout64.astype(np.float32)
    layer = npf.GELU(dtype="float32")
    y = layer.forward(x)
    dx = layer.backward(dout)
    xt = torch.from_numpy(x).requires_grad_(True)
    yt = F.gelu(xt)
    yt.backward(torch.from_numpy(dout))
    assert y.dtype == dx.dtype == np.float32
    # Phi is within 4e-7 absolute (tests/test_activations.py); |x| reaches 50 in the tails,
    # where float32's own spacing is 4e-6, hence the relative term. Measured: 4.8e-7 abs.
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-6, atol=1e-6)
