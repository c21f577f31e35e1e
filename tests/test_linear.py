"""The backward convention, the linear layer and the finite-difference checker."""

from __future__ import annotations

import numpy as np
import pytest

import npformer as npf
from npformer.gradcheck import (
    GradcheckError,
    check_module,
    gradcheck,
    numerical_gradient,
    relative_error,
)

TOL = 1e-7  # the acceptance bound derived in book/linear.md


def rng(seed=0):
    return np.random.default_rng(seed)


# --------------------------------------------------------------------------- Module


class Scale(npf.Module):
    def __init__(self, n):
        super().__init__()
        self.param("w", np.ones(n))

    def forward(self, x):
        self.cache = x
        return x * self.w

    def backward(self, dout):
        self.dw += (dout * self.cache).reshape(-1, self.w.size).sum(0)
        return dout * self.w


def test_named_parameters_yield_dotted_names_arrays_and_same_shaped_gradients():
    class Net(npf.Module):
        def __init__(self):
            super().__init__()
            self.child("fc", npf.Linear(3, 2, dtype="float64"))
            self.child("h", npf.ModuleList([Scale(2), Scale(2)]))

    net = Net()
    names = [n for n, _, _ in net.named_parameters()]
    assert names == ["fc.W", "fc.b", "h.0.w", "h.1.w"]
    for _, p, g in net.named_parameters():
        assert g.shape == p.shape and g.dtype == p.dtype
    assert net.h[1] is net.h._items[1] and len(net.h) == 2 and list(net.h)[0] is net.h[0]


def test_backward_accumulates_until_zero_grad():
    layer = npf.Linear(4, 3, seed=0, dtype="float64")
    x = rng().standard_normal((2, 5, 4))
    dout = rng(1).standard_normal((2, 5, 3))
    layer.forward(x)
    layer.backward(dout)
    once = layer.dW.copy(), layer.db.copy()
    layer.backward(dout)
    np.testing.assert_allclose(layer.dW, 2 * once[0], rtol=1e-15)
    np.testing.assert_allclose(layer.db, 2 * once[1], rtol=1e-15)
    layer.zero_grad()
    assert not layer.dW.any() and not layer.db.any()


def test_train_and_eval_set_the_mode_recursively():
    net = npf.ModuleList([Scale(1), npf.ModuleList([Scale(1)])])
    net.eval()
    assert not net.training and not net[1][0].training
    net.train()
    assert net[1][0].training


def test_module_list_rejects_non_modules():
    with pytest.raises(ValueError, match=r"modules\[1\]: expected a Module, got int"):
        npf.ModuleList([Scale(1), 3])


# --------------------------------------------------------------------------- Linear


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 5), (2, 4, 5), (2, 3, 2, 5)])
def test_linear_gradients_match_finite_differences(bias, shape):
    layer = npf.Linear(5, 3, bias=bias, seed=1, dtype="float64")
    if bias:
        layer.b[:] = rng(2).standard_normal(3)
    errors = check_module(layer, rng(3).standard_normal(shape), tol=TOL)
    assert set(errors) == {"x", "W"} | ({"b"} if bias else set())
    assert max(errors.values()) < TOL


def test_linear_bias_gradient_sums_over_batch_and_time():
    layer = npf.Linear(2, 3, dtype="float64")
    layer.forward(np.zeros((4, 5, 2)))
    layer.backward(np.ones((4, 5, 3)))
    np.testing.assert_array_equal(layer.db, np.full(3, 20.0))


def test_linear_forward_is_x_times_w_plus_b():
    layer = npf.Linear(3, 2, seed=0, dtype="float64")
    layer.b[:] = [1.0, -1.0]
    x = rng().standard_normal((4, 3))
    np.testing.assert_allclose(layer.forward(x), x @ layer.W + layer.b, rtol=1e-15)


def test_linear_float32_stays_float32():
    layer = npf.Linear(4, 3, seed=0)
    y = layer.forward(np.ones((2, 4), np.float32))
    dx = layer.backward(np.ones_like(y))
    assert y.dtype == dx.dtype == layer.dW.dtype == layer.db.dtype == np.float32


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: npf.Linear(0, 3), r"d_in: expected a positive integer, got 0"),
        (lambda: npf.Linear(3, 2.5), r"d_out: expected a positive integer, got 2.5"),
        (lambda: npf.Linear(3, True), r"d_out: expected a positive integer, got True"),
        (lambda: npf.Linear(3, 2, dtype="float16"), r"dtype: expected one of .*got float16"),
        (lambda: npf.Linear(3, 2, dtype="int64"), r"dtype: expected one of .*got int64"),
        (lambda: npf.Linear(3, 2, dtype="nonsense"), r"dtype: expected one of .*nonsense"),
    ],
)
def test_linear_constructor_rejects_bad_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    ("x", "message"),
    [
        ([[1.0, 2.0, 3.0]], r"x: expected a numpy array, got list"),
        (np.ones((2, 3), np.int64), r"x: expected dtype float32 \(the layer's dtype\), got int64"),
        (np.ones((2, 3), np.float64), r"x: expected dtype float32 .*got float64"),
        (np.ones((2, 4), np.float32), r"x: expected last dimension 3, got shape \(2, 4\)"),
        (np.array(1.0, np.float32), r"x: expected at least 1 dimension"),
    ],
)
def test_linear_forward_rejects_bad_input(x, message):
    with pytest.raises(ValueError, match=message):
        npf.Linear(3, 2).forward(x)


def test_linear_backward_rejects_a_mismatched_upstream_gradient():
    layer = npf.Linear(3, 2)
    layer.forward(np.ones((4, 3), np.float32))
    with pytest.raises(ValueError, match=r"dout: expected last dimension 2, got shape \(4, 3\)"):
        layer.backward(np.ones((4, 3), np.float32))
    with pytest.raises(ValueError, match=r"dout: expected shape \(4, 2\), got \(5, 2\)"):
        layer.backward(np.ones((5, 2), np.float32))


# --------------------------------------------------------------------------- gradcheck


def test_numerical_gradient_of_a_cubic_is_accurate_to_truncation_order():
    x = np.array([0.5, -1.0, 2.0])
    g = numerical_gradient(lambda: float(np.sum(x**3)), x, eps=1e-6)
    np.testing.assert_allclose(g, 3 * x**2, rtol=1e-8)
    np.testing.assert_array_equal(x, [0.5, -1.0, 2.0])  # restored after perturbation


def test_gradcheck_accepts_a_correct_gradient_and_reports_each_input():
    a, b = rng().standard_normal(4), rng(1).standard_normal(4)
    errors = gradcheck(lambda a, b: (float(a @ b), [b, a]), [a, b], names=["a", "b"])
    assert set(errors) == {"a", "b"} and max(errors.values()) < TOL


def test_gradcheck_rejects_a_wrong_gradient():
    a = rng().standard_normal(4)
    with pytest.raises(GradcheckError, match=r"a: "):
        gradcheck(lambda a: (float(np.sum(a**2)), [a]), [a], names=["a"])  # should be 2a


def test_check_module_catches_a_forgotten_bias_reduction_axis():
    class Buggy(npf.Linear):
        def backward(self, dout):
            dx = super().backward(dout)
            self.db -= dout.reshape(-1, self.d_out).sum(0) / 2  # half the bias gradient
            return dx

    with pytest.raises(GradcheckError, match=r"(?s)Buggy: gradient check failed .*\n  b: "):
        check_module(Buggy(3, 2, dtype="float64"), rng().standard_normal((2, 3, 3)))


def test_gradcheck_refuses_float32_inputs():
    with pytest.raises(ValueError, match=r"x: expected a float64 array, got float32"):
        gradcheck(lambda x: (0.0, [x]), [np.ones(3, np.float32)], names=["x"])
    with pytest.raises(ValueError, match=r"x: expected float64 for finite differences"):
        numerical_gradient(lambda: 0.0, np.ones(3, np.float32))
    with pytest.raises(ValueError, match=r"W: expected a float64 parameter, got float32"):
        check_module(npf.Linear(3, 2), np.ones((2, 3), np.float32))


def test_relative_error_is_normwise_and_zero_for_two_zero_arrays():
    assert relative_error(np.zeros(3), np.zeros(3)) == 0.0
    # ||a - n|| / (||a|| + ||n||) = 1e-9 / (1 + 1): relative to the size of the whole array
    assert relative_error(np.array([1.0, 0.0]), np.array([1.0, 1e-9])) == pytest.approx(
        0.5e-9, rel=1e-6
    )
    with pytest.raises(ValueError, match=r"n: expected the shape of a, \(2,\), got \(3,\)"):
        relative_error(np.zeros(2), np.zeros(3))


# --------------------------------------------------------------------------- later kernels


def test_the_fused_kernels_are_found_by_name_and_a_missing_one_names_its_module(monkeypatch):
    """Module, the optimisers and cross_entropy reach Kernels by hand through the table it
    fills when imported, never by importing it."""
    from npformer import kernels, module
    from npformer.softmax import cross_entropy

    assert module.KERNELS["use_kernels"] is kernels.use_kernels
    assert module.KERNELS["cross_entropy"] is kernels.fused_cross_entropy
    assert npf.Linear(2, 3).use_kernels("numpy").kernels == "numpy"
    monkeypatch.setattr(module, "KERNELS", {})  # as if that module had never been imported
    with pytest.raises(RuntimeError, match=r"'use_kernels' .*import npformer\.kernels"):
        npf.Linear(2, 3).use_kernels("fused")
    with pytest.raises(RuntimeError, match=r"'cross_entropy' .*import npformer\.kernels"):
        cross_entropy(np.zeros((2, 4)), np.array([0, 3]), kernels="fused")
    loss, _ = cross_entropy(np.zeros((2, 4)), np.array([0, 3]))  # the listing needs none
    assert loss == pytest.approx(np.log(4))


def test_importing_any_module_of_the_package_registers_the_fused_kernels():
    """Python runs npformer/__init__ first, and it imports Kernels by hand's module."""
    import subprocess
    import sys

    code = "import npformer.softmax, npformer.module as m; print(*sorted(m.KERNELS))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["cross_entropy", "use_kernels"]
