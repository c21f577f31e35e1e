"""The masked SFT loss (book/sft.md) against PyTorch autograd on the same GPT weights.

A small float64 GPT with a grown vocabulary is run by npformer (TokenLogProbs, sft_loss
and their hand backward) and by a plain PyTorch transcription of the same model (pre-norm
blocks, exact GELU, causal attention, tied head) holding copies of the same weights. The
loss, the token log-probabilities and every parameter gradient must agree to the oracle
tolerance (rtol 1e-10, atol 1e-12), for a padded batch and for a packed one (restarted
positions, block-diagonal causal mask).
"""

from __future__ import annotations

import numpy as np
import pytest
from oracle_utils import REASON, assert_close, t, torch_gpt_logprobs

torch = pytest.importorskip("torch", reason=REASON)

import npformer as npf  # noqa: E402
from npformer.evaluate import Addition  # noqa: E402
from npformer.sft import SPECIAL_TOKENS, pack_rows, packed_positions, pad_batch  # noqa: E402


def _model():
    cfg = npf.GPTConfig(vocab_size=13, block_size=32, n_layer=2, n_head=2, d_model=16,
                        dtype="float64")
    model = npf.GPT(cfg, seed=0)
    rng = np.random.default_rng(2)
    for _, p, _ in model.named_parameters():
        p += rng.standard_normal(p.shape) * 0.1
    return npf.grow_vocab(model, 16)


def _rows(n=7):
    tok = npf.add_special_tokens(npf.CharTokenizer(Addition.alphabet), SPECIAL_TOKENS)
    template = npf.ChatTemplate(tok)
    return [template.render(p.prompt, p.answer) for p in Addition().sample(n, seed=3)]


@pytest.mark.parametrize("packed", [False, True])
def test_masked_sft_loss_matches_autograd(packed):
    model = _model()
    rows = _rows()
    if packed:
        ids, mask, seg = pack_rows(rows, 32)
    else:
        (ids, mask), seg = pad_batch(rows, pad_id=15), None
    model.zero_grad()
    tlp = npf.TokenLogProbs(model)
    lp = tlp.forward(ids, seg)
    loss, dlp = npf.sft_loss(lp, mask[:, 1:])
    tlp.backward(dlp)

    P = {n: t(p, grad=True) for n, p, _ in model.named_parameters()}
    T = ids.shape[1]
    causal = np.tril(np.ones((T, T), dtype=bool))
    if packed:
        pos = packed_positions(seg)
        allowed = causal & (seg[:, :, None] == seg[:, None, :])
    else:
        pos = np.broadcast_to(np.arange(T), ids.shape)
        allowed = np.broadcast_to(causal, (len(ids), T, T))
    lp_t = torch_gpt_logprobs(P, ids, n_layer=2, n_head=2, pos=np.array(pos),
                              allowed=np.array(allowed))
    m = t(mask[:, 1:])
    loss_t = -(m * lp_t).sum() / m.sum()
    loss_t.backward()
    assert_close(lp, lp_t, "lp")
    assert_close(float(loss), loss_t, "loss")
    for name, _, g in model.named_parameters():
        assert_close(g, P[name].grad, f"d{name}")
