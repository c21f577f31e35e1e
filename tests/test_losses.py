"""MSE, masked-LM cross-entropy and next-token loss (book/losses.md), read as specifications."""

from __future__ import annotations

import numpy as np
import pytest

from npformer.gradcheck import gradcheck
from npformer.losses import (
    masked_lm_loss,
    masked_lm_loss_backward,
    mse_loss,
    mse_loss_backward,
    next_token_loss,
    next_token_loss_backward,
)
from npformer.proofs import prove_masked_lm_grad, prove_mse_grad, prove_next_token_grad
from npformer.softmax import cross_entropy, log_softmax, softmax

TOL = 1e-7  # the book's finite-difference bound, float64
EXACT = 1e-12  # for identities that hold up to float64 rounding


@pytest.fixture
def rng():
    return np.random.default_rng(2024)


def _nll(logits, targets):
    """-log softmax(logits)[target] at every position, computed independently."""
    return -np.take_along_axis(log_softmax(logits), targets[..., None], axis=-1)[..., 0]


def _as_gradcheck_fn(loss_fn, *args, **kwargs):
    def fn(x):
        loss, dx = loss_fn(x, *args, **kwargs)
        return loss, [dx]
    return fn


# --------------------------------------------------------------------------- symbolic


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_mse_gradient_and_library_code_proved_in_sympy(n):
    assert prove_mse_grad(n) is True


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_masked_lm_gradient_and_library_code_proved_in_sympy(n):
    assert prove_masked_lm_grad(n) is True


@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("ignore_index", [None, 0])
def test_next_token_gradient_and_library_code_proved_in_sympy(n, ignore_index):
    assert prove_next_token_grad(n, ignore_index) is True


def test_the_mse_proof_rejects_a_gradient_divided_by_batch_only(monkeypatch):
    import npformer.proofs.losses as proofs

    monkeypatch.setattr(proofs, "mse_loss_backward",
                        lambda pred, target: 2 * (pred - target) / pred.shape[0])
    with pytest.raises(AssertionError, match="residual is not zero"):
        prove_mse_grad(2)


def test_the_masked_lm_proof_rejects_a_mean_over_all_positions(monkeypatch):
    import npformer.proofs.losses as proofs

    def over_all_positions(p, targets, *, ignore_index=-100, mask=None):
        n_valid = np.count_nonzero((targets != ignore_index) & mask)
        return masked_lm_loss_backward(p, targets, ignore_index=ignore_index, mask=mask) \
            * n_valid / targets.size

    monkeypatch.setattr(proofs, "masked_lm_loss_backward", over_all_positions)
    with pytest.raises(AssertionError, match="residual is not zero"):
        prove_masked_lm_grad(2)


# --------------------------------------------------------------------------- MSE


def test_mse_loss_is_the_mean_over_all_BTd_elements(rng):
    pred, target = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    loss, _ = mse_loss(pred, target)
    assert loss == pytest.approx(np.sum((pred - target) ** 2) / (2 * 3 * 4), rel=EXACT)


def test_mse_gradient_is_2_diff_over_BTd_not_over_B(rng):
    pred, target = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    _, dpred = mse_loss(pred, target)
    np.testing.assert_allclose(dpred, 2 * (pred - target) / 24, rtol=EXACT, atol=0)
    np.testing.assert_allclose(mse_loss_backward(pred, target), dpred, rtol=0, atol=0)


def test_mse_of_a_constant_error_c_is_c_squared_for_every_shape():
    for shape in [(1, 1, 1), (2, 3, 4), (4, 7, 16)]:
        loss, _ = mse_loss(np.full(shape, 0.5), np.zeros(shape))
        assert loss == pytest.approx(0.25, rel=EXACT)


def test_mse_gradient_passes_finite_differences(rng):
    target = rng.standard_normal((2, 3, 4))
    err = gradcheck(_as_gradcheck_fn(mse_loss, target), [rng.standard_normal((2, 3, 4))])
    assert err["input0"] < TOL


def test_mse_float32_in_float32_gradient_out(rng):
    pred = rng.standard_normal((2, 3, 4)).astype(np.float32)
    target = rng.standard_normal((2, 3, 4)).astype(np.float32)
    loss, dpred = mse_loss(pred, target)
    assert dpred.dtype == np.float32 and isinstance(loss, float)
    ref, dref = mse_loss(pred.astype(np.float64), target.astype(np.float64))
    assert loss == pytest.approx(ref, rel=1e-6)
    np.testing.assert_allclose(dpred, dref, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("pred, target, match", [
    ([[1.0]], np.ones((1, 1)), r"pred: expected a numpy array, got list"),
    (np.ones((2, 3), dtype=int), np.ones((2, 3)), r"pred: expected one of .*float32.*got int64"),
    (np.ones((2, 3)), np.ones((2, 3), dtype=np.float32),
     r"target: expected dtype float64 \(the dtype of pred\), got float32"),
    (np.ones((2, 3, 4)), np.ones((2, 3, 5)),
     r"target: expected shape \(2, 3, 4\) \(the shape of pred\), got \(2, 3, 5\)"),
    (np.ones((0, 3)), np.ones((0, 3)), r"pred: expected a non-empty array, got shape \(0, 3\)"),
])
def test_mse_rejects_bad_input_naming_argument_expectation_and_value(pred, target, match):
    with pytest.raises(ValueError, match=match):
        mse_loss(pred, target)


# --------------------------------------------------------------------------- masked LM


@pytest.fixture
def mlm(rng):
    B, T, V = 2, 5, 7
    logits = rng.standard_normal((B, T, V)) * 2  # (B, T, V)
    tokens = rng.integers(0, V, size=(B, T))
    chosen = np.array([[True, False, False, True, False], [False, True, False, False, True]])
    return logits, tokens, chosen


def test_masked_lm_loss_is_the_mean_over_predicted_tokens_only(mlm):
    logits, tokens, chosen = mlm
    loss, _ = masked_lm_loss(logits, np.where(chosen, tokens, -100))
    assert loss == pytest.approx(_nll(logits, tokens)[chosen].mean(), rel=EXACT)


def test_masked_lm_gradient_is_mask_times_p_minus_onehot_over_n_masked(mlm):
    logits, tokens, chosen = mlm
    _, dlogits = masked_lm_loss(logits, np.where(chosen, tokens, -100))
    onehot = np.arange(logits.shape[-1]) == tokens[..., None]
    expected = chosen[..., None] * (softmax(logits) - onehot) / chosen.sum()
    np.testing.assert_allclose(dlogits, expected, rtol=EXACT, atol=EXACT)


def test_unpredicted_positions_get_exactly_zero_gradient(mlm):
    logits, tokens, chosen = mlm
    for _, dlogits in (masked_lm_loss(logits, np.where(chosen, tokens, -100)),
                       masked_lm_loss(logits, tokens, mask=chosen)):
        assert not dlogits[~chosen].any()
        assert np.all(np.abs(dlogits[chosen]).sum(axis=-1) > 0)


def test_logits_at_ignored_positions_do_not_change_the_loss(mlm):
    logits, tokens, chosen = mlm
    labels = np.where(chosen, tokens, -100)
    changed = logits.copy()
    changed[~chosen] += 100.0
    assert masked_lm_loss(changed, labels)[0] == masked_lm_loss(logits, labels)[0]


def test_mask_and_ignore_index_give_the_same_loss_and_combine_with_and(mlm):
    logits, tokens, chosen = mlm
    by_labels = masked_lm_loss(logits, np.where(chosen, tokens, -100))
    by_mask = masked_lm_loss(logits, tokens, mask=chosen)
    by_int_mask = masked_lm_loss(logits, tokens, mask=chosen.astype(int))
    for loss, dlogits in (by_mask, by_int_mask):
        assert loss == pytest.approx(by_labels[0], rel=EXACT)
        np.testing.assert_allclose(dlogits, by_labels[1], rtol=0, atol=EXACT)
    mask = chosen.copy()
    mask[0, 0] = False  # one more position off, through the mask
    both = masked_lm_loss(logits, np.where(chosen, tokens, -100), mask=mask)
    assert both[0] == pytest.approx(_nll(logits, tokens)[chosen & mask].mean(), rel=EXACT)


def test_masked_lm_honours_a_custom_ignore_index(mlm):
    logits, tokens, chosen = mlm
    loss, _ = masked_lm_loss(logits, np.where(chosen, tokens, -1), ignore_index=-1)
    assert loss == pytest.approx(_nll(logits, tokens)[chosen].mean(), rel=EXACT)


def test_masked_lm_loss_of_uniform_logits_is_log_V():
    for V in (2, 65, 8192):
        targets = np.array([[0, V - 1, -100]])
        loss, _ = masked_lm_loss(np.zeros((1, 3, V)), targets)
        assert loss == pytest.approx(np.log(V), rel=EXACT)


def test_masked_lm_backward_from_p_equals_the_returned_gradient(mlm):
    logits, tokens, chosen = mlm
    labels = np.where(chosen, tokens, -100)
    mask = np.ones_like(chosen)
    mask[1, 1] = False
    _, dlogits = masked_lm_loss(logits, labels, mask=mask)
    np.testing.assert_allclose(masked_lm_loss_backward(softmax(logits), labels, mask=mask),
                               dlogits, rtol=EXACT, atol=EXACT)


@pytest.mark.parametrize("case", ["ignore_index", "mask", "both", "custom_ignore_index"])
def test_masked_lm_gradient_passes_finite_differences(mlm, case):
    logits, tokens, chosen = mlm
    mask = chosen.copy()
    mask[0, 0] = False
    kwargs = {
        "ignore_index": dict(targets=np.where(chosen, tokens, -100)),
        "mask": dict(targets=tokens, mask=chosen),
        "both": dict(targets=np.where(chosen, tokens, -100), mask=mask),
        "custom_ignore_index": dict(targets=np.where(chosen, tokens, 3), ignore_index=3),
    }[case]
    targets = kwargs.pop("targets")
    err = gradcheck(_as_gradcheck_fn(masked_lm_loss, targets, **kwargs), [logits])
    assert err["input0"] < TOL


def test_masked_lm_float32_in_float32_gradient_out(mlm):
    logits, tokens, chosen = mlm
    loss, dlogits = masked_lm_loss(logits.astype(np.float32), np.where(chosen, tokens, -100))
    assert dlogits.dtype == np.float32 and isinstance(loss, float)
    ref, dref = masked_lm_loss(logits, np.where(chosen, tokens, -100))
    assert loss == pytest.approx(ref, rel=1e-5)
    np.testing.assert_allclose(dlogits, dref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("logits, targets, kwargs, match", [
    (np.zeros((2, 5)), np.zeros(2, dtype=int), {},
     r"logits: expected a 3-D array \(B, T, V\) with V >= 1, got shape \(2, 5\)"),
    (np.zeros((2, 3, 5), dtype=int), np.zeros((2, 3), dtype=int), {},
     r"logits: expected one of .*float32.*got int64"),
    (np.zeros((2, 3, 5)).tolist(), np.zeros((2, 3), dtype=int), {},
     r"logits: expected a numpy array, got list"),
    (np.zeros((2, 3, 5)), np.zeros((3, 2), dtype=int), {},
     r"targets: expected shape \(2, 3\) \(the leading axes of logits \(2, 3, 5\)\), got \(3, 2\)"),
    (np.zeros((2, 3, 5)), np.zeros((2, 3)), {},
     r"targets: expected an integer array, got dtype float64"),
    (np.zeros((2, 3, 5)), np.array([[0, 1, 5], [0, 0, 0]]), {},
     r"targets: expected token ids in \[0, 5\) or ignore_index=-100, got 5"),
    (np.zeros((2, 3, 5)), np.array([[0, -1, 2], [0, 0, 0]]), {},
     r"targets: expected token ids in \[0, 5\) or ignore_index=-100, got -1"),
    (np.zeros((2, 3, 5)), np.full((2, 3), -100), {},
     r"targets: expected at least one target other than ignore_index=-100, got none"),
    (np.zeros((2, 3, 5)), np.zeros((2, 3), dtype=int), {"mask": np.zeros((2, 3), dtype=bool)},
     r"targets: expected at least one target other than ignore_index=-100 where mask is "
     r"true, got none"),
    (np.zeros((2, 3, 5)), np.zeros((2, 3), dtype=int), {"mask": np.ones((3, 2), dtype=bool)},
     r"mask: expected shape \(2, 3\) \(the shape of targets\), got \(3, 2\)"),
    (np.zeros((2, 3, 5)), np.zeros((2, 3), dtype=int), {"mask": np.full((2, 3), 2)},
     r"mask: expected booleans or 0/1 values, got 2"),
    (np.zeros((2, 3, 5)), np.zeros((2, 3), dtype=int), {"mask": np.full((2, 3), "y")},
     r"mask: expected a boolean or 0/1 array, got dtype <U1"),
    (np.zeros((2, 3, 5)), np.zeros((2, 3), dtype=int), {"ignore_index": -100.0},
     r"ignore_index: expected an integer, got -100\.0"),
    (np.zeros((2, 3, 5)), np.zeros((2, 3), dtype=int), {"ignore_index": None},
     r"ignore_index: expected an integer, got None"),
])
def test_masked_lm_rejects_bad_input_naming_argument_expectation_and_value(
        logits, targets, kwargs, match):
    with pytest.raises(ValueError, match=match):
        masked_lm_loss(logits, targets, **kwargs)


# --------------------------------------------------------------------------- next token


@pytest.fixture
def lm(rng):
    B, T, V = 2, 6, 7
    return rng.standard_normal((B, T, V)) * 2, rng.integers(1, V, size=(B, T))


def test_position_t_is_scored_against_ids_t_plus_1(lm):
    logits, ids = lm
    loss, dlogits = next_token_loss(logits, ids)
    ref_loss, ref_grad = cross_entropy(logits[:, :-1], ids[:, 1:])  # the shifted convention
    assert loss == pytest.approx(ref_loss, rel=EXACT)
    assert loss == pytest.approx(_nll(logits[:, :-1], ids[:, 1:]).mean(), rel=EXACT)
    np.testing.assert_allclose(dlogits[:, :-1], ref_grad, rtol=EXACT, atol=EXACT)


def test_the_last_position_has_no_target_and_exactly_zero_gradient(lm):
    logits, ids = lm
    _, dlogits = next_token_loss(logits, ids)
    assert dlogits.shape == logits.shape
    assert not dlogits[:, -1].any()
    changed = logits.copy()
    changed[:, -1] += 50.0
    assert next_token_loss(changed, ids)[0] == next_token_loss(logits, ids)[0]


def test_next_token_mean_is_over_B_times_T_minus_1_targets(lm):
    logits, ids = lm
    B, T, V = logits.shape
    _, dlogits = next_token_loss(np.zeros_like(logits), ids)
    # uniform p: each scored row is (1/V - e_y) / N, whose target entry is (1/V - 1) / N
    target_entries = np.take_along_axis(dlogits[:, :-1], ids[:, 1:, None], axis=-1)
    np.testing.assert_allclose(target_entries, (1 / V - 1) / (B * (T - 1)), rtol=EXACT)


def test_padding_targets_are_ignored_with_ignore_index(lm):
    logits, ids = lm
    PAD = 0
    ids = ids.copy()
    ids[1, 3:] = PAD
    loss, dlogits = next_token_loss(logits, ids, ignore_index=PAD)
    scored = np.zeros(ids.shape, dtype=bool)
    scored[:, :-1] = ids[:, 1:] != PAD
    assert loss == pytest.approx(_nll(logits[:, :-1], ids[:, 1:])[scored[:, :-1]].mean(), rel=EXACT)
    assert not dlogits[~scored].any()
    assert np.all(np.abs(dlogits[scored]).sum(axis=-1) > 0)


def test_next_token_loss_of_uniform_logits_is_log_V():
    for V in (65, 8192):
        ids = np.random.default_rng(V).integers(0, V, size=(2, 4))
        assert next_token_loss(np.zeros((2, 4, V)), ids)[0] == pytest.approx(np.log(V), rel=EXACT)


def test_next_token_backward_from_p_equals_the_returned_gradient(lm):
    logits, ids = lm
    for ignore_index in (None, int(ids[0, 2])):
        _, dlogits = next_token_loss(logits, ids, ignore_index=ignore_index)
        np.testing.assert_allclose(
            next_token_loss_backward(softmax(logits), ids, ignore_index=ignore_index),
            dlogits, rtol=EXACT, atol=EXACT)


@pytest.mark.parametrize("ignore_index", [None, 0])
def test_next_token_gradient_passes_finite_differences(lm, ignore_index):
    logits, ids = lm
    ids = ids.copy()
    ids[1, 4:] = 0  # padding, ignored only when ignore_index=0
    err = gradcheck(_as_gradcheck_fn(next_token_loss, ids, ignore_index=ignore_index), [logits])
    assert err["input0"] < TOL


def test_next_token_float32_in_float32_gradient_out(lm):
    logits, ids = lm
    loss, dlogits = next_token_loss(logits.astype(np.float32), ids)
    assert dlogits.dtype == np.float32 and isinstance(loss, float)
    ref, dref = next_token_loss(logits, ids)
    assert loss == pytest.approx(ref, rel=1e-5)
    np.testing.assert_allclose(dlogits, dref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("logits, ids, kwargs, match", [
    (np.zeros((2, 1, 5)), np.zeros((2, 1), dtype=int), {},
     r"ids: expected shape \(B, T\) with T >= 2 \(position t predicts ids\[:, t\+1\]\), "
     r"got \(2, 1\)"),
    (np.zeros((2, 3, 5)), np.zeros((2, 4), dtype=int), {},
     r"ids: expected shape \(2, 3\) \(the leading axes of logits \(2, 3, 5\)\), got \(2, 4\)"),
    (np.zeros((2, 3, 5)), np.zeros((2, 3), dtype=np.float32), {},
     r"ids: expected an integer array, got dtype float32"),
    (np.zeros((2, 3, 5)), np.array([[0, 1, 7], [0, 0, 0]]), {},
     r"ids: expected token ids in \[0, 5\), got 7"),
    (np.zeros((2, 3, 5)), np.array([[0, 1, -100], [0, 0, 0]]), {"ignore_index": 0},
     r"ids: expected token ids in \[0, 5\) or ignore_index=0, got -100"),
    (np.zeros((2, 3, 5)), np.array([[1, 0, 0], [1, 0, 0]]), {"ignore_index": 0},
     r"ids: expected at least one target ids\[:, 1:\] other than ignore_index=0, got none"),
    (np.zeros((2, 3, 5)), np.zeros((2, 3), dtype=int), {"ignore_index": "pad"},
     r"ignore_index: expected an integer, got 'pad'"),
    (np.zeros((2, 3)), np.zeros((2, 3), dtype=int), {},
     r"logits: expected a 3-D array \(B, T, V\) with V >= 1, got shape \(2, 3\)"),
])
def test_next_token_rejects_bad_input_naming_argument_expectation_and_value(
        logits, ids, kwargs, match):
    with pytest.raises(ValueError, match=match):
        next_token_loss(logits, ids, **kwargs)
