"""The book's committed trained models (book/data/*.safetensors) and their logs.

Each checkpoint is small, loads with ``npf.load`` and is the model its log describes; and a
re-run of the first steps of the script that trained it (bench/gpt_baby.py,
bench/seq2seq_dates.py) gives the training losses of the committed log. The date model's
weights are those its run kept by validation exact match; its test accuracy is checked by
decoding the test pairs, which played no part in that choice. The date chapter's own
1000-step run (seq2seq_dates_1000.*, the same script) is the start of the full run, and
its weights after step 1000 decode the validation pairs as its log says.

A log is bit-exact only on the machine that wrote it: BLAS kernels, and so the rounding of
float32 matrix products, differ between CPUs, and AdamW amplifies a last-bit difference a
little at every step. The first ``FIRST_STEPS`` losses (about 4.6 and 3.2 nats at the
start) are therefore compared within ``FIRST_STEPS_ATOL``; on the machine that wrote the
logs they agree bit for bit.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import npformer as npf

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "book" / "data"
FIRST_STEPS = 10
FIRST_STEPS_ATOL = 1e-3  # nats: float32 losses after 10 optimiser steps, any x86-64 CPU
MAX_BYTES = 5_000_000


def _bench(name: str):
    """A script of bench/ as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _log(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


# --- the baby GPT of book/gpt.md -------------------------------------------------------

def test_gpt_baby_checkpoint_is_small_and_is_the_logged_model():
    path, log = DATA / "gpt_baby.safetensors", _log("gpt_baby")
    assert path.stat().st_size < MAX_BYTES
    ckpt = npf.load_checkpoint(path)
    assert isinstance(ckpt.model, npf.GPT)
    assert ckpt.step == log["optim"]["steps"]
    cfg = ckpt.model.config
    assert {k: getattr(cfg, k) for k in log["config"]} == log["config"]
    assert len(ckpt.extra["chars"]) == cfg.vocab_size == log["corpus"]["vocab"]
    assert type(npf.load(path)) is npf.GPT  # the short form the book uses


def test_gpt_baby_checkpoint_gives_the_logged_final_losses():
    """The loaded weights, on the run's fixed evaluation batches, give its last losses."""
    gb, log = _bench("gpt_baby"), _log("gpt_baby")
    _, train_data, val_data = gb.split_data()
    fixed = gb.fixed_batches(train_data, val_data)
    model = npf.load(DATA / "gpt_baby.safetensors")
    last = log["evals"][-1]
    for split in ("train", "val"):
        assert gb.estimate_loss(model, fixed[split]) == pytest.approx(last[split], abs=1e-4)


def test_gpt_baby_first_steps_match_the_log():
    log = _log("gpt_baby")
    losses = _bench("gpt_baby").first_losses(FIRST_STEPS, log["optim"]["steps"])
    np.testing.assert_allclose(losses, log["train_loss"][:FIRST_STEPS], rtol=0,
                               atol=FIRST_STEPS_ATOL)


# --- the date model of book/seq2seq.md -------------------------------------------------

def test_date_checkpoint_is_small_and_is_the_logged_model():
    path, log = DATA / "seq2seq_dates.safetensors", _log("seq2seq_dates")
    assert path.stat().st_size < MAX_BYTES
    model = npf.load(path)
    assert isinstance(model, npf.Transformer)
    assert {k: getattr(model.config, k) for k in log["config"]} == log["config"]


def test_date_checkpoint_translates_the_test_pairs_as_logged():
    """Greedy decoding of the 10,000 test pairs by the kept weights gives the logged exact
    match, at least 99%; the validation pairs that chose them are not among the test pairs."""
    from npformer.seq2seq import date_vocabs, held_out_split, translate

    log = _log("seq2seq_dates")
    model = npf.load(DATA / "seq2seq_dates.safetensors").eval()
    src_vocab, tgt_vocab = date_vocabs()
    (val_texts, _), (texts, labels) = held_out_split()
    assert len(texts) == log["data"]["test_pairs"] == 10_000
    assert not set(val_texts) & set(texts)
    outs = []
    for i in range(0, len(texts), 500):
        outs += translate(model, texts[i:i + 500], src_vocab, tgt_vocab)
    exact = float(np.mean([o == y for o, y in zip(outs, labels)]))
    assert exact >= 0.99
    assert exact == pytest.approx(log["final"]["test"]["greedy_exact_match"], abs=1e-3)


def test_date_checkpoint_is_the_first_best_validation_evaluation():
    log = _log("seq2seq_dates")
    scores = [e["validation_exact_match"] for e in log["evals"]]
    first_best = log["evals"][int(np.argmax(scores))]
    assert log["selected"]["step"] == first_best["step"]
    assert log["selected"]["validation_exact_match"] == max(scores)
    assert npf.load_checkpoint(DATA / "seq2seq_dates.safetensors").step == first_best["step"]


@pytest.mark.parametrize("name", ["seq2seq_dates", "seq2seq_dates_1000"])
def test_date_model_first_steps_match_the_log(name):
    log = _log(name)
    losses = _bench("seq2seq_dates").first_losses(FIRST_STEPS)
    np.testing.assert_allclose(losses, log["train_loss"][:FIRST_STEPS], rtol=0,
                               atol=FIRST_STEPS_ATOL)


def test_date_1000_step_run_is_the_start_of_the_full_run():
    """The chapter's 1000 steps: the full run's setup, evaluated every 250 steps; the weights
    kept are those after step 1000 (its best evaluation), and the losses follow the full
    run's within the drift of float32 rounding between machines."""
    short, full = _log("seq2seq_dates_1000"), _log("seq2seq_dates")
    assert short["config"] == full["config"] and short["data"] == full["data"]
    assert {k: v for k, v in short["optim"].items() if k != "steps"} == \
        {k: v for k, v in full["optim"].items() if k != "steps"}
    assert short["optim"]["steps"] == len(short["train_loss"]) == 1000
    assert [e["step"] for e in short["evals"]] == [250, 500, 750, 1000]
    assert short["selected"]["step"] == 1000
    assert npf.load_checkpoint(DATA / "seq2seq_dates_1000.safetensors").step == 1000
    np.testing.assert_allclose(short["train_loss"], full["train_loss"][:1000], atol=0.2)
    both = {e["step"]: e["validation_exact_match"] for e in full["evals"]}
    for e in short["evals"]:  # the two runs' evaluations at the steps they share
        if e["step"] in both:
            assert e["validation_exact_match"] == pytest.approx(both[e["step"]], abs=0.05)


def test_date_1000_step_weights_decode_the_validation_pairs_as_logged():
    from npformer.seq2seq import date_vocabs, held_out_split, translate

    log = _log("seq2seq_dates_1000")
    path = DATA / "seq2seq_dates_1000.safetensors"
    assert path.stat().st_size < MAX_BYTES
    model = npf.load(path).eval()
    assert {k: getattr(model.config, k) for k in log["config"]} == log["config"]
    src_vocab, tgt_vocab = date_vocabs()
    (texts, labels), _ = held_out_split()
    outs = []
    for i in range(0, len(texts), 500):
        outs += translate(model, texts[i:i + 500], src_vocab, tgt_vocab)
    exact = float(np.mean([o == y for o, y in zip(outs, labels)]))
    assert exact == pytest.approx(log["evals"][-1]["validation_exact_match"], abs=1e-3)
