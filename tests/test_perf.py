"""Specification of the FLOP counter and the memory formula (book/performance.md)."""

from __future__ import annotations

import dataclasses
import gc
import tracemalloc

import numpy as np
import pytest

import npformer as npf
from npformer.losses import next_token_loss
from npformer.optim import AdamW, clip_grad_norm
from npformer.perf import MB, Shape, formula_memory, forward_flops, shape_of, train_flops

GPT_CFG = dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=16, d_ff=24)
BERT_CFG = dict(vocab_size=13, block_size=8, n_layer=2, n_head=2, d_model=16, d_ff=24)
ENC_CFG = dict(vocab_size=7, block_size=8, n_layer=3, n_head=4, d_model=16, d_ff=20)


def _matmul(m: int, k: int, n: int) -> int:
    """FLOPs of one (m, k) @ (k, n) product."""
    return 2 * m * k * n


def _hand_forward(*, B, T, L, d, H, ff, V, R, dense):
    """Every matrix product of one forward pass, written out one by one."""
    dh = d // H
    blocks = L * (_matmul(B * T, d, 3 * d)  # fused QKV
                  + _matmul(B * T, d, d)  # output projection
                  + _matmul(B * T, d, ff)  # FFN in
                  + _matmul(B * T, ff, d))  # FFN out
    attention = L * B * H * (_matmul(T, dh, T)  # Q K^T, one head of one sequence
                             + _matmul(T, T, dh))  # P V
    head = _matmul(R, d, V) + (_matmul(R, d, d) if dense else 0)
    return {"blocks": blocks, "head": head, "attention": attention,
            "total": blocks + head + attention}


def test_gpt_counts_equal_a_hand_count_of_every_matmul():
    model = npf.GPT(npf.GPTConfig(**GPT_CFG), seed=0)
    hand = _hand_forward(B=3, T=8, L=2, d=16, H=2, ff=24, V=11, R=3 * 8, dense=False)
    shape = shape_of(model, 3, 8)
    assert forward_flops(shape) == hand
    assert train_flops(shape) == {k: 3 * v for k, v in hand.items()}  # backward = 2 x forward


def test_bert_counts_equal_a_hand_count_with_the_head_on_the_masked_rows():
    model = npf.BERT(npf.BERTConfig(**BERT_CFG), seed=0)
    hand = _hand_forward(B=2, T=6, L=2, d=16, H=2, ff=24, V=13, R=5, dense=True)
    assert forward_flops(shape_of(model, 2, 6, head_rows=5)) == hand
    full = _hand_forward(B=2, T=6, L=2, d=16, H=2, ff=24, V=13, R=12, dense=True)
    assert forward_flops(shape_of(model, 2, 6)) == full  # forward: every position


def test_encoder_counts_equal_a_hand_count_without_a_head():
    model = npf.Encoder(npf.EncoderConfig(**ENC_CFG), seed=0)
    hand = _hand_forward(B=4, T=5, L=3, d=16, H=4, ff=20, V=7, R=0, dense=False)
    assert forward_flops(shape_of(model, 4, 5)) == hand
    assert hand["head"] == 0


@pytest.mark.parametrize("shape", [
    Shape("a", 2, 8, 2, 16, 2, 24, 11, 16, False, 1000, 200),
    Shape("b", 8, 64, 3, 192, 4, 768, 8192, 71, True, 2_966_144, 1_572_864),
    Shape("c", 1, 1, 1, 4, 1, 4, 3, 0, False, 10, 10),
])
def test_forward_flops_is_exactly_a_third_of_train_flops(shape):
    train, forward = train_flops(shape), forward_flops(shape)
    for part in ("blocks", "head", "attention", "total"):
        assert 3 * forward[part] == train[part], part
    assert train["total"] == train["blocks"] + train["head"] + train["attention"]


def test_attention_term_is_quadratic_in_T_and_the_rest_linear():
    s1 = Shape("x", 2, 32, 2, 64, 2, 256, 65, 64, False, 10_000, 5_000)
    s2 = dataclasses.replace(s1, T=64, head_rows=128)
    f1, f2 = train_flops(s1), train_flops(s2)
    assert f2["attention"] == 4 * f1["attention"]
    assert f2["blocks"] == 2 * f1["blocks"] and f2["head"] == 2 * f1["head"]


def test_shape_of_reads_each_model():
    gpt = npf.GPT(npf.GPTConfig(**GPT_CFG), seed=0)
    bert = npf.BERT(npf.BERTConfig(**BERT_CFG), seed=0)
    enc = npf.Encoder(npf.EncoderConfig(**ENC_CFG), seed=0)
    for model, head_dense, head_rows in ((gpt, False, 2 * 8), (bert, True, 2 * 8),
                                         (enc, False, 0)):
        s = shape_of(model, 2, 8)
        c = model.config
        sizes = [p.size for _, p, _ in model.named_parameters()]
        assert (s.B, s.T, s.L, s.d, s.H, s.ff, s.V) == (2, 8, c.n_layer, c.d_model, c.n_head,
                                                        c.d_ff, c.vocab_size)
        assert (s.head_rows, s.head_dense) == (head_rows, head_dense)
        assert (s.n_params, s.largest_param) == (sum(sizes), max(sizes))
        assert s.name == type(model).__name__
    assert shape_of(bert, 2, 8, head_rows=3, name="mlm").head_rows == 3
    assert shape_of(bert, 2, 8, head_rows=3, name="mlm").name == "mlm"
    assert shape_of(enc, 2, 8, head_rows=0).head_rows == 0
    assert shape_of(enc, 2, 8).ff_arrays == 1.25  # ReLU: a bool mask and its output
    assert shape_of(bert, 2, 8).ff_arrays == 4.0  # GELU: input, Phi, phi, output


@pytest.mark.parametrize("call, match", [
    (lambda m: shape_of(m, 0, 4), r"^B: expected a positive integer, got 0"),
    (lambda m: shape_of(m, 2.0, 4), r"^B: expected a positive integer, got 2\.0"),
    (lambda m: shape_of(m, True, 4), r"^B: expected a positive integer, got True"),
    (lambda m: shape_of(m, 2, 0), r"^T: expected a positive integer"),
    (lambda m: shape_of(m, 2, 9), r"^T: expected at most block_size = 8, got 9"),
    (lambda m: shape_of(m, 2, 4, head_rows=-1), r"^head_rows: expected a non-negative"),
    (lambda m: shape_of(m, 2, 4, head_rows=9), r"^head_rows: expected at most B T = 8, got 9"),
    (lambda m: shape_of(m, 2, 4, head_rows=1.5), r"^head_rows: expected a non-negative"),
    (lambda m: shape_of("gpt", 2, 4), r"^model: expected a GPT, BERT or Encoder, got str"),
])
def test_shape_of_rejects_bad_arguments_by_name(call, match):
    model = npf.GPT(npf.GPTConfig(**GPT_CFG), seed=0)
    with pytest.raises(ValueError, match=match):
        call(model)


def test_shape_of_refuses_what_the_counter_cannot_count():
    enc = npf.Encoder(npf.EncoderConfig(**ENC_CFG), seed=0)
    with pytest.raises(ValueError, match=r"^head_rows: expected None or 0 .*got 3"):
        shape_of(enc, 2, 4, head_rows=3)
    swiglu = npf.GPT(npf.GPTConfig(**GPT_CFG, activation="swiglu"), seed=0)
    with pytest.raises(ValueError, match=r"^model: .*'swiglu'"):
        shape_of(swiglu, 2, 4)


GOOD = dict(name="x", B=2, T=8, L=1, d=16, H=2, ff=32, V=11, head_rows=16, head_dense=False,
            n_params=1000, largest_param=200)


@pytest.mark.parametrize("field, value, match", [
    ("name", 3, r"^name: expected a string, got 3"),
    ("B", 0, r"^B: expected a positive integer, got 0"),
    ("d", 15, r"^d: expected a multiple of H = 2, got 15"),
    ("ff", -4, r"^ff: expected a positive integer"),
    ("head_rows", 17, r"^head_rows: expected at most B T = 16, got 17"),
    ("head_rows", -1, r"^head_rows: expected a non-negative integer, got -1"),
    ("head_dense", 1, r"^head_dense: expected a bool, got 1"),
    ("largest_param", 1001, r"^largest_param: expected at most n_params = 1000, got 1001"),
    ("ff_arrays", -1.0, r"^ff_arrays: expected a number in \[0, 100\), got -1.0"),
    ("ff_arrays", True, r"^ff_arrays: expected a number in \[0, 100\), got True"),
])
def test_shape_validates_its_fields(field, value, match):
    with pytest.raises(ValueError, match=match):
        Shape(**{**GOOD, field: value})


@pytest.mark.parametrize("fn", [train_flops, forward_flops, formula_memory])
def test_counters_reject_anything_but_a_shape(fn):
    with pytest.raises(ValueError, match=r"^shape: expected a Shape, got dict"):
        fn(dict(GOOD))


def test_formula_memory_parts():
    s = Shape(**GOOD)
    mem = formula_memory(s)
    assert mem["state_mb"] == pytest.approx(16 * s.n_params / MB)
    assert mem["transient_mb"] == pytest.approx(4 * 2 * s.largest_param / MB)
    N = s.B * s.T
    acts = s.L * (N * (10 * s.d + 4 * s.ff) + 2 * s.B * s.H * s.T**2) + 3 * N * s.d \
        + 3 * s.head_rows * s.V
    assert mem["activations_mb"] == pytest.approx(4 * acts / MB)
    assert mem["total_mb"] == pytest.approx(mem["state_mb"] + mem["activations_mb"]
                                            + mem["transient_mb"])


def test_formula_memory_is_within_the_target_factor_of_the_traced_peak():
    """A fresh GPT, its AdamW and one step, traced as bench/run.py traces it."""
    cfg = npf.GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=2, d_model=64)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 64))
    gc.collect()
    tracemalloc.start()
    try:
        model = npf.GPT(cfg, seed=0, kernels="numpy")  # the formula counts the listings'
        opt = AdamW(model.named_parameters(), lr=1e-3)
        opt.zero_grad()
        _, dlogits = next_token_loss(model.forward(ids), ids)
        model.backward(dlogits)
        clip_grad_norm(model.named_parameters(), 1.0)
        opt.step()
        peak = tracemalloc.get_traced_memory()[1] / MB
    finally:
        tracemalloc.stop()
    formula = formula_memory(shape_of(model, 8, 64))["total_mb"]
    assert 1 / 1.2 < peak / formula < 1.2, (peak, formula)  # the benchmark's target
