"""Specification of the GPT decoder, sampling and the KV cache (book/gpt.md)."""

import dataclasses
import json

import numpy as np
import pytest
from scipy.special import erf
from test_float32 import float64_locals_in_npformer  # the tracer; it is tested there

from npformer.gradcheck import check_module
from npformer.models.gpt import GPT, GPTConfig
from npformer.optim import AdamW
from npformer.sampling import (
    generate,
    next_token_logits,
    sample_next,
    top_k_filter,
    top_p_filter,
)
from npformer.softmax import cross_entropy, softmax

TINY = dict(vocab_size=5, block_size=4, n_layer=2, n_head=2, d_model=4, d_ff=8)


def _randomize(model, seed=1, scale=0.5):
    """Give every parameter (biases and norm gains included) non-trivial values."""
    rng = np.random.default_rng(seed)
    for _, p, _ in model.named_parameters():
        p[...] = rng.standard_normal(p.shape) * scale
    return model


def _ids(shape, vocab, seed=2):
    return np.random.default_rng(seed).integers(0, vocab, size=shape)


def _model(dtype="float64", seed=0, **overrides):
    return GPT(GPTConfig(**{**TINY, **overrides}, dtype=dtype), seed=seed)


# --------------------------------------------------------------------- configuration


def test_config_fills_d_ff_and_round_trips_through_json():
    cfg = GPTConfig(vocab_size=7, block_size=8, n_layer=2, n_head=2, d_model=6)
    assert cfg.d_ff == 24 and cfg.activation == "gelu" and cfg.dtype == "float32"
    again = GPTConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert again == cfg
    assert GPTConfig(**{**TINY, "dtype": np.float64}).dtype == "float64"  # stored as a str


@pytest.mark.parametrize("field, value, match", [
    ("n_head", 3, r"d_model: expected a multiple of n_head = 3, got 4"),
    ("vocab_size", 0, r"vocab_size: expected a positive integer, got 0"),
    ("block_size", 2.5, r"block_size: expected a positive integer, got 2.5"),
    ("n_layer", -1, r"n_layer: expected a positive integer, got -1"),
    ("d_ff", 0, r"d_ff: expected a positive integer, got 0"),
    ("dropout", 1.0, r"dropout: expected a probability in \[0, 1\), got 1.0"),
    ("activation", "tanh", r"activation: expected one of .*, got 'tanh'"),
    ("eps", 0.0, r"eps: expected a positive finite number, got 0.0"),
    ("bias", 1, r"bias: expected True or False, got 1"),
    ("dtype", "float16", r"dtype: expected one of \('float32', 'float64'\), got float16"),
])
def test_config_validation_names_the_field_expectation_and_value(field, value, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**TINY, field: value})


def test_gpt_rejects_a_config_that_is_not_a_gpt_config():
    with pytest.raises(ValueError, match=r"config: expected a GPTConfig, got dict"):
        GPT(dict(TINY))


def test_sequence_longer_than_block_size_is_rejected_naming_block_size():
    model = _model()
    with pytest.raises(ValueError, match=r"ids: expected a sequence length of at most "
                                         r"block_size = 4, got T = 5"):
        model.forward(np.zeros((1, 5), dtype=np.int64))


@pytest.mark.parametrize("bad, match", [
    (np.array([[0, 5]]), r"ids: expected token ids in \[0, 5\) \(vocab_size = 5\), got 5"),
    (np.array([[-1, 2]]), r"ids: expected token ids in \[0, 5\) \(vocab_size = 5\), got -1"),
    (np.zeros((1, 3)), r"ids: expected an integer array of shape \(B, T\) with T >= 1, "
                       r"got dtype float64"),
    (np.zeros(3, dtype=np.int64), r"ids: expected an integer array of shape \(B, T\)"),
    (np.zeros((2, 0), dtype=np.int64), r"ids: expected .* T >= 1, got .* shape \(2, 0\)"),
])
def test_invalid_ids_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        _model().forward(bad)


def test_backward_checks_dlogits_and_needs_a_forward_pass():
    model = _model()
    with pytest.raises(RuntimeError, match=r"backward: call forward first"):
        model.backward(np.zeros((1, 2, 5)))
    model.forward(_ids((1, 3), 5))
    with pytest.raises(ValueError, match=r"dlogits: expected shape \(1, 3, 5\) .* got \(1, 2, 5\)"):
        model.backward(np.zeros((1, 2, 5)))
    with pytest.raises(ValueError, match=r"dlogits: expected dtype float64"):
        model.backward(np.zeros((1, 3, 5), dtype=np.float32))


# --------------------------------------------------------------------- the architecture


def _layernorm(x, gamma, beta, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * gamma + beta


def _reference_logits(model, ids):
    """The chapter's equations written out: pre-LN causal blocks, ln_f, tied head."""
    c = model.config
    P = {name: p for name, p, _ in model.named_parameters()}
    gelu = (lambda h: h * 0.5 * (1 + erf(h / np.sqrt(2)))) if c.activation == "gelu" else \
        (lambda h: 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3))))
    B, T = ids.shape
    H, dh = c.n_head, c.d_model // c.n_head
    x = P["wte.W"][ids] + P["wpe.W"][:T]
    for n in range(c.n_layer):
        def p(k, n=n):
            return P[f"h.{n}.{k}"]
        a = _layernorm(x, p("ln_1.gamma"), p("ln_1.beta"), c.eps) @ p("attn.qkv.W") \
            + p("attn.qkv.b")
        q, k, v = (a[..., i * c.d_model:(i + 1) * c.d_model].reshape(B, T, H, dh)
                   .transpose(0, 2, 1, 3) for i in range(3))
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(dh)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        o = (softmax(s) @ v).transpose(0, 2, 1, 3).reshape(B, T, c.d_model)
        x = x + o @ p("attn.proj.W") + p("attn.proj.b")
        f = gelu(_layernorm(x, p("ln_2.gamma"), p("ln_2.beta"), c.eps) @ p("mlp.fc.W")
                 + p("mlp.fc.b"))
        x = x + f @ p("mlp.proj.W") + p("mlp.proj.b")
    return _layernorm(x, P["ln_f.gamma"], P["ln_f.beta"], c.eps) @ P["wte.W"].T


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_logits_equal_the_pre_ln_equations_with_final_norm_and_tied_head(activation):
    model = _randomize(_model(activation=activation))
    ids = _ids((2, 4), 5)
    np.testing.assert_allclose(model.forward(ids), _reference_logits(model, ids),
                               rtol=1e-12, atol=1e-12)
    assert all(block.prenorm for block in model.h)


def test_parameter_names_follow_nanogpt():
    names = [name for name, _, _ in _model().named_parameters()]
    assert names[:2] == ["wte.W", "wpe.W"] and names[-2:] == ["ln_f.gamma", "ln_f.beta"]
    block = ["ln_1.gamma", "ln_1.beta", "attn.qkv.W", "attn.qkv.b", "attn.proj.W",
             "attn.proj.b", "ln_2.gamma", "ln_2.beta", "mlp.fc.W", "mlp.fc.b",
             "mlp.proj.W", "mlp.proj.b"]
    assert names[2:-2] == [f"h.{n}.{b}" for n in range(2) for b in block]


def test_initialisation_scales_the_residual_projections_by_one_over_sqrt_2n():
    model = GPT(GPTConfig(vocab_size=50, block_size=8, n_layer=8, n_head=4, d_model=64), seed=0)
    P = {name: p for name, p, _ in model.named_parameters()}
    fc = np.concatenate([P[f"h.{n}.mlp.fc.W"].ravel() for n in range(8)])
    proj = np.concatenate([P[f"h.{n}.mlp.proj.W"].ravel() for n in range(8)])
    assert abs(fc.std() / 0.02 - 1) < 0.02
    assert abs(proj.std() / (0.02 / np.sqrt(16)) - 1) < 0.02
    assert not P["h.0.attn.qkv.b"].any() and (P["ln_f.gamma"] == 1).all()


def test_the_same_seed_gives_the_same_model_and_another_seed_another():
    a, b, c = _model(seed=4), _model(seed=4), _model(seed=5)
    for (_, pa, _), (_, pb, _), (_, pc, _) in zip(*(m.named_parameters() for m in (a, b, c))):
        assert np.array_equal(pa, pb)
    assert not np.array_equal(a.wte.W, c.wte.W)


def test_changing_a_future_token_does_not_change_past_logits():
    model = _randomize(_model(block_size=6))
    ids = _ids((2, 6), 5)
    base = model.forward(ids)
    for t in range(6):
        changed = ids.copy()
        changed[:, t] = (changed[:, t] + 1) % 5
        out = model.forward(changed)
        assert np.array_equal(out[:, :t], base[:, :t])  # exactly: bit for bit
        assert not np.allclose(out[:, t], base[:, t])


# --------------------------------------------------------------------- gradients


def test_full_model_gradients_match_central_differences():
    model = _randomize(_model())
    errors = check_module(model, _ids((2, 4), 5), wrt_inputs=False, tol=1e-7)
    assert set(errors) == {name for name, _, _ in model.named_parameters()}
    assert max(errors.values()) < 1e-7


def test_head_weight_is_the_token_embedding_array_listed_once():
    model = _model()
    assert model.head_weight is model.wte.W
    arrays = [p for _, p, _ in model.named_parameters()]
    assert sum(p is model.wte.W for p in arrays) == 1
    assert len({id(p) for p in arrays}) == len(arrays)
    AdamW(model.named_parameters())  # the optimiser accepts the list: no array twice


def test_tied_gradient_is_the_sum_of_the_head_and_lookup_gradients():
    model = _randomize(_model())
    ids = _ids((3, 4), 5)
    G = np.random.default_rng(3).standard_normal((3, 4, 5))  # dL/dlogits
    model.zero_grad()
    model.forward(ids)
    xf = model.cache.copy()  # (B, T, d) final features
    seen = {}
    original = model.drop.backward
    model.drop.backward = lambda dout: seen.setdefault("D", original(dout))
    model.backward(G)
    head = G.reshape(-1, 5).T @ xf.reshape(-1, 4)  # (V, d)
    lookup = np.zeros((5, 4))
    np.add.at(lookup, ids.ravel(), seen["D"].reshape(-1, 4))
    assert np.linalg.norm(head) > 0.1 and np.linalg.norm(lookup) > 0.1
    np.testing.assert_allclose(model.wte.dW, head + lookup, rtol=1e-12, atol=1e-12)


def test_gradients_accumulate_across_backward_calls():
    model = _randomize(_model())
    ids = _ids((2, 4), 5)
    G = np.random.default_rng(3).standard_normal((2, 4, 5))
    model.zero_grad()
    model.forward(ids)
    model.backward(G)
    once = {name: g.copy() for name, _, g in model.named_parameters()}
    model.forward(ids)
    model.backward(G)
    for name, _, g in model.named_parameters():
        np.testing.assert_allclose(g, 2 * once[name], rtol=1e-12, atol=1e-14)


def test_every_parameter_gets_a_gradient_and_moves_after_one_adamw_step():
    model = GPT(GPTConfig(**{**TINY, "vocab_size": 7}), seed=0)
    ids = _ids((3, 5), 7)
    model.zero_grad()
    loss, dlogits = cross_entropy(model.forward(ids[:, :-1]), ids[:, 1:])
    model.backward(dlogits)
    before = {name: p.copy() for name, p, _ in model.named_parameters()}
    for name, _, g in model.named_parameters():
        assert np.abs(g).max() > 0, f"{name} received no gradient"
    AdamW(model.named_parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1).step()
    for name, p, _ in model.named_parameters():
        assert not np.array_equal(p, before[name]), f"{name} did not move"


# --------------------------------------------------------------------- float32


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_float32_model_creates_no_float64_array_in_forward_or_backward(dropout):
    model = GPT(GPTConfig(**{**TINY, "dropout": dropout}), seed=0)  # float32 by default
    ids = _ids((2, 4), 5)
    logits = model.forward(ids)
    dlogits = cross_entropy(logits, _ids((2, 4), 5, seed=3))[1]

    def step():
        model.zero_grad()
        model.forward(ids)
        model.backward(dlogits)

    assert float64_locals_in_npformer(step) == []
    assert logits.dtype == dlogits.dtype == np.float32
    assert all(p.dtype == g.dtype == np.float32 for _, p, g in model.named_parameters())


# --------------------------------------------------------------------- dropout


def test_dropout_is_active_in_training_and_off_in_eval_mode():
    model = _model(dropout=0.5)
    ids = _ids((2, 4), 5)
    train_out = model.forward(ids)
    model.eval()
    eval_out = model.forward(ids)
    without_dropout = _model(dropout=0.0).forward(ids)  # same seed, same weights
    assert not np.allclose(train_out, eval_out)
    np.testing.assert_array_equal(eval_out, without_dropout)


def test_dropout_masks_are_reproducible_from_the_seed():
    a, b = _model(dropout=0.3, seed=9), _model(dropout=0.3, seed=9)
    ids = _ids((2, 4), 5)
    np.testing.assert_array_equal(a.forward(ids), b.forward(ids))


# --------------------------------------------------------------------- sampling

PROBS = np.array([0.05, 0.40, 0.10, 0.25, 0.20])  # ranks: 1, 3, 4, 2, 0 in token order
LOGITS = np.log(PROBS)[None, :]


def test_top_k_keeps_exactly_the_k_largest_logits():
    out = top_k_filter(LOGITS, 2)
    np.testing.assert_array_equal(np.isfinite(out[0]), [False, True, False, True, False])
    np.testing.assert_array_equal(out[0, [1, 3]], LOGITS[0, [1, 3]])  # kept values unchanged
    assert np.array_equal(top_k_filter(LOGITS, 5), LOGITS)
    assert np.array_equal(top_k_filter(LOGITS, 50), LOGITS)


def test_top_k_keeps_ties_with_the_kth_logit():
    out = top_k_filter(np.array([[1.0, 3.0, 2.0, 2.0, 0.0]]), 2)
    np.testing.assert_array_equal(np.isfinite(out[0]), [False, True, True, True, False])


@pytest.mark.parametrize("p, kept", [
    (1e-9, [1]),  # always at least the most probable token
    (0.3, [1]),  # 0.40 >= 0.3
    (0.6, [1, 3]),  # 0.40 < 0.6, 0.65 >= 0.6
    (0.66, [1, 3, 4]),  # 0.65 < 0.66
    (0.9, [1, 3, 4, 2]),  # 0.85 < 0.9, 0.95 >= 0.9
    (0.96, [1, 3, 4, 2, 0]),
    (1.0, [1, 3, 4, 2, 0]),
])
def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p(p, kept):
    out = top_p_filter(LOGITS, p)
    assert set(np.flatnonzero(np.isfinite(out[0]))) == set(kept)
    assert PROBS[kept].sum() >= p - 1e-12
    assert PROBS[kept[:-1]].sum() < p  # one token fewer would fall short


def test_top_p_filters_each_row_separately():
    rows = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.2, 0.7], [0.34, 0.33, 0.33]]))
    keep = np.isfinite(top_p_filter(rows, 0.6))
    np.testing.assert_array_equal(keep, [[1, 0, 0], [0, 0, 1], [1, 1, 0]])


def test_temperature_zero_is_greedy_and_uses_no_randomness():
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    logits = np.array([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    np.testing.assert_array_equal(sample_next(logits, rng, temperature=0), [1, 0])
    assert rng.bit_generator.state == state


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sample_frequencies_match_the_tempered_softmax(temperature):
    n = 200_000
    draws = sample_next(np.repeat(LOGITS, n, axis=0), np.random.default_rng(1),
                        temperature=temperature)
    freq = np.bincount(draws, minlength=5) / n
    np.testing.assert_allclose(freq, softmax(LOGITS[0] / temperature), atol=0.005)


def test_filtered_tokens_are_never_sampled():
    n = 50_000
    many = np.repeat(LOGITS, n, axis=0)
    rng = np.random.default_rng(2)
    assert set(sample_next(many, rng, top_k=2)) == {1, 3}
    assert set(sample_next(many, rng, top_p=0.6)) == {1, 3}
    assert set(sample_next(many, rng, top_k=3, top_p=0.99, temperature=5.0)) == {1, 3, 4}
    freq = np.bincount(sample_next(many, rng, top_k=2), minlength=5) / n
    np.testing.assert_allclose(freq[[1, 3]], [0.40 / 0.65, 0.25 / 0.65], atol=0.01)


def test_sampling_is_reproducible_from_the_seed():
    logits = np.random.default_rng(0).standard_normal((4, 30))
    a = sample_next(logits, np.random.default_rng(7), top_p=0.9)
    b = sample_next(logits, np.random.default_rng(7), top_p=0.9)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("call, match", [
    (lambda: top_k_filter(LOGITS, 0), r"k: expected a positive integer, got 0"),
    (lambda: top_p_filter(LOGITS, 0.0), r"p: expected a probability in \(0, 1\], got 0.0"),
    (lambda: top_p_filter(LOGITS, 1.5), r"p: expected a probability in \(0, 1\], got 1.5"),
    (lambda: sample_next(LOGITS, np.random.default_rng(0), temperature=-1.0),
     r"temperature: expected a finite number >= 0, got -1.0"),
    (lambda: sample_next(LOGITS, 0), r"rng: expected a numpy.random.Generator, got int"),
    (lambda: sample_next(LOGITS[0], np.random.default_rng(0)),
     r"logits: expected a float array of shape \(B, vocab_size\)"),
    (lambda: top_k_filter(np.array([[1, 2]]), 1), r"logits: expected a float array"),
])
def test_sampling_controls_validate_their_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --------------------------------------------------------------------- generation, KV cache


def test_kv_cache_logits_equal_full_recomputation_at_every_step():
    model = _randomize(_model(block_size=8, vocab_size=7), scale=0.3).eval()
    seq = _ids((3, 3), 7)
    cache = model.new_cache()
    for step in range(10):  # 3 + 10 > block_size: the cache fills and the fallback takes over
        cached = next_token_logits(model, seq, cache)
        full = model.forward(seq[:, -8:])[:, -1]
        np.testing.assert_allclose(cached, full, rtol=0, atol=1e-12, err_msg=f"step {step}")
        seq = np.concatenate([seq, cached.argmax(-1)[:, None]], axis=1)
    assert cache[0].length == 8


def test_forward_cached_in_chunks_equals_one_forward_pass():
    model = _randomize(_model(block_size=8, vocab_size=7), scale=0.3).eval()
    ids = _ids((2, 8), 7)
    cache = model.new_cache()
    pieces = [model.forward_cached(ids[:, a:b], cache) for a, b in ((0, 3), (3, 4), (4, 8))]
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), model.forward(ids),
                               rtol=0, atol=1e-12)


def test_generate_gives_the_same_tokens_with_and_without_the_cache():
    model = _randomize(_model(block_size=8, vocab_size=7), scale=0.3)
    prompt = _ids((2, 3), 7)
    a = generate(model, prompt, 12, temperature=0.9, top_k=5, top_p=0.95, seed=3)
    b = generate(model, prompt, 12, temperature=0.9, top_k=5, top_p=0.95, seed=3,
                 use_cache=False)
    assert a.shape == (2, 15)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a[:, :3], prompt)
    assert model.training  # restored after generating in eval mode


def test_generate_is_reproducible_from_the_seed():
    model = _model(vocab_size=7, block_size=8)
    prompt = _ids((1, 2), 7)
    assert np.array_equal(generate(model, prompt, 6, seed=11), generate(model, prompt, 6,
                                                                        seed=11))
    assert np.array_equal(generate(model, prompt, 6, seed=np.random.default_rng(11)),
                          generate(model, prompt, 6, seed=11))


def test_generate_accepts_a_prompt_longer_than_the_block_size():
    model = _model(vocab_size=7, block_size=4)
    out = generate(model, _ids((1, 6), 7), 3, temperature=0)
    assert out.shape == (1, 9)


def test_generation_inputs_are_validated():
    model = _model()
    with pytest.raises(ValueError, match=r"max_new_tokens: expected a positive integer, got 0"):
        generate(model, _ids((1, 2), 5), 0)
    with pytest.raises(ValueError, match=r"ids: expected token ids in \[0, 5\)"):
        generate(model, np.array([[9]]), 2)
    with pytest.raises(ValueError, match=r"cache: expected a list of 2 KVCache"):
        model.forward_cached(_ids((1, 2), 5), cache=None)
    cache = model.new_cache()
    model.forward_cached(_ids((1, 3), 5), cache)
    with pytest.raises(ValueError, match=r"ids: expected a sequence length of at most "
                                         r"block_size = 4, got 3 cached \+ 2 new = 5"):
        model.forward_cached(_ids((1, 2), 5), cache)
    with pytest.raises(ValueError, match=r"ids: expected tokens after the 3 in the cache"):
        next_token_logits(model, _ids((1, 3), 5), cache)
    with pytest.raises(RuntimeError, match=r"backward: call forward first"):
        model.backward(np.zeros((1, 2, 5)))
