"""The Bradley-Terry loss through the reward model and the DPO loss through the policy,
against PyTorch autograd on the same float64 weights (book/preferences.md).

Random GPT2LMHeadModels are saved with save_pretrained and loaded with
npf.load_pretrained_gpt2 in float64: a policy and a different reference. The reward model
is RewardModel.from_gpt of the policy, and its head is copied into a torch Linear. Losses
and every parameter gradient must agree to the oracle tolerance (rtol 1e-10, atol 1e-12).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from oracle_utils import REASON, assert_close, hf_to_ours, save_random_gpt2, t

torch = pytest.importorskip("torch", reason=REASON)
transformers = pytest.importorskip("transformers", reason=REASON)

import npformer as npf  # noqa: E402
from npformer.preference import dpo_token_loss  # noqa: E402
from npformer.sft import TokenLogProbs  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = "1"

V, N_POS, D, N_LAYER, N_HEAD = 13, 16, 12, 2, 3
F = torch.nn.functional



def _save_gpt2(path, seed: int):
    return save_random_gpt2(path, seed, vocab_size=V, n_positions=N_POS, n_embd=D,
                            n_layer=N_LAYER, n_head=N_HEAD)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return (_save_gpt2(tmp_path_factory.mktemp("policy"), 0),
            _save_gpt2(tmp_path_factory.mktemp("reference"), 1))


def _torch(path, cls=None):
    cls = cls or transformers.GPT2LMHeadModel
    return cls.from_pretrained(path, attn_implementation="eager").double().eval()


def _batch(seed=2):
    """Three pairs: ids (6, 10) [chosen; rejected], the response mask on targets, last."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, (6, 10))
    mask = np.zeros((6, 9))
    for row, (start, end) in enumerate([(3, 9), (4, 7), (2, 8), (3, 6), (4, 9), (2, 5)]):
        mask[row, start:end] = 1  # targets start..end-1: ids positions start+1..end
    last = np.array([9, 7, 8, 6, 9, 5])
    return ids, mask, last


def _grads(model):
    return {hf_to_ours(n): p.grad for n, p in model.named_parameters()}


def test_dpo_loss_and_every_policy_gradient_match_torch(dirs):
    policy = npf.load_pretrained_gpt2(dirs[0], dtype="float64")
    reference = npf.load_pretrained_gpt2(dirs[1], dtype="float64")
    ids, mask, _ = _batch()
    beta = 0.3
    ref_lp = TokenLogProbs(reference).forward(ids)
    tlp = TokenLogProbs(policy)
    policy.zero_grad()
    loss, dlp = dpo_token_loss(tlp.forward(ids), ref_lp, mask, beta)
    tlp.backward(dlp)

    tpolicy, tref = _torch(dirs[0]), _torch(dirs[1])
    tids, tmask = torch.tensor(ids), t(mask)

    def seq_logprob(model):
        logp = F.log_softmax(model(tids).logits[:, :-1], dim=-1)  # (2N, T-1, V)
        lp = logp.gather(-1, tids[:, 1:, None])[..., 0]  # (2N, T-1)
        return (lp * tmask).sum(-1)  # (2N,)

    s = seq_logprob(tpolicy)
    with torch.no_grad():
        s_ref = seq_logprob(tref)
    z = beta * ((s[:3] - s_ref[:3]) - (s[3:] - s_ref[3:]))
    tloss = -F.logsigmoid(z).mean()
    tloss.backward()
    assert_close(loss, tloss, "DPO loss")
    tgrads = _grads(tpolicy)
    assert set(tgrads) == {n for n, _, _ in policy.named_parameters()}
    for name, _, g in policy.named_parameters():
        assert_close(g, tgrads[name], "d" + name)


def test_bradley_terry_loss_through_the_reward_model_matches_torch(dirs):
    gpt = npf.load_pretrained_gpt2(dirs[0], dtype="float64")
    rm = npf.RewardModel.from_gpt(gpt, seed=3)
    rm.eval()  # as loaded: no dropout (there is none: dropout 0)
    ids, _, last = _batch(4)
    rm.zero_grad()
    r = rm.forward(ids, last)
    loss, dw, dl = npf.bradley_terry_loss(r[:3], r[3:])
    rm.backward(np.concatenate([dw, dl]))

    trunk = _torch(dirs[0], transformers.GPT2Model)
    head = torch.nn.Linear(D, 1).double()
    with torch.no_grad():
        head.weight.copy_(t(rm.score.W.T))
        head.bias.copy_(t(rm.score.b))
    hidden = trunk(torch.tensor(ids)).last_hidden_state  # (2N, T, d), after ln_f
    tr = head(hidden[torch.arange(6), torch.tensor(last)])[:, 0]  # (2N,)
    tloss = -F.logsigmoid(tr[:3] - tr[3:]).mean()
    tloss.backward()
    assert_close(r, tr, "rewards")
    assert_close(loss, tloss, "Bradley-Terry loss")
    tgrads = _grads(trunk)  # GPT2Model's names lack "transformer.": the same mapping
    tgrads.update({"score.W": head.weight.grad.T, "score.b": head.bias.grad})
    assert set(tgrads) == {n for n, _, _ in rm.named_parameters()}
    for name, _, g in rm.named_parameters():
        assert_close(g, tgrads[name], "d" + name)
