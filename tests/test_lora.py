"""Specification of LoRA and the frozen flag of the Module contract (book/lora.md)."""

import numpy as np
import pytest

import npformer as npf
from npformer.gradcheck import check_module, numerical_gradient, relative_error
from npformer.losses import next_token_loss

LLAMA = dict(vocab_size=11, block_size=6, n_layer=2, n_head=4, n_kv_head=2, d_model=16,
             d_ff=12)


def _llama(dtype="float64"):
    return npf.Llama(npf.LlamaConfig(**LLAMA, dtype=dtype), seed=0)


def _gpt(dtype="float64"):
    return npf.GPT(npf.GPTConfig(vocab_size=11, block_size=6, n_layer=2, n_head=2, d_model=8,
                                 dtype=dtype), seed=0)


def _ids(seed=1):
    return np.random.default_rng(seed).integers(0, 11, (2, 6))


def _perturb(model, scale=0.1, seed=2):
    rng = np.random.default_rng(seed)
    for _, p, _ in model.named_parameters():
        p += rng.standard_normal(p.shape) * scale
    return model


def test_layer_gradients_and_zero_init():
    base = npf.Linear(8, 24, bias=True, seed=0, dtype="float64")
    layer = npf.LoRALinear(base, rank=3, alpha=6.0, cols=np.r_[0:8, 16:24], seed=1)
    assert np.all(layer.lora_B == 0) and layer.scale == 2.0
    x = np.random.default_rng(3).standard_normal((2, 5, 8))
    np.testing.assert_array_equal(layer(x), base(x))
    layer.lora_B[...] = np.random.default_rng(2).standard_normal(layer.lora_B.shape)
    errors = check_module(layer, x)
    assert set(errors) == {"x", "lora_A", "lora_B"} and max(errors.values()) < 1e-7


@pytest.mark.parametrize("make", [_llama, _gpt])
def test_add_lora_leaves_only_lora_factors_trainable(make):
    model = make()
    ids = _ids()
    before = model.forward(ids)
    n_all = len(list(model.named_parameters()))
    npf.add_lora(model, rank=2, alpha=4)
    names = [n for n, _, _ in model.named_parameters()]
    assert names and all("lora" in n for n in names)
    assert len(list(model.named_parameters(include_frozen=True))) == n_all + len(names)
    np.testing.assert_array_equal(model.forward(ids), before)
    opt = npf.AdamW(model.named_parameters(), lr=1e-2)
    assert {n for n, _, _ in opt.params} == set(names)


def test_default_targets_are_query_and_value_columns():
    model = npf.add_lora(_llama(), rank=2, alpha=2)
    qkv = model.h[0].attn.qkv
    d, kv = 16, 2 * 4  # h_kv d_h
    np.testing.assert_array_equal(qkv.cols, np.r_[0:d, d + kv:d + 2 * kv])
    assert qkv.lora_B.shape == (2, d + kv)


def test_model_gradients_of_the_lora_factors():
    model = npf.add_lora(_llama(), rank=2, alpha=4, targets=["attn.qkv", "mlp.fc"])
    _perturb(model, 0.3)
    ids = _ids()
    model.zero_grad()
    _, dlogits = next_token_loss(model.forward(ids), ids)
    model.backward(dlogits)
    for name, p, g in model.named_parameters():
        num = numerical_gradient(lambda: next_token_loss(model.forward(ids), ids)[0], p)
        assert relative_error(g, num) < 1e-6, name


def test_merge_restores_the_plain_model():
    model = _llama()
    names = [n for n, _, _ in model.named_parameters()]
    npf.add_lora(model, rank=2, alpha=4, targets=["attn.qkv", "attn.proj"])
    _perturb(model)
    ids = _ids()
    adapted = model.forward(ids)
    npf.merge_lora(model)
    assert [n for n, _, _ in model.named_parameters()] == names
    assert type(model.h[0].attn.qkv) is npf.Linear
    np.testing.assert_allclose(model.forward(ids), adapted, rtol=1e-12, atol=1e-13)
    npf.add_lora(model, rank=1, alpha=1)  # a merged model takes new adapters


def test_save_load_round_trip(tmp_path):
    model = _perturb(npf.add_lora(_llama(dtype="float32"), rank=2, alpha=4))
    npf.save(model, tmp_path / "lora.safetensors")
    again = npf.load(tmp_path / "lora.safetensors")
    ids = _ids()
    np.testing.assert_array_equal(again.forward(ids), model.forward(ids))
    assert [n for n, _, _ in again.named_parameters()] == \
        [n for n, _, _ in model.named_parameters()]
    npf.merge_lora(again)


def test_trainer_trains_only_the_adapters():
    text = np.tile(np.arange(11), 30)
    cfg = npf.TrainConfig(steps=5, batch_size=2, block_size=6, lr=1e-2, warmup_steps=1,
                          eval_interval=5, eval_batches=1, log_interval=5)
    model = npf.add_lora(_llama(dtype="float32"), rank=2, alpha=4)
    frozen = {n: p.copy() for n, p, _ in model.named_parameters(include_frozen=True)
              if "lora" not in n}
    npf.Trainer(model, text[:250], text[250:], cfg).fit()
    for n, p, _ in model.named_parameters(include_frozen=True):
        if n in frozen:
            np.testing.assert_array_equal(p, frozen[n], err_msg=n)
    assert np.any(model.h[0].attn.qkv.lora_B != 0)


def test_bad_input():
    with pytest.raises(ValueError, match="^rank: expected a positive integer, got 0"):
        npf.add_lora(_llama(), rank=0, alpha=1)
    model = npf.add_lora(_llama(), rank=1, alpha=1)
    with pytest.raises(ValueError, match="^model: expected a model without LoRA"):
        npf.add_lora(model, rank=1, alpha=1)
    with pytest.raises(ValueError, match="^model: expected a model with LoRA"):
        npf.merge_lora(_llama())
    with pytest.raises(ValueError, match="^targets: expected"):
        npf.add_lora(_llama(), rank=1, alpha=1, targets=["nothing.here"])
    plain = _llama()
    with pytest.raises(ValueError, match="^targets: expected"):
        npf.add_lora(plain, rank=1, alpha=1, targets="attn.qkv")
    assert len(list(plain.named_parameters())) == 15  # nothing half-done


def test_frozen_flag_and_buffers_on_module():
    m = npf.Linear(3, 2, seed=0)
    m.freeze("W")
    assert [n for n, _, _ in m.named_parameters()] == ["b"]
    assert [n for n, _, _ in m.named_parameters(include_frozen=True)] == ["W", "b"]
    m.freeze("W", False)
    m.buffer("table", np.ones(3))
    assert [n for n, _ in m.named_buffers()] == ["table"]


@pytest.mark.parametrize("zero", [False, True])
def test_data_parallel_trainer_sees_only_the_adapters(zero):
    from npformer.distributed import DistributedTrainer, SingleProcess

    text = np.tile(np.arange(11), 30)
    cfg = npf.TrainConfig(steps=3, batch_size=2, block_size=6, lr=1e-2, warmup_steps=1,
                          eval_interval=3, eval_batches=1, log_interval=3)
    model = npf.add_lora(_llama(dtype="float32"), rank=2, alpha=4)
    trainer = DistributedTrainer(model, text[:250], text[250:], cfg, comm=SingleProcess(),
                                 zero=zero)
    assert all("lora" in n for n in trainer.flat.names)
    trainer.fit()
    assert np.any(model.h[0].attn.qkv.lora_B != 0)


def _bert():
    return npf.BERT(npf.BERTConfig(vocab_size=11, block_size=6, n_layer=2, n_head=2, d_model=8,
                                   d_ff=16, dropout=0.0, dtype="float64"), seed=0)


def _encoder():
    return npf.Encoder(npf.EncoderConfig(vocab_size=11, block_size=6, n_layer=2, n_head=2,
                                         d_model=8, d_ff=16, dtype="float64"), seed=0)


def _transformer():
    return npf.Transformer(npf.TransformerConfig(
        src_vocab_size=11, tgt_vocab_size=11, block_size=6, n_layer=2, n_head=2, d_model=8,
        d_ff=16, dropout=0.0, dtype="float64"), seed=0)


def _run(model, ids):
    if isinstance(model, npf.Transformer):
        return model.forward(ids, ids[:, ::-1].copy())
    return model.forward(ids)


# every attention of each model: (path of the adapted Linear, adapted output columns)
_QV = np.r_[0:8, 16:24]  # Q and V of a fused (8, 24) qkv
DEFAULT_SITES = {
    "gpt": (_gpt, {f"h.{i}.attn.qkv": _QV for i in range(2)}),
    "bert": (_bert, {f"h.{i}.attn.qkv": _QV for i in range(2)}),
    "encoder": (_encoder, {f"h.{i}.attn.qkv": _QV for i in range(2)}),
    "transformer": (_transformer, {
        **{f"encoder.{i}.attn.qkv": _QV for i in range(2)},
        **{f"decoder.{i}.self_attn.qkv": _QV for i in range(2)},
        **{f"decoder.{i}.cross_attn.q": np.arange(8) for i in range(2)},
        **{f"decoder.{i}.cross_attn.kv": np.arange(8, 16) for i in range(2)}}),
    "llama": (_llama, {f"h.{i}.attn.qkv": np.r_[0:16, 24:32] for i in range(2)}),
}


@pytest.mark.parametrize("kind", sorted(DEFAULT_SITES))
def test_default_targets_cover_every_attention_and_merge_restores_it(kind):
    make, expected = DEFAULT_SITES[kind]
    model = make()
    ids = _ids()
    before = _run(model, ids)
    names = [n for n, _, _ in model.named_parameters()]
    npf.add_lora(model, rank=2, alpha=4)
    adapted = {path: m for path, m in model.named_modules() if isinstance(m, npf.LoRALinear)}
    assert set(adapted) == set(expected)
    for path, cols in expected.items():
        np.testing.assert_array_equal(adapted[path].cols, cols, err_msg=path)
    trainable = [n for n, _, _ in model.named_parameters()]
    assert sorted(trainable) == sorted(f"{p}.lora_{ab}" for p in expected for ab in "AB")
    np.testing.assert_array_equal(_run(model, ids), before)  # B = 0: the same model
    npf.merge_lora(model)
    assert [n for n, _, _ in model.named_parameters()] == names
    np.testing.assert_array_equal(_run(model, ids), before)  # exactly: W + 0
    npf.add_lora(model, rank=2, alpha=4)
    _perturb(model)
    tuned = _run(model, ids)
    assert not np.allclose(tuned, before)  # every adapter moves the output
    npf.merge_lora(model)
    np.testing.assert_allclose(_run(model, ids), tuned, rtol=1e-12, atol=1e-12)


def test_generators_are_registered_and_walked():
    from npformer.checkpoint import generator_states

    m = npf.Linear(3, 2, seed=0)
    m.stray = np.random.default_rng(5)  # not registered: not part of the model's state
    rng = m.generator("rng", np.random.default_rng(1))
    m.generator("rng", rng)  # registering again replaces, never duplicates
    assert [n for n, _ in m.named_generators()] == ["rng"]
    gpt = _gpt()
    names = [n for n, _ in gpt.named_generators()]
    assert names == ["drop.rng"] + [f"h.{i}.drop_{w}.rng" for i in range(2)
                                    for w in ("attn", "mlp")]
    assert list(generator_states(gpt)) == names
