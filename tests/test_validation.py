"""The shared validation vocabulary, and the named errors every layer and model owes.

Each public layer and model refuses bad input with ``name: expected ..., got ...``
(or, for ``backward`` before ``forward``, a RuntimeError that says so), never with
an error from deep inside NumPy and never by silently accepting it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import npformer as npf
from npformer.models.bert import BERT, BERTConfig
from npformer.models.encoder import Encoder, EncoderConfig
from npformer.models.gpt import GPT, GPTConfig
from npformer.module import (
    check_array,
    check_bool,
    check_choice,
    check_count,
    check_ids,
    check_int,
    check_mask,
    check_positive,
    check_probability,
    check_real,
    check_seed,
    check_type,
    fail,
)
from npformer.sampling import generate

# ---------------------------------------------------------------- the vocabulary

SEED_ERROR = r"^seed: expected None, an integer >= 0, a list of them or a numpy"


def test_fail_writes_the_one_message_shape():
    with pytest.raises(ValueError, match=r"^width: expected a positive integer, got 0$"):
        fail("width", "a positive integer", 0)


@pytest.mark.parametrize("value", [True, 1.0, "3", None, np.float64(2.0)])
def test_check_int_refuses_what_is_not_an_integer(value):
    with pytest.raises(ValueError, match=r"^n: expected an integer, got "):
        check_int(value, "n")


def test_check_int_states_its_range_and_returns_a_python_int():
    assert check_int(np.int64(3), "n", low=1) == 3 and type(check_int(np.int8(3), "n")) is int
    with pytest.raises(ValueError, match=r"^n: expected a positive integer, got 0$"):
        check_int(0, "n", low=1)
    with pytest.raises(ValueError, match=r"^n: expected an integer >= 0, got -1$"):
        check_int(-1, "n", low=0)
    with pytest.raises(ValueError, match=r"^n: expected an integer in \[2, 5\], got 6$"):
        check_int(6, "n", low=2, high=5)
    with pytest.raises(ValueError, match=r"^offset: expected a non-negative integer, got -2$"):
        check_count(-2, "offset")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, True, "1", None])
def test_check_real_refuses_nan_inf_bools_and_strings(value):
    with pytest.raises(ValueError, match=r"^x: expected a number in \[0, inf\), got "):
        check_real(value, "x", low=0.0)


def test_check_real_prints_the_interval_it_checks():
    assert check_real(np.float32(0.5), "x", low=0, high=1) == 0.5
    assert check_real(1, "x", low=0, high=1, high_open=False) == 1.0
    with pytest.raises(ValueError, match=r"^x: expected a number in \(0, 1\], got 0$"):
        check_real(0, "x", low=0, high=1, low_open=True, high_open=False)
    with pytest.raises(ValueError, match=r"^eps: expected a positive finite number, got nan$"):
        check_positive(math.nan, "eps")
    with pytest.raises(ValueError, match=r"^p: expected a probability in \[0, 1\), got 1$"):
        check_probability(1, "p")


def test_check_bool_choice_and_type_name_what_they_expected():
    assert check_bool(np.bool_(True), "flag") is True
    with pytest.raises(ValueError, match=r"^flag: expected True or False, got 'no'$"):
        check_bool("no", "flag")
    with pytest.raises(ValueError, match=r"^norm: expected one of \('a', 'b'\), got 'c'$"):
        check_choice("c", "norm", ("a", "b"))
    with pytest.raises(ValueError, match=r"^norm: expected one of \('a', 'b'\), got \['a'\]$"):
        check_choice(["a"], "norm", ("a", "b"))
    with pytest.raises(ValueError, match=r"^config: expected an EncoderConfig, got dict$"):
        check_type({}, "config", EncoderConfig)


def test_check_array_checks_type_dtype_and_shape_in_that_order():
    x = np.zeros((2, 3), dtype=np.float32)
    assert check_array(x, "x", dtype=np.float32, shape=(2, 3)) is x
    with pytest.raises(ValueError, match=r"^x: expected a numpy array, got list$"):
        check_array([1.0], "x")
    with pytest.raises(ValueError, match=r"^x: expected dtype float64 \(the dtype of y\), got "):
        check_array(x, "x", dtype=np.float64, note="the {} of y")
    with pytest.raises(ValueError, match=r"^x: expected shape \(3, 2\) \(the output's\), got "):
        check_array(x, "x", shape=(3, 2), note="the output's")
    with pytest.raises(ValueError, match=r"^x: expected last dimension 4, got shape \(2, 3\)$"):
        check_array(x, "x", last_dim=4)


def test_check_ids_refuses_booleans_floats_and_ids_out_of_range():
    assert check_ids(np.array([[0, 4]]), vocab_size=5).shape == (1, 2)
    with pytest.raises(ValueError, match=r"^ids: expected an integer array, got dtype bool$"):
        check_ids(np.array([True, False]), vocab_size=5)
    with pytest.raises(ValueError, match=r"^ids: expected an integer array, got dtype float64$"):
        check_ids(np.array([1.0]), vocab_size=5)
    with pytest.raises(ValueError, match=r"^ids: expected token ids in \[0, 5\), got 5$"):
        check_ids(np.array([1, 5]), vocab_size=5)
    assert check_ids(np.array([-100, 2]), vocab_size=5, ignore_index=-100).shape == (2,)


def test_check_mask_takes_booleans_or_zeros_and_ones_and_returns_bool():
    assert check_mask(np.array([0, 1]), shape=(2,)).dtype == bool
    with pytest.raises(ValueError, match=r"^mask: expected booleans or 0/1 values, got 2$"):
        check_mask(np.array([0, 2]), shape=(2,))
    with pytest.raises(ValueError, match=r"^mask: expected shape \(3,\), got \(2,\)$"):
        check_mask(np.array([0, 1]), shape=(3,))


def test_check_seed_gives_a_generator_and_names_a_bad_seed():
    g = np.random.default_rng(1)
    assert check_seed(g) is g
    assert check_seed(7).random() == np.random.default_rng(7).random()
    assert check_seed([3, 1]).random() == np.random.default_rng([3, 1]).random()
    for bad in ("abc", -1, 1.5, True, [1, -1], [], "12"):
        with pytest.raises(ValueError, match=SEED_ERROR):
            check_seed(bad)


# ------------------------------------------------- layers and models: named errors


def _layers():
    """A fresh instance of each public layer, with an input it accepts (float64)."""
    x3 = np.random.default_rng(0).standard_normal((2, 3, 4))
    return [
        ("Linear", npf.Linear(4, 5, dtype="float64"), x3),
        ("LayerNorm", npf.LayerNorm(4, dtype="float64"), x3),
        ("RMSNorm", npf.RMSNorm(4, dtype="float64"), x3),
        ("Embedding", npf.Embedding(7, 4, dtype="float64"), np.array([[1, 2, 3]])),
        ("Encoder", Encoder(EncoderConfig(vocab_size=7, block_size=4, n_layer=1, n_head=2,
                                          d_model=4, d_ff=8, dtype="float64")),
         np.array([[1, 2, 3]])),
    ]


@pytest.mark.parametrize("name", [n for n, _, _ in _layers()])
def test_backward_before_forward_is_a_named_error(name):
    layer, x = next((m, x) for n, m, x in _layers() if n == name)
    dout = np.ones_like(layer.forward(x))
    fresh = next(m for n, m, _ in _layers() if n == name)
    with pytest.raises(RuntimeError, match=r"^backward: call forward first"):
        fresh.backward(dout)
    layer.backward(dout)  # after forward the same gradient is accepted


@pytest.mark.parametrize("make", [
    lambda seed: npf.Linear(2, 3, seed=seed),
    lambda seed: npf.Embedding(5, 2, seed=seed),
    lambda seed: npf.PositionalEmbedding(5, 2, seed=seed),
    lambda seed: npf.MultiHeadAttention(4, 2, seed=seed),
    lambda seed: npf.TransformerBlock(4, 2, 8, seed=seed),
    lambda seed: npf.Dropout(0.1, seed=seed),
    lambda seed: GPT(GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=2, d_model=4),
                     seed=seed),
    lambda seed: BERT(BERTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=2, d_model=4,
                                 d_ff=8), seed=seed),
    lambda seed: Encoder(EncoderConfig(vocab_size=5, block_size=4, n_layer=1, n_head=2,
                                       d_model=4, d_ff=8), seed=seed),
])
def test_a_seed_that_is_not_a_seed_is_refused_by_name(make):
    with pytest.raises(ValueError, match=SEED_ERROR):
        make("abc")


def test_generate_refuses_a_string_seed_by_name():
    model = GPT(GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=2, d_model=4), seed=0)
    with pytest.raises(ValueError, match=SEED_ERROR):
        generate(model, np.array([[1, 2]]), 1, seed="abc")


@pytest.mark.parametrize("make", [
    lambda std: npf.Linear(2, 3, init_std=std),
    lambda std: npf.Embedding(5, 2, init_std=std),
    lambda std: npf.PositionalEmbedding(5, 2, init_std=std),
])
@pytest.mark.parametrize("std", [math.nan, math.inf, -0.1, "0.02"])
def test_init_std_must_be_a_positive_finite_number(make, std):
    with pytest.raises(ValueError, match=r"^init_std: expected a positive finite number, got "):
        make(std)


def test_linear_bias_must_be_a_bool():
    with pytest.raises(ValueError, match=r"^bias: expected True or False, got 'no'$"):
        npf.Linear(2, 3, bias="no")
    assert npf.Linear(2, 3, bias=np.bool_(False)).has_bias is False


def _tiny_bert(**kw):
    cfg = BERTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2, d_model=8, d_ff=16,
                     dropout=0.0, dtype="float64", **kw)
    return BERT(cfg, seed=0)


def test_bert_refuses_boolean_ids_as_gpt_does():
    ids = np.array([[True, False, True]])
    with pytest.raises(ValueError, match=r"^ids: expected an integer array, got dtype bool$"):
        _tiny_bert().forward(ids)
    gpt = GPT(GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2, d_model=8), seed=0)
    with pytest.raises(ValueError, match=r"^ids: expected an integer array"):
        gpt.forward(ids)


@pytest.mark.parametrize("tie_head", [True, False])
def test_bert_backward_names_a_gradient_of_the_wrong_sequence_length(tie_head):
    model = _tiny_bert(tie_head=tie_head)
    ids = np.array([[1, 2, 3, 4]])
    logits = model.forward(ids)  # (1, 4, 11)
    with pytest.raises(ValueError, match=r"^dout: expected shape \(1, 4, 11\)"):
        model.backward(np.ones((1, 3, 11)))
    positions = np.array([[False, True, True, False]])
    model.forward_mlm(ids, positions)  # (2, 11)
    with pytest.raises(ValueError, match=r"^dout: expected shape \(2, 11\)"):
        model.backward(np.ones((3, 11)))
    model.encode(ids)
    with pytest.raises(ValueError, match=r"^dout: expected shape \(1, 4\)"):
        model.backward(np.ones((1, 5, 8)))
    assert logits.shape == (1, 4, 11)
