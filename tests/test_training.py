"""Data, objectives and the training loop (book/training.md).

The loop is model-agnostic; most tests use a tiny bigram model with dropout (an
Embedding, a Dropout and a Linear) so that they run in milliseconds, and the
resume test is repeated on a tiny GPT.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest

import npformer as npf
from npformer.data import (
    encode_ids,
    load_corpus,
    make_tokenizer,
    sample_windows,
    tokenizer_from_spec,
    tokenizer_spec,
    train_val_split,
)
from npformer.models.bert import bert_mask_tokens
from npformer.optim import train_step
from npformer.train import (
    IGNORE,
    NonFiniteError,
    TrainConfig,
    Trainer,
    next_token_objective,
)

TEXT = "the quick brown fox jumps over the lazy dog. " * 40


@dataclass
class TinyConfig:
    vocab_size: int
    block_size: int = 16
    d_model: int = 8
    dropout: float = 0.2
    dtype: str = "float64"


class TinyLM(npf.Module):
    """A bigram model with dropout: ids (B, T) -> logits (B, T, V)."""

    def __init__(self, config: TinyConfig, seed=None):
        super().__init__()
        self.config = config
        r1, r2, r3 = np.random.default_rng(seed).spawn(3)
        self.child("wte", npf.Embedding(config.vocab_size, config.d_model, seed=r1,
                                        dtype=config.dtype))
        self.child("drop", npf.Dropout(config.dropout, seed=r2))
        self.child("head", npf.Linear(config.d_model, config.vocab_size, seed=r3,
                                      dtype=config.dtype))

    def forward(self, ids):
        return self.head(self.drop(self.wte(ids)))  # (B, T, V)

    def backward(self, dlogits):
        self.wte.backward(self.drop.backward(self.head.backward(dlogits)))


npf.register_model("TinyLM", TinyLM, TinyConfig)


@pytest.fixture
def data():
    tok = make_tokenizer(TEXT)
    train_text, val_text = train_val_split(TEXT, 0.2)
    return tok, encode_ids(tok, train_text), encode_ids(tok, val_text)


def tiny_trainer(data, steps=12, **kw):
    tok, train_ids, val_ids = data
    model = TinyLM(TinyConfig(tok.vocab_size), seed=0)
    cfg = TrainConfig(steps=steps, batch_size=4, block_size=16, warmup_steps=2,
                      eval_interval=4, eval_batches=2, log_interval=2, **kw)
    return Trainer(model, train_ids, val_ids, cfg)


def params_of(model):
    return {name: p.copy() for name, p, _ in model.named_parameters()}


# --------------------------------------------------------------------------- data


def test_pydoc_corpus_is_the_sorted_topics_joined():
    from pydoc_data.topics import topics

    text = load_corpus("pydoc")
    assert text == "\n".join(topics[k] for k in sorted(topics))


def test_stdlib_corpus_is_python_source_without_test_suites():
    text = load_corpus("stdlib")
    assert len(text) > 1_000_000 and "def " in text and "import " in text
    assert load_corpus("stdlib") == text  # deterministic


def test_folder_corpus_reads_sorted_files_and_skips_hidden(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "z.txt").write_text("first")
    (tmp_path / ".hidden").write_text("never")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("never")
    assert load_corpus(tmp_path) == "first\nsecond"
    assert load_corpus(str(tmp_path / "b.txt")) == "second"


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"data: expected 'pydoc', 'stdlib' or an existing "
                                         r"file or folder, got .*no such file"):
        load_corpus(tmp_path / "nope.txt")


@pytest.mark.parametrize("content", ["", "  \n\t "])
def test_empty_corpus_is_a_clear_error(tmp_path, content):
    (tmp_path / "empty.txt").write_text(content)
    with pytest.raises(ValueError, match="data: expected a non-empty corpus"):
        load_corpus(tmp_path / "empty.txt")
    with pytest.raises(ValueError, match="data: expected a non-empty corpus"):
        load_corpus(tmp_path / "empty.txt")


def test_empty_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="data: expected a non-empty corpus"):
        load_corpus(tmp_path)


def test_non_utf8_file_is_a_clear_error(tmp_path):
    (tmp_path / "bin.dat").write_bytes(b"ok \xff\xfe")
    with pytest.raises(ValueError, match=r"data: expected UTF-8 text, got undecodable bytes "
                                         r"in .*bin.dat.* at byte 3"):
        load_corpus(tmp_path)


def test_corpus_source_must_be_a_str_or_path():
    with pytest.raises(ValueError, match="data: expected 'pydoc', 'stdlib' or a path, got int"):
        load_corpus(3)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_tokenizer_spec_round_trips_through_json(kind):
    tok = make_tokenizer(TEXT, kind, vocab_size=270)
    back = tokenizer_from_spec(json.loads(json.dumps(tokenizer_spec(tok))))
    assert back.encode(TEXT) == tok.encode(TEXT)
    assert back.vocab_size == tok.vocab_size


def test_encode_ids_matches_the_tokenizer_and_keeps_its_errors():
    text = load_corpus("pydoc")
    tok = make_tokenizer(text)
    ids = encode_ids(tok, text)
    assert ids.dtype == np.int32 and ids.tolist() == tok.encode(text)
    assert encode_ids(tok, "").shape == (0,)
    with pytest.raises(ValueError, match="text: expected characters of the vocabulary"):
        encode_ids(tok, "caf\u00e9 \u2615")


def test_tokenizer_errors_name_the_argument():
    with pytest.raises(ValueError, match="tokenizer: expected one of"):
        make_tokenizer(TEXT, "words")
    with pytest.raises(ValueError, match="spec: expected"):
        tokenizer_from_spec({"kind": "char", "chars": ""})
    with pytest.raises(ValueError, match="tok: expected a CharTokenizer or ByteBPE, got str"):
        tokenizer_spec("abc")


def test_split_is_contiguous_tail_of_the_given_fraction():
    ids = np.arange(100)
    train, val = train_val_split(ids, 0.1)
    assert np.array_equal(train, np.arange(90)) and np.array_equal(val, np.arange(90, 100))
    assert train_val_split("abcdefghij", 0.3) == ("abcdefg", "hij")


@pytest.mark.parametrize("fraction", [0, 1, -0.5, 1.5, "0.1", True])
def test_split_fraction_out_of_range_is_rejected(fraction):
    with pytest.raises(ValueError, match=r"val_fraction: expected a number in \(0, 1\)"):
        train_val_split("abcdefghij", fraction)


def test_split_that_leaves_a_part_empty_is_rejected():
    with pytest.raises(ValueError, match="val_fraction: expected a split leaving both parts"):
        train_val_split("abc", 0.1)


def test_windows_are_consecutive_tokens_from_a_seeded_generator():
    ids = np.arange(1000, 1100)
    a = sample_windows(ids, 5, 7, np.random.default_rng(3))
    b = sample_windows(ids, 5, 7, np.random.default_rng(3))
    assert a.shape == (5, 7) and np.array_equal(a, b)
    assert np.all(np.diff(a, axis=1) == 1)  # consecutive
    assert a.min() >= 1000 and a.max() <= 1099
    assert np.array_equal(sample_windows(ids, 3, 100, np.random.default_rng(0))[0], ids)


def test_window_longer_than_the_data_is_rejected():
    with pytest.raises(ValueError, match=r"length: expected at most 10 \(the number of tokens"):
        sample_windows(np.arange(10), 2, 11, np.random.default_rng(0))


# --------------------------------------------------------------------------- objectives


def test_masking_follows_bert_80_10_10_on_the_chosen_positions():
    ids = np.random.default_rng(0).integers(0, 50, size=(200, 500))
    # the one masker (the BERT chapter's), with [MASK] = 50 as the one special id
    inputs, targets = bert_mask_tokens(ids, np.random.default_rng(1), 51, 50, [50], p=0.15)
    chosen = targets != IGNORE
    assert np.array_equal(targets[chosen], ids[chosen])  # targets are the original tokens
    assert np.array_equal(inputs[~chosen], ids[~chosen])  # others are untouched
    assert abs(chosen.mean() - 0.15) < 0.005
    masked = (inputs == 50)[chosen].mean()
    same = (inputs == ids)[chosen].mean()  # kept, or replaced by the same token by chance
    assert abs(masked - 0.8) < 0.01
    assert abs(same - (0.1 + 0.1 / 50)) < 0.01
    assert inputs.max() <= 50 and inputs.dtype == ids.dtype


def test_masking_always_chooses_at_least_one_position():
    ids = np.zeros((1, 3), dtype=np.int32)
    for seed in range(20):
        # p must lie in (0, 1); at 1e-12 no position is chosen by chance, so one is forced
        _, targets = bert_mask_tokens(ids, np.random.default_rng(seed), 6, 5, [5], p=1e-12)
        assert (targets != IGNORE).sum() == 1


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("field, value, match", [
    ("steps", 0, "steps: expected a positive integer"),
    ("batch_size", 1.5, "batch_size: expected a positive integer"),
    ("lr", -1.0, r"lr: expected a number in \[0, inf\)"),
    ("min_lr", 1.0, r"min_lr: expected a number in \[0, 0.001\]"),
    ("beta2", 1.0, r"beta2: expected a number in \[0, 1\)"),
    ("grad_clip", -1, r"grad_clip: expected a number in \[0, inf\]"),
    ("warmup_steps", 2000, r"warmup_steps: expected an integer in \[0, steps=1000\]"),
    ("objective", "nope", "objective: expected one of"),
    ("seed", -1, "seed: expected an integer >= 0"),
])
def test_train_config_rejects_bad_values(field, value, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{field: value})


def test_masked_lm_objective_needs_a_mask_id():
    with pytest.raises(ValueError, match="mask_id: expected the \\[MASK\\] token id"):
        TrainConfig(objective="masked_lm")


def test_trainer_rejects_a_block_size_longer_than_the_data(data):
    tok, train_ids, val_ids = data
    with pytest.raises(ValueError, match=rf"block_size: expected at most {len(val_ids)} "
                                         r"\(the number of tokens in val_ids\), got 1000"):
        Trainer(TinyLM(TinyConfig(tok.vocab_size)), train_ids, val_ids,
                TrainConfig(block_size=1000))


# --------------------------------------------------------------------------- the loop


def test_training_lowers_the_validation_loss(data):
    trainer = tiny_trainer(data, steps=60, lr=3e-2)
    before = trainer.evaluate()
    trainer.fit()
    assert trainer.evaluate() < before - 0.5


def test_evaluation_does_not_change_the_training_run(data):
    a, b = tiny_trainer(data), tiny_trainer(data)
    a.config.eval_interval, b.config.eval_interval = 1, 100
    a.fit()
    b.fit()
    for (name, p, _), (_, q, _) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert np.array_equal(p, q), name


def test_resume_is_bit_exact_with_dropout_and_data_generators(data, tmp_path):
    """2N steps in one go == N steps, save, load, N steps: every bit of every parameter."""
    full = tiny_trainer(data, steps=12)
    full.fit()
    first = tiny_trainer(data, steps=12)
    first.fit(until=6, checkpoint_path=tmp_path / "ckpt.safetensors")
    assert first.step == 6
    second = Trainer.resume(tmp_path / "ckpt.safetensors", data[1], data[2])
    assert second.step == 6 and second.optimizer.t == 6
    second.fit()
    assert second.step == 12
    for (name, p, _), (_, q, _) in zip(full.model.named_parameters(),
                                       second.model.named_parameters()):
        assert np.array_equal(p, q), name
    assert full.rng.bit_generator.state == second.rng.bit_generator.state
    assert (full.model.drop.rng.bit_generator.state
            == second.model.drop.rng.bit_generator.state)
    for key, value in full.optimizer.state_dict().items():
        assert np.array_equal(value, second.optimizer.state_dict()[key]), key


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_resume_is_bit_exact_for_tiny_gpt_and_bert_with_dropout(kind, data, tmp_path):
    tok, train_ids, val_ids = data
    V = tok.vocab_size

    def make():  # the same 8-step run, twice
        if kind == "gpt":
            model = npf.GPT(npf.GPTConfig(vocab_size=V, block_size=16, n_layer=2, n_head=2,
                                          d_model=16, dropout=0.1), seed=1)
            objective = {"objective": "next_token"}
        else:  # masked LM: [MASK] is one more id; masking draws from the data generator
            model = npf.BERT(npf.BERTConfig(vocab_size=V + 1, block_size=16, n_layer=2,
                                            n_head=2, d_model=16, d_ff=32, dropout=0.1), seed=1)
            objective = {"objective": "masked_lm", "mask_id": V}
        cfg = TrainConfig(steps=8, batch_size=3, block_size=16, warmup_steps=1,
                          eval_interval=100, eval_batches=1, **objective)
        return Trainer(model, train_ids, val_ids, cfg)

    full = make()
    full.fit()
    half = make()
    half.fit(until=4, checkpoint_path=tmp_path / "half.safetensors")
    rest = Trainer.resume(tmp_path / "half.safetensors", train_ids, val_ids)
    rest.fit()
    for (name, p, _), (_, q, _) in zip(full.model.named_parameters(),
                                       rest.model.named_parameters()):
        assert np.array_equal(p, q), name


def test_restarting_without_the_generators_would_not_be_exact(data, tmp_path):
    """The control for the test above: the generator states are what make it exact."""
    full = tiny_trainer(data, steps=12)
    full.fit()
    first = tiny_trainer(data, steps=12)
    first.fit(until=6, checkpoint_path=tmp_path / "ckpt.safetensors")
    second = Trainer.resume(tmp_path / "ckpt.safetensors", data[1], data[2])
    second.rng = np.random.default_rng([0, 1])  # the data generator restarted from its seed
    second.fit()
    assert not np.array_equal(full.model.head.W, second.model.head.W)


def test_log_records_have_the_documented_fields_and_are_appended(data, tmp_path):
    log = tmp_path / "log.jsonl"
    trainer = tiny_trainer(data, steps=12)
    trainer.fit(until=6, log_path=log, checkpoint_path=tmp_path / "c.safetensors")
    first = log.read_text().splitlines()
    resumed = Trainer.resume(tmp_path / "c.safetensors", data[1], data[2])
    resumed.fit(log_path=log)
    lines = log.read_text().splitlines()
    assert lines[: len(first)] == first  # never truncated
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10, 12]
    for r in records:
        assert set(r) == {"step", "train_loss", "val_loss", "lr", "tokens_per_s", "time"}
        assert np.isfinite(r["train_loss"]) and r["tokens_per_s"] > 0 and r["lr"] > 0
    assert [r["val_loss"] is not None for r in records] == [False, True, False, True] * 1 + \
        [False, True]
    assert records[-1]["time"] >= records[0]["time"]


def test_should_stop_ends_the_run_between_steps_with_a_checkpoint(data, tmp_path):
    trainer = tiny_trainer(data, steps=12)
    trainer.fit(checkpoint_path=tmp_path / "c.safetensors", should_stop=lambda: trainer.step >= 5)
    assert trainer.step == 5
    assert npf.load_checkpoint(tmp_path / "c.safetensors").step == 5


def test_a_nan_loss_stops_before_the_update_and_writes_no_checkpoint(data, tmp_path):
    trainer = tiny_trainer(data)
    trainer.model.head.W[0, 0] = np.nan
    before = params_of(trainer.model)
    with pytest.raises(NonFiniteError, match="the loss is nan at step 0; stopping before"):
        trainer.fit(checkpoint_path=tmp_path / "c.safetensors")
    assert not (tmp_path / "c.safetensors").exists()
    for name, p in params_of(trainer.model).items():
        assert np.array_equal(p, before[name], equal_nan=True), name


def test_an_infinite_gradient_stops_before_the_update(data, monkeypatch):
    trainer = tiny_trainer(data)
    backward = trainer.model.backward

    def poisoned(dlogits):
        backward(dlogits)
        trainer.model.head.db[1] = np.inf

    monkeypatch.setattr(trainer.model, "backward", poisoned)
    before = params_of(trainer.model)
    with pytest.raises(NonFiniteError, match=r"gradient norm is inf at step 0 \(first "
                                             r"non-finite gradient: 'head.b'\)"):
        trainer.train_step()
    for name, p in params_of(trainer.model).items():
        assert np.array_equal(p, before[name]), name


def test_a_non_finite_validation_loss_stops_without_a_checkpoint(data, tmp_path, monkeypatch):
    trainer = tiny_trainer(data)
    monkeypatch.setattr(trainer, "evaluate", lambda: float("nan"))
    with pytest.raises(NonFiniteError, match="the validation loss is nan after step 4"):
        trainer.fit(checkpoint_path=tmp_path / "c.safetensors")
    assert not (tmp_path / "c.safetensors").exists()


def test_gradient_clipping_bounds_the_step_and_reports_the_raw_norm(data):
    tok, train_ids, val_ids = data
    model = TinyLM(TinyConfig(tok.vocab_size, dropout=0.0), seed=0)
    rng = np.random.default_rng(0)
    ids = sample_windows(train_ids, 4, 16, rng)
    opt = npf.SGD(model.named_parameters(), lr=1.0)
    cfg = TrainConfig(grad_clip=1e-3)
    before = params_of(model)
    _, norm = train_step(model, opt, lambda m, b: next_token_objective(m, b, rng), ids,
                         lr=1.0, max_norm=cfg.grad_clip)
    moved = np.sqrt(sum(np.sum((p - before[n]) ** 2) for n, p, _ in model.named_parameters()))
    assert norm > 1e-3
    assert moved == pytest.approx(1e-3, rel=1e-3)  # SGD moves by lr * the clipped gradient


def test_masked_lm_training_runs_on_the_tiny_model(data):
    tok, train_ids, val_ids = data
    model = TinyLM(TinyConfig(tok.vocab_size + 1), seed=0)
    cfg = TrainConfig(steps=20, batch_size=4, block_size=16, warmup_steps=2, lr=3e-2,
                      eval_batches=2, objective="masked_lm", mask_id=tok.vocab_size)
    trainer = Trainer(model, train_ids, val_ids, cfg)
    before = trainer.evaluate()
    trainer.fit()
    assert trainer.evaluate() < before


def test_the_encoder_learns_to_reconstruct_its_input_embeddings(data):
    tok, train_ids, val_ids = data
    model = npf.Encoder(npf.EncoderConfig(vocab_size=tok.vocab_size, block_size=16,
                                          n_layer=1, n_head=2, d_model=16, d_ff=32), seed=0)
    cfg = TrainConfig(steps=40, batch_size=4, block_size=16, warmup_steps=2, lr=5e-2,
                      min_lr=5e-3, eval_batches=2, objective="reconstruction")
    trainer = Trainer(model, train_ids, val_ids, cfg)
    before = trainer.evaluate()
    trainer.fit()
    assert trainer.evaluate() < 0.1 * before  # the final LayerNorm's gain shrinks first


def test_an_overflowing_update_is_named_and_its_warnings_do_not_leak(data, tmp_path):
    """lr = 1e38 overflows AdamW's float32 update in step 0; step 1's loss is NaN. The
    error names the update that broke (step 0), not just the step that noticed."""
    import warnings

    tok, train_ids, val_ids = data
    cfg = TrainConfig(steps=12, batch_size=4, block_size=16, warmup_steps=0, lr=1e38,
                      min_lr=0.0, eval_interval=4, eval_batches=2, log_interval=2)
    model = npf.GPT(npf.GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=1,
                                  n_head=2, d_model=16), seed=0)  # float32
    trainer = Trainer(model, train_ids, val_ids, cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RuntimeWarning would fail the test
        with pytest.raises(NonFiniteError, match=r"the loss is nan at step 1 because the "
                                                 r"update of step 0 made parameter '.*' "
                                                 r"non-finite"):
            trainer.fit(checkpoint_path=tmp_path / "c.safetensors")
    assert trainer.step == 1 and not (tmp_path / "c.safetensors").exists()
