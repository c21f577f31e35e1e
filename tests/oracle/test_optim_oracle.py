"""npformer.optim against torch.optim and torch.nn.utils.clip_grad_norm_, float64, rtol 1e-10.

Both sides start from the same parameters and see the same gradient sequence for
100 steps: fixed noise from a seeded Generator plus a term that depends on the
current parameters (the gradient of 0.25 ||p||^2), so that any drift between the
two trajectories would feed back and grow. PyTorch rearranges the Adam update
(lerp for m, step size lr / (1 - b1^t), sqrt(v) / sqrt(1 - b2^t) + eps), so the
two agree to rounding, not bit for bit: rtol 1e-10, atol 1e-12, after every step.
"""

from __future__ import annotations

import numpy as np
import pytest
from oracle_utils import REASON, assert_close, t

torch = pytest.importorskip("torch", reason=REASON)

import npformer as npf  # noqa: E402
from npformer.optim import default_no_decay  # noqa: E402

STEPS = 100
SHAPES = {"wte": (6, 4), "ln.gamma": (4,), "head.W": (4, 6), "head.b": (6,)}


def make_params(seed: int = 0):
    rng = np.random.default_rng(seed)
    ours = [(name, rng.standard_normal(shape), np.zeros(shape)) for name, shape in SHAPES.items()]
    theirs = {name: t(p, grad=True) for name, p, _ in ours}
    return ours, theirs


def set_grads(step: int, ours, theirs) -> None:
    rng = np.random.default_rng(1000 + step)
    for name, p, g in ours:
        noise = rng.standard_normal(p.shape)
        g[...] = noise + 0.5 * p
        pt = theirs[name]
        pt.grad = t(noise) + 0.5 * pt.detach()


def run_both(ours, theirs, opt, opt_t, schedule=None):
    for step in range(STEPS):
        if schedule is not None:
            opt.lr = schedule(step)
            for group in opt_t.param_groups:
                group["lr"] = schedule(step)
        set_grads(step, ours, theirs)
        opt.step()
        opt_t.step()
        for name, p, _ in ours:
            assert_close(p, theirs[name], f"{name} after step {step + 1}")


def schedule(step: int) -> float:
    return npf.warmup_cosine(step, peak_lr=0.05, warmup_steps=10, total_steps=STEPS,
                             min_lr=0.005)


@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.9, 0.01),
                                                    (0.0, 0.1)])
def test_sgd_matches_torch_over_100_steps(momentum, weight_decay):
    ours, theirs = make_params()
    opt = npf.SGD(ours, lr=0.01, momentum=momentum, weight_decay=weight_decay)
    opt_t = torch.optim.SGD(theirs.values(), lr=0.01, momentum=momentum,
                            weight_decay=weight_decay)
    run_both(ours, theirs, opt, opt_t)
    if momentum:
        for name, pt in theirs.items():
            assert_close(opt.state["momentum." + name], opt_t.state[pt]["momentum_buffer"], name)


@pytest.mark.parametrize("betas, eps", [((0.9, 0.999), 1e-8), ((0.8, 0.95), 1e-3)])
def test_adam_matches_torch_over_100_steps(betas, eps):
    ours, theirs = make_params()
    opt = npf.Adam(ours, lr=0.01, betas=betas, eps=eps)
    opt_t = torch.optim.Adam(theirs.values(), lr=0.01, betas=betas, eps=eps)
    run_both(ours, theirs, opt, opt_t)
    for name, pt in theirs.items():
        assert_close(opt.state["m." + name], opt_t.state[pt]["exp_avg"], f"m.{name}")
        assert_close(opt.state["v." + name], opt_t.state[pt]["exp_avg_sq"], f"v.{name}")
        assert opt.t == int(opt_t.state[pt]["step"]) == STEPS


def test_adamw_matches_torch_over_100_steps_with_a_schedule():
    """Every parameter decayed, lr changed every step: the decay follows lr as in torch."""
    ours, theirs = make_params()
    opt = npf.AdamW(ours, lr=0.0, weight_decay=0.1, no_decay=lambda name, p: False)
    opt_t = torch.optim.AdamW(theirs.values(), lr=0.0, weight_decay=0.1)
    run_both(ours, theirs, opt, opt_t, schedule)
    for name, pt in theirs.items():
        assert_close(opt.state["m." + name], opt_t.state[pt]["exp_avg"], f"m.{name}")
        assert_close(opt.state["v." + name], opt_t.state[pt]["exp_avg_sq"], f"v.{name}")


def test_no_decay_grouping_matches_torch_adamw_with_two_param_groups():
    ours, theirs = make_params()
    opt = npf.AdamW(ours, lr=0.02, weight_decay=0.1)  # default_no_decay: only head.W decays
    decay = [name for name, p, _ in ours if not default_no_decay(name, p)]
    assert decay == ["head.W"]
    opt_t = torch.optim.AdamW([
        {"params": [theirs[n] for n in decay], "weight_decay": 0.1},
        {"params": [theirs[n] for n in theirs if n not in decay], "weight_decay": 0.0},
    ], lr=0.02)
    run_both(ours, theirs, opt, opt_t)


@pytest.mark.parametrize("max_norm", [0.5, 3.0, 1e3])
def test_clip_grad_norm_matches_torch(max_norm):
    rng = np.random.default_rng(7)
    grads = [rng.standard_normal(shape) for shape in SHAPES.values()]
    ours = [(f"g{k}", np.zeros_like(g), g.copy()) for k, g in enumerate(grads)]
    theirs = [t(np.zeros_like(g), grad=True) for g in grads]
    for pt, g in zip(theirs, grads):
        pt.grad = t(g)
    norm = npf.clip_grad_norm(ours, max_norm)
    norm_t = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert_close(np.array(norm), norm_t, "returned norm")
    for (name, _, g), pt in zip(ours, theirs):
        assert_close(g, pt.grad, name)
    clipped = max_norm < norm
    assert clipped == (max_norm < 1e3)  # the parametrisation covers both branches
