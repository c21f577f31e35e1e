"""The library on a real GPU through CuPy: ``pytest -m gpu``. Skipped cleanly without
CuPy or without a GPU (CI has neither).

Each model family trains two steps in float64 on the GPU and on the host from the same
weights. The two runs compute the same function with different summation orders
(cuBLAS and CuPy's reductions against OpenBLAS and NumPy's pairwise sums), so they agree
to rounding: losses and gradient norms to RTOL, parameters to RTOL_P after two AdamW
steps. In float32 the GPU's loss must lie within RTOL_F32 of the float64 host loss.
``generate`` must give the same tokens.
"""
from __future__ import annotations

import numpy as np
import pytest

import npformer as npf
from npformer.device import to_device, to_host
from npformer.optim import AdamW, train_step
from npformer.seq2seq import beam_search, seq2seq_objective
from npformer.train import masked_lm_objective, next_token_objective, reconstruction_objective

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy", reason="CuPy is not installed (pip install -e '.[gpu]')")
try:
    _N_GPU = cupy.cuda.runtime.getDeviceCount()
except Exception:  # CUDA's runtime raises when there is no driver
    _N_GPU = 0
if _N_GPU == 0:
    pytest.skip("no GPU", allow_module_level=True)

RTOL, RTOL_P, RTOL_F32 = 1e-10, 1e-8, 1e-4
ATOL_P = 1e-10  # parameters whose true gradient is 0 (a key bias) hold rounding noise


def _ids(vocab, shape, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, shape)


def _run(model, objective, batches, device, **kw):
    if device != "cpu":
        model.to(device)
    opt = AdamW(model.named_parameters(), lr=1e-2, weight_decay=0.1)
    rng = np.random.default_rng(1)
    out = [train_step(model, opt, lambda m, b: objective(m, b, rng, **kw), b, max_norm=0.5)
           for b in batches]
    return out, {n: to_host(p) for n, p, _ in model.named_parameters(include_frozen=True)}


FAMILIES = {
    "gpt": (lambda dt: npf.GPT(npf.GPTConfig(vocab_size=37, block_size=16, n_layer=2,
                                             n_head=2, d_model=32, dtype=dt), seed=0),
            next_token_objective, lambda s: _ids(37, (3, 16), s), {}),
    "bert": (lambda dt: npf.BERT(npf.BERTConfig(vocab_size=40, block_size=16, n_layer=2,
                                                n_head=2, d_model=32, d_ff=64, dropout=0.0,
                                                dtype=dt), seed=0),
             masked_lm_objective, lambda s: np.random.default_rng(s).integers(5, 39, (3, 16)),
             {"mask_id": 39}),
    "llama": (lambda dt: npf.Llama(npf.LlamaConfig(vocab_size=37, block_size=16, n_layer=2,
                                                   n_head=4, n_kv_head=2, d_model=32,
                                                   d_ff=48, dtype=dt), seed=0),
              next_token_objective, lambda s: _ids(37, (3, 16), s), {}),
    "experts": (lambda dt: npf.Llama(npf.LlamaConfig(vocab_size=37, block_size=16,
                                                     n_layer=2, n_head=4, n_kv_head=2,
                                                     d_model=32, d_ff=48, n_expert=4,
                                                     top_k=2, dtype=dt), seed=0),
                next_token_objective, lambda s: _ids(37, (3, 16), s), {}),
    "encoder": (lambda dt: npf.Encoder(npf.EncoderConfig(dtype=dt), seed=0),
                reconstruction_objective,
                lambda s: _ids(npf.EncoderConfig().vocab_size,
                               (3, npf.EncoderConfig().block_size), s), {}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_step_on_the_gpu_equals_the_host_in_float64(family):
    make, objective, batch, kw = FAMILIES[family]
    batches = [batch(s) for s in range(2)]
    (host, p0), (gpu, p1) = (_run(make("float64"), objective, batches, d, **kw)
                             for d in ("cpu", "cuda"))
    np.testing.assert_allclose(np.array(gpu), np.array(host), rtol=RTOL)
    for name in p0:
        np.testing.assert_allclose(p1[name], p0[name], rtol=RTOL_P, atol=ATOL_P, err_msg=name)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_float32_on_the_gpu_is_near_the_float64_host_loss(family):
    make, objective, batch, kw = FAMILIES[family]
    (host, _), (gpu, _) = (_run(make(dt), objective, [batch(0)], d, **kw)
                           for dt, d in (("float64", "cpu"), ("float32", "cuda")))
    assert abs(gpu[0][0] - host[0][0]) <= RTOL_F32 * abs(host[0][0])


def test_generate_on_the_gpu_gives_the_host_tokens():
    make = FAMILIES["gpt"][0]
    prompt = _ids(37, (2, 4))
    want = npf.generate(make("float64"), prompt, 8, seed=3)
    got = npf.generate(make("float64").to("cuda"), prompt, 8, seed=3)
    np.testing.assert_array_equal(got, want)


def test_transformer_and_beam_search_on_the_gpu():
    cfg = npf.TransformerConfig(src_vocab_size=13, tgt_vocab_size=13, block_size=10,
                                n_layer=2, n_head=2, d_model=32, d_ff=48, dropout=0.0,
                                dtype="float64")
    rng = np.random.default_rng(0)
    records = np.concatenate([rng.integers(3, 13, (3, 10)), np.full((3, 1), 1),
                              rng.integers(3, 13, (3, 5)), np.full((3, 1), 2)], axis=1)
    (host, _), (gpu, _) = (_run(npf.Transformer(cfg, seed=0), seq2seq_objective, [records],
                                d) for d in ("cpu", "cuda"))
    np.testing.assert_allclose(np.array(gpu), np.array(host), rtol=RTOL)
    src = rng.integers(3, 13, (2, 7))
    ids0, _ = beam_search(npf.Transformer(cfg, seed=0), src, beam_size=3, max_new_tokens=6)
    ids1, _ = beam_search(npf.Transformer(cfg, seed=0).to("cuda"), src, beam_size=3,
                          max_new_tokens=6)
    np.testing.assert_array_equal(ids1, ids0)


def test_save_from_the_gpu_writes_the_host_file(tmp_path):
    make = FAMILIES["gpt"][0]
    npf.save(make("float32"), tmp_path / "cpu.safetensors")
    npf.save(make("float32").to("cuda"), tmp_path / "gpu.safetensors")
    import safetensors.numpy
    a = safetensors.numpy.load_file(tmp_path / "cpu.safetensors")
    b = safetensors.numpy.load_file(tmp_path / "gpu.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    model = npf.load(tmp_path / "gpu.safetensors", device="cuda")
    assert model.device == "cuda"
    assert isinstance(next(model.named_parameters())[1], cupy.ndarray)
    assert to_device(np.ones(2), "cuda").__class__ is cupy.ndarray


# The CUDA kernels of book/kernels.md against the host's float64 listings. In float64 they
# agree to rounding (RTOL_K); in float32 to a few float32 roundings of the result's size.
RTOL_K = 1e-12
EPS32 = float(np.finfo(np.float32).eps)


def _kernel_layers():
    from npformer.activations import GELU, SiLU, SwiGLU
    from npformer.norm import LayerNorm, RMSNorm

    return {"gelu": (lambda dt: GELU(dtype=dt), (4, 30, 64)),
            "gelu_tanh": (lambda dt: GELU("tanh", dtype=dt), (4, 30, 64)),
            "silu": (lambda dt: SiLU(dtype=dt), (4, 30, 64)),
            "swiglu": (lambda dt: SwiGLU(dtype=dt), (4, 30, 128)),
            "layernorm": (lambda dt: LayerNorm(64, dtype=dt), (4, 30, 64)),
            "rmsnorm": (lambda dt: RMSNorm(64, dtype=dt), (4, 30, 64))}


def _close(got, truth, dtype):
    got = to_host(got)
    if dtype == "float64":
        np.testing.assert_allclose(got, truth, rtol=RTOL_K, atol=RTOL_K)
    else:
        assert np.abs(got - truth).max() <= 16 * EPS32 * max(1.0, np.abs(truth).max())


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "silu", "swiglu", "layernorm",
                                  "rmsnorm"])
def test_cuda_kernel_layer_matches_the_listing(name, dtype):
    make, shape = _kernel_layers()[name]
    rng = np.random.default_rng(12)
    x = rng.standard_normal(shape) * 3
    listing = make("float64").use_kernels("numpy")
    y = listing.forward(x)
    dy = rng.standard_normal(y.shape)
    dx = listing.backward(dy)
    layer = make(dtype).to("cuda").use_kernels("fused")
    y_g = layer.forward(to_device(x.astype(dtype), "cuda"))
    dx_g = layer.backward(to_device(dy.astype(dtype), "cuda"))
    _close(y_g, y, dtype)
    _close(dx_g, dx, dtype)
    if dtype == "float64":  # a parameter's gradient sums 120 rows: float64 only here
        for (_, _, g), (_, _, g_g) in zip(listing.named_parameters(),
                                          layer.named_parameters()):
            _close(g_g, g, dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_cuda_attention_and_cross_entropy_kernels_match_the_listing(dtype):
    from npformer import kernels
    from npformer.attention import attention_backward, causal_mask, scaled_dot_product_attention
    from npformer.softmax import cross_entropy

    rng = np.random.default_rng(13)
    q, k, v, dout = (rng.standard_normal((2, 3, 20, 8)) for _ in range(4))
    pad = np.ones((2, 1, 1, 20), dtype=bool)
    pad[1, ..., 12:] = False
    mask = causal_mask(20) & pad
    out, cache = scaled_dot_product_attention(q, k, v, mask)
    truth = [out, *attention_backward(dout, cache)]
    dev = [to_device(a.astype(dtype), "cuda") for a in (q, k, v, dout)]
    out_g, cache_g = kernels.fused_attention(*dev[:3], to_device(mask, "cuda"))
    for got, t in zip([out_g, *kernels.fused_attention_backward(dev[3], cache_g)], truth):
        _close(got, t, dtype)
    logits, targets = rng.standard_normal((6, 500)) * 4, rng.integers(0, 500, 6)
    scored = np.array([1, 1, 0, 1, 0, 1], dtype=bool)
    loss, grad = cross_entropy(logits, targets, scored)
    loss_g, grad_g = cross_entropy(to_device(logits.astype(dtype), "cuda"),
                                   to_device(targets, "cuda"), to_device(scored, "cuda"),
                                   kernels="fused")
    assert loss_g == pytest.approx(loss, rel=RTOL_K if dtype == "float64" else 1e-5)
    _close(grad_g, grad, dtype)


def test_cuda_fused_adamw_matches_the_host_listing():
    config = npf.GPTConfig(vocab_size=30, block_size=8, n_layer=1, n_head=2, d_model=16,
                           dtype="float64")
    params = []
    for device, kind in (("cpu", "numpy"), ("cuda", "fused")):
        model = npf.GPT(config, seed=3, kernels=kind)
        if device != "cpu":
            model.to(device)
        opt = AdamW(model.named_parameters(), lr=1e-2, weight_decay=0.1)
        assert opt.kernels == kind
        grads = np.random.default_rng(4)
        for _ in range(3):
            for _, _, g in model.named_parameters():
                g[...] = to_device(grads.standard_normal(g.shape), device)
            opt.step()
        params.append({n: to_host(p) for n, p, _ in model.named_parameters()})
    for name, p in params[0].items():
        np.testing.assert_allclose(params[1][name], p, rtol=RTOL_K, atol=RTOL_K, err_msg=name)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_cuda_kernels_are_non_finite_where_the_listing_is(dtype):
    """The cases of tests/test_kernels_nonfinite.py, with the fused side on the GPU."""
    import test_kernels_nonfinite as nf

    for special in nf.SPECIALS:
        for name in nf.LAYERS:
            for where in ("x", "dout"):
                listing, fused = nf.layer_case(name, dtype, special, where, device="cuda")
                nf.assert_same_classes(fused, listing, f"{name} {dtype}, {special} in {where}")
        for where in ("q", "k", "v", "dout"):
            for mask in nf.MASKS:
                listing, fused = nf.attention_case(dtype, special, where, mask, "cuda")
                nf.assert_same_classes(fused, listing, f"attention {dtype}, {special} in "
                                                       f"{where}, mask {mask}")
        for where in ("target", "other"):
            listing, fused = nf.cross_entropy_case(dtype, special, where, "cuda")
            nf.assert_same_classes(fused, listing, f"cross-entropy {dtype}, {special} at {where}")
        listing, fused = nf.adamw_case(dtype, special, "cuda")
        nf.assert_same_classes(fused, listing, f"AdamW {dtype}, {special}")
