"""Specification of the feed-forward network, dropout and the transformer block (book/blocks.md)."""

import numpy as np
import pytest

from npformer.attention import KVCache
from npformer.block import FFN_ACTIVATIONS, Dropout, FeedForward, TransformerBlock
from npformer.embedding import RoPE
from npformer.gradcheck import GradcheckError, check_module
from npformer.module import Module


def _randomize(module, seed=1, scale=0.5):
    """Give every parameter (biases and norm gains included) non-trivial values."""
    rng = np.random.default_rng(seed)
    for _, p, _ in module.named_parameters():
        p[...] = rng.standard_normal(p.shape) * scale
    return module


def _x(shape=(2, 3, 4), seed=2, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# --------------------------------------------------------------------- feed-forward network


@pytest.mark.parametrize("activation", FFN_ACTIVATIONS)
def test_feedforward_gradients_match_central_differences(activation):
    ffn = _randomize(FeedForward(4, 6, activation=activation, seed=0, dtype="float64"))
    x = _x()
    if activation == "relu":  # ReLU has no derivative at 0: keep clear of it
        assert np.abs(ffn.fc(x)).min() > 1e-3
    errors = check_module(ffn, x, tol=1e-7)
    assert set(errors) == {"x", "fc.W", "fc.b", "proj.W", "proj.b"}
    assert max(errors.values()) < 1e-7


@pytest.mark.parametrize("bias", [True, False])
def test_feedforward_without_bias_passes_gradient_check_and_has_no_bias_parameters(bias):
    ffn = _randomize(FeedForward(4, 6, activation="swiglu", bias=bias, seed=0, dtype="float64"))
    errors = check_module(ffn, _x(), tol=1e-7)
    expected = {"x", "fc.W", "proj.W"} | ({"fc.b", "proj.b"} if bias else set())
    assert set(errors) == expected


def test_feedforward_equals_its_formula_for_each_activation():
    from scipy.special import erf

    x = _x((2, 3, 4))
    phis = {
        "gelu": lambda h: h * 0.5 * (1 + erf(h / np.sqrt(2))),
        "gelu_tanh": lambda h: 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi)
                                                      * (h + 0.044715 * h**3))),
        "relu": lambda h: np.maximum(h, 0),
    }
    for activation, phi in phis.items():
        ffn = _randomize(FeedForward(4, 6, activation=activation, seed=0, dtype="float64"))
        expected = phi(x @ ffn.fc.W + ffn.fc.b) @ ffn.proj.W + ffn.proj.b
        np.testing.assert_allclose(ffn(x), expected, rtol=1e-12, atol=1e-12)


def test_swiglu_feedforward_gates_the_second_half_with_silu_of_the_first():
    ffn = _randomize(FeedForward(4, 6, activation="swiglu", seed=0, dtype="float64"))
    x = _x()
    assert ffn.fc.W.shape == (4, 12) and ffn.proj.W.shape == (6, 4)
    h = x @ ffn.fc.W + ffn.fc.b
    gate, value = h[..., :6], h[..., 6:]
    expected = (gate / (1 + np.exp(-gate)) * value) @ ffn.proj.W + ffn.proj.b
    np.testing.assert_allclose(ffn(x), expected, rtol=1e-12, atol=1e-12)


def test_feedforward_is_position_wise():
    ffn = FeedForward(4, 8, seed=0, dtype="float64")
    x = _x((2, 5, 4))
    perm = np.array([3, 0, 4, 1, 2])
    np.testing.assert_allclose(ffn(x[:, perm]), ffn(x)[:, perm], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(ffn(x[:, 2:3]), ffn(x)[:, 2:3], rtol=1e-12, atol=1e-14)


def test_feedforward_seed_reproduces_the_weights():
    a, b = FeedForward(4, 8, seed=3), FeedForward(4, 8, seed=3)
    c = FeedForward(4, 8, seed=4)
    for (_, pa, _), (_, pb, _), (_, pc, _) in zip(a.named_parameters(), b.named_parameters(),
                                                  c.named_parameters()):
        np.testing.assert_array_equal(pa, pb)
    assert not np.array_equal(a.fc.W, c.fc.W)


def test_feedforward_float32_stays_float32():
    ffn = FeedForward(4, 8, activation="swiglu", seed=0)
    x = _x(dtype=np.float32)
    y = ffn(x)
    dx = ffn.backward(np.ones_like(y))
    assert y.dtype == dx.dtype == np.float32
    assert all(p.dtype == g.dtype == np.float32 for _, p, g in ffn.named_parameters())


def test_feedforward_rejects_an_unknown_activation_naming_the_allowed_ones():
    with pytest.raises(ValueError, match=r"activation: expected one of \('gelu', 'gelu_tanh', "
                                         r"'relu', 'swiglu'\), got 'tanh'"):
        FeedForward(4, 8, activation="tanh")


@pytest.mark.parametrize("kwargs, match", [
    (dict(d_model=0, d_ff=8), "d_model: expected a positive integer, got 0"),
    (dict(d_model=4, d_ff=2.5), "d_ff: expected a positive integer, got 2.5"),
    (dict(d_model=4, d_ff=8, dtype="float16"), "dtype: expected one of"),
])
def test_feedforward_rejects_bad_sizes_and_dtypes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FeedForward(**kwargs)


def test_feedforward_rejects_input_of_the_wrong_width_or_dtype():
    ffn = FeedForward(4, 8, seed=0)
    with pytest.raises(ValueError, match=r"x: expected last dimension 4, got shape \(2, 3, 5\)"):
        ffn(np.zeros((2, 3, 5), dtype=np.float32))
    with pytest.raises(ValueError, match="x: expected dtype float32"):
        ffn(np.zeros((2, 3, 4)))


# --------------------------------------------------------------------- residual connections


class _ResidualFFN(Module):
    def __init__(self, forget_identity=False):
        super().__init__()
        self.child("mlp", _randomize(FeedForward(4, 6, seed=0, dtype="float64")))
        self.forget_identity = forget_identity

    def forward(self, x):
        return x + self.mlp(x)

    def backward(self, dout):
        dx = self.mlp.backward(dout)
        return dx if self.forget_identity else dout + dx


def test_residual_backward_adds_the_upstream_gradient_to_the_sublayer_gradient():
    errors = check_module(_ResidualFFN(), _x(), tol=1e-7)
    assert max(errors.values()) < 1e-7


def test_gradient_check_catches_a_residual_backward_that_forgets_the_identity():
    with pytest.raises(GradcheckError, match=r"\n  x:\s+\d"):
        check_module(_ResidualFFN(forget_identity=True), _x(), tol=1e-7)
    # ... while its parameter gradients alone would have passed
    errors = check_module(_ResidualFFN(forget_identity=True), _x(), tol=1e-7, wrt_inputs=False)
    assert max(errors.values()) < 1e-7


# --------------------------------------------------------------------- dropout


def test_dropout_in_eval_mode_is_the_identity_and_passes_gradient_check():
    drop = Dropout(0.5, seed=0).eval()
    x = _x()
    assert drop(x) is x
    assert drop.backward(x) is x
    assert check_module(drop, x, tol=1e-7)["x"] < 1e-7


def test_dropout_with_a_frozen_mask_passes_gradient_check_in_training_mode():
    drop = Dropout(0.3, seed=0)
    drop.freeze_mask = True
    x = _x((3, 4, 5))
    assert check_module(drop, x, tol=1e-7)["x"] < 1e-7


def test_dropout_backward_uses_the_mask_of_the_forward_pass():
    drop = Dropout(0.4, seed=0)
    x = _x((3, 4, 5))
    y = drop(x)
    dx = drop.backward(np.ones_like(x))
    np.testing.assert_allclose(y, x * dx, rtol=1e-15, atol=0)
    assert set(np.unique(dx)) <= {0.0, 1 / 0.6}


def test_dropout_without_a_frozen_mask_draws_a_new_mask_each_forward():
    drop = Dropout(0.5, seed=0)
    x = np.ones((50, 50))
    assert not np.array_equal(drop(x), drop(x))
    drop.freeze_mask = True
    first = drop(x)
    np.testing.assert_array_equal(drop(x), first)


def test_dropout_frozen_mask_rejects_an_input_of_another_shape():
    drop = Dropout(0.5, seed=0)
    drop.freeze_mask = True
    drop(np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"x: expected shape \(2, 3\) \(the frozen mask's\), "
                                         r"got \(3, 2\)"):
        drop(np.ones((3, 2)))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_drops_a_fraction_p_and_preserves_the_mean(p):
    x = np.ones((400, 500))
    y = Dropout(p, seed=0)(x)
    n = x.size
    sd = np.sqrt(p * (1 - p) / n)  # standard deviation of the dropped fraction
    assert abs(np.mean(y == 0) - p) < 5 * sd
    assert abs(y.mean() - 1) < 5 * sd / (1 - p)
    np.testing.assert_allclose(y[y != 0], 1 / (1 - p), rtol=1e-15)


def test_dropout_with_p_zero_is_the_identity_even_in_training():
    x = _x()
    drop = Dropout(0.0, seed=0)
    assert drop.training and drop(x) is x


def test_dropout_seed_reproduces_the_mask_in_float32_and_float64():
    x64 = np.ones((20, 30))
    a, b = Dropout(0.3, seed=7)(x64), Dropout(0.3, seed=7)(x64)
    np.testing.assert_array_equal(a, b)
    a32 = Dropout(0.3, seed=7)(x64.astype(np.float32))
    assert a32.dtype == np.float32
    np.testing.assert_array_equal(a32 == 0, a == 0)
    assert not np.array_equal(Dropout(0.3, seed=8)(x64), a)


def test_dropout_float32_stays_float32():
    drop = Dropout(0.2, seed=0)
    x = _x(dtype=np.float32)
    assert drop(x).dtype == np.float32
    assert drop.backward(np.ones_like(x)).dtype == np.float32


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan"), "0.1", True, None])
def test_dropout_rejects_p_outside_zero_to_one(p):
    with pytest.raises(ValueError, match=r"p: expected a probability in \[0, 1\), got"):
        Dropout(p)


def test_dropout_rejects_non_float_input_and_mismatched_dout():
    drop = Dropout(0.5, seed=0)
    with pytest.raises(ValueError, match="x: expected a numpy array, got list"):
        drop([1.0, 2.0])
    with pytest.raises(ValueError, match="x: expected one of"):
        drop(np.ones(3, dtype=np.int64))
    drop(np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"dout: expected shape \(2, 3\)"):
        drop.backward(np.ones((3, 2)))


# --------------------------------------------------------------------- transformer block

PAD = np.array([[1, 1, 1], [1, 1, 0]])  # the second sequence ends in one padding token
BLOCK_PARAMS = ["ln_1.gamma", "ln_1.beta", "attn.qkv.W", "attn.qkv.b", "attn.proj.W",
                "attn.proj.b", "ln_2.gamma", "ln_2.beta", "mlp.fc.W", "mlp.fc.b",
                "mlp.proj.W", "mlp.proj.b"]


def _block(seed=0, dtype="float64", **kwargs):
    block = TransformerBlock(4, 2, 6, seed=seed, dtype=dtype, **kwargs)
    return _randomize(block, seed=3) if dtype == "float64" else block


@pytest.mark.parametrize("mask", ["none", "causal", "padding", "causal+padding"])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("prenorm", [True, False], ids=["pre-LN", "post-LN"])
def test_block_gradients_match_central_differences(prenorm, norm, mask):
    block = _block(prenorm=prenorm, norm=norm, causal="causal" in mask)
    inputs = (_x((2, 3, 4)),) + ((PAD,) if "padding" in mask else ())
    errors = check_module(block, *inputs, tol=1e-7)
    expected = {"x"} | {n for n in BLOCK_PARAMS if norm == "layernorm" or "beta" not in n}
    assert set(errors) == expected
    assert max(errors.values()) < 1e-7


@pytest.mark.parametrize("prenorm, activation", [
    (True, "gelu"), (False, "gelu_tanh"), (True, "relu"), (True, "swiglu"), (False, "swiglu")])
def test_block_gradients_match_central_differences_for_each_activation(prenorm, activation):
    block = _block(prenorm=prenorm, activation=activation, causal=True)
    assert max(check_module(block, _x((2, 3, 4)), PAD, tol=1e-7).values()) < 1e-7


@pytest.mark.parametrize("prenorm", [True, False], ids=["pre-LN", "post-LN"])
def test_block_with_dropout_and_frozen_masks_passes_gradient_check_in_training(prenorm):
    block = _block(prenorm=prenorm, dropout=0.3, causal=True)
    block.drop_attn.freeze_mask = block.drop_mlp.freeze_mask = True
    assert block.training
    y = block(_x((2, 3, 4)))
    assert not np.allclose(y, _block(prenorm=prenorm, causal=True)(_x((2, 3, 4))), atol=1e-3)
    assert max(check_module(block, _x((2, 3, 4)), tol=1e-7).values()) < 1e-7


def test_block_with_rope_and_no_biases_passes_gradient_check():
    block = _block(causal=True, bias=False, rope=RoPE(2, 8, dtype="float64"))
    errors = check_module(block, _x((2, 3, 4)), tol=1e-7)
    assert not any(name.endswith(".b") for name in errors)
    assert max(errors.values()) < 1e-7


def test_block_backward_accumulates_parameter_gradients():
    block = _block(prenorm=False)
    x, g = _x((2, 3, 4)), _x((2, 3, 4), seed=5)
    block.zero_grad()
    block.forward(x)
    block.backward(g)
    once = {name: grad.copy() for name, _, grad in block.named_parameters()}
    block.backward(g)
    for name, _, grad in block.named_parameters():
        np.testing.assert_allclose(grad, 2 * once[name], rtol=1e-12, atol=1e-15, err_msg=name)


def test_block_parameter_names_follow_nanogpt():
    block = TransformerBlock(8, 2, 32, seed=0)
    assert [name for name, _, _ in block.named_parameters()] == BLOCK_PARAMS
    assert block.attn.qkv.W.shape == (8, 24) and block.mlp.fc.W.shape == (8, 32)
    assert isinstance(block.drop_attn, Dropout) and isinstance(block.drop_mlp, Dropout)


def test_post_ln_block_output_rows_are_normalised_by_ln_2():
    block = _block(prenorm=False)
    x = 5 + 3 * _x((2, 3, 4))
    z = (block(x) - block.ln_2.beta) / block.ln_2.gamma  # undo the affine map of ln_2
    np.testing.assert_allclose(z.mean(-1), 0, atol=1e-12)
    np.testing.assert_allclose(z.var(-1), 1, atol=1e-3)  # var / (var + eps), just below 1


def test_post_ln_rmsnorm_block_output_rows_have_unit_mean_square():
    block = _block(prenorm=False, norm="rmsnorm")
    z = block(5 + 3 * _x((2, 3, 4))) / block.ln_2.gamma
    np.testing.assert_allclose(np.mean(z * z, axis=-1), 1, atol=1e-3)


def test_pre_ln_block_output_minus_input_is_the_sum_of_the_two_sublayer_outputs():
    block = _block(prenorm=True)
    x = 5 + 3 * _x((2, 3, 4))
    y = block(x, PAD)
    a = block.attn(block.ln_1(x), PAD)  # attention branch, on the normalised input
    m = block.mlp(block.ln_2(x + a))  # FFN branch, on the normalised stream
    np.testing.assert_allclose(y - x, a + m, rtol=1e-12, atol=1e-12)
    assert y.var(-1).max() > 2  # the stream is not normalised


def test_post_ln_block_equals_its_formula():
    block = _block(prenorm=False)
    x = _x((2, 3, 4))
    h = block.ln_1(x + block.attn(x, PAD))
    expected = block.ln_2(h + block.mlp(h))
    np.testing.assert_allclose(block(x, PAD), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("prenorm", [True, False], ids=["pre-LN", "post-LN"])
def test_causal_block_output_does_not_depend_on_later_positions(prenorm):
    block = _block(prenorm=prenorm, causal=True)
    x = _x((2, 4, 4))
    changed = x.copy()
    changed[:, 2:] += 1.0
    np.testing.assert_allclose(block(changed)[:, :2], block(x)[:, :2], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("prenorm", [True, False], ids=["pre-LN", "post-LN"])
def test_padded_positions_do_not_affect_the_real_ones(prenorm):
    block = _block(prenorm=prenorm)
    x = _x((2, 3, 4))
    changed = x.copy()
    changed[1, 2] += 10.0  # a padding position of sequence 1
    np.testing.assert_allclose(block(changed, PAD)[1, :2], block(x, PAD)[1, :2],
                               rtol=1e-12, atol=1e-12)


def test_block_in_eval_mode_ignores_dropout_and_in_training_applies_it():
    x = _x((2, 3, 4), dtype=np.float32)
    plain = TransformerBlock(4, 2, 6, seed=0)(x)
    block = TransformerBlock(4, 2, 6, dropout=0.5, seed=0)
    assert not np.allclose(block(x), plain, atol=1e-3)
    block.eval()
    assert not block.drop_attn.training and not block.drop_mlp.training
    np.testing.assert_array_equal(block(x), plain)


def test_block_seed_reproduces_weights_and_dropout_masks():
    x = _x((2, 3, 4), dtype=np.float32)
    a = TransformerBlock(4, 2, 6, dropout=0.2, seed=11)
    b = TransformerBlock(4, 2, 6, dropout=0.2, seed=11)
    for (_, pa, _), (_, pb, _) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(pa, pb)
    np.testing.assert_array_equal(a(x), b(x))
    assert not np.array_equal(TransformerBlock(4, 2, 6, seed=12).attn.qkv.W, a.attn.qkv.W)


@pytest.mark.parametrize("prenorm", [True, False], ids=["pre-LN", "post-LN"])
def test_forward_cached_matches_forward_on_the_whole_sequence(prenorm):
    block = TransformerBlock(8, 2, 16, prenorm=prenorm, causal=True, seed=0, dtype="float64")
    block.eval()
    x = _x((2, 5, 8))
    cache = KVCache(8)
    parts = [block.forward_cached(x[:, :3], cache), block.forward_cached(x[:, 3:4], cache),
             block.forward_cached(x[:, 4:], cache)]
    np.testing.assert_allclose(np.concatenate(parts, axis=1), block(x), rtol=1e-12, atol=1e-12)


def test_block_float32_stays_float32():
    block = TransformerBlock(8, 2, 16, prenorm=False, norm="rmsnorm", activation="swiglu",
                             causal=True, dropout=0.1, seed=0)
    x = _x((2, 3, 8), dtype=np.float32)
    y = block(x, PAD)
    dx = block.backward(np.ones_like(y))
    assert y.dtype == dx.dtype == np.float32
    assert all(p.dtype == g.dtype == np.float32 for _, p, g in block.named_parameters())


@pytest.mark.parametrize("kwargs, match", [
    (dict(norm="batchnorm"), r"norm: expected one of \('layernorm', 'rmsnorm'\), "
                             r"got 'batchnorm'"),
    (dict(activation="gelu_exact"), r"activation: expected one of \('gelu', 'gelu_tanh', "
                                    r"'relu', 'swiglu'\), got 'gelu_exact'"),
    (dict(dropout=1.0), r"dropout: expected a probability in \[0, 1\), got 1.0"),
    (dict(dropout=-0.5), r"dropout: expected a probability in \[0, 1\), got -0.5"),
    (dict(prenorm="yes"), r"prenorm: expected True or False, got 'yes'"),
    (dict(dtype="int32"), r"dtype: expected one of \('float32', 'float64'\), got int32"),
    (dict(eps=0.0), r"eps: expected a positive finite number, got 0.0"),
])
def test_block_rejects_bad_options_naming_the_allowed_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TransformerBlock(8, 2, 16, **kwargs)


def test_block_rejects_sizes_that_do_not_fit():
    with pytest.raises(ValueError, match="d_model: expected a positive integer, got 0"):
        TransformerBlock(0, 2, 16)
    with pytest.raises(ValueError, match="d_model: expected a multiple of n_head = 3, got 8"):
        TransformerBlock(8, 3, 16)
    with pytest.raises(ValueError, match="d_ff: expected a positive integer, got 0"):
        TransformerBlock(8, 2, 0)


def test_block_rejects_inputs_of_the_wrong_shape_or_dtype():
    block = TransformerBlock(8, 2, 16, seed=0)
    with pytest.raises(ValueError, match=r"x: expected last dimension 8, got shape \(2, 3, 4\)"):
        block(np.zeros((2, 3, 4), dtype=np.float32))
    with pytest.raises(ValueError, match="x: expected dtype float32"):
        block(np.zeros((2, 3, 8)))
    with pytest.raises(ValueError, match=r"x: expected at least 3 dimension\(s\)"):
        block(np.zeros((3, 8), dtype=np.float32))
    with pytest.raises(ValueError, match=r"attention_mask: expected shape \(2, 3\)"):
        block(np.zeros((2, 3, 8), dtype=np.float32), np.ones((2, 4)))
    block(np.zeros((2, 3, 8), dtype=np.float32))
    with pytest.raises(ValueError, match="dout: expected dtype float32"):
        block.backward(np.zeros((2, 3, 8)))
