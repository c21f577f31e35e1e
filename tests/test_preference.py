"""Specification of the Bradley-Terry reward model and DPO (book/preferences.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import npformer as npf
from npformer.gradcheck import numerical_gradient, relative_error
from npformer.preference import (
    DPOConfig,
    DPOTrainer,
    PreferencePair,
    dpo_stage,
    dpo_token_loss,
    encode_pairs,
    implicit_rewards,
    last_positions,
    sample_pairs,
    sequence_logprob,
)
from npformer.sft import TokenLogProbs

TINY = dict(vocab_size=16, block_size=16, n_layer=1, n_head=2, d_model=8)


def _gpt(seed=0, dtype="float64"):
    return npf.GPT(npf.GPTConfig(**TINY, dtype=dtype), seed=seed)


def _perturb(model, scale=0.05, seed=9):
    rng = np.random.default_rng(seed)
    for _, p, _ in model.named_parameters():
        p += (rng.standard_normal(p.shape) * scale).astype(p.dtype)
    return model


def _template():
    from npformer.preference import addition_template
    return addition_template()


PAIRS = [PreferencePair("12+5", "17", "16"), PreferencePair("7+80", "87", "807"),
         PreferencePair("999+1", "1000", "100"), PreferencePair("3+4", "7", "8")]


# ------------------------------------------------------------------ the losses alone
def test_bradley_terry_loss_and_gradient_match_their_formulas():
    rng = np.random.default_rng(0)
    r_w, r_l = rng.normal(size=5), rng.normal(size=5)
    loss, dw, dl = npf.bradley_terry_loss(r_w, r_l)
    z = r_w - r_l
    assert loss == pytest.approx(np.mean(-np.log(1 / (1 + np.exp(-z)))), rel=1e-14)
    np.testing.assert_allclose(dw, -1 / (1 + np.exp(z)) / 5, rtol=1e-14)
    np.testing.assert_array_equal(dl, -dw)
    # central differences in float64: relative error below 1e-8
    for x, g in ((r_w, dw), (r_l, dl)):
        num = numerical_gradient(lambda: npf.bradley_terry_loss(r_w, r_l)[0], x)
        assert relative_error(g, num) < 1e-8


def test_bradley_terry_depends_only_on_differences_and_does_not_overflow():
    rng = np.random.default_rng(1)
    r_w, r_l = rng.normal(size=4), rng.normal(size=4)
    a, b = npf.bradley_terry_loss(r_w, r_l), npf.bradley_terry_loss(r_w + 3.0, r_l + 3.0)
    assert a[0] == pytest.approx(b[0], rel=1e-15)
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # margins of +-1000
        loss, dw, _ = npf.bradley_terry_loss(np.array([1000.0, -1000.0]), np.zeros(2))
    assert loss == pytest.approx(500.0, rel=1e-15) and dw[1] == pytest.approx(-0.5)


def test_dpo_at_the_reference_is_log_2_with_gradient_minus_and_plus_beta_over_2n():
    """Exact: sigmoid(0) = 1/2 and log(1 + e^0) = log 2 in floating point."""
    rng = np.random.default_rng(2)
    for N, beta in ((1, 0.1), (4, 0.1), (8, 0.5), (2, 1.0)):
        w, lose = rng.normal(-6, 3, size=N), rng.normal(-6, 3, size=N)
        loss, dw, dl = npf.dpo_loss(w, lose, w.copy(), lose.copy(), beta)
        assert loss == np.log(2)
        assert np.all(dw == -beta / (2 * N)) and np.all(dl == beta / (2 * N))


def test_dpo_is_bradley_terry_on_implicit_rewards_and_its_derivative_is_sympys():
    sp = pytest.importorskip("sympy")
    a, b, c, e = sp.symbols("a b c e", real=True)
    beta = sp.Symbol("beta", positive=True)
    z = beta * ((a - c) - (b - e))
    L = sp.log(1 + sp.exp(-z))
    assert sp.simplify(sp.diff(L, a) + beta / (1 + sp.exp(z))) == 0
    assert sp.simplify(sp.diff(L, b) - beta / (1 + sp.exp(z))) == 0
    grads = sp.lambdify((a, b, c, e, beta), [sp.diff(L, v) for v in (a, b)])
    rng = np.random.default_rng(3)
    x = rng.normal(-5, 3, size=(4, 3))  # rows: logp_w, logp_l, ref_w, ref_l
    x = np.vstack([x, rng.normal(-5, 3, size=(1, 3))])
    loss, dw, dl = npf.dpo_loss(x[0], x[1], x[2], x[3], 0.3)
    for i in range(3):
        gw, gl = grads(*x[:4, i], 0.3)
        assert abs(dw[i] - gw / 3) < 1e-16 and abs(dl[i] - gl / 3) < 1e-16
    bt = npf.bradley_terry_loss(0.3 * (x[0] - x[2]), 0.3 * (x[1] - x[3]))
    assert loss == bt[0]


def test_dpo_token_loss_gives_each_response_token_its_sequence_gradient_and_prompts_zero():
    rng = np.random.default_rng(4)
    lp, ref = -rng.random((6, 7)) * 3, -rng.random((6, 7)) * 3
    mask = np.zeros((6, 7))
    mask[:, 3:6] = 1
    mask[2, 5] = 0  # a shorter response
    loss, dlp = dpo_token_loss(lp, ref, mask, 0.2)
    s, s_ref = sequence_logprob(lp, mask), sequence_logprob(ref, mask)
    want, dw, dl = npf.dpo_loss(s[:3], s[3:], s_ref[:3], s_ref[3:], 0.2)
    assert loss == want
    np.testing.assert_array_equal(dlp, np.concatenate([dw, dl])[:, None] * mask)
    assert np.all(dlp[mask == 0] == 0)  # exactly zero on the prompt and the padding


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="r_l: expected shape"):
        npf.bradley_terry_loss(np.zeros(3), np.zeros(2))
    with pytest.raises(ValueError, match="r_w: expected a float array"):
        npf.bradley_terry_loss(np.zeros(3, dtype=int), np.zeros(3, dtype=int))
    with pytest.raises(ValueError, match="beta: expected"):
        npf.dpo_loss(np.zeros(2), np.zeros(2), np.zeros(2), np.zeros(2), 0.0)
    with pytest.raises(ValueError, match="ref_w: expected shape"):
        npf.dpo_loss(np.zeros(2), np.zeros(2), np.zeros(3), np.zeros(2), 0.1)
    with pytest.raises(ValueError, match="lp: expected an even number of rows"):
        dpo_token_loss(np.zeros((3, 4)), np.zeros((3, 4)), np.ones((3, 4)), 0.1)
    with pytest.raises(ValueError, match="mask: expected shape"):
        dpo_token_loss(np.zeros((2, 4)), np.zeros((2, 4)), np.ones((2, 3)), 0.1)
    rm = npf.RewardModel(npf.GPTConfig(**TINY), seed=0)
    with pytest.raises(ValueError, match=r"last: expected integer positions in \[0, 5\)"):
        rm.forward(np.zeros((2, 5), dtype=int), np.array([1, 5]))
    with pytest.raises(ValueError, match="last: expected shape"):
        rm.forward(np.zeros((2, 5), dtype=int), np.array([1]))
    with pytest.raises(ValueError, match="batch_pairs"):
        DPOConfig(batch_pairs=0)


# ------------------------------------------------------------------ the reward model
def test_reward_model_gradients_by_central_differences_in_float64():
    rm = _perturb(npf.RewardModel(npf.GPTConfig(**TINY, dtype="float64"), seed=0), 0.1)
    rng = np.random.default_rng(5)
    ids, last = rng.integers(0, 16, (6, 9)), np.array([8, 5, 6, 7, 3, 4])

    def loss():
        r = rm.forward(ids, last)
        return npf.bradley_terry_loss(r[:3], r[3:])[0]

    rm.zero_grad()
    r = rm.forward(ids, last)
    _, dw, dl = npf.bradley_terry_loss(r[:3], r[3:])
    rm.backward(np.concatenate([dw, dl]))
    for name, p, g in rm.named_parameters():
        num = numerical_gradient(loss, p)
        if name in ("score.b", "ln_f.beta"):  # a constant added to both rewards of a pair
            assert np.abs(g).max() < 1e-15 and np.abs(num).max() < 1e-8, name
        else:
            assert relative_error(g, num) < 1e-6, name


def test_reward_model_reads_only_up_to_its_last_position_and_copies_a_gpt():
    gpt = _gpt(seed=3)
    rm = npf.RewardModel.from_gpt(gpt, seed=1)
    trunk = {n: p for n, p, _ in rm.named_parameters()}
    for name, p, _ in gpt.named_parameters():
        np.testing.assert_array_equal(trunk[name], p)
        assert trunk[name] is not p
    ids = np.random.default_rng(6).integers(0, 16, (2, 10))
    later = ids.copy()
    later[:, 6:] = (later[:, 6:] + 1) % 16  # tokens after the read position change
    last = np.array([5, 5])
    np.testing.assert_array_equal(rm.forward(ids, last), rm.forward(later, last))


def test_reward_model_saves_and_loads(tmp_path):
    rm = npf.RewardModel(npf.GPTConfig(**TINY), seed=2)
    npf.save(rm, tmp_path / "rm.safetensors")
    back = npf.load(tmp_path / "rm.safetensors")
    ids, last = np.random.default_rng(7).integers(0, 16, (3, 6)), np.array([5, 2, 4])
    assert type(back) is npf.RewardModel
    np.testing.assert_array_equal(back.forward(ids, last), rm.forward(ids, last))


# ------------------------------------------------------------------ DPO through a model
def test_dpo_gradients_through_the_policy_by_central_differences_in_float64():
    policy, reference = _perturb(_gpt(0), 0.2), _gpt(1)
    ids, mask = encode_pairs(_template(), PAIRS)
    ref_lp = TokenLogProbs(reference).forward(ids)
    tlp = TokenLogProbs(policy)

    def loss():
        return dpo_token_loss(tlp.forward(ids), ref_lp, mask, 0.5)[0]

    policy.zero_grad()
    _, dlp = dpo_token_loss(tlp.forward(ids), ref_lp, mask, 0.5)
    tlp.backward(dlp)
    for name, p, g in policy.named_parameters():
        assert relative_error(g, numerical_gradient(loss, p)) < 1e-6, name


def test_encoded_pairs_mask_the_response_and_find_its_last_token():
    template = _template()
    ids, mask = encode_pairs(template, PAIRS)
    assert ids.shape[0] == mask.shape[0] == 8 and mask.shape[1] == ids.shape[1] - 1
    last = last_positions(mask)
    for row, (p, response) in enumerate([(p, p.chosen) for p in PAIRS] +
                                        [(p, p.rejected) for p in PAIRS]):
        want, _ = template.render(p.prompt, response)
        np.testing.assert_array_equal(ids[row, :len(want)], want)
        assert ids[row, last[row]] == template.end_id and last[row] == len(want) - 1
        assert mask[row].sum() == len(template.tok.encode(response)) + 1


def test_sample_pairs_keeps_a_correct_and_a_wrong_answer_per_prompt(monkeypatch):
    import npformer.preference as pref

    task, template = npf.Addition(), _template()
    problems = [task.problem(1, 2), task.problem(40, 5), task.problem(9, 9)]
    answers = {"1+2": ["4", "3", "3"], "40+5": ["45", "45", "45"], "9+9": ["18", "<|user|>", "81"]}

    def fake(model, tok, prompts, *, n, stop, **_):
        assert stop == "<|end|>" and n == 3
        return [a + stop for p in prompts for a in answers[p[len("<|user|>"):-len(
            "<|assistant|>")]]]

    monkeypatch.setattr(pref, "complete", fake)
    pairs = sample_pairs(None, template, task, problems, samples=3)
    assert pairs == [PreferencePair("1+2", "3", "4"), PreferencePair("9+9", "18", "81")]


def test_sample_pairs_on_a_real_model_uses_the_verifier():
    task, template = npf.Addition(), _template()
    model = _gpt(0, "float32")
    problems = task.sample(20, seed=0)
    pairs = sample_pairs(model, template, task, problems, samples=4, seed=1)
    by_prompt = {p.prompt: p for p in problems}
    for pair in pairs:
        p = by_prompt[pair.prompt]
        assert pair.chosen == p.answer and not task.grade(p, pair.rejected)
    assert all(not task.is_test(*map(int, p.prompt.split("+"))) for p in problems)


def _trainer(steps=6, **kw):
    policy, reference = _gpt(0, "float32"), _gpt(0, "float32")
    return DPOTrainer(policy, reference, _template(), PAIRS * 3,
                      DPOConfig(steps=steps, batch_pairs=4, eval_interval=2, lr=1e-3,
                                warmup_steps=1, **kw))


def test_dpo_trainer_first_step_is_log_2_and_training_separates_the_pairs():
    trainer = _trainer(steps=30)
    loss, _ = trainer.train_step()
    assert abs(loss - np.log(2)) < 1e-6  # policy = reference (float32 log-probs)
    trainer.fit()
    r = implicit_rewards(trainer, trainer.ids, trainer.mask)
    P = len(trainer.pairs)
    assert (r[:P] > r[P:]).all()


def test_dpo_trainer_resumes_bit_exactly(tmp_path):
    full = _trainer()
    full.fit()
    part = _trainer()
    part.fit(until=3, checkpoint_path=tmp_path / "ckpt.safetensors")
    resumed = DPOTrainer.resume(tmp_path / "ckpt.safetensors", _gpt(0, "float32"),
                                _template(), PAIRS * 3)
    assert resumed.step == 2  # the last checkpoint: step 2 (eval_interval)
    resumed.fit()
    for (name, a, _), (_, b, _) in zip(full.policy.named_parameters(),
                                       resumed.policy.named_parameters()):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_dpo_stage_writes_and_resumes_its_run_folder(tmp_path):
    start = tmp_path / "sft.safetensors"
    npf.save(_gpt(0, "float32"), start)
    pairs = json.dumps([p.__dict__ for p in PAIRS * 2])
    for name in ("run", "whole"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "pairs.json").write_text(pairs)  # else sampled from the model
    config = DPOConfig(steps=4, batch_pairs=4, eval_interval=2, warmup_steps=1)
    first = dpo_stage(start, tmp_path / "run", config, until=2)
    assert first.step == 2 and (tmp_path / "run" / "ckpt.safetensors").exists()
    second = dpo_stage(start, tmp_path / "run")  # resumes: config from the checkpoint
    assert second.step == 4
    assert len((tmp_path / "run" / "log.jsonl").read_text().splitlines()) == 2
    longer = dpo_stage(start, tmp_path / "run", DPOConfig(steps=6, warmup_steps=1))
    assert longer.step == 6 and longer.config.batch_pairs == 4  # the run's own config
    whole = dpo_stage(start, tmp_path / "whole", config)
    for (name, a, _), (_, b, _) in zip(whole.policy.named_parameters(),
                                       second.policy.named_parameters()):
        np.testing.assert_array_equal(a, b, err_msg=name)


# ------------------------------------------------------------------ the strict device
def test_dpo_and_bradley_terry_steps_on_the_strict_device_equal_the_host():
    """The CuPy stand-in of book/gpu.md: the same steps give the same weights, and each
    step reads from the device twice (the loss and the gradient norm)."""
    from npformer.device import to_device, to_host
    from npformer.optim import AdamW, train_step
    from npformer.strict import Strict, register

    register()
    weights, reads = {}, {}
    for device in ("cpu", "strict"):
        trainer = DPOTrainer(_gpt(0).to(device), _gpt(1).to(device), _template(), PAIRS,
                             DPOConfig(steps=2, batch_pairs=4, warmup_steps=0, lr=1e-2))
        Strict.reads = 0
        trainer.fit()
        reads[device] = Strict.reads
        rm = npf.RewardModel.from_gpt(_gpt(2), seed=0).to(device)
        opt = AdamW(rm.named_parameters(), lr=1e-2)
        ids, mask = encode_pairs(_template(), PAIRS)
        ids, last = to_device(ids, device), to_device(last_positions(mask), device)

        def bt(model, rows):
            r = model.forward(ids, last)
            loss, dw, dl = npf.bradley_terry_loss(r[:4], r[4:])
            return loss, np.concatenate([dw, dl])

        train_step(rm, opt, bt, None, max_norm=1.0)
        weights[device] = {n: to_host(p) for n, p, _ in [
            *trainer.policy.named_parameters(), *(("rm." + n, p, g) for n, p, g in
                                                 rm.named_parameters())]}
    assert reads["strict"] <= 2 * 2
    for name, p in weights["cpu"].items():
        np.testing.assert_allclose(weights["strict"][name], p, rtol=1e-10, atol=1e-11,
                                   err_msg=name)


# ------------------------------------------------------------------ the committed run
def test_committed_dpo_run_matches_its_log():
    """book/data/addition_dpo.py's log against its weights: greedy exact match of the
    fine-tuned and of the DPO model on the first 100 test items, item by item (BLAS
    rounding differs between CPUs, so up to 2 of 100 greedy answers may differ), and the
    pairs' prompts disjoint from each other and from the test set."""
    from pathlib import Path

    from npformer.evaluate import exact_match

    data = Path(__file__).resolve().parents[1] / "book" / "data"
    log = json.loads((data / "addition_dpo.json").read_text())
    assert log["prompt_overlap"] == 0 and log["test_overlap"] == 0
    assert log["task"]["before"]["n"] == log["task"]["after"]["n"] == 1000
    task, template = npf.Addition(), _template()
    test = task.test_set()[:100]
    for name, bits in (("addition_sft", "before_bits"), ("addition_dpo", "after_bits")):
        model = npf.load(data / f"{name}.safetensors")
        correct, _ = exact_match(model, template.tok, test, template.grader(task),
                                 render=lambda p: template.prompt(p.prompt),
                                 stop=template.end)
        logged = np.array([c == "1" for c in log["task"][bits][:100]])
        assert (correct != logged).sum() <= 2, name
