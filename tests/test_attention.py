"""Attention, masks, multi-head attention and the KV cache (book/attention.md), as specs."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from npformer.attention import (
    AttentionCache,
    KVCache,
    MultiHeadAttention,
    attention_backward,
    causal_mask,
    scaled_dot_product_attention,
)
from npformer.embedding import RoPE
from npformer.gradcheck import check_module, gradcheck
from npformer.proofs import prove_attention_backward

TOL = 1e-7  # the book's finite-difference bound, float64
CACHE_ATOL = 1e-13  # KV cache vs full recomputation, float64, outputs of order one


@pytest.fixture
def rng():
    return np.random.default_rng(2024)


def reference_attention(q, k, v, mask=None):
    """One query at a time, with explicit loops; fully masked rows give zeros."""
    B, H, Tq, d = q.shape
    allowed = np.broadcast_to(True if mask is None else mask, (B, H, Tq, k.shape[2]))
    out = np.zeros((B, H, Tq, v.shape[-1]))
    for b, h, t in np.ndindex(B, H, Tq):
        keys = allowed[b, h, t]
        if keys.any():
            s = k[b, h, keys] @ q[b, h, t] / np.sqrt(d)
            w = np.exp(s - s.max())
            out[b, h, t] = w @ v[b, h, keys] / w.sum()
    return out


def qkv(rng, B=2, H=3, Tq=5, Tk=5, d=4, d_v=None, dtype=np.float64):
    q = rng.standard_normal((B, H, Tq, d)).astype(dtype)
    k = rng.standard_normal((B, H, Tk, d)).astype(dtype)
    v = rng.standard_normal((B, H, Tk, d if d_v is None else d_v)).astype(dtype)
    return q, k, v


def left_padded_causal(B=2, T=5):
    """Causal mask and a left-padded sequence 1, which makes two rows fully masked."""
    pad = np.ones((B, T), dtype=bool)
    pad[1, :2] = False
    return causal_mask(T) & pad[:, None, None, :]  # (B, 1, T, T)


def randomised(layer, seed=7):
    """Linear starts with zero biases; random ones let the checks see their gradients."""
    g = np.random.default_rng(seed)
    for name, param, _ in layer.named_parameters():
        if name.endswith(".b"):
            param[:] = g.standard_normal(param.shape)
    return layer


# --------------------------------------------------------------------------- masks


def test_causal_mask_allows_exactly_the_keys_at_or_before_each_query():
    m = causal_mask(4)
    assert m.dtype == np.bool_ and m.shape == (4, 4)
    assert np.array_equal(m, np.tril(np.ones((4, 4), dtype=bool)))


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("mask_kind", ["none", "causal", "padding", "causal+left padding"])
def test_attention_equals_the_explicit_loop_reference(rng, mask_kind):
    q, k, v = qkv(rng)
    pad = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=bool)[:, None, None, :]
    mask = {"none": None, "causal": causal_mask(5), "padding": pad,
            "causal+left padding": left_padded_causal()}[mask_kind]
    out, _ = scaled_dot_product_attention(q, k, v, mask)
    np.testing.assert_allclose(out, reference_attention(q, k, v, mask), rtol=0, atol=1e-14)


def test_cross_attention_shapes_tq_tk_and_dv_may_differ(rng):
    q, k, v = qkv(rng, Tq=3, Tk=6, d=4, d_v=5)
    out, cache = scaled_dot_product_attention(q, k, v)
    assert out.shape == (2, 3, 3, 5) and cache.p.shape == (2, 3, 3, 6)
    np.testing.assert_allclose(out, reference_attention(q, k, v), rtol=0, atol=1e-14)


def test_attention_weights_are_rows_of_probabilities_and_exactly_zero_where_masked(rng):
    q, k, v = qkv(rng)
    _, cache = scaled_dot_product_attention(q, k, v, causal_mask(5))
    np.testing.assert_allclose(cache.p.sum(-1), 1.0, rtol=0, atol=1e-15)
    assert np.all(cache.p[..., ~causal_mask(5)] == 0.0)


def test_float32_stays_float32(rng):
    q, k, v = qkv(rng, dtype=np.float32)
    out, cache = scaled_dot_product_attention(q, k, v, causal_mask(5))
    dq, dk, dv = attention_backward(np.ones_like(out), cache)
    assert {a.dtype for a in (out, cache.p, dq, dk, dv)} == {np.dtype(np.float32)}


def test_huge_forbidden_scores_still_get_exactly_zero_probability():
    """A finite mask (-1e4) would leak here; -inf does not, at any score size."""
    q = np.array([[1.0]])  # (Tq=1, d=1)
    k = np.array([[0.0], [1e6]])  # the forbidden key scores 1e6
    v = np.array([[1.0], [-1.0]])
    out, cache = scaled_dot_product_attention(q, k, v, np.array([[True, False]]))
    assert cache.p[0, 1] == 0.0 and out[0, 0] == 1.0


def test_fully_masked_rows_give_zero_output_and_zero_gradient_without_warnings(rng):
    q, k, v = qkv(rng)
    mask = left_padded_causal()  # rows 0 and 1 of sequence 1 see only padding
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no 0/0, no inf - inf
        out, cache = scaled_dot_product_attention(q, k, v, mask)
        dq, dk, dv = attention_backward(rng.standard_normal(out.shape), cache)
    assert np.all(np.isfinite(out)) and np.all(out[1, :, :2] == 0.0)
    assert np.all(cache.p[1, :, :2] == 0.0)
    assert np.all(dq[1, :, :2] == 0.0)


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("mask_kind", ["none", "causal", "padding", "causal+left padding", "cross"])
def test_attention_backward_matches_finite_differences(rng, mask_kind):
    Tq = 3 if mask_kind == "cross" else 5
    q, k, v = qkv(rng, B=2, H=2, Tq=Tq, Tk=5, d=3, d_v=4 if mask_kind == "cross" else None)
    pad = np.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=bool)[:, None, None, :]
    mask = {"none": None, "causal": causal_mask(5), "padding": pad, "cross": pad,
            "causal+left padding": left_padded_causal()}[mask_kind]
    dout = rng.standard_normal((2, 2, Tq, v.shape[-1]))

    def loss(q, k, v):
        out, cache = scaled_dot_product_attention(q, k, v, mask)
        return float(np.sum(out * dout)), attention_backward(dout, cache)

    errors = gradcheck(loss, [q, k, v], names=["q", "k", "v"], tol=TOL)
    assert max(errors.values()) < TOL


def test_no_gradient_reaches_keys_and_values_a_query_cannot_see(rng):
    q, k, v = qkv(rng)
    out, cache = scaled_dot_product_attention(q, k, v, causal_mask(5))
    dout = np.zeros_like(out)
    dout[:, :, :2] = rng.standard_normal((2, 3, 2, 4))  # losses on queries 0 and 1 only
    dq, dk, dv = attention_backward(dout, cache)
    assert np.all(dk[:, :, 2:] == 0.0) and np.all(dv[:, :, 2:] == 0.0)  # keys 2..4: exactly 0
    assert np.all(dq[:, :, 2:] == 0.0)
    assert np.abs(dk[:, :, :2]).min() > 0 and np.abs(dv[:, :, :2]).min() > 0


def test_padding_keys_receive_exactly_zero_gradient(rng):
    q, k, v = qkv(rng)
    pad = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=bool)
    out, cache = scaled_dot_product_attention(q, k, v, pad[:, None, None, :])
    _, dk, dv = attention_backward(rng.standard_normal(out.shape), cache)
    assert np.all(dk[0, :, 3:] == 0.0) and np.all(dv[0, :, 3:] == 0.0)
    assert np.all(dk[1, :, 4:] == 0.0) and np.all(dv[1, :, 4:] == 0.0)


def test_changing_future_keys_and_values_leaves_earlier_outputs_bit_identical(rng):
    q, k, v = qkv(rng)
    out, _ = scaled_dot_product_attention(q, k, v, causal_mask(5))
    k[:, :, 3:] += 50.0
    v[:, :, 3:] -= 50.0
    out2, _ = scaled_dot_product_attention(q, k, v, causal_mask(5))
    assert np.array_equal(out2[:, :, :3], out[:, :, :3])


# --------------------------------------------------------------------------- SymPy


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T, dk", [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (3, 2)])
def test_library_attention_backward_equals_sympy_gradient(T, dk, causal):
    assert prove_attention_backward(T, dk, causal=causal) is True


def test_sympy_proof_rejects_a_backward_without_the_scale_on_dk():
    def wrong(dout, cache):
        dq, dk, dv = attention_backward(dout, cache)
        return dq, dk / cache.scale, dv

    with pytest.raises(AssertionError, match="dk"):
        prove_attention_backward(2, 2, backward=wrong)


# --------------------------------------------------------------------------- multi-head


MHA_CASES = {
    "bidirectional": (dict(), None),
    "bidirectional+padding": (dict(), np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])),
    "causal": (dict(causal=True), None),
    "causal+left padding": (dict(causal=True), np.array([[0, 1, 1, 1, 1], [0, 0, 1, 1, 1]])),
    "causal+rope": (dict(causal=True, rope=RoPE(4, 8, dtype="float64")), None),
    "causal+rope+padding": (dict(causal=True, rope=RoPE(4, 8, dtype="float64")),
                            np.array([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=bool)),
    "no bias": (dict(causal=True, bias=False), None),
}


@pytest.mark.parametrize("case", list(MHA_CASES))
def test_multihead_attention_gradients_match_finite_differences(rng, case):
    kwargs, attention_mask = MHA_CASES[case]
    mha = randomised(MultiHeadAttention(8, 2, seed=3, dtype="float64", **kwargs))
    x = rng.standard_normal((2, 5, 8))
    inputs = (x,) if attention_mask is None else (x, attention_mask)
    errors = check_module(mha, *inputs, tol=TOL)
    expected = {"x", "qkv.W", "proj.W"}
    if kwargs.get("bias", True):
        expected |= {"qkv.b", "proj.b"}
    assert set(errors) == expected and max(errors.values()) < TOL


def test_fused_qkv_columns_are_q_then_k_then_v_with_heads_contiguous(rng):
    """The layout of GPT-2's c_attn: column = part * d_model + head * d_head + j."""
    mha = randomised(MultiHeadAttention(6, 3, causal=True, seed=0, dtype="float64"))
    x = rng.standard_normal((2, 4, 6))
    W, b = mha.qkv.W, mha.qkv.b
    heads = []
    for h in range(3):
        cols = [slice(part * 6 + 2 * h, part * 6 + 2 * h + 2) for part in range(3)]
        q, k, v = (x @ W[:, c] + b[c] for c in cols)  # (B, T, 2) each
        heads.append(reference_attention(q[:, None], k[:, None], v[:, None], causal_mask(4))[:, 0])
    expected = np.concatenate(heads, axis=-1) @ mha.proj.W + mha.proj.b
    np.testing.assert_allclose(mha(x), expected, rtol=0, atol=1e-13)


def test_multihead_backward_accumulates_parameter_gradients(rng):
    mha = randomised(MultiHeadAttention(8, 2, causal=True, seed=1, dtype="float64"))
    x, dout = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 5, 8))
    mha.forward(x)
    mha.backward(dout)
    once = {name: g.copy() for name, _, g in mha.named_parameters()}
    mha.backward(dout)
    for name, _, g in mha.named_parameters():
        np.testing.assert_allclose(g, 2 * once[name], rtol=1e-15, atol=0, err_msg=name)


def test_multihead_attention_float32_in_float32_out(rng):
    mha = MultiHeadAttention(8, 2, causal=True, seed=0)
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    y = mha(x, np.ones((2, 5), dtype=bool))
    dx = mha.backward(np.ones_like(y))
    assert y.dtype == dx.dtype == np.float32 and mha.qkv.dW.dtype == np.float32


@pytest.mark.parametrize("rope", [False, True])
def test_changing_the_last_token_leaves_earlier_outputs_bit_identical(rng, rope):
    mha = MultiHeadAttention(8, 2, causal=True, seed=2, dtype="float64",
                             rope=RoPE(4, 8, dtype="float64") if rope else None)
    x = rng.standard_normal((2, 6, 8))
    y = mha(x)
    x[:, -1] = 1e3
    assert np.array_equal(mha(x)[:, :-1], y[:, :-1])


def test_padding_tokens_do_not_change_real_token_outputs(rng):
    mha = randomised(MultiHeadAttention(8, 2, seed=2, dtype="float64"))
    pad = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    x = rng.standard_normal((2, 5, 8))
    y = mha(x, pad)
    x[0, 3:] = -1e3
    assert np.array_equal(mha(x, pad)[0, :3], y[0, :3])


def test_real_token_gradients_do_not_reach_padding_inputs_through_keys(rng):
    """Only the padding positions' own outputs depend on their inputs."""
    mha = randomised(MultiHeadAttention(8, 2, seed=2, dtype="float64"))
    pad = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    mha(rng.standard_normal((2, 5, 8)), pad)
    dout = rng.standard_normal((2, 5, 8))
    dout[0, 3:] = 0.0  # no loss at the padding positions
    dx = mha.backward(dout)
    assert np.all(dx[0, 3:] == 0.0)


# --------------------------------------------------------------------------- KV cache


def test_kv_cache_attend_matches_causal_attention_over_the_whole_sequence(rng):
    q, k, v = qkv(rng, Tq=7, Tk=7)
    full, _ = scaled_dot_product_attention(q, k, v, causal_mask(7))
    cache, outs = KVCache(10), []
    for start, stop in ((0, 3), (3, 4), (4, 7)):  # a prompt, then one, then three positions
        cache.append(k[:, :, start:stop], v[:, :, start:stop])
        outs.append(cache.attend(q[:, :, start:stop]))
    assert cache.length == 7 and cache.k.shape == (2, 3, 10, 4)
    np.testing.assert_allclose(np.concatenate(outs, axis=2), full, rtol=0, atol=CACHE_ATOL)


def test_kv_cache_prompt_in_one_call_is_bit_identical_to_the_full_forward(rng):
    q, k, v = qkv(rng, Tq=6, Tk=6)
    full, _ = scaled_dot_product_attention(q, k, v, causal_mask(6))
    cache = KVCache(6)
    cache.append(k, v)
    assert np.array_equal(cache.attend(q), full)


@pytest.mark.parametrize("max_len", [7, 12])
def test_multihead_prompt_in_one_cached_call_is_bit_identical_to_forward(rng, max_len):
    mha = randomised(MultiHeadAttention(8, 2, causal=True, seed=4, dtype="float64",
                                        rope=RoPE(4, 12, dtype="float64")))
    x = rng.standard_normal((2, 7, 8))
    pad = np.array([[1] * 7, [0, 0, 1, 1, 1, 1, 1]], dtype=bool)
    assert np.array_equal(mha.forward_cached(x, KVCache(max_len), pad), mha(x, pad))


@pytest.mark.parametrize("rope", [False, True])
def test_generation_with_kv_cache_matches_full_causal_forward(rng, rope):
    T, prompt = 10, 3
    mha = randomised(MultiHeadAttention(8, 2, causal=True, seed=4, dtype="float64",
                                        rope=RoPE(4, T, dtype="float64") if rope else None))
    x = rng.standard_normal((2, T, 8))
    pad = np.ones((2, T), dtype=bool)
    pad[1, :2] = False  # left padding: sequence 1's first rows see only padding
    full = mha(x, pad)
    cache = KVCache(T)
    steps = [mha.forward_cached(x[:, :prompt], cache, pad[:, :prompt])]
    steps += [mha.forward_cached(x[:, t:t + 1], cache, pad[:, t:t + 1]) for t in range(prompt, T)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=0, atol=CACHE_ATOL)


def test_generation_with_kv_cache_matches_full_forward_in_float32(rng):
    mha = MultiHeadAttention(8, 2, causal=True, seed=4, rope=RoPE(4, 6))
    x = rng.standard_normal((1, 6, 8)).astype(np.float32)
    cache = KVCache(6)
    steps = np.concatenate([mha.forward_cached(x[:, t:t + 1], cache) for t in range(6)], axis=1)
    assert steps.dtype == np.float32
    np.testing.assert_allclose(steps, mha(x), rtol=0, atol=1e-6)


def test_no_backward_after_forward_cached(rng):
    mha = MultiHeadAttention(8, 2, causal=True, seed=0, dtype="float64")
    mha.forward_cached(rng.standard_normal((1, 2, 8)), KVCache(4))
    with pytest.raises(RuntimeError, match="backward: call forward first"):
        mha.backward(np.zeros((1, 2, 8)))


def test_kv_cache_reset_empties_it(rng):
    q, k, v = qkv(rng, Tq=2, Tk=2)
    cache = KVCache(4)
    cache.append(k, v)
    cache.reset()
    assert cache.length == 0 and cache.k is None


# --------------------------------------------------------------------------- validation


def test_d_model_must_be_a_multiple_of_n_head():
    with pytest.raises(ValueError, match=r"d_model: expected a multiple of n_head = 4, got 10"):
        MultiHeadAttention(10, 4)


@pytest.mark.parametrize("name, kwargs", [("d_model", dict(d_model=0, n_head=1)),
                                          ("n_head", dict(d_model=8, n_head=-2))])
def test_sizes_must_be_positive_integers(name, kwargs):
    with pytest.raises(ValueError, match=rf"{name}: expected a positive integer"):
        MultiHeadAttention(**kwargs)


def test_x_last_dimension_must_be_d_model():
    with pytest.raises(ValueError, match=r"x: expected last dimension 8, got shape \(2, 5, 6\)"):
        MultiHeadAttention(8, 2)(np.zeros((2, 5, 6), np.float32))


def test_x_must_be_three_dimensional():
    message = r"x: expected shape \(B, T, d_model=8\), got \(1, 2, 5, 8\)"
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(8, 2)(np.zeros((1, 2, 5, 8), np.float32))


def test_x_dtype_must_match_the_layer():
    with pytest.raises(ValueError, match=r"x: expected dtype float32"):
        MultiHeadAttention(8, 2)(np.zeros((2, 5, 8)))


def test_attention_mask_shape_must_be_batch_by_time():
    message = r"attention_mask: expected shape \(2, 5\) \(B, T\), got \(2, 4\)"
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(8, 2)(np.zeros((2, 5, 8), np.float32), np.ones((2, 4)))


def test_attention_mask_values_must_be_zero_or_one():
    message = r"attention_mask: expected only 0/False .* got values \[0 1 2\]"
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(8, 2)(np.zeros((1, 3, 8), np.float32), np.array([[0, 1, 2]]))


def test_mask_must_broadcast_to_the_scores(rng):
    q, k, v = qkv(rng)
    with pytest.raises(ValueError, match=r"mask: expected a shape broadcastable to the scores' "
                                         r"shape \(2, 3, 5, 5\) .* got \(3, 3\)"):
        scaled_dot_product_attention(q, k, v, np.ones((3, 3), dtype=bool))


def test_mask_must_be_boolean(rng):
    q, k, v = qkv(rng)
    message = r"mask: expected a bool array \(True = may attend\), got float64"
    with pytest.raises(ValueError, match=message):
        scaled_dot_product_attention(q, k, v, np.zeros((5, 5)))


@pytest.mark.parametrize("which, shape, message", [
    ("k", (2, 3, 5, 3), r"k: expected shape \(2, 3, 'Tk', 4\) to match q"),
    ("k", (2, 2, 5, 4), r"k: expected shape \(2, 3, 'Tk', 4\) to match q"),
    ("v", (2, 3, 4, 4), r"v: expected shape \(2, 3, 5, 'd_v'\) to match k"),
])
def test_q_k_v_shapes_must_agree(rng, which, shape, message):
    q, k, v = qkv(rng)
    args = {"q": q, "k": k, "v": v, which: np.zeros(shape)}
    with pytest.raises(ValueError, match=message):
        scaled_dot_product_attention(**args)


def test_q_k_v_dtypes_must_agree(rng):
    q, k, v = qkv(rng)
    with pytest.raises(ValueError, match=r"k: expected dtype float64 \(that of q\), got float32"):
        scaled_dot_product_attention(q, k.astype(np.float32), v)


def test_attention_backward_checks_dout_shape(rng):
    q, k, v = qkv(rng)
    _, cache = scaled_dot_product_attention(q, k, v)
    assert isinstance(cache, AttentionCache)
    message = r"dout: expected shape \(2, 3, 5, 4\) \(that of out\), got \(2, 3, 5, 3\)"
    with pytest.raises(ValueError, match=message):
        attention_backward(np.zeros((2, 3, 5, 3)), cache)


def test_rope_must_match_the_head_width_and_dtype():
    message = r"rope: expected d_head = d_model / n_head = 4 and dtype float32, got .* d_head = 8"
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(8, 2, rope=RoPE(8, 16))
    message = r"rope: expected None or an npformer\.embedding\.RoPE, got str"
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(8, 2, rope="rope")


def test_causal_mask_size_must_be_positive():
    with pytest.raises(ValueError, match=r"T: expected a positive integer, got 0"):
        causal_mask(0)


def test_kv_cache_refuses_to_overflow(rng):
    q, k, v = qkv(rng, Tq=3, Tk=3)
    cache = KVCache(4)
    cache.append(k, v)
    message = r"k: expected at most max_len - length = 1 new positions, got 3"
    with pytest.raises(ValueError, match=message):
        cache.append(k, v)


def test_kv_cache_refuses_keys_unlike_the_cached_ones(rng):
    q, k, v = qkv(rng, Tq=2, Tk=2)
    cache = KVCache(8)
    cache.append(k, v)
    message = r"k: expected shape \(2, 3, 'T_new', 4\) and dtype float64"
    with pytest.raises(ValueError, match=message):
        cache.append(k[:1], v[:1])


def test_kv_cache_attend_needs_keys_and_at_most_length_queries(rng):
    q, k, v = qkv(rng, Tq=3, Tk=2)
    cache = KVCache(8)
    with pytest.raises(ValueError, match=r"q: expected a cache holding keys"):
        cache.attend(q)
    cache.append(k, v)
    message = r"q: expected shape \(B, H, Tq, d_head\) with 1 <= Tq <= length = 2"
    with pytest.raises(ValueError, match=message):
        cache.attend(q)


def test_kv_cache_max_len_must_be_positive():
    with pytest.raises(ValueError, match=r"max_len: expected a positive integer, got 0"):
        KVCache(0)


def test_forward_cached_needs_a_causal_layer_and_a_kv_cache():
    x = np.zeros((1, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"forward_cached: expected a causal MultiHeadAttention"):
        MultiHeadAttention(8, 2).forward_cached(x, KVCache(4))
    with pytest.raises(ValueError, match=r"cache: expected a KVCache, got dict"):
        MultiHeadAttention(8, 2, causal=True).forward_cached(x, {})
    message = r"attention_mask: expected shape \(1, 2\) \(B, T\), got \(1, 3\)"
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(8, 2, causal=True).forward_cached(x, KVCache(4), np.ones((1, 3)))


def test_causal_mask_is_built_once_and_read_only():
    from npformer.attention import causal_mask

    a, b = causal_mask(7), causal_mask(7)
    assert a is b and not a.flags.writeable
    with pytest.raises(ValueError):
        a[0, 1] = True
    assert np.array_equal(a, np.tril(np.ones((7, 7), dtype=bool)))
