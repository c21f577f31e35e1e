"""npformer's losses against torch autograd, float64, rtol 1e-10: F.mse_loss,
F.cross_entropy(ignore_index=-100) and cross-entropy on shifted logits."""

from __future__ import annotations

import numpy as np
import pytest
from oracle_utils import REASON, assert_close, t

torch = pytest.importorskip("torch", reason=REASON)

import torch.nn.functional as F  # noqa: E402

import npformer as npf  # noqa: E402


def test_mse_loss_and_gradient_match_torch():
    rng = np.random.default_rng(0)
    pred, target = rng.standard_normal((3, 5, 4)), rng.standard_normal((3, 5, 4))

    loss, dpred = npf.mse_loss(pred, target)

    pt = t(pred, grad=True)
    lt = F.mse_loss(pt, t(target))  # reduction="mean": over all B*T*d elements
    lt.backward()
    assert_close(loss, lt, "loss")
    assert_close(dpred, pt.grad, "dpred")


@pytest.mark.parametrize("case", ["ignore_index", "mask", "none_ignored"])
def test_masked_lm_loss_and_gradient_match_torch_cross_entropy(case):
    rng = np.random.default_rng(1)
    B, T, V = 3, 6, 9
    logits = rng.standard_normal((B, T, V)) * 2
    tokens = rng.integers(0, V, size=(B, T))
    chosen = rng.random((B, T)) < 0.4
    chosen[0, 0] = True
    if case == "ignore_index":
        loss, dlogits = npf.masked_lm_loss(logits, np.where(chosen, tokens, -100))
    elif case == "mask":
        loss, dlogits = npf.masked_lm_loss(logits, tokens, mask=chosen)
    else:
        chosen[:] = True
        loss, dlogits = npf.masked_lm_loss(logits, tokens)

    zt = t(logits, grad=True)
    labels = torch.tensor(np.where(chosen, tokens, -100))
    lt = F.cross_entropy(zt.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    lt.backward()
    assert_close(loss, lt, "loss")
    assert_close(dlogits, zt.grad, "dlogits")


@pytest.mark.parametrize("pad", [None, 0])
def test_next_token_loss_matches_torch_cross_entropy_on_shifted_logits(pad):
    rng = np.random.default_rng(2)
    B, T, V = 3, 7, 10
    logits = rng.standard_normal((B, T, V)) * 2
    ids = rng.integers(1, V, size=(B, T))
    if pad is not None:
        ids[1, 4:] = pad
        ids[2, 2:] = pad

    loss, dlogits = npf.next_token_loss(logits, ids, ignore_index=pad)

    zt = t(logits, grad=True)
    targets = torch.tensor(ids[:, 1:])  # position t predicts ids[:, t+1]
    lt = F.cross_entropy(zt[:, :-1].reshape(-1, V), targets.reshape(-1),
                         ignore_index=-100 if pad is None else pad)
    lt.backward()
    assert_close(loss, lt, "loss")
    assert_close(dlogits, zt.grad, "dlogits")  # torch's last position: zero, as ours
