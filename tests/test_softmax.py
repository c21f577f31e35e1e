"""Softmax, log-softmax and cross-entropy (book/softmax.md), read as specifications."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from npformer.gradcheck import check_module, gradcheck
from npformer.proofs import (
    prove_cross_entropy_grad,
    prove_log_softmax_backward_code,
    prove_softmax_backward_code,
    prove_softmax_jacobian,
    prove_softmax_vjp,
)
from npformer.softmax import (
    Softmax,
    cross_entropy,
    cross_entropy_backward,
    log_softmax,
    log_softmax_backward,
    softmax,
    softmax_backward,
)

TOL = 1e-7  # the book's finite-difference bound, float64


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# --------------------------------------------------------------------------- symbolic


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_softmax_jacobian_is_diag_p_minus_p_pT_in_sympy(n):
    assert prove_softmax_jacobian(n) is True


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_softmax_vjp_formula_equals_JT_g_in_sympy(n):
    assert prove_softmax_vjp(n) is True


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_library_softmax_backward_equals_JT_g_on_symbols(n):
    assert prove_softmax_backward_code(n) is True


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_library_log_softmax_backward_equals_JT_g_on_symbols(n):
    assert prove_log_softmax_backward_code(n) is True


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_masked_cross_entropy_gradient_and_library_code_proved_in_sympy(n):
    assert prove_cross_entropy_grad(n) is True


def test_single_row_cross_entropy_gradient_is_p_minus_onehot_in_sympy():
    assert prove_cross_entropy_grad(4, rows=1) is True


def _forgets_the_sum_term(dout, p):
    return p * dout


def _sums_over_the_wrong_axis(dout, p):
    return p * (dout - np.sum(dout * p, axis=0, keepdims=True))


@pytest.mark.parametrize("wrong", [_forgets_the_sum_term, _sums_over_the_wrong_axis])
def test_a_wrong_softmax_backward_fails_the_code_proof(wrong, monkeypatch):
    import npformer.proofs.softmax as proofs

    monkeypatch.setattr(proofs, "softmax_backward", wrong)
    with pytest.raises(AssertionError, match="residual is not zero"):
        proofs.prove_softmax_backward_code(2, rows=2)


# --------------------------------------------------------------------------- forward


def test_softmax_rows_are_positive_and_sum_to_one(rng):
    x = rng.standard_normal((3, 4, 9)) * 10
    p = softmax(x)
    assert p.shape == x.shape
    assert np.all(p > 0)
    np.testing.assert_allclose(p.sum(axis=-1), 1.0, rtol=0, atol=1e-14)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_output_dtype_equals_input_dtype(dtype, rng):
    x = rng.standard_normal((2, 5)).astype(dtype)
    assert softmax(x).dtype == np.dtype(dtype)
    assert log_softmax(x).dtype == np.dtype(dtype)
    loss, dlogits = cross_entropy(x, np.array([0, 4]))
    assert dlogits.dtype == np.dtype(dtype)
    assert isinstance(loss, float)


def test_softmax_and_log_softmax_are_invariant_to_shifting_each_row(rng):
    x = rng.standard_normal((4, 6))
    c = rng.standard_normal((4, 1)) * 100
    np.testing.assert_allclose(softmax(x + c), softmax(x), rtol=0, atol=1e-13)
    np.testing.assert_allclose(log_softmax(x + c), log_softmax(x), rtol=0, atol=1e-12)


def test_large_logits_give_exact_finite_results_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any overflow or invalid-value warning fails
        p = softmax(np.array([1000.0, 1001.0, 1002.0]))
        logp = log_softmax(np.array([0.0, -800.0]))
        p32 = softmax(np.array([100.0, 0.0], dtype=np.float32))
    assert np.array_equal(p, softmax(np.array([0.0, 1.0, 2.0])))
    np.testing.assert_array_equal(logp, [0.0, -800.0])
    assert np.all(np.isfinite(p32))


def test_log_softmax_is_log_of_softmax_where_both_are_finite(rng):
    x = rng.standard_normal((3, 7)) * 4
    np.testing.assert_allclose(log_softmax(x), np.log(softmax(x)), rtol=1e-13, atol=1e-13)


def test_cross_entropy_is_mean_negative_log_probability_of_valid_targets(rng):
    logits = rng.standard_normal((2, 3, 5))
    targets = rng.integers(0, 5, size=(2, 3))
    mask = np.array([[True, False, True], [False, True, True]])
    logp = np.log(softmax(logits))
    nll = -np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    loss, _ = cross_entropy(logits, targets, mask)
    assert abs(loss - nll[mask].mean()) < 1e-13
    loss_all, _ = cross_entropy(logits, targets)
    assert abs(loss_all - nll.mean()) < 1e-13


def test_cross_entropy_gradient_is_masked_p_minus_onehot_over_valid_count(rng):
    logits = rng.standard_normal((4, 6))
    targets = np.array([5, 0, 2, 2])
    mask = np.array([1, 0, 1, 1])  # 0/1 integers are accepted as a mask
    _, dlogits = cross_entropy(logits, targets, mask)
    expected = (softmax(logits) - np.eye(6)[targets]) * mask[:, None] / 3
    np.testing.assert_allclose(dlogits, expected, rtol=0, atol=1e-15)
    assert np.all(dlogits[1] == 0)


def test_masked_positions_do_not_affect_loss_or_gradient(rng):
    logits = rng.standard_normal((2, 4, 5))
    targets = rng.integers(0, 5, size=(2, 4))
    mask = np.array([[True, True, False, True], [False, True, True, False]])
    loss, dlogits = cross_entropy(logits, targets, mask)
    logits2, targets2 = logits.copy(), targets.copy()
    logits2[~mask] = rng.standard_normal((np.count_nonzero(~mask), 5)) * 50
    targets2[~mask] = 0
    loss2, dlogits2 = cross_entropy(logits2, targets2, mask)
    assert abs(loss - loss2) < 1e-14
    np.testing.assert_allclose(dlogits2[mask], dlogits[mask], rtol=0, atol=1e-15)


def test_cross_entropy_is_exact_for_a_target_with_underflowing_probability():
    loss, dlogits = cross_entropy(np.array([[0.0, 1000.0, 3.0]]), np.array([2]))
    assert loss == 997.0
    np.testing.assert_array_equal(dlogits, [[0.0, 1.0, -1.0]])


def test_fused_cross_entropy_gradient_equals_chain_through_log_softmax(rng):
    logits = rng.standard_normal((3, 4, 6))
    targets = rng.integers(0, 6, size=(3, 4))
    mask = rng.random((3, 4)) < 0.5
    mask[0, 0] = True
    _, dlogits = cross_entropy(logits, targets, mask)
    dlogp = -np.eye(6)[targets] * mask[..., None] / mask.sum()
    np.testing.assert_allclose(log_softmax_backward(dlogp, log_softmax(logits)), dlogits,
                               rtol=0, atol=1e-15)


def test_cross_entropy_backward_from_probabilities_matches_cross_entropy(rng):
    logits = rng.standard_normal((5, 7))
    targets = rng.integers(0, 7, size=5)
    _, dlogits = cross_entropy(logits, targets)
    np.testing.assert_allclose(cross_entropy_backward(softmax(logits), targets), dlogits,
                               rtol=0, atol=1e-15)


# --------------------------------------------------------------------------- finite differences


def test_softmax_layer_passes_gradcheck(rng):
    errors = check_module(Softmax(), rng.standard_normal((2, 3, 7)) * 3, tol=TOL)
    assert errors["x"] < TOL


def test_softmax_backward_passes_gradcheck(rng):
    v = rng.standard_normal((4, 5))

    def fn(x):
        p = softmax(x)
        return float(np.sum(p * v)), [softmax_backward(v, p)]

    assert gradcheck(fn, [rng.standard_normal((4, 5)) * 3], tol=TOL)["input0"] < TOL


def test_log_softmax_backward_passes_gradcheck(rng):
    v = rng.standard_normal((2, 3, 6))

    def fn(x):
        logp = log_softmax(x)
        return float(np.sum(logp * v)), [log_softmax_backward(v, logp)]

    assert gradcheck(fn, [rng.standard_normal((2, 3, 6)) * 3], tol=TOL)["input0"] < TOL


@pytest.mark.parametrize("masked", [False, True])
def test_cross_entropy_passes_gradcheck(masked, rng):
    targets = rng.integers(0, 6, size=(2, 4))
    mask = np.array([[True, False, True, True], [False, True, False, True]]) if masked else None

    def fn(logits):
        loss, dlogits = cross_entropy(logits, targets, mask)
        return loss, [dlogits]

    assert gradcheck(fn, [rng.standard_normal((2, 4, 6)) * 2], tol=TOL)["input0"] < TOL


def test_cross_entropy_on_a_single_position_passes_gradcheck(rng):
    def fn(logits):
        loss, dlogits = cross_entropy(logits, np.int64(3))
        return loss, [dlogits]

    assert gradcheck(fn, [rng.standard_normal(5)], tol=TOL)["input0"] < TOL


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("fn", [softmax, log_softmax])
def test_softmax_rejects_non_float_or_empty_input(fn):
    with pytest.raises(ValueError, match=r"x: expected one of .*float32.*got int64"):
        fn(np.arange(3))
    with pytest.raises(ValueError, match="x: expected a numpy array, got list"):
        fn([1.0, 2.0])
    with pytest.raises(ValueError, match=r"x: expected a non-empty last axis, got shape \(2, 0\)"):
        fn(np.zeros((2, 0)))


@pytest.mark.parametrize("backward", [softmax_backward, log_softmax_backward])
def test_backward_rejects_dout_of_the_wrong_shape(backward):
    with pytest.raises(ValueError, match=r"dout: expected shape \(2, 3\).*got \(3, 2\)"):
        backward(np.zeros((3, 2)), np.zeros((2, 3)))


@pytest.mark.parametrize("bad, value", [(5, "5"), (-1, "-1")])
def test_cross_entropy_rejects_targets_out_of_range(bad, value):
    targets = np.array([[0, bad, 1]])
    message = rf"targets: expected class indices in \[0, 5\), got {value}"
    with pytest.raises(ValueError, match=message):
        cross_entropy(np.zeros((1, 3, 5)), targets)


def test_cross_entropy_rejects_out_of_range_targets_even_where_masked():
    with pytest.raises(ValueError, match=r"targets: .*\[0, 5\), got 7"):
        cross_entropy(np.zeros((1, 2, 5)), np.array([[0, 7]]), np.array([[True, False]]))


def test_cross_entropy_rejects_non_integer_targets():
    with pytest.raises(ValueError, match="targets: expected an integer array, got dtype float64"):
        cross_entropy(np.zeros((2, 5)), np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="targets: expected an integer array, got dtype bool"):
        cross_entropy(np.zeros((2, 5)), np.array([True, False]))


def test_cross_entropy_rejects_targets_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"targets: expected shape \(2, 3\).*got \(2,\)"):
        cross_entropy(np.zeros((2, 3, 5)), np.array([0, 1]))


def test_cross_entropy_rejects_non_float_logits():
    with pytest.raises(ValueError, match=r"logits: expected one of .*got int64"):
        cross_entropy(np.zeros((2, 5), dtype=np.int64), np.array([0, 1]))
    with pytest.raises(ValueError, match="logits: expected a numpy array, got list"):
        cross_entropy([[0.0, 1.0]], np.array([0]))


def test_cross_entropy_rejects_bad_masks():
    logits, targets = np.zeros((2, 5)), np.array([0, 1])
    with pytest.raises(ValueError, match=r"mask: expected shape \(2,\).*got \(3,\)"):
        cross_entropy(logits, targets, np.array([True, True, False]))
    with pytest.raises(ValueError, match="mask: expected booleans or 0/1 values, got 2"):
        cross_entropy(logits, targets, np.array([1, 2]))
    with pytest.raises(ValueError, match="mask: expected a boolean or 0/1 array, got dtype <U1"):
        cross_entropy(logits, targets, np.array(["a", "b"]))
    with pytest.raises(ValueError, match="mask: expected at least one valid"):
        cross_entropy(logits, targets, np.array([False, False]))
