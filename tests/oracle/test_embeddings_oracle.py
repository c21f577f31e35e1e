"""Embeddings and positions against torch autograd, float64, rtol 1e-10."""

from __future__ import annotations

import math

import numpy as np
import pytest
from oracle_utils import REASON, assert_close, t

torch = pytest.importorskip("torch", reason=REASON)

import npformer as npf  # noqa: E402


def test_embedding_output_and_weight_gradient_match_torch_with_repeated_ids():
    rng = np.random.default_rng(0)
    emb = npf.Embedding(11, 6, seed=1, dtype="float64")
    ids = np.array([[3, 1, 3, 3, 0], [10, 1, 3, 7, 10]])  # 3, 1 and 10 repeat
    dout = rng.standard_normal((2, 5, 6))

    y = emb.forward(ids)
    emb.zero_grad()
    assert emb.backward(dout) is None

    Wt = t(emb.W, grad=True)
    yt = torch.nn.functional.embedding(torch.tensor(ids), Wt)
    yt.backward(t(dout))

    assert_close(y, yt, "y")
    assert_close(emb.dW, Wt.grad, "dW")


def test_learned_positions_output_and_gradient_match_torch():
    rng = np.random.default_rng(1)
    pos = npf.PositionalEmbedding(12, 5, seed=2, dtype="float64")
    x = rng.standard_normal((3, 4, 5))  # (B, T, d) token vectors
    dout = rng.standard_normal((3, 4, 5))

    y = x + pos.forward(4, offset=6)
    pos.zero_grad()
    pos.backward(dout)

    Wt = t(pos.W, grad=True)
    yt = t(x) + Wt[torch.arange(6, 10)]  # rows 6..9, broadcast over the batch
    yt.backward(t(dout))

    assert_close(y, yt, "y")
    assert_close(pos.dW, Wt.grad, "dW")


def test_sinusoidal_encoding_matches_the_annotated_transformer_form():
    max_len, d = 50, 16
    position = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d, 2, dtype=torch.float64) * -(math.log(10000.0) / d))
    pe = torch.zeros(max_len, d, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    assert_close(npf.sinusoidal_encoding(max_len, d, dtype="float64"), pe, "pe")


def _torch_rope(x, offset, base=10000.0):
    """RoPE with the halves pairing (Hugging Face's rotate_half), written in torch."""
    T, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    angles = torch.arange(offset, offset + T, dtype=torch.float64)[:, None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)  # (T, d)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rotate_half = torch.cat([-x2, x1], dim=-1)
    return x * emb.cos() + rotate_half * emb.sin()


@pytest.mark.parametrize("offset", [0, 5])
def test_rope_output_and_input_gradient_match_torch_autograd(offset):
    rng = np.random.default_rng(2)
    rope = npf.RoPE(8, 32, dtype="float64")
    x = rng.standard_normal((2, 3, 7, 8))  # (B, H, T, d_head)
    dout = rng.standard_normal((2, 3, 7, 8))

    y = rope.forward(x, offset=offset)
    dx = rope.backward(dout)

    xt = t(x, grad=True)
    yt = _torch_rope(xt, offset)
    yt.backward(t(dout))

    assert_close(y, yt, "y")
    assert_close(dx, xt.grad, "dx")  # autograd's dx is the inverse rotation of dout
