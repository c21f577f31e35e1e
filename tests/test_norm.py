"""Specification of LayerNorm and RMSNorm (book/norm.md)."""

import numpy as np
import pytest

from npformer.gradcheck import check_module
from npformer.norm import LayerNorm, RMSNorm
from npformer.proofs import (
    prove_layernorm_backward_code,
    prove_layernorm_forms_equal,
    prove_layernorm_jacobian,
    prove_rmsnorm_backward_code,
    prove_rmsnorm_jacobian,
)

SIZES = [2, 3, 4, 5]
LAYERS = [LayerNorm, RMSNorm]


def _with_random_params(layer, seed=1):
    """Give every parameter non-trivial values, so no term of the gradient hides."""
    rng = np.random.default_rng(seed)
    for _, p, _ in layer.named_parameters():
        p[:] = rng.standard_normal(p.shape)
    return layer


# --------------------------------------------------------------------- SymPy proofs


@pytest.mark.parametrize("n", SIZES)
def test_layernorm_jacobian_equals_the_derived_closed_form(n):
    assert prove_layernorm_jacobian(n) is True


@pytest.mark.parametrize("n", SIZES)
def test_layernorm_long_and_compact_gradient_forms_are_equal(n):
    assert prove_layernorm_forms_equal(n) is True


@pytest.mark.parametrize("n", SIZES)
def test_layernorm_backward_code_returns_jacobian_transpose_times_g(n):
    assert prove_layernorm_backward_code(n) is True


@pytest.mark.parametrize("n", SIZES)
def test_rmsnorm_jacobian_equals_the_derived_closed_form(n):
    assert prove_rmsnorm_jacobian(n) is True


@pytest.mark.parametrize("n", SIZES)
def test_rmsnorm_backward_code_returns_jacobian_transpose_times_g(n):
    assert prove_rmsnorm_backward_code(n) is True


def test_code_proof_rejects_a_layernorm_backward_without_the_mean_term():
    class ForgotTheMean(LayerNorm):
        def backward(self, dout):
            xhat, rstd = self.cache
            self.dgamma += (dout * xhat).reshape(-1, self.d).sum(axis=0)
            self.dbeta += dout.reshape(-1, self.d).sum(axis=0)
            dxhat = dout * self.gamma
            return rstd * (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))

    with pytest.raises(AssertionError, match="residual is not zero in"):
        prove_layernorm_backward_code(2, rows=1, cls=ForgotTheMean)


def test_code_proof_rejects_an_rmsnorm_gamma_gradient_from_the_last_row_only():
    class LastRowOnly(RMSNorm):
        def backward(self, dout):
            dx = super().backward(dout)
            xhat, _ = self.cache
            self.dgamma -= (dout * xhat)[:-1].reshape(-1, self.d).sum(axis=0)
            return dx

    with pytest.raises(AssertionError, match="residual is not zero in"):
        prove_rmsnorm_backward_code(2, rows=2, cls=LastRowOnly)


# --------------------------------------------------------------------- finite differences


@pytest.mark.parametrize("cls", LAYERS)
def test_gradients_match_central_differences_on_a_batch_of_sequences(cls):
    layer = _with_random_params(cls(5, dtype="float64"))
    x = np.random.default_rng(2).standard_normal((2, 3, 5))  # (B, T, d)
    errors = check_module(layer, x, tol=1e-7)
    expected = {"x", "gamma"} | ({"beta"} if cls is LayerNorm else set())
    assert set(errors) == expected
    assert max(errors.values()) < 1e-7


@pytest.mark.parametrize("cls", LAYERS)
def test_backward_accumulates_parameter_gradients(cls):
    layer = _with_random_params(cls(4, dtype="float64"))
    rng = np.random.default_rng(3)
    x, g = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    layer.forward(x)
    layer.backward(g)
    once = {name: grad.copy() for name, _, grad in layer.named_parameters()}
    layer.backward(g)
    for name, _, grad in layer.named_parameters():
        np.testing.assert_allclose(grad, 2 * once[name], rtol=1e-12, atol=0)


# --------------------------------------------------------------------- forward semantics


def test_layernorm_uses_biased_variance_with_eps_inside_the_root():
    x = np.random.default_rng(4).standard_normal((3, 7)) * 0.01  # variance near eps
    eps = 1e-4
    y = LayerNorm(7, eps=eps, dtype="float64")(x)
    mu = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)  # numpy's default ddof=0: divides by n
    np.testing.assert_allclose(y, (x - mu) / np.sqrt(var + eps), rtol=1e-12, atol=1e-14)


def test_layernorm_rows_have_zero_mean_and_unit_variance_before_the_affine_map():
    x = 3.0 + 5.0 * np.random.default_rng(5).standard_normal((4, 6, 16))
    y = LayerNorm(16, eps=1e-12, dtype="float64")(x)
    np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-12)
    np.testing.assert_allclose(y.var(-1), 1.0, rtol=1e-10)


def test_layernorm_applies_gamma_then_beta():
    layer = _with_random_params(LayerNorm(6, dtype="float64"))
    x = np.random.default_rng(6).standard_normal((2, 6))
    y = layer(x)
    xhat, _ = layer.cache
    np.testing.assert_allclose(y, layer.gamma * xhat + layer.beta, rtol=1e-14, atol=1e-14)


def test_rmsnorm_divides_by_root_mean_square_with_eps_inside_the_root():
    layer = _with_random_params(RMSNorm(5, eps=1e-3, dtype="float64"))
    x = np.random.default_rng(7).standard_normal((2, 3, 5))
    rms = np.sqrt((x * x).mean(-1, keepdims=True) + 1e-3)
    np.testing.assert_allclose(layer(x), layer.gamma * x / rms, rtol=1e-13, atol=1e-15)


def test_defaults_are_identity_affine_and_conventional_eps():
    ln, rms = LayerNorm(3), RMSNorm(3)
    assert (ln.eps, rms.eps) == (1e-5, 1e-6)
    assert [name for name, _, _ in ln.named_parameters()] == ["gamma", "beta"]
    assert [name for name, _, _ in rms.named_parameters()] == ["gamma"]
    np.testing.assert_array_equal(ln.gamma, np.ones(3, np.float32))
    np.testing.assert_array_equal(ln.beta, np.zeros(3, np.float32))
    np.testing.assert_array_equal(rms.gamma, np.ones(3, np.float32))


@pytest.mark.parametrize("cls", LAYERS)
def test_float32_in_float32_out_forward_and_backward(cls):
    layer = cls(8)
    x = np.random.default_rng(8).standard_normal((2, 3, 8)).astype(np.float32)
    y = layer(x)
    dx = layer.backward(np.ones_like(y))
    assert y.dtype == dx.dtype == np.float32
    assert all(g.dtype == np.float32 for _, _, g in layer.named_parameters())
    ref = cls(8, dtype="float64")(x.astype(np.float64))
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5)


# --------------------------------------------------------------------- validation


@pytest.mark.parametrize("cls", LAYERS)
def test_wrong_last_dimension_is_rejected(cls):
    with pytest.raises(ValueError, match=r"x: expected last dimension 4, got shape \(2, 5\)"):
        cls(4)(np.zeros((2, 5), np.float32))


@pytest.mark.parametrize("cls", LAYERS)
def test_integer_input_is_rejected(cls):
    with pytest.raises(ValueError, match="x: expected dtype float32.*got int64"):
        cls(4)(np.zeros((2, 4), np.int64))


@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize("dtype", ["float16", "int32", "banana"])
def test_unsupported_dtype_is_rejected(cls, dtype):
    with pytest.raises(ValueError, match="dtype: expected one of"):
        cls(4, dtype=dtype)


@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize("d", [0, -3, 2.5, True])
def test_non_positive_or_non_integer_width_is_rejected(cls, d):
    with pytest.raises(ValueError, match="d: expected a positive integer"):
        cls(d)


@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize("eps", [0, 0.0, -1e-5, float("nan"), float("inf"), "1e-5"])
def test_eps_must_be_a_positive_finite_number(cls, eps):
    with pytest.raises(ValueError, match="eps: expected a positive finite number"):
        cls(4, eps=eps)


@pytest.mark.parametrize("cls", LAYERS)
def test_upstream_gradient_of_the_wrong_shape_is_rejected(cls):
    layer = cls(4)
    layer(np.zeros((2, 3, 4), np.float32))
    with pytest.raises(ValueError, match=r"dout: expected shape \(2, 3, 4\)"):
        layer.backward(np.zeros((3, 2, 4), np.float32))
