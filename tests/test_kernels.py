"""The fused kernels (book/kernels.md) against the NumPy listings they replace.

Bounds: in float64 a kernel and its listing compute the same formulas in a different
order, so they agree to a few units of rounding (rtol 1e-13 on values of order one;
sums over rows, such as dgamma, to 1e-11 absolute). In float32 both are compared with the
float64 listing: the kernel's largest error may be at most FLOAT32_FACTOR times the
float32 listing's own largest error plus two float32 roundings of the result's size.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess

import numpy as np
import pytest

import npformer as npf
from npformer import kernels
from npformer.activations import GELU, SiLU, SwiGLU
from npformer.gradcheck import relative_error
from npformer.losses import next_token_loss
from npformer.norm import LayerNorm, RMSNorm
from npformer.optim import Adam, AdamW

pytestmark = pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="Numba is not installed")

RTOL64 = 1e-13
FLOAT32_FACTOR = 4.0
EPS32 = float(np.finfo(np.float32).eps)

LAYERS = {
    "gelu": (lambda dt: GELU(dtype=dt), (6, 50, 64)),
    "gelu_tanh": (lambda dt: GELU("tanh", dtype=dt), (6, 50, 64)),
    "silu": (lambda dt: SiLU(dtype=dt), (6, 50, 64)),
    "swiglu": (lambda dt: SwiGLU(dtype=dt), (6, 50, 128)),
    "layernorm": (lambda dt: LayerNorm(64, dtype=dt), (6, 50, 64)),
    "rmsnorm": (lambda dt: RMSNorm(64, dtype=dt), (6, 50, 64)),
}


def _run(layer, x, dy):
    layer.zero_grad()
    y = layer.forward(x)
    dx = layer.backward(dy)
    return [y, dx] + [g.copy() for _, _, g in layer.named_parameters()]


def _inputs(shape, out_last, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 3
    x.reshape(-1)[:7] = [0.0, -0.0, 40.0, -40.0, 1e-30, -9.99, 12.0]  # edges of the forms
    dy = rng.standard_normal(shape[:-1] + (out_last,))
    return x, dy


def _with_gains(layer, rng):
    for _, p, _ in layer.named_parameters():
        p[...] = rng.uniform(0.5, 1.5, p.shape)
    return layer


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_fused_layer_matches_listing_in_float64(name):
    make, shape = LAYERS[name]
    listing = make("float64")
    x, dy = _inputs(shape, np.shape(listing.forward(np.zeros(shape)))[-1])
    listing = _with_gains(make("float64"), np.random.default_rng(1))
    fused = _with_gains(kernels.use_kernels(make("float64"), "fused"),
                        np.random.default_rng(1))
    assert type(fused) is not type(listing) and isinstance(fused, type(listing))
    for a, b in zip(_run(fused, x, dy), _run(listing, x, dy)):
        atol = 1e-11 if a.ndim == 1 else 1e-13  # a parameter's gradient sums 300 rows
        np.testing.assert_allclose(a, b, rtol=RTOL64, atol=atol)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_fused_layer_in_float32_is_as_close_to_float64_as_the_listing(name):
    make, shape = LAYERS[name]
    x, dy = _inputs(shape, np.shape(make("float64").forward(np.zeros(shape)))[-1], seed=2)
    truth = _run(_with_gains(make("float64"), np.random.default_rng(3)), x, dy)
    x32, dy32 = x.astype(np.float32), dy.astype(np.float32)
    listing = _run(_with_gains(make("float32"), np.random.default_rng(3)), x32, dy32)
    fused_layer = kernels.use_kernels(make("float32"), "fused")
    fused = _run(_with_gains(fused_layer, np.random.default_rng(3)), x32, dy32)
    for f, li, t in zip(fused, listing, truth):
        assert f.dtype == np.float32
        bound = FLOAT32_FACTOR * np.abs(li - t).max() + 2 * EPS32 * np.abs(t).max()
        assert np.abs(f - t).max() <= bound, (name, np.abs(f - t).max(), bound)


def test_exp32_is_float32_exact_and_underflows_to_zero():
    from numba import njit, prange

    @njit(parallel=True)
    def exp_all(y, out):
        for i in prange(y.size):
            out[i] = kernels.exp32(y[i])

    y = np.concatenate([np.linspace(-87, 0, 200_001, dtype=np.float32),
                        np.float32([-87.5, -100, -1e30, -np.inf])])
    out = np.empty_like(y)
    exp_all(y, out)
    truth = np.exp(y[:-4].astype(np.float64))
    assert (np.abs(out[:-4] - truth) / truth).max() < 2 * EPS32
    assert out[0] > 0 and out[-4:].tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("dtype, rtol", [("float64", 1e-14), ("float32", 4 * EPS32)])
@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_fused_adam_step_matches_the_listing(kind, dtype, rtol):
    config = npf.GPTConfig(vocab_size=30, block_size=8, n_layer=2, n_head=2, d_model=16,
                           dtype=dtype)
    states = []
    for kernels_kind in ("numpy", "fused"):
        model = npf.GPT(config, seed=5, kernels=kernels_kind)
        opt = (AdamW(model.named_parameters(), lr=1e-2, weight_decay=0.1) if kind == "adamw"
               else Adam(model.named_parameters(), lr=1e-2))
        assert opt.kernels == kernels_kind
        assert isinstance(opt, kernels.FusedAdam) == (kernels_kind == "fused")
        grads = np.random.default_rng(6)
        for _ in range(3):
            for _, _, g in model.named_parameters():
                g[...] = grads.standard_normal(g.shape)
            opt.step()
        states.append({n: p.copy() for n, p, _ in model.named_parameters()}
                      | {k: v.copy() for k, v in opt.state.items()})
    for name in states[0]:
        np.testing.assert_allclose(states[1][name], states[0][name], rtol=rtol,
                                   atol=rtol * 1e-2, err_msg=name)


def _tiny(kind: str):
    if kind == "gpt":
        return npf.GPTConfig(vocab_size=20, block_size=8, n_layer=2, n_head=2, d_model=16,
                             dropout=0.0, dtype="float64"), npf.GPT
    if kind == "gpt_tanh":
        return npf.GPTConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, d_model=16,
                             dropout=0.0, activation="gelu_tanh", dtype="float64"), npf.GPT
    return npf.LlamaConfig(vocab_size=20, block_size=8, n_layer=2, n_head=2, d_model=16,
                           dtype="float64"), npf.Llama


@pytest.mark.parametrize("kind", ["gpt", "gpt_tanh", "llama"])
def test_whole_model_gradients_agree_between_kernels(kind):
    config, cls = _tiny(kind)
    ids = np.random.default_rng(7).integers(0, 20, (3, 8))
    grads = {}
    for kernels_kind in ("numpy", "fused"):
        model = cls(config, seed=1, kernels=kernels_kind)
        assert model.kernels == kernels_kind
        model.zero_grad()
        loss, dlogits = next_token_loss(model.forward(ids), ids)
        model.backward(dlogits)
        grads[kernels_kind] = (loss, {n: g.copy() for n, _, g in model.named_parameters()})
    assert grads["fused"][0] == pytest.approx(grads["numpy"][0], rel=1e-13)
    for name, g in grads["numpy"][1].items():
        assert relative_error(grads["fused"][1][name], g) < 1e-10, name


def test_models_use_fused_kernels_by_default_and_switch_back():
    config, _ = _tiny("gpt")
    model = npf.GPT(config, seed=0)
    assert model.kernels == "fused"
    assert isinstance(model.h[0].ln_1, kernels.FusedLayerNorm)
    model.use_kernels("numpy")
    assert model.kernels == "numpy" and type(model.h[0].ln_1) is LayerNorm
    assert type(model.ln_f) is LayerNorm
    model.use_kernels("fused")
    assert type(model.ln_f) is kernels.FusedLayerNorm


def test_a_subclass_keeps_its_own_forward():
    class MyGELU(GELU):
        def forward(self, x):
            return super().forward(x) * 2

    layer = kernels.use_kernels(MyGELU(), "fused")
    assert type(layer) is MyGELU


def test_bad_kind_and_missing_numba_are_named(monkeypatch):
    with pytest.raises(ValueError, match="kernels"):
        kernels.use_kernels(GELU(), "triton")
    monkeypatch.setattr(kernels, "HAVE_NUMBA", False)
    with pytest.raises(RuntimeError, match=r"\.\[fast\]"):
        kernels.use_kernels(GELU(), "fused")
    assert kernels.use_kernels(GELU(), None).kernels == "numpy"  # the default falls back


def test_parameter_gradients_do_not_depend_on_the_number_of_threads():
    import numba

    layer = kernels.use_kernels(LayerNorm(64), "fused")
    x, dy = _inputs((300, 64), 64, seed=8)
    x, dy = x.astype(np.float32), dy.astype(np.float32)
    before = numba.get_num_threads()
    results = []
    try:
        for threads in (1, before):
            numba.set_num_threads(threads)
            results.append(_run(layer, x, dy))
    finally:
        numba.set_num_threads(before)
    for a, b in zip(*results):
        assert np.array_equal(a, b)


def test_float32_caches_stay_float32():
    config = dataclasses.replace(_tiny("gpt")[0], dtype="float32")
    model = npf.GPT(config, seed=0, kernels="fused")
    model.forward(np.zeros((2, 8), dtype=np.int64))
    for _, m in model.named_modules():
        for a in m.cache if isinstance(m.cache, tuple) else ():
            if isinstance(a, np.ndarray) and a.dtype.kind == "f":
                assert a.dtype == np.float32, type(m).__name__


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("ctype", ["float", "double"])
def test_cuda_source_compiles(tmp_path, ctype):
    """The CUDA kernels compile for an H100 (sm_90), as CuPy compiles them at run time."""
    assert f"#define ROW_THREADS {kernels.ROW_THREADS}\n" in kernels.CUDA_SOURCE
    source = tmp_path / f"kernels_{ctype}.cu"
    source.write_text(f"typedef {ctype} T;\n" + kernels.CUDA_SOURCE)
    done = subprocess.run(["nvcc", "-arch=sm_90", "-ptx", str(source), "-o",
                           str(tmp_path / "out.ptx")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    ptx = (tmp_path / "out.ptx").read_text()
    for name in set(kernels.CPU_KERNELS) - {"embedding_backward"}:  # np.add.at on a GPU
        assert f".entry {name}(" in ptx, name


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_fused_attention_matches_the_listing_with_every_mask(dtype):
    from npformer.attention import attention_backward, causal_mask, scaled_dot_product_attention

    rng = np.random.default_rng(9)
    q, k, v, dout = (rng.standard_normal((2, 3, 12, 8)) for _ in range(4))
    pad = np.ones((2, 1, 1, 12), dtype=bool)
    pad[1, ..., 4:] = False
    window = causal_mask(12) & ~np.tri(12, 12, -4, dtype=bool)  # the last 4 keys only
    no_keys = np.ones((2, 3, 12, 12), dtype=bool)
    no_keys[0, 1, 5] = False  # one query that may attend to nothing
    for mask in (None, causal_mask(12), causal_mask(12) & pad, window, no_keys):
        truth = scaled_dot_product_attention(q, k, v, mask)
        truth = [truth[0], *attention_backward(dout, truth[1])]
        args = [a.astype(dtype) for a in (q, k, v)]
        listing = scaled_dot_product_attention(*args, mask)
        listing = [listing[0], *attention_backward(dout.astype(dtype), listing[1])]
        fused = kernels.fused_attention(*args, mask)
        fused = [fused[0], *kernels.fused_attention_backward(dout.astype(dtype), fused[1])]
        for f, li, t in zip(fused, listing, truth):
            assert f.dtype == np.dtype(dtype)
            if dtype == "float64":
                np.testing.assert_allclose(f, t, rtol=RTOL64, atol=1e-13)
            else:
                bound = FLOAT32_FACTOR * np.abs(li - t).max() + 2 * EPS32 * np.abs(t).max()
                assert np.abs(f - t).max() <= bound
        if mask is not None and not mask.any(axis=-1).all():
            assert not fused[0][0, 1, 5].any()  # the query with no key gets zeros


def test_attention_layers_get_their_fused_twins():
    config, _ = _tiny("llama")
    llama = npf.Llama(config, seed=0, kernels="fused")
    assert all(type(b.attn).__name__ == "FusedGroupedQueryAttention" for b in llama.h)
    gpt = npf.GPT(_tiny("gpt")[0], seed=0, kernels="fused")
    assert all(isinstance(b.attn, kernels.FusedMultiHeadAttention) for b in gpt.h)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_fused_cross_entropy_matches_the_listing(dtype):
    from npformer.softmax import cross_entropy

    rng = np.random.default_rng(10)
    logits = rng.standard_normal((3, 7, 50)) * 5
    logits[0, 0, 3] = 80.0  # one near-certain prediction
    targets = rng.integers(0, 50, (3, 7))
    for mask in (None, rng.random((3, 7)) < 0.5):
        loss_t, grad_t = cross_entropy(logits, targets, mask)
        loss_l, grad_l = cross_entropy(logits.astype(dtype), targets, mask)
        loss_f, grad_f = cross_entropy(logits.astype(dtype), targets, mask, kernels="fused")
        assert grad_f.dtype == np.dtype(dtype) and grad_f.shape == logits.shape
        if mask is not None:
            assert not grad_f[~mask].any()  # unscored positions get no gradient
        if dtype == "float64":
            assert loss_f == pytest.approx(loss_t, rel=1e-13)
            np.testing.assert_allclose(grad_f, grad_t, rtol=RTOL64, atol=1e-15)
        else:
            assert abs(loss_f - loss_t) <= FLOAT32_FACTOR * abs(loss_l - loss_t) + 4 * EPS32
            bound = FLOAT32_FACTOR * np.abs(grad_l - grad_t).max() + 2 * EPS32 * grad_t.max()
            assert np.abs(grad_f - grad_t).max() <= bound


def test_bad_kernels_name_in_a_loss_is_named():
    from npformer.softmax import cross_entropy

    with pytest.raises(ValueError, match="kernels"):
        cross_entropy(np.zeros((2, 3)), [0, 1], kernels="cuda")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_fused_embedding_backward_adds_repeated_ids(dtype):
    from npformer.embedding import Embedding

    rng = np.random.default_rng(11)
    ids = rng.integers(0, 9, (4, 30))  # every id many times
    dout = rng.standard_normal((4, 30, 40))
    truth = np.zeros((9, 40))
    np.add.at(truth, ids.reshape(-1), dout.reshape(-1, 40))
    layer = kernels.use_kernels(Embedding(9, 40, dtype=dtype), "fused")
    assert isinstance(layer, kernels.FusedEmbedding)
    layer.forward(ids)
    layer.backward(dout.astype(dtype))
    layer.backward(dout.astype(dtype))  # gradients accumulate
    rtol = 1e-14 if dtype == "float64" else 8 * EPS32 * np.sqrt(30 * 4)
    np.testing.assert_allclose(layer.dW, 2 * truth, rtol=rtol, atol=rtol)
