"""Optimisers, clipping, schedules and gradient accumulation (book/optim.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from npformer.linear import Linear
from npformer.module import Module
from npformer.norm import LayerNorm
from npformer.optim import (
    SGD,
    Adam,
    AdamW,
    clip_grad_norm,
    default_no_decay,
    warmup_cosine,
    warmup_linear,
)

RTOL = 1e-12  # hand formulas vs the classes in float64: a few roundings apart


def never_exempt(name, p):  # a no_decay rule that decays everything
    return False


def triple(values, grads=None, dtype="float64"):
    p = np.array(values, dtype=dtype)
    g = np.zeros_like(p) if grads is None else np.array(grads, dtype=dtype)
    return ("p", p, g)


class Tiny(Module):
    """An embedding table, a LayerNorm and a linear head: every kind of parameter."""

    def __init__(self, seed: int = 0, dtype: str = "float64") -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.param("wte", rng.standard_normal((7, 4)).astype(dtype))
        self.child("ln", LayerNorm(4, dtype=dtype))
        self.child("head", Linear(4, 7, seed=seed, dtype=dtype))


def fill_grads(model: Module, step: int) -> None:
    rng = np.random.default_rng(1000 + step)
    for _, p, g in model.named_parameters():
        g[...] = rng.standard_normal(p.shape) + 0.1 * p


# --------------------------------------------------------------------------- formulas


def test_sgd_plain_step_is_p_minus_lr_g():
    name, p, g = triple([1.0, -2.0, 3.0], [0.5, 0.25, -1.0])
    SGD([(name, p, g)], lr=0.1).step()
    np.testing.assert_allclose(p, [0.95, -2.025, 3.1], rtol=RTOL, atol=0)


def test_sgd_momentum_and_weight_decay_follow_torch_convention():
    """v = mu v + (g + wd p); p -= lr v, over three steps with changing gradients."""
    lr, mu, wd = 0.1, 0.9, 0.01
    grads = [np.array([0.5, -1.0]), np.array([0.25, 2.0]), np.array([-1.0, 0.125])]
    p, g = np.array([1.0, -2.0]), np.zeros(2)
    opt = SGD([("p", p, g)], lr, momentum=mu, weight_decay=wd)
    p_ref, v_ref = p.copy(), np.zeros(2)
    for gs in grads:
        g[...] = gs
        opt.step()
        v_ref = mu * v_ref + (gs + wd * p_ref)
        p_ref = p_ref - lr * v_ref
        np.testing.assert_allclose(p, p_ref, rtol=RTOL, atol=0)
    np.testing.assert_allclose(opt.state["momentum.p"], v_ref, rtol=RTOL, atol=0)


def test_sgd_does_not_modify_the_gradient():
    name, p, g = triple([1.0, 2.0], [0.5, 0.5])
    SGD([(name, p, g)], lr=0.1, momentum=0.9, weight_decay=0.1).step()
    np.testing.assert_array_equal(g, [0.5, 0.5])


def test_adam_matches_the_unrolled_bias_corrected_formula():
    """m_t = (1-b1) sum b1^(t-s) g_s, v_t likewise; p -= lr m_hat / (sqrt(v_hat) + eps)."""
    lr, b1, b2, eps = 0.01, 0.8, 0.95, 1e-3  # a large eps, so that it matters
    grads = [np.array([0.5, -1.0, 1e-4]), np.array([0.25, 2.0, -3e-4]),
             np.array([-1.0, 0.125, 2e-4]), np.array([0.75, -0.5, 0.0])]
    p, g = np.array([1.0, -2.0, 0.5]), np.zeros(3)
    opt = Adam([("p", p, g)], lr, (b1, b2), eps)
    p_ref = p.copy()
    for t in range(1, len(grads) + 1):
        g[...] = grads[t - 1]
        opt.step()
        m = (1 - b1) * sum(b1 ** (t - s) * grads[s - 1] for s in range(1, t + 1))
        v = (1 - b2) * sum(b2 ** (t - s) * grads[s - 1] ** 2 for s in range(1, t + 1))
        p_ref = p_ref - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        np.testing.assert_allclose(p, p_ref, rtol=RTOL, atol=0)
    assert opt.t == len(grads)


@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e6])
def test_adam_first_step_moves_each_coordinate_by_lr_whatever_the_gradient_scale(scale):
    name, p, g = triple(np.zeros(4), scale * np.array([1.0, -2.0, 0.5, -7.0]))
    Adam([(name, p, g)], lr=1e-3, eps=1e-12).step()
    np.testing.assert_allclose(p, -1e-3 * np.sign(g), rtol=1e-5, atol=0)


def test_adamw_decays_before_the_adam_step():
    """p <- p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps), decay not seen by the moments."""
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.999, 1e-8, 0.1
    grads = [np.array([0.5, -1.0]), np.array([0.25, 2.0]), np.array([-1.0, 0.125])]
    p, g = np.array([1.0, -2.0]), np.zeros(2)
    opt = AdamW([("p", p, g)], lr, (b1, b2), eps, weight_decay=wd, no_decay=never_exempt)
    p_ref, m, v = p.copy(), np.zeros(2), np.zeros(2)
    for t, gs in enumerate(grads, start=1):
        g[...] = gs
        opt.step()
        m = b1 * m + (1 - b1) * gs
        v = b2 * v + (1 - b2) * gs**2
        p_ref = p_ref * (1 - lr * wd) - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        np.testing.assert_allclose(p, p_ref, rtol=RTOL, atol=0)
    np.testing.assert_allclose(opt.state["m.p"], m, rtol=RTOL, atol=0)
    np.testing.assert_allclose(opt.state["v.p"], v, rtol=RTOL, atol=0)


def test_adamw_with_zero_weight_decay_is_adam():
    a, b = triple([1.0, -2.0], [0.3, 0.1]), triple([1.0, -2.0], [0.3, 0.1])
    opt_a, opt_b = Adam([a], lr=0.1), AdamW([b], lr=0.1, weight_decay=0.0, no_decay=never_exempt)
    for _ in range(3):
        opt_a.step()
        opt_b.step()
    np.testing.assert_array_equal(a[1], b[1])


def test_adamw_zero_gradient_shrinks_decayed_params_only():
    model = Tiny()
    before = {name: p.copy() for name, p, _ in model.named_parameters()}
    opt = AdamW(model.named_parameters(), lr=0.1, weight_decay=0.5)
    opt.step()  # all gradients are zero: the Adam part is exactly 0
    for name, p, _ in model.named_parameters():
        expected = before[name] * (1 - 0.1 * 0.5) if name == "head.W" else before[name]
        np.testing.assert_array_equal(p, expected, err_msg=name)


def test_schedule_lr_is_used_by_the_next_step():
    name, p, g = triple([0.0], [1.0])
    opt = SGD([(name, p, g)], lr=1.0)
    opt.lr = 0.25
    opt.step()
    np.testing.assert_array_equal(p, [-0.25])


# --------------------------------------------------------------------------- no decay rule


@pytest.mark.parametrize("name, shape, exempt", [
    ("head.W", (4, 7), False),
    ("blocks.0.attn.W_qkv", (8, 24), False),
    ("head.b", (7,), True),
    ("ln.gamma", (4,), True),
    ("ln.beta", (4,), True),
    ("wte", (7, 4), True),
    ("wpe", (16, 4), True),
    ("tok_emb.W", (7, 4), True),
    ("Embedding.W", (7, 4), True),
    ("scale", (), True),
])
def test_default_no_decay_exempts_vectors_and_embeddings(name, shape, exempt):
    assert default_no_decay(name, np.zeros(shape)) is exempt


def test_no_decay_rule_is_configurable():
    model = Tiny()
    default = AdamW(model.named_parameters())
    nanogpt = AdamW(model.named_parameters(), no_decay=lambda name, p: p.ndim < 2)
    everything = AdamW(model.named_parameters(), no_decay=never_exempt)
    assert [n for n, d in default.decay.items() if d] == ["head.W"]
    assert [n for n, d in nanogpt.decay.items() if d] == ["wte", "head.W"]
    assert all(everything.decay.values())


# --------------------------------------------------------------------------- dtype, in place


@pytest.mark.parametrize("make", [
    lambda ps: SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    lambda ps: Adam(ps, lr=0.1),
    lambda ps: AdamW(ps, lr=0.1),
], ids=["SGD", "Adam", "AdamW"])
def test_float32_parameters_and_state_stay_float32_and_are_updated_in_place(make):
    model = Tiny(dtype="float32")
    arrays = {name: p for name, p, _ in model.named_parameters()}
    before = {name: p.copy() for name, p in arrays.items()}
    opt = make(model.named_parameters())
    for step in range(3):
        fill_grads(model, step)
        opt.step()
    for name, p, _ in model.named_parameters():
        assert p is arrays[name] and p.dtype == np.float32, name
        assert not np.array_equal(p, before[name]), name
    for key, arr in opt.state_dict().items():
        if key not in ("step", "lr"):
            assert arr.dtype == np.float32, key


def test_zero_grad_clears_the_modules_gradients():
    model = Tiny()
    opt = SGD(model.named_parameters(), lr=0.1)
    fill_grads(model, 0)
    opt.zero_grad()
    assert all(not g.any() for _, _, g in model.named_parameters())


# --------------------------------------------------------------------------- state dict


@pytest.mark.parametrize("make", [
    lambda ps: SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
    lambda ps: Adam(ps, lr=0.05, betas=(0.8, 0.99)),
    lambda ps: AdamW(ps, lr=0.05, weight_decay=0.1),
], ids=["SGD", "Adam", "AdamW"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_state_dict_round_trip_resumes_bit_exactly(make, dtype):
    model = Tiny(dtype=dtype)
    opt = make(model.named_parameters())
    for step in range(4):
        fill_grads(model, step)
        opt.lr = warmup_cosine(opt.t, peak_lr=0.05, warmup_steps=2, total_steps=8)
        opt.step()
    saved_params = {name: p.copy() for name, p, _ in model.named_parameters()}
    saved = opt.state_dict()
    for step in range(4, 8):
        fill_grads(model, step)
        opt.lr = warmup_cosine(opt.t, peak_lr=0.05, warmup_steps=2, total_steps=8)
        opt.step()

    fresh = Tiny(seed=1, dtype=dtype)
    for name, p, _ in fresh.named_parameters():
        p[...] = saved_params[name]
    opt2 = make(fresh.named_parameters())
    opt2.load_state_dict(saved)
    assert opt2.t == 4
    for step in range(4, 8):
        fill_grads(fresh, step)
        opt2.lr = warmup_cosine(opt2.t, peak_lr=0.05, warmup_steps=2, total_steps=8)
        opt2.step()
    for (name, p, _), (_, q, _) in zip(model.named_parameters(), fresh.named_parameters()):
        np.testing.assert_array_equal(q, p, err_msg=name)


def test_state_dict_is_flat_and_a_copy():
    model = Tiny()
    opt = AdamW(model.named_parameters(), lr=0.01)
    fill_grads(model, 0)
    opt.step()
    saved = opt.state_dict()
    names = [name for name, _, _ in model.named_parameters()]
    assert set(saved) == {f"{k}.{n}" for k in ("m", "v") for n in names} | {"step", "lr"}
    assert all(isinstance(v, np.ndarray) for v in saved.values())
    assert int(saved["step"]) == 1 and float(saved["lr"]) == 0.01
    m_before = saved["m.head.W"].copy()
    opt.step()
    np.testing.assert_array_equal(saved["m.head.W"], m_before)


def test_load_state_dict_restores_the_learning_rate():
    a, b = triple([1.0], [1.0]), triple([1.0], [1.0])
    opt = SGD([a], lr=0.3, momentum=0.5)
    opt2 = SGD([b], lr=0.1, momentum=0.5)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.lr == 0.3


def test_load_state_dict_rejects_mismatched_state_and_changes_nothing():
    model = Tiny()
    opt = Adam(model.named_parameters())
    good = opt.state_dict()
    missing = {k: v for k, v in good.items() if k != "v.wte"}
    with pytest.raises(ValueError, match=r"state: expected .*missing \['v\.wte'\]"):
        opt.load_state_dict(missing)
    with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
        opt.load_state_dict({**good, "extra": np.zeros(1)})
    with pytest.raises(ValueError, match=r"state\['m\.head\.W'\]: expected shape \(4, 7\)"):
        opt.load_state_dict({**good, "m.head.W": np.ones((7, 4))})
    with pytest.raises(ValueError, match=r"state\['m\.wte'\]: expected .*dtype float64"):
        opt.load_state_dict({**good, "m.wte": np.ones((7, 4), np.float32)})
    with pytest.raises(ValueError, match=r"state\['step'\]: expected an integer >= 0"):
        opt.load_state_dict({**good, "m.wte": np.ones((7, 4)), "step": np.array(-1)})
    assert not opt.state["m.wte"].any()  # validated before anything was copied


# --------------------------------------------------------------------------- clipping


def test_clip_grad_norm_returns_the_global_norm_and_scales_all_grads_alike():
    a = ("a", np.zeros(2), np.array([3.0, 0.0]))
    b = ("b", np.zeros((2, 1)), np.array([[0.0], [4.0]]))
    norm = clip_grad_norm([a, b], max_norm=1.0)
    assert norm == 5.0  # sqrt(3^2 + 4^2), before clipping
    coef = 1.0 / (5.0 + 1e-6)  # torch's eps in the denominator
    np.testing.assert_allclose(a[2], [3.0 * coef, 0.0], rtol=1e-15, atol=0)
    np.testing.assert_allclose(b[2], [[0.0], [4.0 * coef]], rtol=1e-15, atol=0)


def test_clip_grad_norm_leaves_small_gradients_untouched():
    a = ("a", np.zeros(2), np.array([3.0, 4.0]))
    assert clip_grad_norm([a], max_norm=5.0 + 1e-6) == 5.0
    np.testing.assert_array_equal(a[2], [3.0, 4.0])


def test_clip_grad_norm_leaves_non_finite_gradients_for_the_caller():
    a = ("a", np.zeros(2), np.array([np.inf, 1.0]))
    b = ("b", np.zeros(2), np.array([np.nan, 1.0]))
    assert math.isinf(clip_grad_norm([a], max_norm=1.0))
    assert math.isnan(clip_grad_norm([b], max_norm=1.0))
    np.testing.assert_array_equal(a[2], [np.inf, 1.0])


def test_clip_grad_norm_float32_gradients_stay_float32():
    a = ("a", np.zeros(3, np.float32), np.full(3, 10.0, np.float32))
    clip_grad_norm([a], max_norm=1.0)
    assert a[2].dtype == np.float32
    assert abs(float(np.linalg.norm(a[2])) - 1.0) < 1e-6


# --------------------------------------------------------------------------- schedules


def test_warmup_linear_key_values():
    def lr(s):
        return warmup_linear(s, peak_lr=1.0, warmup_steps=10, total_steps=110)

    assert lr(0) == pytest.approx(0.1, rel=1e-15)  # (0 + 1) / 10, never 0
    assert lr(9) == 1.0  # peak at the end of warmup
    assert lr(10) == 1.0  # decay starts from the peak
    assert lr(60) == pytest.approx(0.5, rel=1e-15)
    assert lr(109) == pytest.approx(0.01, rel=1e-15)  # the last step still moves
    assert lr(110) == 0.0 and lr(500) == 0.0
    values = [lr(s) for s in range(120)]
    assert all(a <= b for a, b in zip(values[:10], values[1:11]))
    assert all(a >= b for a, b in zip(values[10:], values[11:]))


def test_warmup_cosine_key_values():
    def lr(s):
        return warmup_cosine(s, peak_lr=1.0, warmup_steps=10, total_steps=110, min_lr=0.1)

    assert lr(0) == pytest.approx(0.1, rel=1e-15)
    assert lr(9) == 1.0 and lr(10) == 1.0
    assert lr(60) == pytest.approx(0.55, rel=1e-15)  # halfway: the mean of peak and floor
    assert lr(110) == 0.1 and lr(1000) == 0.1
    values = [lr(s) for s in range(10, 120)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert min(values) == 0.1


@pytest.mark.parametrize("schedule", [warmup_linear, warmup_cosine])
def test_schedules_without_warmup_start_at_the_peak(schedule):
    assert schedule(0, peak_lr=3e-4, warmup_steps=0, total_steps=100) == 3e-4


@pytest.mark.parametrize("schedule", [warmup_linear, warmup_cosine])
def test_schedules_with_all_warmup_are_never_zero_before_total(schedule):
    values = [schedule(s, peak_lr=1.0, warmup_steps=5, total_steps=5) for s in range(5)]
    assert values == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0], rel=1e-15)


# --------------------------------------------------------------------------- accumulation


def mse(y, target):
    diff = y - target
    return float(np.mean(diff**2)), 2 * diff / diff.size


@pytest.mark.parametrize("k", [2, 4, 8])
def test_gradient_accumulation_equals_one_large_batch(k):
    """k micro-batches with loss / k give the batch gradient and the same AdamW step."""
    rng = np.random.default_rng(0)
    x, target = rng.standard_normal((16, 6)), rng.standard_normal((16, 3))
    full, accum = (Linear(6, 3, seed=1, dtype="float64") for _ in range(2))
    full.b[:] = accum.b[:] = rng.standard_normal(3)
    opt_full = AdamW(full.named_parameters(), lr=1e-2, weight_decay=0.1, no_decay=never_exempt)
    opt_accum = AdamW(accum.named_parameters(), lr=1e-2, weight_decay=0.1, no_decay=never_exempt)
    for step in range(3):
        xs, ts = x + step, target - step  # a different batch each step
        opt_full.zero_grad()
        full.backward(mse(full(xs), ts)[1])
        opt_accum.zero_grad()
        for xb, tb in zip(np.split(xs, k), np.split(ts, k)):
            accum.backward(mse(accum(xb), tb)[1] / k)
        for (name, _, gf), (_, _, ga) in zip(full.named_parameters(), accum.named_parameters()):
            np.testing.assert_allclose(ga, gf, rtol=1e-13, atol=1e-16, err_msg=name)
        opt_full.step()
        opt_accum.step()
        for (name, pf, _), (_, pa, _) in zip(full.named_parameters(), accum.named_parameters()):
            np.testing.assert_allclose(pa, pf, rtol=1e-13, atol=1e-16, err_msg=name)


# --------------------------------------------------------------------------- validation


def params():
    return [triple([1.0, 2.0])]


@pytest.mark.parametrize("make, match", [
    (lambda: SGD(params(), lr=-0.1), r"lr: expected a number in \[0, inf\), got -0.1"),
    (lambda: SGD(params(), lr=float("nan")), r"lr: expected .* got nan"),
    (lambda: SGD(params(), lr="0.1"), r"lr: expected a number .* got '0.1'"),
    (lambda: SGD(params(), lr=0.1, momentum=1.0), r"momentum: expected .*\[0, 1\), got 1.0"),
    (lambda: SGD(params(), lr=0.1, weight_decay=-1), r"weight_decay: expected .* got -1"),
    (lambda: Adam(params(), betas=(1.0, 0.999)), r"betas\[0\]: expected .*\[0, 1\), got 1.0"),
    (lambda: Adam(params(), betas=(0.9, -0.1)), r"betas\[1\]: expected .* got -0.1"),
    (lambda: Adam(params(), betas=0.9), r"betas: expected a pair .* got 0.9"),
    (lambda: Adam(params(), eps=0.0), r"eps: expected a number in \(0, inf\), got 0.0"),
    (lambda: AdamW(params(), weight_decay=-0.01), r"weight_decay: expected .* got -0.01"),
    (lambda: AdamW(params(), no_decay="bias"), r"no_decay: expected a callable .* got 'bias'"),
    (lambda: Adam([]), r"params: expected at least one .* got none"),
    (lambda: Adam(params() + params()), r"params: expected unique string names, got 'p'"),
    (lambda: Adam([("p", np.ones(2), np.ones(3))]),
     r"params\['p'\]: expected a gradient of shape \(2,\) and dtype float64, got \(3,\)"),
    (lambda: Adam([("p", np.ones(2), np.ones(2, np.float32))]),
     r"params\['p'\]: expected a gradient .* dtype float64, got \(2,\) float32"),
    (lambda: Adam([("p", np.ones(2, np.int64), np.ones(2, np.int64))]),
     r"params\['p'\]: expected one of .* got int64"),
    (lambda: Adam([("p", [1.0], [0.0])]), r"params\['p'\]: expected a numpy array, got list"),
    (lambda: Adam([("p", np.ones(2))]), r"params: expected \(name, param, grad\) triples"),
])
def test_optimiser_arguments_are_validated(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_tied_parameter_passed_twice_is_rejected():
    w, g = np.ones((2, 2)), np.zeros((2, 2))
    with pytest.raises(ValueError, match=r"params\['head.W'\]: expected distinct arrays, "
                                         r"got the array of 'wte.W' again"):
        Adam([("wte.W", w, g), ("head.W", w, np.zeros((2, 2)))])


def test_setting_a_negative_learning_rate_is_rejected():
    opt = Adam(params())
    with pytest.raises(ValueError, match=r"lr: expected a number in \[0, inf\), got -1"):
        opt.lr = -1


@pytest.mark.parametrize("max_norm", [0.0, -1.0, float("nan"), float("inf"), None])
def test_clip_grad_norm_max_norm_is_validated(max_norm):
    with pytest.raises(ValueError, match=r"max_norm: expected a number in \(0, inf\)"):
        clip_grad_norm(params(), max_norm)


def test_clip_grad_norm_rejects_an_empty_parameter_list():
    with pytest.raises(ValueError, match=r"params: expected at least one"):
        clip_grad_norm(iter([]), 1.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(step=-1), r"step: expected an integer >= 0, got -1"),
    (dict(step=1.5), r"step: expected an integer >= 0, got 1.5"),
    (dict(peak_lr=-1.0), r"peak_lr: expected a number in \[0, inf\), got -1.0"),
    (dict(warmup_steps=-1), r"warmup_steps: expected an integer >= 0, got -1"),
    (dict(total_steps=0), r"total_steps: expected a positive integer, got 0"),
    (dict(warmup_steps=200), r"warmup_steps: expected at most total_steps = 100, got 200"),
])
@pytest.mark.parametrize("schedule", [warmup_linear, warmup_cosine])
def test_schedule_arguments_are_validated(schedule, kwargs, match):
    args = dict(step=0, peak_lr=1e-3, warmup_steps=10, total_steps=100) | kwargs
    step = args.pop("step")
    with pytest.raises(ValueError, match=match):
        schedule(step, **args)


@pytest.mark.parametrize("min_lr", [-1e-4, 2e-3])
def test_warmup_cosine_min_lr_must_lie_between_zero_and_peak(min_lr):
    with pytest.raises(ValueError, match=r"min_lr: expected a number in \[0, 0.001\]"):
        warmup_cosine(0, peak_lr=1e-3, warmup_steps=10, total_steps=100, min_lr=min_lr)


# --- the fast Adam update against the formula as written --------------------------------------
@pytest.mark.parametrize("dtype,rtol", [("float64", 1e-12), ("float32", 2e-5)])
def test_adam_update_equals_reference_over_many_steps(dtype, rtol):
    from npformer.optim import adam_update, adam_update_reference

    rng = np.random.default_rng(1)
    p1 = rng.standard_normal((30, 7)).astype(dtype)
    p2, m1, v1 = p1.copy(), np.zeros_like(p1), np.zeros_like(p1)
    m2, v2, buf = m1.copy(), v1.copy(), np.empty_like(p1)
    for t in range(1, 301):
        g = (rng.standard_normal(p1.shape) * 10.0 ** rng.integers(-4, 3)).astype(dtype)
        adam_update_reference(p1, g, m1, v1, lr=3e-3, b1=0.9, b2=0.99, eps=1e-8, t=t)
        adam_update(p2, g, m2, v2, lr=3e-3, b1=0.9, b2=0.99, eps=1e-8, t=t, buf=buf)
        assert p2.dtype == m2.dtype == v2.dtype == np.dtype(dtype)
    np.testing.assert_allclose(m2, m1, rtol=rtol, atol=0)
    np.testing.assert_allclose(v2, v1, rtol=rtol, atol=0)
    np.testing.assert_allclose(p2, p1, rtol=rtol, atol=0)


def test_adam_scratch_is_shared_and_not_saved():
    a = np.zeros((4, 5), np.float32)
    b = np.zeros(3, np.float32)
    opt = Adam([("a", a, np.ones_like(a)), ("b", b, np.ones_like(b))], lr=0.1)
    opt.step()
    assert set(opt._scratch) == {np.dtype(np.float32)}
    assert opt._scratch[np.dtype(np.float32)].size == a.size  # the largest parameter
    assert not any("scratch" in k for k in opt.state_dict())


def test_clip_grad_norm_float32_sum_is_accurate_and_overflow_safe():
    rng = np.random.default_rng(0)
    g = (rng.standard_normal(1_500_000) * 1e-3).astype(np.float32)
    exact = math.sqrt(np.sum(g.astype(np.float64) ** 2))
    norm = clip_grad_norm([("g", np.zeros_like(g), g.copy())], 1e9)
    assert abs(norm / exact - 1) < 1e-6
    huge = np.array([3e19, -4e19], dtype=np.float32)  # squares overflow float32
    h = huge.copy()
    norm = clip_grad_norm([("h", np.zeros_like(h), h)], 1.0)
    assert math.isclose(norm, 5e19, rel_tol=1e-6)
    assert np.all(np.isfinite(h)) and math.isclose(float(np.linalg.norm(h.astype(np.float64))),
                                                    1.0, rel_tol=1e-5)
