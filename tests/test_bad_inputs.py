"""A sweep of bad values through every argument of the public layers and configs.

Each value either is valid for that argument (and is accepted) or raises a
ValueError whose message starts with an argument's name (this one, or the one it
conflicts with: ``n_head`` too large names ``d_model``, which it must divide). No
other exception may escape (no TypeError from deep inside NumPy, no
AttributeError); the one exception is a size of 10**12, which asks for terabytes:
NumPy's MemoryError (or its "array is too big") is then the truth.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import npformer as npf
from npformer.train import TrainConfig

BAD = [None, "abc", -1, 0, 1.5, float("nan"), float("inf"), True, [1, 2], 10**12,
       np.float64(2.0), np.int64(-3), object()]

CALLABLES = {
    "Linear": (npf.Linear, {"d_in": 4, "d_out": 3}),
    "LayerNorm": (npf.LayerNorm, {"d": 4}),
    "RMSNorm": (npf.RMSNorm, {"d": 4}),
    "Embedding": (npf.Embedding, {"num_embeddings": 5, "d": 4}),
    "PositionalEmbedding": (npf.PositionalEmbedding, {"max_len": 5, "d": 4}),
    "RoPE": (npf.RoPE, {"d_head": 4, "max_len": 8}),
    "GELU": (npf.GELU, {}),
    "Dropout": (npf.Dropout, {"p": 0.1}),
    "MultiHeadAttention": (npf.MultiHeadAttention, {"d_model": 8, "n_head": 2}),
    "GPTConfig": (npf.GPTConfig, {"vocab_size": 11, "block_size": 8, "n_layer": 1,
                                  "n_head": 2, "d_model": 8}),
    "BERTConfig": (npf.BERTConfig, {"vocab_size": 11, "block_size": 8, "n_layer": 1,
                                    "n_head": 2, "d_model": 8, "d_ff": 16}),
    "EncoderConfig": (npf.EncoderConfig, {"vocab_size": 11, "block_size": 8, "n_layer": 1,
                                          "n_head": 2, "d_model": 8, "d_ff": 16}),
    "TrainConfig": (TrainConfig, {}),
    "TransformerConfig": (npf.TransformerConfig, {"src_vocab_size": 11, "tgt_vocab_size": 7,
                                                  "block_size": 8, "n_layer": 1, "n_head": 2,
                                                  "d_model": 8}),
    "CrossAttention": (npf.CrossAttention, {"d_model": 8, "n_head": 2}),
}

CASES = [(name, arg, i) for name, (fn, _) in CALLABLES.items()
         for arg in inspect.signature(fn).parameters
         for i in range(len(BAD))]


@pytest.mark.parametrize("name, arg, i", CASES)
def test_a_bad_argument_is_accepted_or_named(name, arg, i):
    fn, base = CALLABLES[name]
    kwargs = {**base, arg: BAD[i]}
    names = tuple(inspect.signature(fn).parameters)
    try:
        fn(**kwargs)
    except ValueError as exc:
        if BAD[i] == 10**12 and "array is too big" in str(exc):
            return
        assert str(exc).startswith(names), f"{name}({arg}={BAD[i]!r}): {exc}"
    except MemoryError:
        assert BAD[i] == 10**12
