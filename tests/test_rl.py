"""Specification of the policy-gradient objectives, the grouped sampler and the GRPO stage
trainer (book/rl.md).

The exact checks enumerate all 27 responses of a GPT with a vocabulary of 3 that writes 3
tokens, in float64: expectations are finite sums, not samples.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

import npformer as npf
from npformer.gradcheck import numerical_gradient, relative_error
from npformer.rl import k3
from npformer.sft import TokenLogProbs
from npformer.softmax import log_softmax

# --- the losses, on log-probs directly -------------------------------------------------


def _rollout_arrays(seed=0, B=6, T=5):
    rng = np.random.default_rng(seed)
    lp = np.log(rng.uniform(0.1, 0.9, (B, T)))
    old_lp, ref_lp = lp + rng.normal(0, 0.3, (B, T)), lp + rng.normal(0, 0.3, (B, T))
    mask = (rng.random((B, T)) > 0.3).astype(float)
    return lp, old_lp, ref_lp, mask, rng.normal(size=B)


@pytest.mark.parametrize("length_norm", [False, True])
def test_grpo_loss_derivative_by_finite_differences(length_norm):
    lp, old_lp, ref_lp, mask, adv = _rollout_arrays()
    r = np.exp(lp - old_lp)[mask > 0]
    assert np.any(r > 1.2) and np.any(r < 0.8)  # both clips are exercised
    _, dlp = npf.grpo_loss(lp, old_lp, ref_lp, mask, adv, length_norm=length_norm)
    num = numerical_gradient(
        lambda: npf.grpo_loss(lp, old_lp, ref_lp, mask, adv, length_norm=length_norm)[0], lp)
    assert relative_error(dlp, num) < 1e-8
    assert np.all(dlp[mask == 0] == 0)


def test_reinforce_loss_derivative_and_value():
    lp, _, _, mask, adv = _rollout_arrays(1)
    loss, dlp = npf.reinforce_loss(lp, mask, adv)
    np.testing.assert_allclose(loss, -np.mean(adv * (mask * lp).sum(1)), rtol=1e-14)
    num = numerical_gradient(lambda: npf.reinforce_loss(lp, mask, adv)[0], lp)
    assert relative_error(dlp, num) < 1e-8


def test_grpo_at_theta_old_is_reinforce_exactly():
    lp, _, _, mask, adv = _rollout_arrays(2)
    _, d_grpo = npf.grpo_loss(lp, lp.copy(), None, mask, adv, beta=0.0)
    _, d_rf = npf.reinforce_loss(lp, mask, adv)
    np.testing.assert_array_equal(d_grpo, d_rf)
    _, d_kl = npf.grpo_loss(lp, lp.copy(), lp.copy(), mask, adv, beta=0.5)  # at the reference
    np.testing.assert_array_equal(d_kl, d_rf)


def test_clipped_tokens_get_no_gradient():
    lp = np.zeros((2, 1))
    old = np.array([[-0.5], [0.5]])  # ratios e^0.5 > 1.2 and e^-0.5 < 0.8
    mask = np.ones((2, 1))
    _, d_pos = npf.grpo_loss(lp, old, None, mask, np.array([1.0, -1.0]), beta=0.0)
    np.testing.assert_array_equal(d_pos, 0.0)  # clipped: no further push
    _, d_neg = npf.grpo_loss(lp, old, None, mask, np.array([-1.0, 1.0]), beta=0.0)
    np.testing.assert_allclose(d_neg[:, 0], [np.exp(0.5) / 2, -np.exp(-0.5) / 2], rtol=1e-15)


def test_group_advantages():
    r = np.array([1.0, 0, 1, 1, 0.1, 0.1, 0.1, 0.1])
    A = npf.group_advantages(r, 4)
    np.testing.assert_array_equal(A[4:], 0.0)  # equal rewards: exactly zero
    np.testing.assert_allclose(A[:4], (r[:4] - 0.75) / (np.std(r[:4]) + 1e-6), rtol=1e-15)
    np.testing.assert_allclose(npf.group_advantages(r, 4, scale=False)[:4], r[:4] - 0.75)
    with pytest.raises(ValueError, match="^rewards: expected a length that is a multiple"):
        npf.group_advantages(r, 3)


def test_k3_is_non_negative_and_zero_at_the_reference():
    lp, _, ref_lp, _, _ = _rollout_arrays(3)
    assert np.all(k3(lp, ref_lp) >= 0)
    np.testing.assert_array_equal(k3(lp, lp), 0.0)


def test_bad_inputs():
    lp, old_lp, ref_lp, mask, adv = _rollout_arrays()
    with pytest.raises(ValueError, match=r"^mask: expected shape \(6, 5\)"):
        npf.grpo_loss(lp, old_lp, ref_lp, mask[:, :4], adv)
    with pytest.raises(ValueError, match=r"^advantages: expected shape \(6,\)"):
        npf.reinforce_loss(lp, mask, adv[:5])
    with pytest.raises(ValueError, match="^clip: expected"):
        npf.grpo_loss(lp, old_lp, ref_lp, mask, adv, clip=0)
    with pytest.raises(ValueError, match="^ref_lp: expected"):
        npf.grpo_loss(lp, old_lp, None, mask, adv, beta=0.1)


# --- exact checks on an enumerable policy -----------------------------------------------

TINY = npf.GPTConfig(vocab_size=3, block_size=4, n_layer=1, n_head=2, d_model=8,
                     dtype="float64")
OUTPUTS = np.array(list(itertools.product(range(3), repeat=3)))  # (27, 3)
IDS = np.concatenate([np.zeros((27, 1), dtype=int), OUTPUTS], axis=1)  # (27, 4)
REWARD = (OUTPUTS == 2).sum(axis=1) + 0.5 * (OUTPUTS[:, 0] == OUTPUTS[:, 2])
ONES = np.ones((27, 3))


def _tiny(seed=0):
    model = npf.GPT(TINY, seed=seed)
    for _, p, _ in model.named_parameters():
        p += np.random.default_rng(seed + 1).standard_normal(p.shape) * 0.5
    return model


def _gradient(model, ids, dlp_of):
    tlp = TokenLogProbs(model)
    model.zero_grad()
    lp = tlp.forward(ids)
    tlp.backward(dlp_of(lp))
    return np.concatenate([g.ravel() for _, _, g in model.named_parameters()])


def _estimates(model, advantage):
    """Row o: the gradient of reinforce_loss on the single response o."""
    rows = []
    for o in range(27):
        def dlp_of(lp, o=o):
            dlp = np.zeros_like(lp)
            dlp[o] = npf.reinforce_loss(lp[o:o + 1], ONES[o:o + 1], advantage[o:o + 1])[1][0]
            return dlp
        rows.append(_gradient(model, IDS, dlp_of))
    return np.array(rows)


@pytest.fixture(scope="module")
def tiny():
    model = _tiny()
    pi = np.exp(TokenLogProbs(model).forward(IDS).sum(axis=1))
    exact = -_gradient(model, IDS, lambda lp: (np.exp(lp.sum(1)) * REWARD)[:, None] * ONES)
    return model, pi, exact


def test_the_policy_is_a_distribution_over_27_responses(tiny):
    _, pi, _ = tiny
    assert abs(pi.sum() - 1) < 1e-14 and pi.min() > 1e-4 and pi.max() < 0.5


def test_exact_gradient_of_the_expected_reward_by_finite_differences(tiny):
    model, _, exact = tiny

    def expected_reward():
        return np.exp(TokenLogProbs(model).forward(IDS).sum(axis=1)) @ REWARD

    fd = np.concatenate([numerical_gradient(expected_reward, p).ravel()
                         for _, p, _ in model.named_parameters()])
    assert relative_error(-exact, fd) < 1e-8


@pytest.mark.parametrize("baseline", ["none", "mean"])
def test_mean_of_the_estimator_is_the_exact_gradient(tiny, baseline):
    model, pi, exact = tiny
    nu = 0.0 if baseline == "none" else pi @ REWARD
    mean = pi @ _estimates(model, REWARD - nu)
    assert relative_error(mean, exact) < 1e-12


def test_a_baseline_lowers_the_variance(tiny):
    model, pi, _ = tiny
    var = {}
    for nu in (0.0, pi @ REWARD):
        est = _estimates(model, REWARD - nu)
        var[nu] = pi @ ((est - pi @ est) ** 2).sum(axis=1)
    assert var[pi @ REWARD] < 0.6 * var[0.0]


def test_group_mean_baseline_shrinks_the_gradient_by_one_minus_one_over_g(tiny):
    """G = 2, mean baseline without scaling: E[update] = (1 - 1/G) grad J, over 27^2 groups."""
    model, pi, exact = tiny
    scores = _estimates(model, np.ones(27))  # -grad log pi(o)
    mean = 0.0
    for a, b in itertools.product(range(27), repeat=2):
        adv = npf.group_advantages(REWARD[[a, b]], 2, scale=False)
        mean = mean + pi[a] * pi[b] * (adv[0] * scores[a] + adv[1] * scores[b]) / 2
    assert relative_error(mean, 0.5 * exact) < 1e-12


def test_k3_summed_over_tokens_is_the_exact_kl(tiny):
    model, pi, _ = tiny
    lp = TokenLogProbs(model).forward(IDS)
    ref_lp = TokenLogProbs(_tiny(3)).forward(IDS)
    kl = pi @ (lp.sum(1) - ref_lp.sum(1))
    assert kl > 0.1 and abs(pi @ k3(lp, ref_lp).sum(1) - kl) < 1e-12


def test_grpo_gradient_at_theta_old_and_equal_rewards(tiny):
    model, _, _ = tiny
    group, rewards = IDS[[4, 13, 13, 20, 22, 26]], REWARD[[4, 13, 13, 20, 22, 26]]
    chi = np.ones((6, 3))
    lp = TokenLogProbs(model).forward(group)
    adv = npf.group_advantages(rewards, 6)
    g_grpo = _gradient(model, group, lambda x: npf.grpo_loss(x, lp, lp, chi, adv)[1])
    g_rf = _gradient(model, group, lambda x: npf.reinforce_loss(x, chi, adv)[1])
    np.testing.assert_array_equal(g_grpo, g_rf)
    assert np.abs(g_rf).max() > 1e-3
    flat = npf.group_advantages(np.ones(6), 6)
    g0 = _gradient(model, group, lambda x: npf.grpo_loss(x, lp, lp, chi, flat)[1])
    np.testing.assert_array_equal(g0, 0.0)


def test_grpo_loss_through_the_model_by_finite_differences():
    model = _tiny(5)
    group = IDS[[1, 7, 8, 15, 19, 25]]
    chi = np.ones((6, 3))
    chi[0, 2] = chi[3, 1:] = 0
    rng = np.random.default_rng(0)
    lp0 = TokenLogProbs(model).forward(group)
    old_lp, ref_lp = lp0 + rng.normal(0, 0.2, lp0.shape), lp0 + rng.normal(0, 0.2, lp0.shape)
    adv = rng.normal(size=6)

    def loss():
        return npf.grpo_loss(TokenLogProbs(model).forward(group), old_lp, ref_lp, chi, adv)[0]

    g = _gradient(model, group, lambda x: npf.grpo_loss(x, old_lp, ref_lp, chi, adv)[1])
    fd = np.concatenate([numerical_gradient(loss, p).ravel()
                         for _, p, _ in model.named_parameters()])
    assert relative_error(g, fd) < 1e-7


# --- the sampler ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, bound", [("float64", 1e-12), ("float32", 1e-5)])
def test_sampler_log_probs_match_a_full_forward(dtype, bound):
    cfg = npf.GPTConfig(vocab_size=7, block_size=12, n_layer=2, n_head=2, d_model=16,
                        dtype=dtype)
    model = npf.GPT(cfg, seed=0)
    prompts = [np.array([1, 2]), np.array([3, 4, 5]), np.array([2]), np.array([5, 6])]
    ro = npf.sample_groups(model, prompts, 4, 6, stop_id=0, seed=0)
    assert ro.ids.shape[0] == 16 and ro.mask.shape == ro.lp.shape == (16, ro.ids.shape[1] - 1)
    for i, p in enumerate(prompts):  # rows 4i .. 4i+3 continue prompt i
        np.testing.assert_array_equal(ro.ids[4 * i:4 * i + 4, :len(p)], np.tile(p, (4, 1)))
        assert np.all(ro.mask[4 * i:4 * i + 4, :len(p) - 1] == 0)
    full = np.take_along_axis(log_softmax(model.forward(ro.ids[:, :-1]).astype(np.float64)),
                              ro.ids[:, 1:, None], 2)[..., 0]
    assert np.abs((ro.lp - full) * ro.mask).max() < bound
    n = ro.mask.sum(1).astype(int)  # each response: its tokens, the stop last if finished
    for b in range(16):
        resp = ro.ids[b, ro.prompt_len[b]:ro.prompt_len[b] + n[b]]
        assert (resp[-1] == 0) == ro.finished[b] and np.all(resp[:-1] != 0)


def test_sampler_is_reproducible_from_its_seed():
    model = npf.GPT(npf.GPTConfig(vocab_size=5, block_size=8, n_layer=1, n_head=1,
                                  d_model=8), seed=1)
    a = npf.sample_groups(model, [np.array([1, 2])], 8, 4, stop_id=0, seed=3)
    b = npf.sample_groups(model, [np.array([1, 2])], 8, 4, stop_id=0, seed=3)
    np.testing.assert_array_equal(a.ids, b.ids)
    np.testing.assert_array_equal(a.lp, b.lp)


# --- the stage trainer --------------------------------------------------------------------

def _stand_in(tmp_path, dtype="float32"):
    """A small GPT over the template's 16 tokens, saved as a stand-in fine-tuned checkpoint."""
    cfg = npf.GPTConfig(vocab_size=16, block_size=16, n_layer=1, n_head=2, d_model=16,
                        dtype=dtype)
    path = tmp_path / "sft.safetensors"
    npf.save(npf.GPT(cfg, seed=0), path)
    return path


class _FirstDigitEven(npf.GRPOTrainer):
    """A reward a random model earns half the time, so that every group has a signal."""

    def rewards(self, problems, ro):
        first = ro.ids[np.arange(len(ro.ids)), ro.prompt_len]
        return (first % 2 == 0).astype(float)


def _config(**changes):
    return npf.GRPOConfig(**{**dict(steps=4, prompts=3, group_size=4, updates=2,
                                    max_new_tokens=4, lr=1e-2, checkpoint_interval=2),
                             **changes})


def _weights(model):
    return np.concatenate([p.ravel() for _, p, _ in model.named_parameters()])


def test_trainer_updates_and_logs(tmp_path):
    trainer = _FirstDigitEven.start(_stand_in(tmp_path), _config())
    before = _weights(trainer.model).copy()
    records = trainer.fit(log_path=tmp_path / "log.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4] and trainer.step == 4
    assert np.any(_weights(trainer.model) != before)
    np.testing.assert_array_equal(_weights(trainer.reference), before)  # frozen
    assert all(0 <= r["reward"] <= 1 and r["kl"] >= 0 for r in records)
    assert records[0]["kl"] == 0.0  # the first batch is sampled by the reference itself
    assert records[1]["kl"] > 0
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 4


def test_resume_is_bit_exact(tmp_path):
    start = _stand_in(tmp_path)
    straight = _FirstDigitEven.start(start, _config())
    straight_log = straight.fit()
    paused = _FirstDigitEven.start(start, _config())
    paused.fit(until=2, checkpoint_path=tmp_path / "ckpt.safetensors")
    resumed = _FirstDigitEven.resume(tmp_path / "ckpt.safetensors")
    assert resumed.step == 2
    resumed_log = resumed.fit()
    np.testing.assert_array_equal(_weights(resumed.model), _weights(straight.model))
    assert [r["reward"] for r in resumed_log] == [r["reward"] for r in straight_log[2:]]
    assert [r["loss"] for r in resumed_log] == [r["loss"] for r in straight_log[2:]]


def test_a_stop_request_saves_and_the_run_resumes_from_there(tmp_path):
    start, ckpt = _stand_in(tmp_path), tmp_path / "ckpt.safetensors"
    trainer = _FirstDigitEven.start(start, _config(checkpoint_interval=10))
    assert len(trainer.fit(checkpoint_path=ckpt, should_stop=lambda: True)) == 1
    resumed = _FirstDigitEven.resume(ckpt)
    assert resumed.step == 1
    np.testing.assert_array_equal(_weights(resumed.model), _weights(trainer.model))


def test_resume_refuses_another_reference(tmp_path):
    start = _stand_in(tmp_path)
    trainer = _FirstDigitEven.start(start, _config(steps=1))
    trainer.fit(checkpoint_path=tmp_path / "ckpt.safetensors")
    other = tmp_path / "other.safetensors"
    npf.save(npf.GPT(npf.load(start).config, seed=1), other)
    with pytest.raises(ValueError, match="^reference: expected the checkpoint the run"):
        npf.GRPOTrainer.resume(tmp_path / "ckpt.safetensors", reference=other)
    with pytest.raises(ValueError, match="^steps: expected at least 1"):
        npf.GRPOTrainer.resume(tmp_path / "ckpt.safetensors", steps=0)


def test_addition_reward_grades_the_text_before_end(tmp_path):
    trainer = npf.GRPOTrainer.start(_stand_in(tmp_path), _config())
    tok, template = trainer.tok, trainer.template
    problems = [npf.Problem("12+30", "42")]
    prompt = tok.encode(template.prompt("12+30"))
    rows = [tok.encode("42<|end|>"), tok.encode("42"), tok.encode("43<|end|>"),
            tok.encode("42\n<|end|>")]
    T = len(prompt) + 4
    ids = np.full((4, T), template.end_id)
    mask = np.zeros((4, T - 1))
    for b, r in enumerate(rows):
        ids[b, len(prompt):len(prompt) + len(r)] = r
        ids[b, :len(prompt)] = prompt
        mask[b, len(prompt) - 1:len(prompt) - 1 + len(r)] = 1
    finished = np.array([True, False, True, True])
    ro = npf.rl.Rollout(ids, mask, np.zeros_like(mask), finished, np.full(4, len(prompt)))
    trainer.config.group_size = 4
    np.testing.assert_array_equal(trainer.rewards(problems, ro), [1.0, 0.0, 0.0, 0.0])


def test_config_bad_values():
    with pytest.raises(ValueError, match="^group_size: expected a positive integer, got 0"):
        npf.GRPOConfig(group_size=0)
    with pytest.raises(ValueError, match="^clip: expected"):
        npf.GRPOConfig(clip=0.0)


def test_a_grpo_step_on_the_strict_device_equals_the_host(tmp_path):
    """The step's arrays on the strict array (CuPy's rules): the same samples, rewards and
    updates as on the host; the updates read the device twice each (loss, gradient norm)."""
    from npformer.device import to_host
    from npformer.strict import Strict, register

    register()
    path = _stand_in(tmp_path, dtype="float64")
    runs = {}
    for device in ("cpu", "strict"):
        model, ref = npf.load(path).to(device), npf.load(path).to(device)
        trainer = _FirstDigitEven(model, ref, _config(steps=2))
        Strict.reads = 0
        runs[device] = (trainer.fit(), {n: to_host(p) for n, p, _ in
                                        trainer.model.named_parameters()}, Strict.reads)
    (host_log, host_p, _), (dev_log, dev_p, reads) = runs["cpu"], runs["strict"]
    assert [r["reward"] for r in dev_log] == [r["reward"] for r in host_log]
    np.testing.assert_allclose([r["loss"] for r in dev_log], [r["loss"] for r in host_log],
                               rtol=1e-12)
    for name in host_p:
        np.testing.assert_allclose(dev_p[name], host_p[name], rtol=1e-10, atol=1e-11,
                                   err_msg=name)
    # per step: one read per sampled token of each prompt length (3 x 4), two per update
    # (2 x 2), and the log record's copies; 20 measured
    assert 0 < reads <= 2 * 20


# --- the committed run (book/data/addition_rl.py) -----------------------------------------

DATA = Path(__file__).resolve().parents[1] / "book" / "data"


@pytest.fixture(scope="module")
def run_log():
    return json.loads((DATA / "addition_rl.json").read_text())


def test_the_run_starts_as_logged(run_log):
    """The first step from the fine-tuned checkpoint, re-run: the same batch's reward, and its
    loss within a relative 1e-4 (BLAS kernels differ between CPUs)."""
    trainer = npf.GRPOTrainer.start(DATA / "addition_sft.safetensors",
                                    npf.GRPOConfig(**run_log["config"]))
    first = trainer.train_step()
    assert first["reward"] == run_log["steps"][0]["reward"]
    np.testing.assert_allclose(first["loss"], run_log["steps"][0]["loss"], rtol=1e-4)


@pytest.mark.parametrize("which, model", [(0, "addition_sft"), (-1, "addition_rl")])
def test_the_logged_greedy_grades_of_the_first_100_test_sums(run_log, which, model):
    ev = run_log["evals"][which]
    trainer = npf.GRPOTrainer.start(DATA / "addition_sft.safetensors", npf.GRPOConfig())
    template, task = trainer.template, trainer.task
    problems = task.test_set()[:100]
    correct, _ = npf.exact_match(npf.load(DATA / f"{model}.safetensors"), template.tok,
                                 problems, template.grader(task),
                                 render=lambda p: template.prompt(p.prompt),
                                 stop=template.end, max_new_tokens=6)
    logged = np.array([c == "1" for c in ev["greedy"][:100]])
    assert np.mean(correct != logged) <= 0.02  # a near tie may flip on another CPU
