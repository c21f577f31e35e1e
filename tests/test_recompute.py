"""Specification of activation recomputation (book/precision.md, "Recomputation"):
``npf.recompute(model, every)`` keeps each segment's input instead of the blocks' caches,
and the gradients are bit-identical to the run that keeps every cache."""
from __future__ import annotations

import numpy as np
import pytest

import npformer as npf
from npformer.block import TransformerBlock
from npformer.device import to_device, to_host
from npformer.losses import mse_loss, next_token_loss
from npformer.module import CounterGenerator
from npformer.optim import AdamW
from npformer.perf import traced_peak
from npformer.precision import Recomputed, use_precision
from npformer.strict import Strict, register

register()


def _gpt(n_layer=4, dtype="float32", dropout=0.1, **kw):
    cfg = npf.GPTConfig(vocab_size=23, block_size=12, n_layer=n_layer, n_head=2, d_model=16,
                        dropout=dropout, dtype=dtype, **kw)
    return lambda: npf.GPT(cfg, seed=0)


def _llama(n_layer=4, dtype="float32", dropout=0.1):
    cfg = npf.LlamaConfig(vocab_size=23, block_size=12, n_layer=n_layer, n_head=4,
                          n_kv_head=2, d_model=16, d_ff=24, dropout=dropout, dtype=dtype)
    return lambda: npf.Llama(cfg, seed=0)


def _batches(n=2, vocab=23, shape=(3, 12)):
    rng = np.random.default_rng(7)
    return [rng.integers(0, vocab, shape) for _ in range(n)]


def _lm_step(model, ids):
    loss, dlogits = next_token_loss(model.forward(ids), ids)
    model.backward(dlogits)
    return loss


def _run(model, batches, step=_lm_step):
    """Losses and host copies of every gradient of each of len(batches) AdamW steps."""
    opt, out = AdamW(model.named_parameters(), lr=1e-2), []
    for batch in batches:
        model.zero_grad()
        loss = step(model, batch)
        out.append((float(loss), [to_host(g).copy() for _, _, g in model.named_parameters()]))
        opt.step()
    return out


def _assert_identical(a, b):
    assert len(a) == len(b)
    for (loss_a, grads_a), (loss_b, grads_b) in zip(a, b):
        assert loss_a == loss_b
        assert len(grads_a) == len(grads_b)
        for ga, gb in zip(grads_a, grads_b):
            assert np.array_equal(ga, gb)  # bit for bit, not within a tolerance


@pytest.mark.parametrize("make", [_gpt, _llama], ids=["gpt", "llama"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("every", [1, 2, 3, 4])
def test_gradients_are_bit_identical_with_dropout(make, dtype, every):
    new = make(dtype=dtype, dropout=0.1)
    batches = _batches()
    _assert_identical(_run(new(), batches), _run(npf.recompute(new(), every), batches))


@pytest.mark.parametrize("kernels", ["numpy", "fused"])
def test_recomputation_composes_with_the_kernel_switch(kernels):
    pytest.importorskip("numba") if kernels == "fused" else None
    new = _gpt(dropout=0.1)
    batches = _batches()
    plain = new().use_kernels(kernels)
    again = npf.recompute(new(), 2).use_kernels(kernels)
    _assert_identical(_run(plain, batches), _run(again, batches))


def test_recomputation_composes_with_mixed_precision():
    new = _gpt(dropout=0.1)
    batches = _batches()
    plain = use_precision(new(), "bf16-mixed")
    again = npf.recompute(use_precision(new(), "bf16-mixed"), 1)
    _assert_identical(_run(plain, batches), _run(again, batches))


def test_counter_generators_replay_the_same_masks():
    new = _gpt(dropout=0.3)

    def counters(model):  # the GPU chapter's generator, on the host
        for k, (_, m) in enumerate(model.named_modules()):
            if isinstance(m, npf.Dropout):
                m.generator("rng", CounterGenerator(100 + k))
        return model

    batches = _batches()
    _assert_identical(_run(counters(new()), batches),
                      _run(npf.recompute(counters(new()), 2), batches))


def test_on_the_strict_array_identical_and_no_extra_host_reads():
    new = _gpt(dropout=0.2, dtype="float64")
    batches = [to_device(b, "strict") for b in _batches()]
    reads = []

    def counted(model, ids):
        Strict.reset()
        loss, dlogits = next_token_loss(model.forward(ids), ids)
        model.backward(dlogits)
        reads.append(Strict.reads)
        return loss

    plain = _run(new().to("strict"), batches, counted)
    again = _run(npf.recompute(new().to("strict"), 2), batches, counted)
    _assert_identical(plain, again)
    assert reads[:2] == reads[2:]  # recomputation reads the host no more often


def test_bert_with_padding_masks():
    cfg = npf.BERTConfig(vocab_size=31, block_size=10, n_layer=3, n_head=2, d_model=16,
                         d_ff=24, dropout=0.1)
    rng = np.random.default_rng(3)
    ids = rng.integers(5, 31, (3, 10))
    mask = np.ones((3, 10), dtype=bool)
    mask[0, 6:] = mask[2, 3:] = False

    def step(model, ids):
        logits = model.forward(ids, attention_mask=mask)
        dout = np.where(mask[..., None], logits - logits.mean(), 0).astype(logits.dtype)
        model.backward(dout)
        return float(np.sum(logits * dout))

    batches = [ids, ids[::-1].copy()]
    _assert_identical(_run(npf.BERT(cfg, seed=0), batches, step),
                      _run(npf.recompute(npf.BERT(cfg, seed=0), 2), batches, step))


def test_encoder_and_encoder_decoder():
    enc_cfg = npf.EncoderConfig(vocab_size=19, block_size=8, n_layer=3, n_head=2, d_model=16)

    def enc_step(model, ids):
        loss, dout = mse_loss(model.forward(ids), model.target(ids))
        model.backward(dout)
        return loss

    batches = _batches(vocab=19, shape=(2, 8))
    _assert_identical(_run(npf.Encoder(enc_cfg, seed=0), batches, enc_step),
                      _run(npf.recompute(npf.Encoder(enc_cfg, seed=0), 1), batches, enc_step))

    cfg = npf.TransformerConfig(src_vocab_size=19, tgt_vocab_size=17, block_size=8, n_layer=3,
                                n_head=2, d_model=16, d_ff=24, dropout=0.1)
    src = np.random.default_rng(4).integers(0, 19, (2, 8))
    src_mask = np.ones((2, 8), dtype=bool)
    src_mask[1, 5:] = False

    def s2s_step(model, tgt):
        loss, dlogits = next_token_loss(model.forward(src, tgt, src_mask), tgt)
        model.backward(dlogits)
        return loss

    batches = _batches(vocab=17, shape=(2, 8))
    for every in (1, 2, 3):  # a decoder segment passes its memory to every block
        _assert_identical(_run(npf.Transformer(cfg, seed=0), batches, s2s_step),
                          _run(npf.recompute(npf.Transformer(cfg, seed=0), every), batches,
                               s2s_step))


def test_names_store_and_checkpoints_unchanged_and_switch_off(tmp_path):
    plain, model = _gpt()(), npf.recompute(_gpt()(), 2)
    assert [n for n, _, _ in plain.named_parameters()] == \
        [n for n, _, _ in model.named_parameters()]
    assert all(isinstance(b, Recomputed) and isinstance(b, TransformerBlock) for b in model.h)
    assert model.store.current() and model.recompute_every == 2
    ids = _batches(1)[0]
    _lm_step(model, ids)
    npf.save(model, tmp_path / "r.safetensors")
    loaded = npf.load(tmp_path / "r.safetensors")
    for (_, p, _), (_, q, _) in zip(model.named_parameters(), loaded.named_parameters()):
        assert np.array_equal(p, q)
    npf.recompute(model, None)
    assert all(type(b) is TransformerBlock for b in model.h) and model.recompute_every is None
    assert not any(hasattr(b, "replay") and "replay" in vars(b) for b in model.h)


def test_inference_pays_nothing():
    plain, model = _gpt()(), npf.recompute(_gpt()(), 1)
    plain.eval(), model.eval()
    ids = _batches(1)[0]
    np.testing.assert_array_equal(plain.forward(ids), model.forward(ids))
    assert all(b.replay is None for b in model.h)  # no input kept, no state saved
    assert all(b.attn.cache is not None for b in model.h)  # the listing's caches, as always
    prompt = ids[:, :3]
    np.testing.assert_array_equal(npf.generate(plain, prompt, 5, seed=1),
                                  npf.generate(model, prompt, 5, seed=1))


def test_caches_are_dropped_and_a_second_backward_is_refused():
    model = npf.recompute(_gpt(dropout=0.0)(), 2)
    ids = _batches(1)[0]
    loss, dlogits = next_token_loss(model.forward(ids), ids)
    for block in model.h:
        assert all(m.cache is None for _, m in block.named_modules())
    assert model.h[0].replay.x is not None and model.h[1].replay.x is None  # one input kept
    model.backward(dlogits)
    assert all(m.cache is None for b in model.h for _, m in b.named_modules())
    with pytest.raises(RuntimeError, match="call forward first"):
        model.backward(dlogits)


def test_recomputation_lowers_the_traced_peak():
    cfg = npf.GPTConfig(vocab_size=32, block_size=32, n_layer=8, n_head=2, d_model=32)
    ids = np.random.default_rng(0).integers(0, 32, (2, 32))
    plain = traced_peak(npf.GPT(cfg, seed=0, kernels="numpy"), ids)
    again = traced_peak(npf.recompute(npf.GPT(cfg, seed=0, kernels="numpy"), 1), ids)
    assert again < plain / 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="every: expected a positive integer, got 0"):
        npf.recompute(_gpt()(), 0)
    with pytest.raises(ValueError, match="model: expected a model with a list of blocks"):
        npf.recompute(npf.Linear(3, 4), 1)
    with pytest.raises(ValueError, match="model: expected an? "):
        npf.recompute("gpt", 1)
    moe = npf.Llama(npf.LlamaConfig(vocab_size=23, block_size=12, n_layer=2, n_head=4,
                                    n_kv_head=2, d_model=16, d_ff=24, n_expert=4), seed=0)
    with pytest.raises(ValueError, match="model: expected dense blocks"):
        npf.recompute(moe, 1)
    npf.recompute(moe, None)  # switching off is always allowed
