"""LayerNorm and RMSNorm against torch autograd, float64, rtol 1e-10 (atol 1e-12):
F.layer_norm with weight and bias, F.rms_norm and the explicit formula
x * rsqrt(mean(x**2) + eps) * weight; dx, dgamma and dbeta."""

from __future__ import annotations

import numpy as np
import pytest
from oracle_utils import REASON, assert_close, t

torch = pytest.importorskip("torch", reason=REASON)

import torch.nn.functional as F  # noqa: E402

import npformer as npf  # noqa: E402

D = 8


def _data(seed: int) -> tuple[np.random.Generator, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, 5, D)) * 2 + 3  # a nonzero mean for LayerNorm to remove
    return rng, x, rng.standard_normal(x.shape)


@pytest.mark.parametrize("eps", [None, 1e-12])  # None: the library default; 1e-12: BERT's
def test_layernorm_output_and_gradients_match_torch(eps):
    rng, x, dout = _data(0)
    layer = npf.LayerNorm(D, dtype="float64") if eps is None \
        else npf.LayerNorm(D, eps=eps, dtype="float64")
    layer.gamma[:] = rng.standard_normal(D)
    layer.beta[:] = rng.standard_normal(D)

    y = layer.forward(x)
    layer.zero_grad()
    dx = layer.backward(dout)

    xt, gt, bt = t(x, grad=True), t(layer.gamma, grad=True), t(layer.beta, grad=True)
    yt = F.layer_norm(xt, (D,), gt, bt, eps=layer.eps)
    yt.backward(t(dout))

    assert_close(y, yt, "y")
    assert_close(dx, xt.grad, "dx")
    assert_close(layer.dgamma, gt.grad, "dgamma")
    assert_close(layer.dbeta, bt.grad, "dbeta")


def _rms_formula(xt, gt, eps):
    return xt * torch.rsqrt(xt.pow(2).mean(dim=-1, keepdim=True) + eps) * gt


@pytest.mark.parametrize("reference", ["F.rms_norm", "formula"])
@pytest.mark.parametrize("eps", [None, 1e-12])  # None: the library default
def test_rmsnorm_output_and_gradients_match_torch(reference, eps):
    rng, x, dout = _data(1)
    layer = npf.RMSNorm(D, dtype="float64") if eps is None \
        else npf.RMSNorm(D, eps=eps, dtype="float64")
    layer.gamma[:] = rng.standard_normal(D)

    y = layer.forward(x)
    layer.zero_grad()
    dx = layer.backward(dout)

    xt, gt = t(x, grad=True), t(layer.gamma, grad=True)
    if reference == "F.rms_norm":
        if not hasattr(F, "rms_norm"):  # added in torch 2.4; CI pins 2.13
            pytest.skip("torch.nn.functional.rms_norm is not available")
        yt = F.rms_norm(xt, (D,), gt, eps=layer.eps)
    else:
        yt = _rms_formula(xt, gt, layer.eps)
    yt.backward(t(dout))

    assert_close(y, yt, "y")
    assert_close(dx, xt.grad, "dx")
    assert_close(layer.dgamma, gt.grad, "dgamma")
