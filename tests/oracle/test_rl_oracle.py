"""The GRPO loss and the policy gradient (book/rl.md) against PyTorch autograd.

A small float64 GPT is run by npformer (TokenLogProbs, grpo_loss and their hand backward)
and by a plain PyTorch transcription of the same model (pre-norm blocks, exact GELU, causal
attention, tied head) holding copies of the same weights. On a batch sampled by
sample_groups (prompts of different lengths, right padding, responses that stop early), the
GRPO loss and every parameter gradient must agree to the oracle tolerance (rtol 1e-10,
atol 1e-12), with both clips active and the k3 penalty on. Then the exact gradient of an
expected reward over all 27 responses of a 3-token policy: autograd differentiates the sum
of pi(o) R(o) itself, npformer takes the exact mean of the REINFORCE estimator; they must
agree to 1e-12.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from oracle_utils import REASON, assert_close, t, torch_gpt_logprobs

torch = pytest.importorskip("torch", reason=REASON)

import npformer as npf  # noqa: E402
from npformer.sft import TokenLogProbs  # noqa: E402


def _model(vocab_size, block_size, n_layer, d_model, scale, seed=0):
    cfg = npf.GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer,
                        n_head=2, d_model=d_model, dtype="float64")
    model = npf.GPT(cfg, seed=seed)
    rng = np.random.default_rng(seed + 1)
    for _, p, _ in model.named_parameters():
        p += rng.standard_normal(p.shape) * scale
    return model


def _torch_grpo(lp, old_lp, ref_lp, mask, adv, clip, beta, length_norm):
    """GRPO written as the paper's objective, for autograd."""
    m = t(mask)
    if length_norm:
        m = m / m.sum(1, keepdim=True).clamp(min=1)
    ratio = torch.exp(lp - t(old_lp))
    A = t(adv)[:, None]
    s = torch.minimum(ratio * A, torch.clamp(ratio, 1 - clip, 1 + clip) * A)
    log_w = t(ref_lp) - lp
    kl = torch.exp(log_w) - 1 - log_w
    return (m * (-s + beta * kl)).sum() / lp.shape[0]


@pytest.mark.parametrize("length_norm", [False, True])
def test_grpo_loss_and_gradients_match_autograd(length_norm):
    model = _model(vocab_size=9, block_size=14, n_layer=2, d_model=16, scale=0.1)
    prompts = [np.array([1, 2, 3]), np.array([4, 5]), np.array([6, 7, 8, 1]), np.array([2])]
    ro = npf.sample_groups(model, prompts, 4, 7, stop_id=0, seed=1)
    assert 0 < ro.finished.mean() < 1
    rng = np.random.default_rng(2)
    old_lp = ro.lp + rng.normal(0, 0.3, ro.lp.shape) * ro.mask  # theta has moved on
    ref_lp = ro.lp + rng.normal(0, 0.3, ro.lp.shape) * ro.mask
    adv = npf.group_advantages(rng.integers(0, 2, 16).astype(float), 4)
    tlp = TokenLogProbs(model)
    model.zero_grad()
    lp = tlp.forward(ro.ids)
    loss, dlp = npf.grpo_loss(lp, old_lp, ref_lp, ro.mask, adv, clip=0.2, beta=0.1,
                              length_norm=length_norm)
    tlp.backward(dlp)
    r = np.exp(lp - old_lp)[ro.mask > 0]
    assert np.any(r > 1.2) and np.any(r < 0.8)

    P = {n: t(p, grad=True) for n, p, _ in model.named_parameters()}
    tl = torch_gpt_logprobs(P, ro.ids, n_layer=2, n_head=2)
    tloss = _torch_grpo(tl, old_lp, ref_lp, ro.mask, adv, 0.2, 0.1, length_norm)
    tloss.backward()
    assert_close(lp, tl, "lp")
    assert_close(loss, tloss, "loss")
    for name, _, g in model.named_parameters():
        assert_close(g, P[name].grad, "d" + name)


def test_mean_of_the_estimator_is_the_autograd_gradient_of_the_expected_reward():
    model = _model(vocab_size=3, block_size=4, n_layer=1, d_model=8, scale=0.5)
    outputs = np.array(list(itertools.product(range(3), repeat=3)))  # (27, 3)
    ids = np.concatenate([np.zeros((27, 1), dtype=int), outputs], axis=1)
    reward = (outputs == 2).sum(axis=1) + 0.5 * (outputs[:, 0] == outputs[:, 2])
    ones = np.ones((1, 3))
    tlp = TokenLogProbs(model)
    pi = np.exp(tlp.forward(ids).sum(axis=1))
    mean = 0.0
    for o in range(27):  # one sample at a time, weighted by its probability
        model.zero_grad()
        lp = tlp.forward(ids[o:o + 1])
        tlp.backward(npf.reinforce_loss(lp, ones, reward[o:o + 1])[1])
        mean = mean - pi[o] * np.concatenate([g.ravel() for _, _, g in
                                              model.named_parameters()])
    P = {n: t(p, grad=True) for n, p, _ in model.named_parameters()}
    J = (torch.exp(torch_gpt_logprobs(P, ids, n_layer=1, n_head=2).sum(1)) * t(reward)).sum()
    J.backward()
    exact = torch.cat([P[n].grad.reshape(-1) for n, _, _ in model.named_parameters()])
    assert_close(mean, exact, "grad J", rtol=1e-12, atol=1e-13)
