"""A float32 model never makes a float64 array: not in forward, backward, clipping or AdamW.

Two nets catch an upcast. First, every parameter and gradient is replaced by a view of
the same memory whose class, ``Float64Alarm``, records the creation of any float64
array derived from it; NumPy calls ``__array_finalize__`` for every result of a ufunc,
a matmul, a reduction or a view, named or not, so temporaries inside one expression are
seen too. Second, a trace of every npformer frame checks each local variable after every
line and each return value, which catches arrays made from nothing (``np.zeros(shape)``
is float64 by default) that never touch a parameter. (A dropout layer draws its uniform
numbers in float64 on purpose, so that a seed gives the same mask in both precisions; the
draw is compared with p at once and never held, and the mask is built in float32.)
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import numpy as np
import pytest

import npformer as npf
from npformer.losses import mse_loss, next_token_loss
from npformer.models.bert import bert_mask_tokens, mlm_step_loss
from npformer.optim import AdamW, clip_grad_norm


class Float64Alarm(np.ndarray):
    """An ndarray view that logs where any float64 array derived from it was made."""

    log: list[str] = []

    def __array_finalize__(self, obj) -> None:
        # 0-d results are scalars: NumPy's own mean divides a 0-d float32 sum by an integer
        # count in float64 and casts back; only arrays with elements count as upcasts.
        if self.dtype == np.float64 and self.ndim > 0:
            Float64Alarm.log.append("".join(traceback.format_stack(limit=5)[:-1]))


def _modules(m):
    yield m
    for child in m._children.values():
        yield from _modules(child)


def arm(model) -> int:
    """Swap every parameter and gradient for a Float64Alarm view; return how many."""
    n = 0
    for m in _modules(model):
        for name in m._param_names:
            for attr in (name, "d" + name):
                setattr(m, attr, getattr(m, attr).view(Float64Alarm))
                n += 1
    return n


def float64_locals_in_npformer(fn) -> list[str]:
    """Run fn; return 'file:function:variable' for each float64 array an npformer frame held."""
    src = str(Path(npf.__file__).parent)
    found: list[str] = []

    def check(frame, items) -> None:
        for name, v in items:
            if isinstance(v, np.ndarray) and v.dtype == np.float64:
                found.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}:{name}")

    def local_trace(frame, event, arg):
        if event in ("line", "return"):
            check(frame, list(frame.f_locals.items()))
        if event == "return":
            check(frame, [("<return>", arg)])
        return local_trace

    def global_trace(frame, event, arg):
        return local_trace if frame.f_code.co_filename.startswith(src) else None

    sys.settrace(global_trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return sorted(set(found))


def _train_step(model, loss_and_backward, **adamw):
    opt = AdamW(model.named_parameters(), lr=1e-3, **adamw)

    def step() -> None:
        opt.zero_grad()
        loss_and_backward()
        clip_grad_norm(model.named_parameters(), 0.5)  # small: the scaling branch runs
        opt.step()

    return step


def _gpt(dropout):
    model = npf.GPT(npf.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2,
                                  d_model=16, dropout=dropout), seed=0)
    ids = np.random.default_rng(1).integers(0, 11, (2, 8))

    def run() -> None:
        loss, dlogits = next_token_loss(model.forward(ids), ids)
        model.backward(dlogits)

    return model, run


def _bert(dropout):
    cfg = npf.BERTConfig(vocab_size=40, block_size=12, n_layer=2, n_head=2, d_model=16,
                         d_ff=32, dropout=dropout)
    model = npf.BERT(cfg, seed=0)
    rng = np.random.default_rng(1)
    rows = rng.integers(5, cfg.vocab_size, (3, cfg.block_size))
    inputs, targets = bert_mask_tokens(rows, rng, cfg.vocab_size, 4, np.arange(5), p=0.3)
    mask = np.ones(rows.shape, dtype=np.int64)
    mask[-1, -3:] = 0  # padding keys in the last row

    def run() -> None:
        mlm_step_loss(model, inputs, targets, mask)

    return model, run


def _encoder(dropout):
    cfg = npf.EncoderConfig()  # the seed's encoder has no dropout
    model = npf.Encoder(cfg, seed=0)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (4, cfg.block_size))

    def run() -> None:
        loss, dout = mse_loss(model.forward(ids), model.target(ids))
        model.backward(dout)

    return model, run


BUILDERS = {"gpt": _gpt, "bert": _bert, "encoder": _encoder}


@pytest.mark.parametrize("kind,dropout", [("gpt", 0.0), ("gpt", 0.1), ("bert", 0.0),
                                           ("bert", 0.1), ("encoder", 0.0)])  # no dropout
def test_float32_training_step_makes_no_float64_array(kind, dropout):
    model, run = BUILDERS[kind](dropout)
    assert {p.dtype for _, p, _ in model.named_parameters()} == {np.dtype(np.float32)}
    step = _train_step(model, run)
    step()  # AdamW's state and scratch exist from here on
    assert arm(model) > 10
    Float64Alarm.log.clear()
    step()
    assert Float64Alarm.log == [], "float64 arrays derived from parameters:\n" + \
        "\n".join(Float64Alarm.log[:3])
    assert float64_locals_in_npformer(step) == []
    assert all(p.dtype == g.dtype == np.float32 for _, p, g in model.named_parameters())


def test_the_alarm_and_the_tracer_do_fire():
    w = np.ones(3, np.float32).view(Float64Alarm)
    Float64Alarm.log.clear()
    _ = w * np.float64(2.0) + np.zeros(3)  # float64 zeros promote the sum
    assert Float64Alarm.log

    def leaky() -> None:
        npf.softmax(np.zeros(3))  # a float64 input: float64 inside softmax

    assert float64_locals_in_npformer(leaky)
