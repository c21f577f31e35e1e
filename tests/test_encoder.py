"""Specification of the reconstruction encoder (book/encoder.md): npformer.models.encoder."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest

import npformer as npf
from npformer.block import TransformerBlock
from npformer.embedding import sinusoidal_encoding
from npformer.gradcheck import check_module, gradcheck
from npformer.losses import mse_loss
from npformer.models.encoder import reconstruction_metrics
from npformer.module import Module
from npformer.optim import Adam

TOL = 1e-7  # finite-difference bound, float64 (book/linear.md)

TINY = dict(vocab_size=5, block_size=4, n_layer=2, n_head=2, d_model=4, d_ff=6)


def tiny_model(seed: int = 0, **overrides) -> npf.Encoder:
    """A float64 model with non-trivial norm and bias values, for gradient checks."""
    config = npf.EncoderConfig(**{**TINY, **overrides}, dtype="float64")
    model = npf.Encoder(config, seed=seed)
    rng = np.random.default_rng(seed + 1)
    for name, p, _ in model.named_parameters():
        if name.endswith((".b", ".beta")):
            p[...] = 0.1 * rng.standard_normal(p.shape)
        elif name.endswith(".gamma"):
            p[...] = 1 + 0.1 * rng.standard_normal(p.shape)
    return model


def random_ids(config: npf.EncoderConfig, B: int, T: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, config.vocab_size, (B, T))


def unmoved(before: dict[str, np.ndarray], params) -> list[str]:
    """Names whose array is unchanged since ``before`` was taken."""
    return [name for name, p, _ in params if np.array_equal(p, before[name])]


# --------------------------------------------------------------------------- configuration


def test_config_defaults_are_the_seed_setting():
    cfg = npf.EncoderConfig()
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.d_ff) == (2, 64, 4, 256)
    assert (cfg.vocab_size, cfg.block_size) == (65, 16)
    assert cfg.init_std == 0.02 and cfg.dtype == "float32"


def test_config_round_trips_through_json():
    cfg = npf.EncoderConfig(vocab_size=np.int64(11), d_model=8, n_head=2, dtype=np.float64)
    d = json.loads(json.dumps(asdict(cfg)))
    assert npf.EncoderConfig(**d) == cfg
    assert d["dtype"] == "float64" and type(d["vocab_size"]) is int


@pytest.mark.parametrize("field, value, match", [
    ("vocab_size", 0, "vocab_size: expected a positive integer, got 0"),
    ("block_size", 2.5, "block_size: expected a positive integer, got 2.5"),
    ("n_layer", -1, "n_layer: expected a positive integer, got -1"),
    ("n_head", True, "n_head: expected a positive integer, got True"),
    ("d_ff", "256", "d_ff: expected a positive integer, got '256'"),
    ("n_head", 3, r"d_model: expected a multiple of n_head = 3, got 64"),
    ("eps", 0.0, "eps: expected a positive finite number, got 0.0"),
    ("init_std", float("nan"), "init_std: expected a positive finite number, got nan"),
    ("dtype", "float16", r"dtype: expected one of \('float32', 'float64'\), got float16"),
])
def test_config_rejects_invalid_fields(field, value, match):
    with pytest.raises(ValueError, match=match):
        npf.EncoderConfig(**{field: value})


def test_config_rejects_an_odd_width_for_sinusoidal_positions():
    with pytest.raises(ValueError, match="d_model: expected an even number .* got 5"):
        npf.EncoderConfig(d_model=5, n_head=1)


def test_encoder_rejects_a_config_of_another_type():
    with pytest.raises(ValueError, match="config: expected an EncoderConfig, got dict"):
        npf.Encoder(asdict(npf.EncoderConfig()))


@pytest.mark.parametrize("ids, match", [
    (np.zeros((2, 4)), "ids: expected an integer numpy array of shape \\(B, T\\), got float64"),
    ([[1, 2]], "ids: expected an integer numpy array of shape \\(B, T\\), got list"),
    (np.zeros(4, dtype=int), "ids: expected a non-empty array of shape \\(B, T\\), got \\(4,\\)"),
    (np.zeros((2, 0), dtype=int), "ids: expected a non-empty array .* got \\(2, 0\\)"),
    (np.zeros((1, 5), dtype=int), "ids: expected a sequence length T <= block_size = 4, got T = 5"),
    (np.array([[0, 5]]), r"ids: expected token ids in \[0, 5\), got 5"),
    (np.array([[-1, 0]]), r"ids: expected token ids in \[0, 5\), got -1"),
])
def test_forward_rejects_invalid_ids(ids, match):
    model = npf.Encoder(npf.EncoderConfig(**TINY))
    with pytest.raises(ValueError, match=match):
        model.forward(ids)


# --------------------------------------------------------------------------- architecture


def test_blocks_are_post_ln_with_relu_and_no_dropout():
    model = npf.Encoder(npf.EncoderConfig(**TINY, dtype="float64"), seed=0)
    assert len(model.h) == TINY["n_layer"]
    for block in model.h:
        assert isinstance(block, TransformerBlock)
        assert block.prenorm is False
        assert block.mlp.activation == "relu"
        assert block.drop_attn.p == 0.0 and block.drop_mlp.p == 0.0


def test_block_output_is_layernorm_of_the_residual_sums():
    """y = ln_2(h + mlp(h)), h = ln_1(x + attn(x)): post-LN, recomputed by hand."""
    model = tiny_model()
    block = model.h[0]
    x = np.random.default_rng(3).standard_normal((2, 3, TINY["d_model"]))
    h = block.ln_1(x + block.attn(x))
    expected = block.ln_2(h + block.mlp(h))
    np.testing.assert_allclose(block.forward(x), expected, rtol=1e-12, atol=1e-12)
    pre = x + block.attn(block.ln_1(x))
    pre = pre + block.mlp(block.ln_2(pre))
    assert np.max(np.abs(block.forward(x) - pre)) > 1e-3  # pre-LN is a different function


def test_input_is_token_embedding_plus_fixed_sinusoidal_positions():
    cfg = npf.EncoderConfig(**TINY, dtype="float64")
    model = npf.Encoder(cfg, seed=0)
    np.testing.assert_array_equal(model.pe, sinusoidal_encoding(cfg.block_size, cfg.d_model,
                                                                 dtype="float64"))
    assert all("pe" not in name.split(".") for name, _, _ in model.named_parameters())
    ids = random_ids(cfg, 2, 3)
    model.forward(ids)
    x0 = model.h[0].attn.qkv.cache  # the first block's attention reads x0 itself (post-LN)
    np.testing.assert_allclose(x0, model.wte.W[ids] + model.pe[:3], rtol=0, atol=1e-15)


def test_output_has_shape_b_t_d_and_the_config_dtype():
    cfg = npf.EncoderConfig()
    out = npf.Encoder(cfg).forward(random_ids(cfg, 3, 16))
    assert out.shape == (3, 16, 64) and out.dtype == np.float32


def test_embeddings_are_drawn_with_std_0_02():
    W = npf.Encoder(npf.EncoderConfig(vocab_size=4096), seed=0).wte.W
    assert abs(W.std() - 0.02) < 0.0005 and abs(W.mean()) < 0.0005


def test_same_seed_gives_the_same_model_and_another_seed_does_not():
    cfg = npf.EncoderConfig(**TINY)
    a, b, c = npf.Encoder(cfg, seed=5), npf.Encoder(cfg, seed=5), npf.Encoder(cfg, seed=6)
    for (na, pa, _), (_, pb, _), (_, pc, _) in zip(a.named_parameters(), b.named_parameters(),
                                                   c.named_parameters()):
        np.testing.assert_array_equal(pa, pb, err_msg=na)
    assert not np.array_equal(a.wte.W, c.wte.W) and not np.array_equal(a.h[1].attn.qkv.W,
                                                                         c.h[1].attn.qkv.W)
    assert not np.array_equal(a.h[0].attn.qkv.W, a.h[1].attn.qkv.W)  # layers differ


def test_parameter_names_are_dotted_and_the_embedding_is_named_wte():
    names = [name for name, _, _ in npf.Encoder(npf.EncoderConfig(**TINY)).named_parameters()]
    assert names[0] == "wte.W" and "h.1.attn.qkv.W" in names and names[-1] == "ln_f.beta"
    assert len(names) == len(set(names))


# --------------------------------------------------------------------------- gradients


def test_every_parameter_receives_a_gradient_and_moves_after_one_adam_step():
    """Catches an optimiser wired to gradients under the wrong keys (the published code's bug 3)."""
    cfg = npf.EncoderConfig()
    model = npf.Encoder(cfg, seed=0)
    params = list(model.named_parameters())
    before = {name: p.copy() for name, p, _ in params}
    ids = random_ids(cfg, 4, 16)
    loss, dout = mse_loss(model.forward(ids), model.target(ids))
    model.zero_grad()
    model.backward(dout)
    no_grad = [name for name, _, g in params if not np.any(g != 0)]
    assert no_grad == [], f"parameters without a gradient: {no_grad}"
    Adam(model.named_parameters(), lr=1e-3).step()
    assert unmoved(before, params) == [], "parameters the optimiser did not update"


def test_the_moved_check_catches_an_update_keyed_by_mismatched_names():
    """Keys as in the published code: params 'L0_...', grads 'layer0_...'; only ln_f matches."""
    model = npf.Encoder(npf.EncoderConfig(**TINY))
    ids = random_ids(model.config, 2, 4)
    _, dout = mse_loss(model.forward(ids), model.target(ids))
    model.backward(dout)
    params = list(model.named_parameters())
    before = {name: p.copy() for name, p, _ in params}
    weights = {name.replace("h.", "L").replace(".", "_"): p for name, p, _ in params}
    grads = {name.replace("h.", "layer").replace("wte.", "tok_").replace(".", "_"): g
             for name, _, g in params}
    for key, p in weights.items():
        if key in grads:  # the silent skip
            p -= 1e-2 * grads[key]
    assert unmoved(before, params) == [name for name, _, _ in params
                                       if not name.startswith("ln_f.")]


def test_full_model_gradients_match_finite_differences_float64():
    errors = check_module(tiny_model(), random_ids(npf.EncoderConfig(**TINY), 2, 4),
                          wrt_inputs=False, tol=TOL)
    assert len(errors) == len(list(tiny_model().named_parameters()))
    assert max(errors.values()) < TOL


def test_mse_gradient_with_a_constant_target_matches_finite_differences():
    model = tiny_model(seed=2, n_layer=1)  # one block: the test above checks the stack
    ids = random_ids(model.config, 2, 3, seed=4)
    target = model.target(ids)  # held fixed while the finite differences perturb wte.W
    names = [name for name, _, _ in model.named_parameters()]

    def fn(*params):
        model.zero_grad()
        loss, dout = mse_loss(model.forward(ids), target)
        model.backward(dout)
        return loss, [g for _, _, g in model.named_parameters()]

    errors = gradcheck(fn, [p for _, p, _ in model.named_parameters()], names=names, tol=TOL)
    assert max(errors.values()) < TOL


def test_target_is_a_copy_so_no_gradient_flows_into_it():
    model = npf.Encoder(npf.EncoderConfig(**TINY))
    ids = random_ids(model.config, 2, 4)
    target = model.target(ids)
    np.testing.assert_array_equal(target, model.wte.W[ids])
    assert not np.shares_memory(target, model.wte.W)
    W = model.wte.W.copy()
    target += 1.0  # writing into the target leaves the embeddings alone
    np.testing.assert_array_equal(model.wte.W, W)


def test_backward_returns_none_and_gradients_accumulate():
    model = tiny_model()
    ids = random_ids(model.config, 2, 4)
    v = np.random.default_rng(0).standard_normal((2, 4, TINY["d_model"]))
    model.zero_grad()
    model.forward(ids)
    assert model.backward(v) is None
    once = {name: g.copy() for name, _, g in model.named_parameters()}
    model.forward(ids)
    model.backward(v)
    for name, _, g in model.named_parameters():
        np.testing.assert_allclose(g, 2 * once[name], rtol=1e-13, atol=1e-15, err_msg=name)


def _float_arrays(obj, seen: set[int]):
    """Every floating ndarray reachable from a module's attributes (caches included)."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        if np.issubdtype(obj.dtype, np.floating):
            yield obj
    elif isinstance(obj, Module):
        for value in vars(obj).values():
            yield from _float_arrays(value, seen)
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            yield from _float_arrays(value, seen)


def test_float32_end_to_end():
    cfg = npf.EncoderConfig()
    model = npf.Encoder(cfg, seed=0)
    ids = random_ids(cfg, 2, 16)
    out = model.forward(ids)
    loss, dout = mse_loss(out, model.target(ids))
    model.backward(dout)
    assert out.dtype == np.float32 and dout.dtype == np.float32
    arrays = list(_float_arrays(model, set()))
    assert len(arrays) > 50  # parameters, gradients, caches and the position table
    assert {a.dtype for a in arrays} == {np.dtype(np.float32)}


# --------------------------------------------------------------------------- training


SMALL = dict(vocab_size=13, block_size=8, n_layer=1, n_head=2, d_model=16, d_ff=32)


def test_short_training_beats_the_all_zeros_baseline_by_ten_times():
    model = npf.Encoder(npf.EncoderConfig(**SMALL), seed=0)
    history = npf.train_reconstruction(model, steps=150, batch_size=16, lr=1e-2, seed=0)
    assert history["mse"][0] > 1000 * history["zeros"][0]  # LayerNorm outputs start at unit size
    ids = random_ids(model.config, 64, 8, seed=123)
    metrics = reconstruction_metrics(model.forward(ids), ids, model.wte.W)
    assert metrics["relative"] < 0.1  # MSE / (all-zeros MSE on the same batch)
    assert metrics["cosine"] > 0.95 and metrics["nearest"] == 1.0


def test_training_is_reproducible_and_freeze_leaves_parameters_alone():
    runs = []
    for _ in range(2):
        model = npf.Encoder(npf.EncoderConfig(**TINY), seed=0)
        before = {name: p.copy() for name, p, _ in model.named_parameters()}
        history = npf.train_reconstruction(model, steps=3, batch_size=2, seq_len=3,
                                           freeze=("wte.", "h.0."), seed=1)
        runs.append(history)
        moved = {name for name, p, _ in model.named_parameters()
                 if not np.array_equal(p, before[name])}
        assert moved and not any(name.startswith(("wte.", "h.0.")) for name in moved)
    assert runs[0] == runs[1] and len(runs[0]["mse"]) == len(runs[0]["zeros"]) == 3


@pytest.mark.parametrize("kwargs, match", [
    (dict(steps=0), "steps: expected a positive integer, got 0"),
    (dict(batch_size=1.5), "batch_size: expected a positive integer, got 1.5"),
    (dict(seq_len=5), "ids: expected a sequence length T <= block_size = 4, got T = 5"),
    (dict(freeze="wte."), "freeze: expected a sequence of name prefixes, got 'wte.'"),
    (dict(freeze=("",)), r"freeze: expected to leave some parameter trainable, got \(''"),
    (dict(lr=-1.0), r"lr: expected a number in \[0, inf\), got -1.0"),
])
def test_train_reconstruction_rejects_invalid_arguments(kwargs, match):
    model = npf.Encoder(npf.EncoderConfig(**TINY))
    with pytest.raises(ValueError, match=match):
        npf.train_reconstruction(model, **kwargs)


def test_train_reconstruction_rejects_another_model():
    with pytest.raises(ValueError, match="model: expected an Encoder, got Module"):
        npf.train_reconstruction(Module())


def test_train_reconstruction_stops_on_a_non_finite_loss():
    model = npf.Encoder(npf.EncoderConfig(**TINY))
    model.ln_f.beta[0] = np.nan
    with pytest.raises(FloatingPointError, match="step 0: the loss is nan"):
        npf.train_reconstruction(model, steps=2)


def test_metrics_of_a_perfect_and_of_an_all_zeros_prediction():
    W = np.random.default_rng(0).standard_normal((6, 4)) * 0.02
    ids = np.random.default_rng(1).integers(0, 6, (3, 5))
    perfect = reconstruction_metrics(W[ids], ids, W)
    assert perfect["mse"] == 0 and perfect["relative"] == 0 and perfect["nearest"] == 1
    assert abs(perfect["cosine"] - 1) < 1e-12
    zeros = reconstruction_metrics(np.zeros((3, 5, 4)), ids, W)
    assert zeros["relative"] == 1 and zeros["cosine"] == 0
    assert abs(zeros["zeros"] - np.mean(W[ids] ** 2)) < 1e-18
    with pytest.raises(ValueError, match=r"out: expected shape \(3, 5, 4\) .* got \(3, 5\)"):
        reconstruction_metrics(np.zeros((3, 5)), ids, W)
