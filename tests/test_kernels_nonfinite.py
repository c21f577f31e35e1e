"""A fused kernel is non-finite exactly where its listing is (book/kernels.md, "NaN and
infinity").

One NaN, +inf or -inf is placed in one input of a kernel (an activation, a norm,
attention's q, k, v or dout, a logit, a gradient), in float32 and in float64; the kernel
and the NumPy listing then run forward and backward on the same numbers. Every output,
input gradient and parameter gradient must carry the same class at every position:
finite, NaN, +inf or -inf. A kernel that turned a NaN into a number would hide from the
training loop the non-finite loss that stops it (the optimisation chapter's rule).

The cases are functions of the device the fused side runs on, so that ``tests/test_gpu.py``
runs the same cases on the CUDA kernels.
"""
from __future__ import annotations

import numpy as np
import pytest
from test_kernels import LAYERS  # the same layers and shapes as the kernels' own tests

from npformer import kernels
from npformer.attention import attention_backward, causal_mask, scaled_dot_product_attention
from npformer.device import to_device, to_host
from npformer.embedding import Embedding
from npformer.optim import AdamW
from npformer.softmax import cross_entropy

SPECIALS = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}
DTYPES = ("float32", "float64")
AT = 21  # the flat position that receives the special number, in the first row


def classes(a) -> np.ndarray:
    """0 finite, 1 NaN, 2 +inf, 3 -inf at every position of a (a host array or number)."""
    a = np.asarray(a)
    return np.select([np.isnan(a), np.isposinf(a), np.isneginf(a)], [1, 2, 3], 0)


def assert_same_classes(fused, listing, what: str) -> None:
    assert len(fused) == len(listing)
    for k, (f, li) in enumerate(zip(fused, listing)):
        cf, cl = classes(f), classes(li)
        bad = np.argwhere(cf != cl)
        assert not bad.size, (f"{what}, result {k}: {len(bad)} positions differ, first at "
                              f"{bad[0].tolist()}: fused class {cf[tuple(bad[0])]}, "
                              f"listing class {cl[tuple(bad[0])]} (0 finite, 1 NaN, "
                              "2 +inf, 3 -inf)")
    if "nan" in what:  # a NaN input reaches some result (a -inf logit, say, need not)
        assert any(classes(li).any() for li in listing), f"{what}: the listing stayed finite"


def _fused(make, dtype, device):
    layer = make(dtype)
    return kernels.use_kernels(layer.to(device) if device != "cpu" else layer, "fused")


def _forward_backward(layer, x, dy, device):
    layer.zero_grad()
    x, dy = (to_device(a, device) for a in (x, dy))
    y = layer.forward(x)
    dx = layer.backward(dy)
    return [to_host(a) for a in [y, dx] + [g for _, _, g in layer.named_parameters()]]


def layer_case(name: str, dtype: str, special: str, where: str, device: str = "cpu"):
    """The listing's and the fused kernel's (y, dx, parameter gradients) for one layer,
    with one special number at position AT of x (where="x") or of dout ("dout")."""
    make, shape = LAYERS[name]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 2).astype(dtype)
    dy = rng.standard_normal(make(dtype).forward(x).shape).astype(dtype)
    (x if where == "x" else dy).reshape(-1)[AT] = SPECIALS[special]
    with np.errstate(all="ignore"):
        listing = _forward_backward(make(dtype), x, dy, "cpu")
        fused = _forward_backward(_fused(make, dtype, device), x, dy, device)
    return listing, fused


MASKS = {"none": None, "causal": causal_mask(6), "padding": np.arange(6) < 4}


def attention_case(dtype: str, special: str, where: str, mask: str, device: str = "cpu"):
    """(out, dq, dk, dv) of the listing and of the fused softmax kernel, one special number
    in q, k, v or dout."""
    rng = np.random.default_rng(1)
    q, k, v, dout = (rng.standard_normal((2, 2, 6, 4)).astype(dtype) for _ in range(4))
    {"q": q, "k": k, "v": v, "dout": dout}[where][1, 0, 2, 1] = SPECIALS[special]
    m = MASKS[mask]
    with np.errstate(all="ignore"):
        out, cache = scaled_dot_product_attention(q, k, v, m)
        listing = [out, *attention_backward(dout, cache)]
        dq, dk, dv, ddout = (to_device(a, device) for a in (q, k, v, dout))
        dm = None if m is None else to_device(m, device)
        out, cache = kernels.fused_attention(dq, dk, dv, dm)
        fused = [to_host(a) for a in (out, *kernels.fused_attention_backward(ddout, cache))]
    return listing, fused


def cross_entropy_case(dtype: str, special: str, where: str, device: str = "cpu"):
    """(loss, dlogits) of the listing and of the fused kernel, one special logit at a
    target (where="target"), elsewhere in a scored row ("other"), or in a row the mask
    leaves out ("masked")."""
    rng = np.random.default_rng(2)
    logits = (rng.standard_normal((4, 5, 30)) * 3).astype(dtype)
    targets = rng.integers(0, 30, (4, 5))
    mask = np.ones((4, 5), dtype=bool)
    mask[3, 2] = False
    row = (3, 2) if where == "masked" else (1, 3)
    col = targets[row] if where == "target" else (targets[row] + 7) % 30
    logits[row + (col,)] = SPECIALS[special]
    with np.errstate(all="ignore"):
        loss, grad = cross_entropy(logits, targets, mask)
        listing = [loss, grad]
        loss, grad = cross_entropy(*(to_device(a, device) for a in (logits, targets, mask)),
                                   kernels="fused")
        fused = [loss, to_host(grad)]
    return listing, fused


def adamw_case(dtype: str, special: str, device: str = "cpu"):
    """The parameters and moments after one AdamW step, the listing's and the fused
    kernel's, with one special number in the gradient."""
    runs = []
    for fused in (False, True):
        emb = Embedding(8, 5, seed=0, dtype=dtype)
        if fused and device != "cpu":
            emb.to(device)
        opt = AdamW(emb.named_parameters(), lr=1e-2, weight_decay=0.1)
        if fused:
            kernels.use_kernels(opt, "fused")
        g = np.random.default_rng(3).standard_normal((8, 5)).astype(dtype)
        g[2, 3] = SPECIALS[special]
        emb.dW[...] = to_device(g, device if fused else "cpu")
        with np.errstate(all="ignore"):
            opt.step()
        runs.append([to_host(a) for a in (emb.W, *opt.moments.values())])
    return runs


@pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="Numba is not installed")
class TestOnTheHost:
    @pytest.mark.parametrize("where", ["x", "dout"])
    @pytest.mark.parametrize("special", sorted(SPECIALS))
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", sorted(LAYERS))
    def test_layer(self, name, dtype, special, where):
        listing, fused = layer_case(name, dtype, special, where)
        assert_same_classes(fused, listing, f"{name} {dtype}, {special} in {where}")

    @pytest.mark.parametrize("mask", sorted(MASKS))
    @pytest.mark.parametrize("where", ["q", "k", "v", "dout"])
    @pytest.mark.parametrize("special", sorted(SPECIALS))
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_attention(self, dtype, special, where, mask):
        listing, fused = attention_case(dtype, special, where, mask)
        assert_same_classes(fused, listing, f"attention {dtype}, {special} in {where}")

    @pytest.mark.parametrize("where", ["target", "other", "masked"])
    @pytest.mark.parametrize("special", sorted(SPECIALS))
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_cross_entropy(self, dtype, special, where):
        listing, fused = cross_entropy_case(dtype, special, where)
        if where == "masked":  # a row the loss ignores stays ignored, by both
            assert [classes(a).any() for a in listing + fused] == [False] * 4
            return
        assert_same_classes(fused, listing, f"cross-entropy {dtype}, {special} at {where}")

    def test_the_reported_case(self):
        """One NaN logit that is not the target, float32: the loss is NaN, not a number."""
        listing, fused = cross_entropy_case("float32", "nan", "other")
        assert np.isnan(listing[0]) and np.isnan(fused[0])

    @pytest.mark.parametrize("special", sorted(SPECIALS))
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_embedding_backward(self, dtype, special):
        ids = np.array([[1, 4, 1, 7]])
        dy = np.random.default_rng(4).standard_normal((1, 4, 5)).astype(dtype)
        dy[0, 2, 3] = SPECIALS[special]  # a row of id 1, which appears twice
        runs = []
        for kind in ("numpy", "fused"):
            emb = kernels.use_kernels(Embedding(8, 5, seed=0, dtype=dtype), kind)
            emb.forward(ids)
            emb.backward(dy)
            runs.append([emb.dW.copy()])
        assert_same_classes(runs[1], runs[0], f"embedding {dtype}, {special}")

    @pytest.mark.parametrize("special", sorted(SPECIALS))
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_adamw(self, dtype, special):
        listing, fused = adamw_case(dtype, special)
        assert_same_classes(fused, listing, f"AdamW {dtype}, {special} in the gradient")


@pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="Numba is not installed")
def test_exp32_keeps_nan_and_sends_minus_infinity_to_zero():
    from numba import njit

    @njit
    def exp_all(y, out):
        for i in range(y.size):
            out[i] = kernels.exp32(y[i])

    y = np.float32([np.nan, -np.inf, -1e30, -88.0, -87.0, 0.0])
    out = np.empty_like(y)
    exp_all(y, out)
    assert np.isnan(out[0]) and out[1:4].tolist() == [0, 0, 0]
    assert out[4] > 0 and out[5] == 1
