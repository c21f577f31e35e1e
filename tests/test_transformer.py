"""Specification of the encoder-decoder, its decoding and its training pieces (book/seq2seq.md).

Also the two pieces of the paper's recipe that the chapter adds to earlier chapters:
label-smoothed cross-entropy (book/losses.md) and the warmup-then-inverse-square-root
schedule (book/optim.md).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re

import numpy as np
import pytest
from test_float32 import float64_locals_in_npformer  # the tracer; it is tested there

import npformer as npf
from npformer.gradcheck import check_module, gradcheck
from npformer.losses import smoothed_cross_entropy
from npformer.models.transformer import (
    CrossAttention,
    DecoderBlock,
    Transformer,
    TransformerConfig,
)
from npformer.optim import Adam, warmup_inverse_sqrt
from npformer.seq2seq import (
    BOS,
    DATE_FORMATS,
    EOS,
    HELD_OUT_YEARS,
    PAD,
    TRAIN_YEARS,
    YEARS,
    CharVocab,
    beam_search,
    date_pairs,
    date_vocabs,
    greedy_decode,
    length_penalty,
    seq2seq_loss,
    sequence_scores,
    translate,
)
from npformer.softmax import cross_entropy

TINY = dict(src_vocab_size=7, tgt_vocab_size=6, block_size=6, n_layer=2, n_head=2,
            d_model=8, d_ff=12, dropout=0.0)


def _randomize(module, seed=1):
    """Every parameter random around its initial scale, in place: LayerNorm gains
    1 + 0.3 N(0, 1), biases 0.3 N(0, 1), matrices 1.5 N(0, 1/d_in), embeddings 0.5 N(0, 1).
    (Much larger weights make a random post-LN encoder's output rows nearly equal, and
    the queries' gradients then too small for finite differences to resolve.)"""
    rng = np.random.default_rng(seed)
    for name, p, _ in module.named_parameters():
        if name.endswith("gamma"):
            p[...] = 1 + 0.3 * rng.standard_normal(p.shape)
        elif p.ndim == 1:
            p[...] = 0.3 * rng.standard_normal(p.shape)
        elif name.endswith("emb.W"):
            p[...] = 0.5 * rng.standard_normal(p.shape)
        else:
            p[...] = 1.5 * rng.standard_normal(p.shape) / np.sqrt(p.shape[0])
    return module


def _model(dtype="float64", seed=0, randomize=True, **overrides):
    model = Transformer(TransformerConfig(**{**TINY, **overrides, "dtype": dtype}), seed=seed)
    return _randomize(model) if randomize else model


def _batch(seed=2, B=2, S=5, T=4, src_vocab=7, tgt_vocab=6):
    rng = np.random.default_rng(seed)
    src = rng.integers(3, src_vocab, size=(B, S))
    tgt = rng.integers(0, tgt_vocab, size=(B, T))
    mask = np.ones((B, S), dtype=bool)
    mask[-1, 3:] = False
    src[~mask] = PAD
    return src, tgt, mask


# --------------------------------------------------------------------- configuration


def test_config_fills_d_ff_and_final_norm_and_round_trips_through_json():
    cfg = TransformerConfig(src_vocab_size=9, tgt_vocab_size=7, block_size=8, n_layer=2,
                            n_head=2, d_model=6)
    assert (cfg.d_ff, cfg.final_norm, cfg.norm_first, cfg.dropout, cfg.label_smoothing) == \
        (24, False, False, 0.1, 0.1)
    assert TransformerConfig(**{**dataclasses.asdict(cfg), "norm_first": True,
                                "final_norm": None}).final_norm is True
    again = TransformerConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert again == cfg
    assert TransformerConfig(**{**TINY, "dtype": np.float64}).dtype == "float64"


@pytest.mark.parametrize("field, value, match", [
    ("n_head", 3, r"d_model: expected a multiple of n_head = 3, got 8"),
    ("src_vocab_size", 0, r"src_vocab_size: expected a positive integer, got 0"),
    ("block_size", 2.5, r"block_size: expected a positive integer, got 2.5"),
    ("d_ff", 0, r"d_ff: expected a positive integer, got 0"),
    ("dropout", 1.0, r"dropout: expected a probability in \[0, 1\), got 1.0"),
    ("label_smoothing", 1.5, r"label_smoothing: expected a probability in \[0, 1\], got 1.5"),
    ("norm_first", "yes", r"norm_first: expected True or False, got 'yes'"),
    ("share_embeddings", True, r"share_embeddings: expected src_vocab_size == tgt_vocab_size"),
    ("eps", 0, r"eps: expected a positive finite number, got 0"),
    ("dtype", "float16", r"dtype: expected one of"),
])
def test_config_validation_names_the_field_expectation_and_value(field, value, match):
    with pytest.raises(ValueError, match=match):
        TransformerConfig(**{**TINY, field: value})


def test_odd_d_model_is_rejected_because_sinusoids_come_in_pairs():
    with pytest.raises(ValueError, match=r"d_model: expected an even number"):
        TransformerConfig(**{**TINY, "d_model": 7, "n_head": 7})


def test_transformer_rejects_a_config_that_is_not_a_transformer_config():
    with pytest.raises(ValueError, match=r"config: expected a TransformerConfig, got dict"):
        Transformer(TINY)


# --------------------------------------------------------------------- cross-attention


@pytest.mark.parametrize("d_memory", [8, 6])
def test_cross_attention_gradients_match_central_differences_for_both_streams(d_memory):
    rng = np.random.default_rng(0)
    cross = _randomize(CrossAttention(8, 2, d_memory=d_memory, seed=1, dtype="float64"))
    x, memory = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 5, d_memory))
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    G = rng.standard_normal((2, 3, 8))

    def fn(x, memory):
        cross.zero_grad()
        out = cross(x, memory, mask)
        return float(np.sum(out * G)), list(cross.backward(G))

    errors = gradcheck(fn, [x, memory], names=["x", "memory"])
    errors.update(check_module(cross, x, memory, mask, wrt_inputs=False))
    assert len(errors) == 2 + 6 and max(errors.values()) < 1e-7


def test_padded_memory_positions_get_exactly_zero_gradient_and_change_nothing():
    rng = np.random.default_rng(1)
    cross = _randomize(CrossAttention(8, 2, seed=1, dtype="float64"))
    x, memory = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 5, 8))
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=bool)
    out = cross(x, memory, mask)
    _, dmemory = cross.backward(rng.standard_normal(out.shape))
    assert np.all(dmemory[1, 2:] == 0) and np.abs(dmemory[1, :2]).min() > 0
    changed = memory.copy()
    changed[1, 2:] = rng.standard_normal((3, 8)) * 100
    np.testing.assert_array_equal(cross(x, changed, mask), out)


def test_cross_attention_forward_cached_equals_forward():
    rng = np.random.default_rng(2)
    cross = _randomize(CrossAttention(8, 2, seed=1, dtype="float64"))
    x, memory = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 5, 8))
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    kv = cross.memory_kv(memory)
    np.testing.assert_array_equal(cross.forward_cached(x, kv, mask), cross(x, memory, mask))
    assert cross.cache is not None
    cross.forward_cached(x, kv, mask)
    with pytest.raises(RuntimeError, match="call forward first"):
        cross.backward(np.zeros((2, 3, 8)))


def test_a_single_memory_position_sends_no_gradient_through_the_queries():
    rng = np.random.default_rng(3)
    cross = _randomize(CrossAttention(8, 2, seed=1, dtype="float64"))
    cross(rng.standard_normal((2, 4, 8)), rng.standard_normal((2, 1, 8)))
    dx, dmemory = cross.backward(rng.standard_normal((2, 4, 8)))
    assert np.all(dx == 0) and np.abs(dmemory).max() > 0


@pytest.mark.parametrize("mask, match", [
    (np.ones((2, 4)), r"memory_mask: expected shape \(2, 5\) \(\(B, S\) of the memory\), "
                      r"got \(2, 4\)"),
    (np.full((2, 5), 2), r"memory_mask: expected booleans or 0/1 values, got 2"),
    (np.full((2, 5), "x"), r"memory_mask: expected a boolean or 0/1 array, got dtype <U1"),
])
def test_cross_attention_validates_its_mask(mask, match):
    cross = CrossAttention(8, 2, seed=1)
    with pytest.raises(ValueError, match=match):
        cross(np.zeros((2, 3, 8), np.float32), np.zeros((2, 5, 8), np.float32), mask)


def test_cross_attention_validates_the_memory_width():
    cross = CrossAttention(8, 2, d_memory=6, seed=1)
    with pytest.raises(ValueError, match=r"memory: expected last dimension 6"):
        cross(np.zeros((2, 3, 8), np.float32), np.zeros((2, 5, 8), np.float32))


# --------------------------------------------------------------------- decoder block


@pytest.mark.parametrize("prenorm", [False, True])
def test_decoder_block_gradients_match_central_differences(prenorm):
    rng = np.random.default_rng(4)
    block = _randomize(DecoderBlock(8, 2, 12, prenorm=prenorm, seed=0, dtype="float64"))
    y, memory = rng.standard_normal((2, 4, 8)), rng.standard_normal((2, 5, 8))
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    G = rng.standard_normal((2, 4, 8))

    def fn(y, memory):
        block.zero_grad()
        out = block(y, memory, mask)
        return float(np.sum(out * G)), list(block.backward(G))

    errors = gradcheck(fn, [y, memory], names=["y", "memory"])
    errors.update(check_module(block, y, memory, mask, wrt_inputs=False))
    assert max(errors.values()) < 1e-7


def test_post_ln_decoder_block_output_is_normalised_and_pre_ln_is_not():
    """The layout is pinned: post-LN ends in ln_3 (gain 1, shift 0 at initialisation)."""
    rng = np.random.default_rng(5)
    y, memory = rng.standard_normal((2, 4, 8)) * 3 + 1, rng.standard_normal((2, 5, 8))
    post = DecoderBlock(8, 2, 12, prenorm=False, seed=0, dtype="float64")(y, memory)
    pre = DecoderBlock(8, 2, 12, prenorm=True, seed=0, dtype="float64")(y, memory)
    np.testing.assert_allclose(post.mean(-1), 0, atol=1e-12)
    np.testing.assert_allclose(post.var(-1), 1, rtol=1e-4)  # eps 1e-5 inside the root
    assert np.abs(pre.mean(-1)).max() > 0.1


# --------------------------------------------------------------------- the model


@pytest.mark.parametrize("overrides", [
    {}, {"norm_first": True}, {"final_norm": True},
    {"share_embeddings": True, "tgt_vocab_size": 7}])
def test_full_model_gradients_match_central_differences(overrides):
    model = _model(**overrides)
    src, tgt, mask = _batch(tgt_vocab=model.config.tgt_vocab_size)
    errors = check_module(model, src, tgt, mask, wrt_inputs=False)
    assert len(errors) == len(list(model.named_parameters()))
    assert max(errors.values()) < 1e-7, errors


def test_parameter_names_and_shared_embeddings_listed_once():
    names = [n for n, _, _ in _model().named_parameters()]
    assert names[:2] == ["src_emb.W", "tgt_emb.W"]
    assert "decoder.1.cross_attn.kv.W" in names and "encoder.0.attn.qkv.W" in names
    assert "enc_ln_f.gamma" not in names  # the paper's post-LN has no final norms
    assert "enc_ln_f.gamma" in [n for n, _, _ in _model(final_norm=True).named_parameters()]
    shared = _model(share_embeddings=True, tgt_vocab_size=7)
    arrays = [p for _, p, _ in shared.named_parameters()]
    assert shared.tgt_emb.W is shared.src_emb.W and shared.tgt_emb.dW is shared.src_emb.dW
    assert len({id(p) for p in arrays}) == len(arrays)
    assert "tgt_emb.W" not in [n for n, _, _ in shared.named_parameters()]


def test_changing_a_later_target_token_does_not_change_earlier_logits():
    model = _model()
    src, tgt, mask = _batch()
    before = model.forward(src, tgt, mask)
    changed = tgt.copy()
    changed[:, -1] = (changed[:, -1] + 1) % 6
    after = model.forward(src, changed, mask)
    np.testing.assert_array_equal(before[:, :-1], after[:, :-1])
    assert not np.allclose(before[:, -1], after[:, -1])


def test_padded_source_tokens_change_no_logit():
    model = _model()
    src, tgt, mask = _batch()
    changed = src.copy()
    changed[~mask] = 5
    np.testing.assert_array_equal(model.forward(src, tgt, mask),
                                  model.forward(changed, tgt, mask))


def test_the_memory_gradient_is_the_sum_of_every_decoder_layers():
    model = _model()
    src, tgt, mask = _batch()
    logits = model.forward(src, tgt, mask)
    G = np.random.default_rng(6).standard_normal(logits.shape)
    per_layer, received = [], []
    for block in model.decoder:
        block.backward = (lambda b: lambda d: per_layer.append(type(b).backward(b, d))
                          or per_layer[-1])(block)
    top = model.encoder[-1]
    top.backward = lambda d: received.append(d) or type(top).backward(top, d)
    model.zero_grad()
    model.backward(G)
    np.testing.assert_allclose(sum(dm for _, dm in per_layer), received[0], rtol=0,
                               atol=1e-13)
    assert len(per_layer) == 2 and all(np.abs(dm).max() > 0 for _, dm in per_layer)


def test_gradients_accumulate_across_backward_calls():
    model = _model()
    src, tgt, mask = _batch()
    G = np.random.default_rng(7).standard_normal(model.forward(src, tgt, mask).shape)
    model.zero_grad()
    model.backward(G)
    once = {n: g.copy() for n, _, g in model.named_parameters()}
    model.forward(src, tgt, mask)
    model.backward(G)
    for n, _, g in model.named_parameters():
        np.testing.assert_allclose(g, 2 * once[n], rtol=1e-12, atol=1e-15)


def test_backward_checks_dlogits_and_needs_a_forward_pass():
    model = _model()
    with pytest.raises(RuntimeError, match="call forward first"):
        model.backward(np.zeros((2, 4, 6)))
    src, tgt, mask = _batch()
    model.forward(src, tgt, mask)
    with pytest.raises(ValueError, match=r"dlogits: expected shape \(2, 4, 6\)"):
        model.backward(np.zeros((2, 3, 6)))
    with pytest.raises(ValueError, match=r"dlogits: expected dtype float64"):
        model.backward(np.zeros((2, 4, 6), np.float32))


@pytest.mark.parametrize("call, match", [
    (lambda m: m.forward(np.zeros((2, 7), int), np.zeros((2, 3), int)),
     r"src_ids: expected at most block_size = 6 positions, got T = 7"),
    (lambda m: m.forward(np.zeros((2, 4), int), np.array([[1, 6, 2]] * 2)),
     r"tgt_ids: expected token ids in \[0, 6\), got 6"),
    (lambda m: m.forward(np.zeros((2, 4)), np.zeros((2, 3), int)),
     r"src_ids: expected an integer array of shape \(B, T\)"),
    (lambda m: m.forward(np.zeros((2, 4), int), np.zeros((1, 3), int)),
     r"tgt_ids: expected a batch of 2 \(that of src_ids\), got 1"),
    (lambda m: m.forward(np.zeros((2, 4), int), np.zeros((2, 3), int), np.ones((2, 5))),
     r"src_mask: expected shape \(2, 4\) \(src_ids'\), got \(2, 5\)"),
])
def test_invalid_inputs_are_rejected_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call(_model())


def test_check_ids_is_public_and_counts_cached_positions():
    model = _model()
    assert model.check_ids([[1, 2]], "tgt", offset=4).shape == (1, 2)
    with pytest.raises(ValueError, match=r"tgt_ids: expected at most block_size = 6 "
                                         r"positions, got 5 cached \+ 2 new"):
        model.check_ids([[1, 2]], "tgt", offset=5)


def test_dropout_is_active_in_training_and_off_in_eval_mode():
    model = _model(dropout=0.3, randomize=False)
    src, tgt, mask = _batch()
    train_out = model.forward(src, tgt, mask)
    eval_out = model.eval().forward(src, tgt, mask)
    np.testing.assert_array_equal(eval_out,
                                  _model(dropout=0.0, randomize=False).forward(src, tgt, mask))
    assert not np.allclose(train_out, eval_out)


def test_float32_model_creates_no_float64_array_in_forward_or_backward():
    model = _model(dtype="float32", dropout=0.1, randomize=False)
    src, tgt, mask = _batch()

    def step():
        model.zero_grad()
        loss, dlogits = seq2seq_loss(model, src, np.concatenate([np.ones((2, 1), int), tgt], 1))
        model.backward(dlogits)

    assert float64_locals_in_npformer(step) == []
    assert all(p.dtype == g.dtype == np.float32 for _, p, g in model.named_parameters())


def test_initial_logits_are_of_unit_scale():
    """Embeddings N(0, 1/d): sqrt(d) E[x] and the tied output start at unit scale."""
    model = Transformer(TransformerConfig(src_vocab_size=50, tgt_vocab_size=50, block_size=16,
                                          n_layer=2, n_head=4, d_model=64), seed=0).eval()
    rng = np.random.default_rng(0)
    logits = model.forward(rng.integers(0, 50, (8, 16)), rng.integers(0, 50, (8, 16)))
    assert 0.5 < logits.std() < 2


# --------------------------------------------------------------------- decoding


def test_forward_cached_logits_equal_full_recomputation_at_every_step():
    model = _model().eval()
    src, _, mask = _batch(B=3)
    cache = model.new_cache(src, mask)
    prefix = np.full((3, 1), BOS)
    for _ in range(model.config.block_size):
        cached = model.forward_cached(prefix[:, -1:], cache)[:, -1]
        full = model.forward(src, prefix, mask)[:, -1]
        np.testing.assert_allclose(cached, full, rtol=0, atol=1e-13)
        prefix = np.concatenate([prefix, full.argmax(-1)[:, None]], axis=1)
    with pytest.raises(ValueError, match=r"6 cached \+ 1 new"):
        model.forward_cached(prefix[:, -1:], cache)


@pytest.mark.parametrize("norm_first", [False, True])
def test_greedy_decoding_gives_the_same_tokens_with_and_without_the_cache(norm_first):
    for seed in range(5):
        model = _model(norm_first=norm_first, seed=seed)
        src, _, mask = _batch(seed=seed, B=4)
        cached = greedy_decode(model, src, mask)
        uncached = greedy_decode(model, src, mask, use_cache=False)
        np.testing.assert_array_equal(cached, uncached)
        assert np.all(cached[:, 0] == BOS)


def test_greedy_stops_at_eos_and_pads_finished_rows():
    model = _model(tgt_vocab_size=6)
    src, _, mask = _batch(B=6)
    out = greedy_decode(model, src, mask)
    for row in out:
        ends = np.flatnonzero(row == EOS)
        if ends.size:
            assert np.all(row[ends[0] + 1:] == PAD)
        assert not np.any(row[1:][row[1:] != PAD] == BOS)  # <s> is never generated


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_beam_search_with_beam_one_is_greedy_decoding(alpha):
    for seed in range(8):
        model = _model(seed=seed)
        src, _, mask = _batch(seed=seed, B=4)
        ids, scores = beam_search(model, src, mask, beam_size=1, alpha=alpha)
        np.testing.assert_array_equal(ids, greedy_decode(model, src, mask))
        np.testing.assert_allclose(scores, sequence_scores(model, src, ids, mask, alpha=alpha),
                                   rtol=0, atol=1e-12)


def test_beam_scores_are_the_length_normalised_log_probabilities_of_its_answers():
    model = _model(seed=3)
    src, _, mask = _batch(seed=3, B=4)
    ids, scores = beam_search(model, src, mask, beam_size=3)
    np.testing.assert_allclose(scores, sequence_scores(model, src, ids, mask), rtol=0,
                               atol=1e-12)


def test_length_penalty_is_wu_et_al():
    assert length_penalty(1, 0.6) == 1.0
    np.testing.assert_allclose(length_penalty(11, 0.6), (16 / 6) ** 0.6)
    assert length_penalty(7, 0.0) == 1.0


def test_decoder_cache_reorder_follows_the_rows():
    model = _model().eval()
    src, _, mask = _batch(B=3)
    cache = model.new_cache(src, mask)
    model.forward_cached(np.full((3, 1), BOS), cache)
    order = np.array([2, 0, 0])  # new row i continues old row order[i]
    cache.reorder(order)
    nxt = np.array([[3], [4], [5]])
    want = model.forward(src[order], np.concatenate([np.full((3, 1), BOS), nxt], 1),
                         mask[order])[:, -1:]
    np.testing.assert_allclose(model.forward_cached(nxt, cache), want, rtol=0, atol=1e-13)


def _toy_reversal_model(steps=200):
    """A small model trained to reverse digit strings: confident enough to end with </s>."""
    vocab = CharVocab("0123456789")
    rng = np.random.default_rng(0)
    texts = ["".join(rng.choice(list("0123456789"), size=rng.integers(2, 6)))
             for _ in range(4000)]
    src = vocab.batch(texts, 6)
    tgt = vocab.batch([t[::-1] for t in texts], 8, bos=True, eos=True)
    model = Transformer(TransformerConfig(src_vocab_size=vocab.vocab_size,
                                          tgt_vocab_size=vocab.vocab_size, block_size=8,
                                          n_layer=1, n_head=2, d_model=32, dropout=0.0,
                                          dtype="float64"), seed=0)
    opt = Adam(model.named_parameters(), lr=3e-3, betas=(0.9, 0.98), eps=1e-9)
    for step in range(steps):
        rows = rng.integers(0, len(texts), 32)
        model.zero_grad()
        model.backward(seq2seq_loss(model, src[rows], tgt[rows])[1])
        opt.step()
    return model.eval(), vocab, src[:64]


def test_best_beam_score_is_at_least_the_greedy_sequences_on_a_trained_model():
    """Not a theorem (the greedy prefix can drop out of the beam), but what beam search
    is for; checked on a model trained for the test and 64 sources. (A beam that keeps
    k live hypotheses until k have finished, fairseq's, fails it here: on '444' it
    stops with '4' and '44' finished before '444' ends.)"""
    model, vocab, src = _toy_reversal_model()
    mask = src != PAD
    greedy = greedy_decode(model, src, mask)
    assert np.mean([EOS in row for row in greedy]) > 0.9  # the answers end
    greedy_scores = sequence_scores(model, src, greedy, mask)
    for k in (2, 4, 8):
        _, scores = beam_search(model, src, mask, beam_size=k)
        assert np.all(scores >= greedy_scores - 1e-9)


@pytest.mark.parametrize("call, match", [
    (lambda m, s: beam_search(m, s, beam_size=0), r"beam_size: expected a positive integer"),
    (lambda m, s: greedy_decode(m, s, max_new_tokens=7),
     r"max_new_tokens: expected at most block_size = 6, got 7"),
    (lambda m, s: greedy_decode(object(), s), r"model: expected an npformer Transformer"),
    (lambda m, s: m.forward_cached(s, []), r"cache: expected a DecoderCache"),
])
def test_decoding_arguments_are_validated(call, match):
    model = _model()
    with pytest.raises(ValueError, match=match):
        call(model, _batch()[0])


# --------------------------------------------------------------------- the date task


def test_every_generated_input_reads_back_as_its_label_and_only_as_it():
    texts, labels = date_pairs(3000, YEARS, np.random.default_rng(0))
    for text, label in zip(texts, labels):
        clean = re.sub(r"(?<=\d)(st|nd|rd|th)", "", text)
        read = set()
        for pattern in DATE_FORMATS:
            try:
                read.add(datetime.datetime.strptime(clean, pattern).date().isoformat())
            except ValueError:
                pass
        assert read == {label}, (text, label, read)


def test_held_out_years_never_appear_in_training_pairs_and_all_formats_do():
    assert set(HELD_OUT_YEARS).isdisjoint(TRAIN_YEARS) and len(TRAIN_YEARS) == 90
    texts, labels = date_pairs(5000, TRAIN_YEARS, np.random.default_rng(1))
    assert not {int(y[:4]) for y in labels} & set(HELD_OUT_YEARS)
    _, held = date_pairs(500, HELD_OUT_YEARS, np.random.default_rng(2))
    assert {int(y[:4]) for y in held} <= set(HELD_OUT_YEARS)
    assert min(labels) >= "1969" and max(labels) < "2069"


def test_date_vocabularies_cover_every_format_and_round_trip():
    src_vocab, tgt_vocab = date_vocabs()
    assert tgt_vocab.vocab_size == 14 and tgt_vocab.chars == "-0123456789"
    texts, labels = date_pairs(2000, YEARS, np.random.default_rng(3))
    for text, label in zip(texts, labels):
        ids = src_vocab.encode(text, bos=True, eos=True)
        assert ids[0] == BOS and ids[-1] == EOS and min(ids[1:-1]) >= 3
        assert src_vocab.decode(ids) == text
        assert tgt_vocab.decode(tgt_vocab.encode(label) + [EOS, 5, 6]) == label
    batch = tgt_vocab.batch(labels[:3], bos=True, eos=True)
    assert batch.shape == (3, 12) and np.all(batch[:, 0] == BOS) and np.all(batch[:, -1] == EOS)
    with pytest.raises(ValueError, match=r"texts\[0\]: expected at most 4 tokens, got 10"):
        tgt_vocab.batch(labels[:1], 4)


def test_seq2seq_loss_scores_only_real_target_positions():
    model = _model()
    src, _, mask = _batch()
    tgt = np.array([[BOS, 3, 4, EOS, PAD], [BOS, 5, EOS, PAD, PAD]])
    loss, dlogits = seq2seq_loss(model, src, tgt)
    assert dlogits.shape == (2, 4, 6)
    np.testing.assert_array_equal(dlogits[0, 3], 0)
    np.testing.assert_array_equal(dlogits[1, 2:], 0)
    logits = model.forward(src, tgt[:, :-1], mask)
    ref, _ = smoothed_cross_entropy(logits, tgt[:, 1:], smoothing=0.0, ignore_index=PAD)
    model.config.label_smoothing = 0.0
    assert seq2seq_loss(model, src, tgt)[0] == pytest.approx(ref, rel=1e-12)


def test_translate_decodes_text_greedy_or_by_beam():
    src_vocab, tgt_vocab = date_vocabs()
    model = Transformer(TransformerConfig(src_vocab_size=src_vocab.vocab_size,
                                          tgt_vocab_size=tgt_vocab.vocab_size, block_size=32,
                                          n_layer=1, n_head=2, d_model=8), seed=0)
    texts = ["23 November 2026", "11/23/26"]
    for beam in (1, 2):
        out = translate(model, texts, src_vocab, tgt_vocab, beam_size=beam)
        assert len(out) == 2 and all(set(o) <= set("-0123456789") for o in out)


# --------------------------------------------------------------------- loss and schedule


def test_smoothing_zero_is_cross_entropy_and_gradient_is_p_minus_q():
    rng = np.random.default_rng(8)
    logits, y = rng.standard_normal((2, 5, 7)), rng.integers(0, 7, (2, 5))
    loss, d = smoothed_cross_entropy(logits, y, smoothing=0.0)
    ref, dref = cross_entropy(logits, y)
    assert loss == pytest.approx(ref, rel=1e-14)
    np.testing.assert_allclose(d, dref, rtol=0, atol=1e-16)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    q = np.full_like(p, 0.2 / 7)
    np.put_along_axis(q, y[..., None], 0.8 + 0.2 / 7, axis=-1)
    np.testing.assert_allclose(smoothed_cross_entropy(logits, y, smoothing=0.2)[1],
                               (p - q) / 10, rtol=1e-12)


@pytest.mark.parametrize("ignore_index", [None, 0])
def test_smoothed_cross_entropy_gradient_matches_central_differences(ignore_index):
    rng = np.random.default_rng(9)
    logits, y = rng.standard_normal((2, 5, 7)), rng.integers(0, 7, (2, 5))
    y[1, 2:] = 0

    def fn(x):
        loss, dx = smoothed_cross_entropy(x, y, smoothing=0.1, ignore_index=ignore_index)
        return loss, [dx]

    assert gradcheck(fn, [logits])["input0"] < 1e-8


def test_label_smoothing_gradient_is_proved_in_sympy():
    from npformer.proofs import prove_label_smoothing_grad

    assert prove_label_smoothing_grad(2) and prove_label_smoothing_grad(3)


def test_smoothed_loss_float32_stays_float32_and_validates():
    logits = np.zeros((1, 2, 3), np.float32)
    loss, d = smoothed_cross_entropy(logits, np.zeros((1, 2), int))
    assert isinstance(loss, float) and d.dtype == np.float32
    with pytest.raises(ValueError,
                       match=r"smoothing: expected a probability in \[0, 1\], got 1.5"):
        smoothed_cross_entropy(logits, np.zeros((1, 2), int), smoothing=1.5)
    with pytest.raises(ValueError, match=r"targets: expected at least one target"):
        smoothed_cross_entropy(logits, np.zeros((1, 2), int), ignore_index=0)


def test_warmup_inverse_sqrt_is_the_papers_formula():
    d_model, W = 512, 4000
    for step in (0, 1, 100, W - 2, W - 1, W, 5 * W, 100_000):
        paper = d_model ** -0.5 * min((step + 1) ** -0.5, (step + 1) * W ** -1.5)
        ours = warmup_inverse_sqrt(step, peak_lr=(d_model * W) ** -0.5, warmup_steps=W)
        assert ours == pytest.approx(paper, rel=1e-13)
    assert warmup_inverse_sqrt(W - 1, peak_lr=1.0, warmup_steps=W) == 1.0  # the peak
    assert warmup_inverse_sqrt(0, peak_lr=1.0, warmup_steps=W) > 0  # never zero


@pytest.mark.parametrize("kw, match", [
    (dict(step=-1, peak_lr=1.0, warmup_steps=4), r"step: expected an integer >= 0"),
    (dict(step=0, peak_lr=-1.0, warmup_steps=4), r"peak_lr: expected a number in"),
    (dict(step=0, peak_lr=1.0, warmup_steps=0), r"warmup_steps: expected a positive integer"),
])
def test_warmup_inverse_sqrt_validates(kw, match):
    step = kw.pop("step")
    with pytest.raises(ValueError, match=match):
        warmup_inverse_sqrt(step, **kw)


def test_public_names_are_exported_from_the_package():
    for name in ("Transformer", "TransformerConfig", "CrossAttention", "greedy_decode",
                 "beam_search", "smoothed_cross_entropy", "warmup_inverse_sqrt"):
        assert name in npf.__all__ and hasattr(npf, name), name


# --------------------------------------------------------------------- the command line

TASK_ARGS = ["--task", "dates", "--n-layer", "1", "--n-head", "2", "--d-model", "16",
             "--batch-size", "8", "--eval-interval", "4", "--eval-batches", "1",
             "--log-interval", "2", "--quiet"]


def _cli(*argv):
    from npformer.cli import main

    return main([str(a) for a in argv])


def test_cli_trains_resumes_bit_exactly_and_translates(tmp_path, capsys, signal_after_step):
    """8 steps in one go == Ctrl-C after step 4, then --resume; then translate."""
    import signal

    straight, split = tmp_path / "straight", tmp_path / "split"
    assert _cli("train", "transformer", "--out", straight, "--steps", 8, *TASK_ARGS) == 0
    disarm = signal_after_step(signal.SIGINT, 4)
    assert _cli("train", "transformer", "--out", split, "--steps", 8, *TASK_ARGS) == 130
    disarm()
    assert _cli("train", "transformer", "--out", split, "--resume", "--quiet") == 0
    a, b = (npf.load_checkpoint(d / "ckpt.safetensors") for d in (straight, split))
    assert a.step == b.step == 8 and type(a.model) is Transformer
    assert a.extra["task"] == "dates" and a.model.config.block_size == 32
    for (name, p, _), (_, q, _) in zip(a.model.named_parameters(), b.model.named_parameters()):
        np.testing.assert_array_equal(p, q, err_msg=name)
    log = [json.loads(line) for line in (split / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4, 6, 8] and log[-1]["val_loss"] is not None
    capsys.readouterr()
    assert _cli("translate", straight, "23 November 2026", "11/23/26", "--beam-size", 2) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(set(line) <= set("-0123456789") for line in lines)


@pytest.mark.parametrize("argv, message", [
    (["train", "transformer", "--data", "pydoc", "--task", "dates"], "--task: expected"),
    (["train", "transformer"], "--task: expected 'train transformer --task dates'"),
    (["train", "gpt", "--task", "dates"], "--task: expected"),
    (["train", "transformer", "--task", "dates", "--block-size", "16"],
     "--block-size: expected nothing (fixed by --task dates)"),
])
def test_cli_task_errors_are_one_line(argv, message, tmp_path, capsys):
    assert _cli(*argv, "--out", tmp_path / "run", "--quiet") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_translate_refuses_a_run_of_another_model_and_unknown_characters(tmp_path, capsys):
    run = tmp_path / "run"
    assert _cli("train", "transformer", "--out", run, "--steps", 2, *TASK_ARGS) == 0
    capsys.readouterr()
    assert _cli("translate", run, "23 November 2026 \u00e9") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "text: expected characters of the vocabulary" in err
    corpus = tmp_path / "c.txt"
    corpus.write_text("abc def ghi\n" * 50)
    gpt = tmp_path / "gpt"
    assert _cli("train", "gpt", "--data", corpus, "--out", gpt, "--steps", 2, "--n-layer", 1,
                "--d-model", 16, "--n-head", 2, "--block-size", 8, "--quiet") == 0
    assert _cli("translate", gpt, "23 November 2026") == 2
    assert "run: expected a run of 'npformer train transformer', got gpt" in \
        capsys.readouterr().err

