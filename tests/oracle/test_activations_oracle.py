"""Activations against torch autograd, float64, rtol 1e-10 (atol 1e-12): ReLU vs
torch.relu, GELU (exact and tanh) vs F.gelu, SiLU vs F.silu, SwiGLU vs
F.silu(a) * b with the gate a the first half."""

from __future__ import annotations

import numpy as np
import pytest
from oracle_utils import REASON, assert_close, assert_float32_no_worse, float32_error, t

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


def test_gelu_float32_fast_path_is_as_accurate_as_torch_float32():
    """Float32 GELU (Hastings' erfc) and F.gelu in float32, both against float64 truth.

    Neither float32 result is exact, and PyTorch's differs between CPUs (on an AVX-512
    machine its GELU is off by 1e-6 at x = -3.49). So each is measured against the
    float64 GELU of the same float32 inputs, and npformer's error may exceed PyTorch's
    by at most 5e-7: Hastings' bound on erf (1.5e-7) plus a few float32 roundings.
    """
    x64, dout64 = _inputs(7, shape=(4, 64, 96))
    x, dout = x64.astype(np.float32), dout64.astype(np.float32)
    layer = npf.GELU(dtype="float32")
    y = layer.forward(x)
    dx = layer.backward(dout)
    assert y.dtype == dx.dtype == np.float32

    xt = torch.from_numpy(x).requires_grad_(True)
    yt = F.gelu(xt)
    yt.backward(torch.from_numpy(dout))

    xt64 = t(x, grad=True)  # the same float32 inputs, computed in float64
    yt64 = F.gelu(xt64)
    yt64.backward(t(dout))

    assert_float32_no_worse(y, yt, yt64, "GELU y", margin=5e-7)
    assert_float32_no_worse(dx, xt.grad, xt64.grad, "GELU dx", margin=5e-7)
    assert float32_error(y, yt64) < 1e-6 and float32_error(dx, xt64.grad) < 1e-6
