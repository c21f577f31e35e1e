"""Specification of book/activations.md: ReLU, GELU (exact and tanh), SiLU, SwiGLU."""

import math
import warnings

import numpy as np
import pytest

from npformer.activations import GELU, ReLU, SiLU, SwiGLU, sigmoid
from npformer.gradcheck import check_module
from npformer.proofs import (
    prove_gelu_backward,
    prove_gelu_derivative,
    prove_silu_backward,
    prove_swiglu_backward,
)

TOL = 1e-7  # normwise relative error bound for central differences in float64
K = math.sqrt(2 / math.pi)
A = 0.044715


def all_layers(dtype):
    return [ReLU(dtype=dtype), GELU("none", dtype=dtype), GELU("tanh", dtype=dtype),
            SiLU(dtype=dtype), SwiGLU(dtype=dtype)]


def layer_ids():
    return ["ReLU", "GELU-none", "GELU-tanh", "SiLU", "SwiGLU"]


def math_gelu(x):
    return x * 0.5 * (1 + math.erf(x / math.sqrt(2)))


def math_gelu_grad(x):
    x = float(x)  # Python floats: x * x may overflow to inf, silently
    Phi = 0.5 * (1 + math.erf(x / math.sqrt(2)))
    return Phi + x * math.exp(-x * x / 2) / math.sqrt(2 * math.pi)


def math_gelu_tanh(x):
    return 0.5 * x * (1 + math.tanh(K * (x + A * x**3)))


def forward_backward(layer, x, dout=None):
    y = layer.forward(x)
    return y, layer.backward(np.ones_like(y) if dout is None else dout)


# --------------------------------------------------------------------------- values

# from the centre out to |x| = 1e300, including both saturated tails
GRID = np.concatenate([np.linspace(-12, 12, 2401),
                       [-1e300, -1e100, -1e8, -1e3, -40.0, 40.0, 1e3, 1e8, 1e100, 1e300]])


def test_exact_gelu_matches_math_erf_to_1e_12_in_float64():
    y = GELU("none", dtype="float64").forward(GRID)
    ref = np.array([math_gelu(x) for x in GRID])
    assert np.max(np.abs(y - ref)) <= 1e-12


def test_exact_gelu_derivative_matches_math_erf_to_1e_12_in_float64():
    _, dx = forward_backward(GELU("none", dtype="float64"), GRID)
    ref = np.array([math_gelu_grad(x) for x in GRID])
    assert np.max(np.abs(dx - ref)) <= 1e-12


def test_tanh_gelu_matches_the_formula_including_beyond_the_clip():
    grid = GRID[np.abs(GRID) <= 1e100]  # math's x**3 overflows beyond
    y = GELU("tanh", dtype="float64").forward(grid)
    ref = np.array([math_gelu_tanh(x) for x in grid])
    assert np.max(np.abs(y - ref)) <= 1e-12


def test_exact_and_tanh_gelu_differ_by_less_than_5e_4():
    x = np.linspace(-10, 10, 20001)
    y_exact = GELU("none", dtype="float64").forward(x)
    y_tanh = GELU("tanh", dtype="float64").forward(x)
    diff = np.max(np.abs(y_exact - y_tanh))
    assert 1e-4 < diff < 5e-4  # a real approximation, but a close one


def test_relu_is_max_x_0():
    x = np.array([-2.0, -0.5, 0.0, 0.5, 2.0])
    np.testing.assert_array_equal(ReLU(dtype="float64").forward(x), [0, 0, 0, 0.5, 2.0])


def test_relu_subgradient_at_zero_is_zero():
    _, dx = forward_backward(ReLU(dtype="float64"), np.zeros(3))
    np.testing.assert_array_equal(dx, np.zeros(3))


def test_sigmoid_matches_the_definition_without_overflow_warnings():
    x = np.linspace(-700, 700, 1401)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = sigmoid(x)
        np.testing.assert_allclose(s, 1 / (1 + np.exp(-x)), rtol=1e-14, atol=0)
        assert sigmoid(np.array([-1e308, 1e308])).tolist() == [0.0, 1.0]


def test_silu_is_x_times_sigmoid():
    x = np.linspace(-30, 30, 601)
    ref = np.array([v / (1 + math.exp(-v)) for v in x])
    np.testing.assert_allclose(SiLU(dtype="float64").forward(x), ref, rtol=1e-14, atol=1e-300)


def test_swiglu_gates_with_the_first_half():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 3, 4))  # (T, h) each
    y = SwiGLU(dtype="float64").forward(np.concatenate([a, b], axis=-1))  # (T, 2h) -> (T, h)
    np.testing.assert_allclose(y, a / (1 + np.exp(-a)) * b, rtol=1e-14, atol=1e-15)
    assert not np.allclose(y, b / (1 + np.exp(-b)) * a)


# --------------------------------------------------------------------------- dtypes and extremes


@pytest.mark.parametrize("index", range(5), ids=layer_ids())
def test_float32_input_gives_float32_output_and_gradient(index):
    layer = all_layers("float32")[index]
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4)  # (B, T, d)
    y, dx = forward_backward(layer, x)
    assert y.dtype == np.float32
    assert dx.dtype == np.float32
    assert dx.shape == x.shape


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("index", range(5), ids=layer_ids())
def test_extreme_inputs_are_finite_and_warning_free(index, dtype):
    layer = all_layers(dtype)[index]
    big = np.finfo(dtype).max
    x = np.array([-big, -1e30, -1e3, -50, -10.5, -1, 0, 1, 10.5, 50, 1e3, 1e30, big], dtype=dtype)
    if isinstance(layer, SwiGLU):
        x = np.concatenate([x, np.ones_like(x)])  # extreme gate, unit value
    with warnings.catch_warnings(), np.errstate(all="raise", under="ignore"):
        warnings.simplefilter("error")
        y, dx = forward_backward(layer, x)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(dx))


# --------------------------------------------------------------------------- finite differences


def away_from_zero(shape, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape)
    return np.sign(x) * (0.1 + np.abs(x))  # |x| >= 0.1: ReLU is differentiable there


def test_relu_gradient_matches_finite_differences_away_from_zero():
    errors = check_module(ReLU(dtype="float64"), away_from_zero((2, 3, 4)), tol=TOL)
    assert errors["x"] < TOL


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_gradient_matches_finite_differences(approximate):
    x = np.random.default_rng(1).standard_normal((2, 3, 4)) * 3  # (B, T, d)
    errors = check_module(GELU(approximate, dtype="float64"), x, tol=TOL)
    assert errors["x"] < TOL


def test_silu_gradient_matches_finite_differences():
    x = np.random.default_rng(2).standard_normal((2, 3, 4)) * 3  # (B, T, d)
    assert check_module(SiLU(dtype="float64"), x, tol=TOL)["x"] < TOL


def test_swiglu_gradient_matches_finite_differences():
    x = np.random.default_rng(3).standard_normal((2, 3, 8)) * 3  # (B, T, 2h), h = 4
    assert check_module(SwiGLU(dtype="float64"), x, tol=TOL)["x"] < TOL


# --------------------------------------------------------------------------- SymPy proofs


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_derivative_formula_is_proved(approximate):
    assert prove_gelu_derivative(approximate) is True


@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_backward_code_equals_jacobian_transpose_times_v(approximate, n):
    assert prove_gelu_backward(n, approximate) is True


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_silu_backward_code_equals_jacobian_transpose_times_v(n):
    assert prove_silu_backward(n) is True


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_swiglu_backward_code_equals_jacobian_transpose_times_v(n):
    assert prove_swiglu_backward(n) is True


def test_backward_proof_rejects_a_wrong_backward(monkeypatch):
    def phi_dropped(self, dout):  # forgets the x * phi term of gelu'
        return dout * self.cache[1]

    monkeypatch.setattr(GELU, "backward", phi_dropped)
    with pytest.raises(AssertionError, match="backward differs from J\\^T v"):
        prove_gelu_backward(2, "none")


def test_swiglu_proof_rejects_swapped_halves(monkeypatch):
    original = SwiGLU.backward

    def swapped(self, dout):
        dz = original(self, dout)
        h = dz.shape[-1] // 2
        return np.concatenate([dz[..., h:], dz[..., :h]], axis=-1)

    monkeypatch.setattr(SwiGLU, "backward", swapped)
    with pytest.raises(AssertionError, match="SwiGLU"):
        prove_swiglu_backward(2)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("index", range(5), ids=layer_ids())
def test_integer_input_is_rejected(index):
    with pytest.raises(ValueError, match=r"x: expected dtype float32 .* got int64"):
        all_layers("float32")[index].forward(np.arange(4, dtype=np.int64))


@pytest.mark.parametrize("index", range(5), ids=layer_ids())
def test_float64_input_to_a_float32_layer_is_rejected(index):
    with pytest.raises(ValueError, match=r"x: expected dtype float32 .* got float64"):
        all_layers("float32")[index].forward(np.zeros(4))


@pytest.mark.parametrize("index", range(5), ids=layer_ids())
def test_dout_of_the_wrong_shape_is_rejected(index):
    layer = all_layers("float64")[index]
    y = layer.forward(np.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"dout: expected shape \(2, \d\) \(the output's\), got"):
        layer.backward(np.zeros((2, y.shape[-1] + 1)))


@pytest.mark.parametrize("width", [3, 0])
def test_swiglu_rejects_an_odd_or_empty_last_dimension(width):
    with pytest.raises(ValueError, match=r"x: expected an even, positive last dimension"):
        SwiGLU(dtype="float64").forward(np.zeros((2, width)))


@pytest.mark.parametrize("bad", ["exact", "erf", None, "TANH"])
def test_gelu_rejects_an_unknown_approximate(bad):
    with pytest.raises(ValueError, match=r"approximate: expected one of \('none', 'tanh'\), got"):
        GELU(bad)


def test_gelu_derivative_proof_rejects_an_unknown_approximate():
    with pytest.raises(ValueError, match="approximate"):
        prove_gelu_derivative("sigmoid")


@pytest.mark.parametrize("cls", [ReLU, SiLU, SwiGLU, GELU])
@pytest.mark.parametrize("dtype", ["float16", "int32", "banana"])
def test_a_non_float32_or_float64_dtype_is_rejected(cls, dtype):
    with pytest.raises(ValueError, match=r"dtype: expected one of \('float32', 'float64'\)"):
        cls(dtype=dtype)


# --- the float32 fast path for Phi and phi (Hastings' erfc) against SciPy in float64 ---------
def test_normal_cdf_pdf_float32_matches_float64_reference():
    from scipy.special import ndtr

    from npformer.activations import normal_cdf_pdf

    x32 = np.concatenate([np.linspace(-12, 12, 200_001),
                          [0.0, -0.0, 1e-30, -1e-30, 40, -40, 1e30, -1e30, 3e38, -3e38]]
                         ).astype(np.float32)
    x64 = x32.astype(np.float64)
    Phi, phi = normal_cdf_pdf(x32)
    assert Phi.dtype == np.float32 and phi.dtype == np.float32
    # Hastings' bound is 7.5e-8 on Phi; float32 rounding of the rational chain adds a few ulps.
    assert np.abs(Phi - ndtr(x64)).max() < 4e-7
    assert np.abs(phi - np.exp(-x64**2 / 2) / np.sqrt(2 * np.pi)).max() < 1e-7
    assert np.all((Phi >= 0) & (Phi <= 1))
    assert np.all(np.diff(Phi[:200_001]) >= -1e-7)  # monotone up to rounding


def test_normal_cdf_pdf_float64_is_scipy_erf():
    from scipy.special import erf

    from npformer.activations import normal_cdf_pdf

    x = np.linspace(-9, 9, 1001)
    Phi, phi = normal_cdf_pdf(x)
    assert np.array_equal(Phi, (1 + erf(x * math.sqrt(0.5))) / 2)
    assert np.allclose(phi, np.exp(-x**2 / 2) / np.sqrt(2 * np.pi), rtol=1e-15, atol=0)


def test_normal_cdf_pdf_does_not_modify_input_and_handles_inf_nan():
    from npformer.activations import normal_cdf_pdf

    x = np.array([-np.inf, -1.0, np.nan, 0.0, 2.0, np.inf], dtype=np.float32)
    keep = x.copy()
    Phi, phi = normal_cdf_pdf(x)
    assert np.array_equal(x, keep, equal_nan=True)
    assert Phi[0] == 0 and Phi[-1] == 1 and phi[0] == 0 and phi[-1] == 0
    assert np.isnan(Phi[2]) and np.isnan(phi[2])
    assert Phi[3] == 0.5


def test_gelu_float32_fast_path_matches_float64_forward_and_backward():
    rng = np.random.default_rng(0)
    x64 = rng.standard_normal((4, 16, 64)) * 3
    g64 = rng.standard_normal(x64.shape)
    ref = GELU(dtype="float64")
    y_ref = ref.forward(x64)
    dx_ref = ref.backward(g64)
    fast = GELU(dtype="float32")
    y = fast.forward(x64.astype(np.float32))
    dx = fast.backward(g64.astype(np.float32))
    assert y.dtype == np.float32 and dx.dtype == np.float32
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=3e-6)
    np.testing.assert_allclose(dx, dx_ref, rtol=0, atol=3e-6)
