"""Weight quantization (book/quantize.md): grids, packing, int8 products, GPTQ, the
quantized model and its checkpoints."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import npformer as npf
from npformer.checkpoint import tensors_sha256
from npformer.quantize import (
    D_IN_MAX,
    QuantizedLinear,
    code_range,
    fit_grid,
    gptq,
    gptq_explicit,
    int8_matmul,
    load_quantized,
    pack_int4,
    quantize_model,
    quantize_rtn,
    quantized_linear,
    round_to_grid,
    save_quantized,
    stored_bytes,
    unpack_int4,
    w8a8_matmul,
)

SCHEMES = [(8, None, True), (8, None, False), (4, 8, False), (4, 8, True), (3, 16, False),
           (2, None, False)]


def weights(seed=0, d_in=32, d_out=12):
    r = np.random.default_rng(seed)
    W = r.standard_normal((d_in, d_out))
    W[:, 0] = 0.0  # an all-zero column
    W[3, 1] = 25.0  # an outlier
    W[:, 2] = np.abs(W[:, 2]) + 1.0  # all positive
    return W


def correlated_inputs(seed, n, d):
    r = np.random.default_rng(seed)
    return r.standard_normal((n, d)) @ (np.eye(d) + 0.7 * r.standard_normal((d, d)))


@pytest.mark.parametrize("bits, group, symmetric", SCHEMES)
def test_every_weight_is_within_half_a_step_and_codes_stay_in_range(bits, group, symmetric):
    W = weights()
    qw = quantize_rtn(W, bits, group, symmetric)
    lo, hi = code_range(bits, symmetric)
    assert lo <= qw.q.min() and qw.q.max() <= hi
    assert (qw.zero >= lo).all() and (qw.zero <= hi).all()
    s = np.repeat(qw.scale, qw.group_size, axis=0).astype(np.float64)
    assert np.all(np.abs(qw.dequantize(np.float64) - W) <= s / 2 * (1 + 1e-6))
    assert np.array_equal(qw.dequantize(np.float64)[:, 0], np.zeros(W.shape[0]))


@pytest.mark.parametrize("bits, symmetric", [(8, True), (4, False)])
def test_output_error_within_the_l1_bound_and_near_the_uniform_model(bits, symmetric):
    r = np.random.default_rng(1)
    W, x = r.standard_normal((256, 200)), r.standard_normal((300, 256))
    qw = quantize_rtn(W, bits, symmetric=symmetric)
    dW, s = qw.dequantize(np.float64) - W, qw.scale[0].astype(np.float64)
    err = x @ dW
    assert np.all(np.abs(err) <= np.abs(x).sum(axis=1, keepdims=True) * s / 2 * (1 + 1e-9))
    # the uniform model: E[dW^2] = s^2 / 12, E[(x dW)^2] = |x|^2 s^2 / 12 (5% here)
    assert abs(np.mean(dW ** 2 / (s ** 2 / 12)) - 1) < 0.05
    model = (x ** 2).sum(axis=1, keepdims=True) * s ** 2 / 12
    assert abs(np.mean(err ** 2) / np.mean(model) - 1) < 0.05


def test_pack_unpack_is_exact_for_every_pair_of_codes():
    pairs = np.array(list(itertools.product(range(16), repeat=2))).T  # (2, 256)
    packed = pack_int4(pairs)
    assert packed.dtype == np.uint8 and packed.shape == (1, 256)
    assert len(np.unique(packed)) == 256
    assert np.array_equal(unpack_int4(packed), pairs)
    codes = np.random.default_rng(0).integers(0, 16, (64, 7))
    assert np.array_equal(unpack_int4(pack_int4(codes)), codes)


@pytest.mark.parametrize("bad, match", [(np.zeros((3, 2), int), "even number"),
                                        (np.full((2, 2), 16), "0..15"),
                                        (np.full((2, 2), -1), "0..15"),
                                        (np.zeros((2, 2)), "integer codes")])
def test_pack_refuses_what_does_not_fit_a_nibble(bad, match):
    with pytest.raises(ValueError, match=match):
        pack_int4(bad)
    with pytest.raises(ValueError, match="p: expected dtype uint8"):
        unpack_int4(np.zeros((2, 2), np.int8))


def test_int8_products_summed_in_int32_are_exact_up_to_the_largest_d_in():
    assert D_IN_MAX * 128 * 127 <= 2 ** 31 - 1 < (D_IN_MAX + 1) * 128 * 127
    r = np.random.default_rng(0)
    a = r.integers(-128, 128, (2, D_IN_MAX), dtype=np.int8)
    b = r.integers(-127, 128, (D_IN_MAX, 3), dtype=np.int8)
    got = int8_matmul(a, b)
    assert got.dtype == np.int32
    exact = [[sum(int(u) * int(v) for u, v in zip(row, col)) for col in b.T]
             for row in a[:, :2000]]
    assert np.array_equal(int8_matmul(a[:, :2000], b[:2000]), np.array(exact))
    assert np.array_equal(got, a.astype(np.int64) @ b.astype(np.int64))
    worst = int8_matmul(np.full((1, D_IN_MAX), -128, np.int8),
                        np.full((D_IN_MAX, 1), 127, np.int8))
    assert int(worst[0, 0]) == -128 * 127 * D_IN_MAX
    with pytest.raises(ValueError, match="at most 132104 columns"):
        int8_matmul(np.zeros((1, D_IN_MAX + 1), np.int8), np.zeros((D_IN_MAX + 1, 1),
                                                                   np.int8))
    with pytest.raises(ValueError, match="-127, 127"):
        int8_matmul(np.zeros((1, 2), np.int8), np.full((2, 1), -128, np.int8))


def test_w8a8_is_the_scaled_integer_product():
    r = np.random.default_rng(2)
    x, W = r.standard_normal((5, 64)), r.standard_normal((64, 9))
    qw = quantize_rtn(W, 8)
    y = w8a8_matmul(x, qw)
    s_x = np.abs(x).max(axis=1, keepdims=True) / 127
    q_x = np.round(x / s_x)
    assert np.allclose(y, s_x * (q_x @ qw.q) * qw.scale[0], rtol=1e-12, atol=0)
    assert np.linalg.norm(y - x @ W) / np.linalg.norm(x @ W) < 0.02
    with pytest.raises(ValueError, match="int8 absmax"):
        w8a8_matmul(x, quantize_rtn(W, 4, symmetric=False))


@pytest.mark.parametrize("bits, group, symmetric, damp", [(4, 8, False, 0.0),
                                                          (3, None, False, 0.01),
                                                          (8, None, True, 0.01),
                                                          (4, 16, True, 0.1)])
def test_cholesky_form_equals_the_explicit_obs_recursion(bits, group, symmetric, damp):
    X, W = correlated_inputs(3, 200, 32), weights(4)
    H = 2 * X.T @ X
    a = gptq(W, H, bits, group, symmetric, damp)
    b = gptq_explicit(W, H, bits, group, symmetric, damp)
    assert np.array_equal(a.q, b.q)
    assert np.array_equal(a.scale, b.scale) and np.array_equal(a.zero, b.zero)
    assert np.max(np.abs(a.losses - b.losses)) <= 1e-12 * max(1.0, a.losses.max())


def test_gptq_added_errors_sum_to_the_output_error_and_free_rows_are_least_squares():
    X, W = correlated_inputs(5, 120, 24), np.random.default_rng(6).standard_normal((24, 5))
    H = 2 * X.T @ X
    qw = gptq(W, H, 3, 8, damp=0.0)
    out = np.sum((X @ (qw.dequantize(np.float64) - W)) ** 2)
    assert abs(qw.losses.sum() - out) <= 1e-9 * out
    # replay: after row i, the free rows minimise |X (W_hat - W)|^2 given rows 0..i
    U = np.linalg.cholesky(np.linalg.inv(H)).T
    Wc = W.copy()
    for i in range(24):
        if i % 8 == 0:
            s, z = fit_grid(Wc[i:i + 8], 3, False)
        qi = round_to_grid(Wc[i], s, z, 3, False)
        Wc[i + 1:] += np.outer(U[i, i + 1:], (s * (qi - z) - Wc[i]) / U[i, i])
        Wc[i] = s * (qi - z)
        if i + 1 < 24:
            target = X @ W - X[:, :i + 1] @ Wc[:i + 1]
            free = np.linalg.lstsq(X[:, i + 1:], target, rcond=None)[0]
            assert np.allclose(free, Wc[i + 1:], rtol=0, atol=1e-9 * np.abs(free).max())
    assert np.array_equal(Wc, qw.dequantize(np.float64))


def test_gptq_against_exhaustive_search_on_tiny_layers():
    levels = np.array(list(itertools.product(range(4), repeat=5)))  # (1024, 5)
    gaps, wins = [], 0
    for k in range(60):
        r = np.random.default_rng([11, k])
        X = r.standard_normal((20, 5)) @ (np.eye(5) + 0.8 * r.standard_normal((5, 5)))
        w = r.standard_normal((5, 1))
        s, z = fit_grid(w, 2, False)
        errors = np.sum((X @ (s * (levels - z)).T - X @ w) ** 2, axis=0)  # every rounding
        opt = errors.min()
        g = np.sum((X @ (gptq(w, 2 * X.T @ X, 2, damp=0.0).dequantize(np.float64) - w)) ** 2)
        n = np.sum((X @ (quantize_rtn(w, 2, symmetric=False).dequantize(np.float64) - w))
                   ** 2)
        assert g >= opt * (1 - 1e-12) and n >= opt * (1 - 1e-12)  # nothing beats the optimum
        gaps.append(g / opt)
        wins += g <= n * (1 + 1e-12)
    assert wins >= 40  # GPTQ <= RTN on most layers (it is greedy: not on all)
    assert np.mean(gaps) < 3


def test_gptq_with_a_diagonal_hessian_is_round_to_nearest():
    W = weights(7)
    H = np.diag(np.random.default_rng(8).uniform(0.5, 3.0, W.shape[0]))
    for bits, group, sym in SCHEMES:
        a, b = gptq(W, H, bits, group, sym, damp=0.0), quantize_rtn(W, bits, group, sym)
        assert np.array_equal(a.q, b.q) and np.array_equal(a.scale, b.scale)


def test_gptq_zeroes_the_rows_of_inputs_that_are_always_zero():
    X, W = correlated_inputs(9, 60, 16), weights(9, 16, 4)
    X[:, 5] = 0
    qw = gptq(W, 2 * X.T @ X, 4, 8)
    assert np.all(qw.dequantize()[5] == 0)


@pytest.mark.parametrize("bits, group, symmetric", SCHEMES)
def test_quantized_linear_equals_linear_with_the_dequantized_weight(bits, group, symmetric):
    W = weights(10).astype(np.float32)
    b = np.random.default_rng(11).standard_normal(W.shape[1]).astype(np.float32)
    qw = quantize_rtn(W, bits, group, symmetric)
    layer = quantized_linear(qw, b)
    assert np.array_equal(layer.codes(), qw.q)
    lin = npf.Linear(*W.shape)
    lin.W[...], lin.b[...] = qw.dequantize(), b
    x = np.random.default_rng(12).standard_normal((3, 4, W.shape[0])).astype(np.float32)
    assert np.array_equal(layer(x), lin(x))
    code_bytes = W.size // 2 if bits <= 4 else W.size
    assert stored_bytes(layer) == (code_bytes + qw.scale.nbytes + 4 * W.shape[1]
                                   + (0 if symmetric else qw.scale.size))
    with pytest.raises(NotImplementedError, match="inference"):
        layer.backward(np.zeros((3, 4, W.shape[1]), np.float32))


def small_gpt(seed=0):
    cfg = npf.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=16)
    return npf.GPT(cfg, seed=seed).eval()


@pytest.mark.parametrize("bits, group, method", [(4, 8, "gptq"), (8, None, "rtn"),
                                                 (3, 16, "gptq")])
def test_a_saved_quantized_model_loads_with_the_same_logits_bit_for_bit(
        tmp_path, bits, group, method):
    model = small_gpt()
    ids = np.random.default_rng(0).integers(0, 11, (24, 8))
    quantize_model(model, bits, group, method, ids, batch_size=8)
    assert len(model.quantization["layers"]) == 8
    assert not any(isinstance(m, npf.Linear) for _, m in model.named_modules())
    path = save_quantized(model, tmp_path / "q.safetensors")
    again = load_quantized(path)
    assert again.quantization == model.quantization
    x = ids[:3]
    assert np.array_equal(again.forward(x), model.forward(x))
    for (n1, p1, _), (n2, p2, _) in zip(model.named_parameters(include_frozen=True),
                                        again.named_parameters(include_frozen=True)):
        assert n1 == n2 and p1.dtype == p2.dtype and np.array_equal(p1, p2)
    with pytest.raises(ValueError, match="a new file"):
        save_quantized(model, path)
    save_quantized(model, path, overwrite=True)
    with pytest.raises(ValueError, match="a float model"):
        save_quantized(small_gpt(), tmp_path / "f.safetensors")
    npf.save(small_gpt(), tmp_path / "f.safetensors")
    with pytest.raises(ValueError, match="a quantized checkpoint"):
        load_quantized(tmp_path / "f.safetensors")


def test_gptq_model_beats_round_to_nearest_on_its_calibration_text():
    ids = np.random.default_rng(1).integers(0, 11, (32, 8))
    out = {}
    for method in ("rtn", "gptq"):
        model = quantize_model(small_gpt(), 3, 8, method, ids)
        out[method] = np.mean((model.forward(ids) - small_gpt().forward(ids)) ** 2)
    assert out["gptq"] < out["rtn"]


def rewrite(path, tmp_path, scheme_change=None, tensor_change=None):
    with safe_open(str(path), framework="np") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    scheme = json.loads(meta["transforms"])
    if scheme_change:
        scheme_change(scheme[0][1])
    if tensor_change:
        tensor_change(tensors)
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata={**meta, "transforms": json.dumps(scheme),
                                           "sha256": tensors_sha256(tensors)})
    return bad


@pytest.mark.parametrize("change, match", [
    (lambda s: s.update(bits=8), r"model.h.0.attn.qkv.qweight: expected shape \(16, 48\)"),
    (lambda s: s.update(bits=9), r"bits: expected an integer in \[2, 8\], got 9"),
    (lambda s: s.update(bits="4"), r"bits: expected an integer"),
    (lambda s: s.update(group_size=3), r"group_size: expected a divisor of d_in = 16"),
    (lambda s: s.update(symmetric="no"), r"symmetric"),
    (lambda s: s.update(layers=[]), r"layers: expected a non-empty list"),
    (lambda s: s["layers"].append("h.5.mlp.fc"), r"layers: expected names of Linear"),
    (lambda s: s.update(symmetric=True), r"unexpected \['h.0.attn.proj.zeros'"),
])
def test_a_tampered_scheme_is_refused_naming_what_is_wrong(tmp_path, change, match):
    model = quantize_model(small_gpt(), 4, 8, "rtn")
    path = save_quantized(model, tmp_path / "q.safetensors")
    with pytest.raises(ValueError, match=match):
        load_quantized(rewrite(path, tmp_path, change))


def test_tampered_arrays_are_refused(tmp_path):
    model = quantize_model(small_gpt(), 4, 8, "rtn")
    path = save_quantized(model, tmp_path / "q.safetensors")
    key = "model.h.1.mlp.fc.scales"
    bad = rewrite(path, tmp_path, None, lambda t: t.update({key: t[key][:1]}))
    with pytest.raises(ValueError, match=r"model.h.1.mlp.fc.scales: expected shape \(2, 64\)"):
        load_quantized(bad)
    with safe_open(str(path), framework="np") as f:  # changed bytes, checksum left alone
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.h.0.mlp.fc.qweight"] = tensors["model.h.0.mlp.fc.qweight"] ^ np.uint8(1)
    save_file(tensors, str(tmp_path / "flip.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match="checksum"):
        load_quantized(tmp_path / "flip.safetensors")


def test_quantize_model_refuses_bad_arguments():
    ids = np.zeros((2, 8), int)
    with pytest.raises(ValueError, match="group_size: expected a divisor of d_in = 16"):
        quantize_model(small_gpt(), 4, 5, "rtn")
    with pytest.raises(ValueError, match="method"):
        quantize_model(small_gpt(), 4, 8, "awq")
    with pytest.raises(ValueError, match="calibration: expected a numpy array"):
        quantize_model(small_gpt(), 4, 8, "gptq")
    with pytest.raises(ValueError, match="bits"):
        quantize_model(small_gpt(), 1, 8, "rtn")
    with pytest.raises(ValueError, match="targets"):
        quantize_model(small_gpt(), 4, 8, "rtn", targets=["nothing.here"])
    model = quantize_model(small_gpt(), 4, 8, "gptq", ids, targets=["mlp.fc"])
    assert model.quantization["layers"] == ["h.0.mlp.fc", "h.1.mlp.fc"]
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model, 4, 8, "rtn")
    with pytest.raises(ValueError, match="d_in"):
        QuantizedLinear(15, 4, 4)
