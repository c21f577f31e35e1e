"""Embeddings and positions: token and learned positional embeddings, the sinusoidal
encoding and RoPE. Gradients are checked by central differences in float64 (tol 1e-7);
RoPE's backward is proved in SymPy to be the inverse rotation."""

from __future__ import annotations

import numpy as np
import pytest

import npformer as npf
from npformer.embedding import scatter_add_rows
from npformer.gradcheck import check_module, gradcheck
from npformer.proofs.embeddings import prove_rope_code, prove_rope_inverse

TOL = 1e-7  # finite-difference bound used throughout the book


# ----------------------------------------------------------------------------- Embedding


def test_embedding_forward_selects_the_rows_of_the_ids():
    emb = npf.Embedding(7, 3, seed=0, dtype="float64")
    ids = np.array([[0, 6, 2], [2, 2, 5]])
    y = emb.forward(ids)
    assert y.shape == (2, 3, 3)
    np.testing.assert_array_equal(y, emb.W[ids])


def test_embedding_init_has_the_requested_std():
    emb = npf.Embedding(400, 50, seed=0, dtype="float64", init_std=0.02)
    assert abs(emb.W.std() - 0.02) < 0.02 * 0.02  # 20000 samples: within 2 percent


def test_embedding_gradient_matches_finite_differences_with_repeated_ids():
    ids = np.array([[1, 3, 1, 0], [3, 3, 5, 1]])  # ids 1 and 3 repeat
    errors = check_module(npf.Embedding(6, 4, seed=1, dtype="float64"), ids,
                          tol=TOL, wrt_inputs=False)
    assert errors["W"] < TOL


def test_embedding_backward_returns_none_and_accumulates():
    emb = npf.Embedding(5, 2, seed=0, dtype="float64")
    ids = np.array([[1, 1, 4]])
    emb.forward(ids)
    g = np.ones((1, 3, 2))
    assert emb.backward(g) is None  # ids carry no gradient
    emb.backward(g)
    np.testing.assert_array_equal(emb.dW[:, 0], [0, 4, 0, 0, 2])  # 2 calls x (2, 1) uses


def test_fancy_index_add_loses_repeated_updates_but_scatter_add_rows_does_not():
    ids = np.array([1, 3, 1, 1])
    g = np.ones((4, 2))
    naive = np.zeros((5, 2))
    naive[ids] += g
    right = np.zeros((5, 2))
    scatter_add_rows(right, ids, g)
    assert naive[1, 0] == 1.0  # the trap: two of three updates lost
    assert right[1, 0] == 3.0


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("id_dtype", [np.int64, np.int32, np.uint16])
def test_scatter_add_rows_equals_np_add_at(dtype, id_dtype):
    rng = np.random.default_rng(0)
    rows = (rng.zipf(1.5, 500) % 40).astype(id_dtype)
    values = rng.standard_normal((500, 7)).astype(dtype)
    start = rng.standard_normal((40, 7)).astype(dtype)
    ref, got = start.copy(), start.copy()
    np.add.at(ref, rows, values)
    scatter_add_rows(got, rows, values)
    assert got.dtype == np.dtype(dtype)
    rtol = 1e-5 if dtype == "float32" else 1e-12  # summation order may differ
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol)


def test_scatter_add_rows_is_bitwise_equal_to_np_add_at_when_sums_are_exact():
    rng = np.random.default_rng(1)
    rows = rng.integers(0, 30, 1000)
    values = rng.integers(-1000, 1000, (1000, 5)).astype(np.float64)  # exact integer sums
    ref, got = np.zeros((30, 5)), np.zeros((30, 5))
    np.add.at(ref, rows, values)
    scatter_add_rows(got, rows, values)
    np.testing.assert_array_equal(got, ref)


def test_scatter_add_rows_with_no_rows_changes_nothing():
    target = np.ones((3, 2))
    scatter_add_rows(target, np.array([], dtype=np.int64), np.zeros((0, 2)))
    np.testing.assert_array_equal(target, np.ones((3, 2)))


@pytest.mark.parametrize("bad, value", [(-1, "-1"), (10, "10"), (99, "99")])
def test_embedding_rejects_ids_out_of_range_naming_range_and_value(bad, value):
    emb = npf.Embedding(10, 4)
    with pytest.raises(ValueError, match=rf"ids: expected token ids in \[0, 10\), got {value}"):
        emb.forward(np.array([[1, bad, 2]]))


def test_embedding_rejects_non_integer_ids():
    with pytest.raises(ValueError, match="ids: expected an integer array.*got dtype float64"):
        npf.Embedding(10, 4).forward(np.array([[1.0, 2.0]]))


def test_embedding_rejects_bad_sizes_and_dtype():
    with pytest.raises(ValueError, match="num_embeddings: expected a positive integer, got 0"):
        npf.Embedding(0, 4)
    with pytest.raises(ValueError, match="d: expected a positive integer, got -2"):
        npf.Embedding(3, -2)
    with pytest.raises(ValueError, match="dtype: expected one of"):
        npf.Embedding(3, 2, dtype="int32")


def test_embedding_backward_rejects_wrong_dout_shape():
    emb = npf.Embedding(10, 4, dtype="float64")
    emb.forward(np.array([[1, 2, 3]]))
    with pytest.raises(ValueError, match=r"dout: expected shape \(1, 3, 4\).*got \(1, 2, 4\)"):
        emb.backward(np.zeros((1, 2, 4)))


def test_embedding_float32_params_give_float32_output_and_grad():
    emb = npf.Embedding(10, 4, seed=0)
    y = emb.forward(np.array([[1, 2, 1]]))
    emb.backward(np.ones_like(y))
    assert y.dtype == np.float32 and emb.dW.dtype == np.float32


# ----------------------------------------------------------------------------- learned positions


def test_positional_embedding_returns_rows_offset_to_offset_plus_T():
    pos = npf.PositionalEmbedding(8, 3, seed=0, dtype="float64")
    np.testing.assert_array_equal(pos.forward(3), pos.W[:3])
    np.testing.assert_array_equal(pos.forward(2, offset=5), pos.W[5:7])


def test_positional_embedding_output_is_a_copy_not_a_view_of_W():
    pos = npf.PositionalEmbedding(8, 3, seed=0, dtype="float64")
    W0 = pos.W.copy()
    out = pos.forward(4)
    out += 1.0
    np.testing.assert_array_equal(pos.W, W0)


def test_positional_embedding_gradient_matches_finite_differences():
    pos = npf.PositionalEmbedding(8, 4, seed=1, dtype="float64")
    errors = check_module(pos, 5, 2, tol=TOL, wrt_inputs=False)  # forward(T=5, offset=2)
    assert errors["W"] < TOL


def test_positional_embedding_gradient_sums_over_the_batch():
    pos = npf.PositionalEmbedding(8, 4, seed=1, dtype="float64")
    v = np.random.default_rng(2).standard_normal((3, 5, 4))  # (B, T, d)

    def loss_and_grad(W):
        pos.W = W
        pos.zero_grad()
        out = pos.forward(5, offset=2)  # (T, d), broadcast over B
        pos.backward(v)
        return float(np.sum(out[None] * v)), [pos.dW]

    errors = gradcheck(loss_and_grad, [pos.W.copy()], names=["W"], tol=TOL)
    assert errors["W"] < TOL
    np.testing.assert_allclose(pos.dW[2:7], v.sum(axis=0), rtol=1e-12, atol=1e-12)
    assert not pos.dW[:2].any() and not pos.dW[7:].any()  # unused rows get nothing


def test_positional_embedding_rejects_sequence_longer_than_max_len():
    pos = npf.PositionalEmbedding(8, 4)
    with pytest.raises(ValueError, match=r"T: expected the sequence length.*max_len = 8, "
                                         r"got 0 \+ 9 = 9"):
        pos.forward(9)
    with pytest.raises(ValueError, match=r"max_len = 8, got 6 \+ 3 = 9"):
        pos.forward(3, offset=6)


def test_positional_embedding_rejects_bad_T_and_offset():
    pos = npf.PositionalEmbedding(8, 4)
    with pytest.raises(ValueError, match="T: expected a positive integer, got 0"):
        pos.forward(0)
    with pytest.raises(ValueError, match="offset: expected a non-negative integer, got -1"):
        pos.forward(2, offset=-1)


def test_positional_embedding_float32_output():
    pos = npf.PositionalEmbedding(8, 4, seed=0)
    out = pos.forward(3)
    pos.backward(np.ones((2, 3, 4), dtype=np.float32))
    assert out.dtype == np.float32 and pos.dW.dtype == np.float32


# ----------------------------------------------------------------------------- sinusoidal


def test_sinusoidal_encoding_matches_the_formula():
    pe = npf.sinusoidal_encoding(50, 16, dtype="float64")
    t = np.arange(50)[:, None]
    i = np.arange(8)
    np.testing.assert_allclose(pe[:, 0::2], np.sin(t * 10000.0 ** (-2 * i / 16)),
                               rtol=0, atol=1e-15)
    np.testing.assert_allclose(pe[:, 1::2], np.cos(t * 10000.0 ** (-2 * i / 16)),
                               rtol=0, atol=1e-15)


def test_sinusoidal_frequencies_equal_the_exp_log_form():
    """div_term = exp(-2i ln(10000)/d) is the same as 10000^(-2i/d)."""
    d = 64
    i = np.arange(d // 2)
    div_term = np.exp(-2 * i * np.log(10000.0) / d)
    pe = npf.sinusoidal_encoding(100, d, dtype="float64")
    t = np.arange(100)[:, None]
    np.testing.assert_allclose(pe[:, 0::2], np.sin(t * div_term), rtol=0, atol=1e-12)


def test_sinusoidal_dot_products_depend_only_on_distance():
    pe = npf.sinusoidal_encoding(64, 32, dtype="float64")
    dots = pe @ pe.T
    for k in range(-63, 64):
        assert np.ptp(np.diagonal(dots, k)) < 1e-12


def test_sinusoidal_encoding_dtype_and_validation():
    assert npf.sinusoidal_encoding(4, 6).dtype == np.float32
    with pytest.raises(ValueError, match=r"d: expected an even number.*got 5"):
        npf.sinusoidal_encoding(4, 5)
    with pytest.raises(ValueError, match="max_len: expected a positive integer, got 0"):
        npf.sinusoidal_encoding(0, 4)
    with pytest.raises(ValueError, match="base: expected a positive finite number, got -1"):
        npf.sinusoidal_encoding(4, 4, base=-1.0)


# ----------------------------------------------------------------------------- RoPE


def _rope_reference(x, offset, base=10000.0):
    """Pair (i, i + h) of the vector at position t rotated by t * base^(-2i/d), looped."""
    d = x.shape[-1]
    h = d // 2
    y = np.empty_like(x)
    for t in range(x.shape[-2]):
        for i in range(h):
            a = (offset + t) * base ** (-2 * i / d)
            c, s = np.cos(a), np.sin(a)
            x1, x2 = x[..., t, i], x[..., t, i + h]
            y[..., t, i] = c * x1 - s * x2
            y[..., t, i + h] = s * x1 + c * x2
    return y


@pytest.mark.parametrize("offset", [0, 3])
def test_rope_rotates_pairs_i_and_i_plus_half(offset):
    rope = npf.RoPE(8, 16, dtype="float64")
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 8))  # (B, H, T, d_head)
    np.testing.assert_allclose(rope.forward(x, offset=offset), _rope_reference(x, offset),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("offset", [0, 4])
def test_rope_gradient_matches_finite_differences(offset):
    rope = npf.RoPE(8, 16, dtype="float64")
    x = np.random.default_rng(3).standard_normal((2, 3, 5, 8))
    errors = check_module(rope, x, offset, tol=TOL)
    assert errors["x"] < TOL
    assert list(rope.named_parameters()) == []  # RoPE has no parameters


def test_rope_backward_is_the_inverse_rotation():
    rope = npf.RoPE(8, 16, dtype="float64")
    x = np.random.default_rng(1).standard_normal((2, 2, 6, 8))
    y = rope.forward(x, offset=3)
    np.testing.assert_allclose(rope.backward(y), x, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1),
                               rtol=1e-12)  # a rotation keeps lengths


def test_rope_score_depends_only_on_relative_position():
    rope = npf.RoPE(16, 64, dtype="float64")
    rng = np.random.default_rng(4)
    q, k = rng.standard_normal((1, 1, 1, 16)), rng.standard_normal((1, 1, 1, 16))

    def score(m, n):
        return float(np.sum(rope.forward(q, offset=m) * rope.forward(k, offset=n)))

    for dist in (0, 1, 5, -7, 30):
        scores = [score(m, m - dist) for m in range(max(dist, 0), 60 + min(dist, 0))]
        assert np.ptp(scores) < 1e-12 * max(1.0, abs(scores[0]))
    assert abs(score(3, 1) - score(1, 3)) > 1e-3  # but it does depend on the sign of m - n


def test_rope_with_offset_matches_rotating_the_whole_sequence():
    rope = npf.RoPE(16, 32, dtype="float64")
    x = np.random.default_rng(5).standard_normal((2, 4, 10, 16))
    np.testing.assert_array_equal(rope.forward(x[:, :, 7:], offset=7),
                                  rope.forward(x)[:, :, 7:])


def test_rope_one_instance_serves_q_and_k():
    rope = npf.RoPE(8, 16, dtype="float64")
    rng = np.random.default_rng(6)
    q, k = rng.standard_normal((2, 2, 5, 8)), rng.standard_normal((2, 2, 5, 8))
    yq, yk = rope.forward(q, offset=2), rope.forward(k, offset=2)
    np.testing.assert_allclose(rope.backward(yq), q, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(rope.backward(yk), k, rtol=1e-12, atol=1e-12)


def test_rope_float32_in_float32_out():
    rope = npf.RoPE(16, 32)
    x = np.random.default_rng(7).standard_normal((2, 4, 10, 16)).astype(np.float32)
    y = rope.forward(x)
    dx = rope.backward(y)
    assert y.dtype == np.float32 and dx.dtype == np.float32
    np.testing.assert_allclose(dx, x, rtol=0, atol=1e-5)


def test_rope_rejects_odd_d_head_and_bad_base():
    with pytest.raises(ValueError, match=r"d_head: expected an even number.*got 7"):
        npf.RoPE(7, 16)
    with pytest.raises(ValueError, match="base: expected a positive finite number, got 0"):
        npf.RoPE(8, 16, base=0)
    with pytest.raises(ValueError, match="max_len: expected a positive integer, got 0"):
        npf.RoPE(8, 0)


def test_rope_rejects_positions_beyond_max_len():
    rope = npf.RoPE(8, 16)
    x = np.zeros((1, 1, 10, 8), dtype=np.float32)
    with pytest.raises(ValueError, match=r"x: expected offset \+ sequence length at most "
                                         r"max_len = 16, got 7 \+ 10 = 17"):
        rope.forward(x, offset=7)
    with pytest.raises(ValueError, match="offset: expected a non-negative integer, got -1"):
        rope.forward(x, offset=-1)


def test_rope_rejects_wrong_input_width_dtype_and_dout_shape():
    rope = npf.RoPE(8, 16)
    with pytest.raises(ValueError, match=r"x: expected last dimension 8, got shape"):
        rope.forward(np.zeros((1, 1, 4, 6), dtype=np.float32))
    with pytest.raises(ValueError, match="x: expected dtype float32"):
        rope.forward(np.zeros((1, 1, 4, 8)))
    rope.forward(np.zeros((1, 1, 4, 8), dtype=np.float32))
    with pytest.raises(ValueError, match=r"dout: expected shape \(\.\.\., 4, 8\)"):
        rope.backward(np.zeros((1, 1, 5, 8), dtype=np.float32))


# ----------------------------------------------------------------------------- SymPy proofs


def test_sympy_proves_rotation_jacobian_transpose_is_the_inverse_rotation():
    assert prove_rope_inverse() is True


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_sympy_proves_rope_code_forward_rotates_and_backward_is_jt_g(n):
    assert prove_rope_code(n) is True


def test_sympy_proof_rejects_a_backward_that_rotates_the_wrong_way(monkeypatch):
    monkeypatch.setattr(npf.RoPE, "backward",
                        lambda self, dout: npf.RoPE.forward(self, dout, self.cache[1]))
    with pytest.raises(AssertionError, match="residual is not zero"):
        prove_rope_code(2)
