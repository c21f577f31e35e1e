"""npformer attention against torch autograd, float64, rtol 1e-10.

scaled_dot_product_attention against torch.nn.functional.scaled_dot_product_attention
(and against the explicit softmax formula); MultiHeadAttention against
torch.nn.MultiheadAttention loaded with the same weights, and, with RoPE, against
a torch module written out by hand (Hugging Face's rotate_half form).
"""

from __future__ import annotations

import numpy as np
import pytest
from oracle_utils import REASON, assert_close, t

torch = pytest.importorskip("torch", reason=REASON)

import torch.nn.functional as F  # noqa: E402

import npformer as npf  # noqa: E402
from npformer.attention import attention_backward, causal_mask  # noqa: E402

B, H, T, D = 2, 3, 6, 4


def masks() -> dict[str, np.ndarray | None]:
    """Bool masks, True = may attend, broadcastable to (B, H, T, T)."""
    right = np.ones((B, T), dtype=bool)
    right[0, 4:] = False  # sequence 0 ends with two pads
    left = np.ones((B, T), dtype=bool)
    left[1, :2] = False  # sequence 1 starts with two pads
    return {
        "none": None,
        "causal": causal_mask(T),
        "padding": right[:, None, None, :],
        "causal+right padding": causal_mask(T) & right[:, None, None, :],
        "causal+left padding (fully masked rows)": causal_mask(T) & left[:, None, None, :],
    }


MASKS = masks()


def explicit_torch_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(d) with -inf where forbidden) v; fully masked rows set to 0."""
    s = q @ k.transpose(-1, -2) / np.sqrt(q.shape[-1])
    if mask is None:
        return torch.softmax(s, dim=-1) @ v
    m = torch.as_tensor(mask.copy()).expand(s.shape)
    seen = m.any(dim=-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~(m | ~seen), float("-inf")), dim=-1)
    return torch.where(seen, p, torch.zeros_like(p)) @ v


@pytest.mark.parametrize("reference", ["F.scaled_dot_product_attention", "explicit softmax"])
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_attention_output_and_gradients_match_torch(mask_name, reference):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, T, D)) for _ in range(3))
    dout = rng.standard_normal((B, H, T, D))
    mask = MASKS[mask_name]

    out, cache = npf.scaled_dot_product_attention(q, k, v, mask)
    dq, dk, dv = attention_backward(dout, cache)

    qt, kt, vt = t(q, grad=True), t(k, grad=True), t(v, grad=True)
    if reference == "explicit softmax":
        outt = explicit_torch_attention(qt, kt, vt, mask)
    else:
        mt = None if mask is None else torch.as_tensor(mask.copy())  # causal_mask is read-only
        outt = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mt)
    outt.backward(t(dout))

    assert_close(out, outt, "out")
    assert_close(dq, qt.grad, "dq")
    assert_close(dk, kt.grad, "dk")
    assert_close(dv, vt.grad, "dv")


def test_cross_attention_with_different_lengths_matches_torch():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((B, H, 3, D))
    k, v = rng.standard_normal((B, H, 7, D)), rng.standard_normal((B, H, 7, 5))
    mask = np.ones((B, 1, 1, 7), dtype=bool)
    mask[1, ..., 5:] = False
    dout = rng.standard_normal((B, H, 3, 5))
    out, cache = npf.scaled_dot_product_attention(q, k, v, mask)
    grads = attention_backward(dout, cache)
    qt, kt, vt = t(q, grad=True), t(k, grad=True), t(v, grad=True)
    outt = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=torch.as_tensor(mask.copy()))
    outt.backward(t(dout))
    assert_close(out, outt, "out")
    for name, g, ref in zip(("dq", "dk", "dv"), grads, (qt.grad, kt.grad, vt.grad)):
        assert_close(g, ref, name)


# --------------------------------------------------------------------------- multi-head


def torch_mha_from(layer: npf.MultiHeadAttention):
    """torch.nn.MultiheadAttention holding the same weights (torch stores (out, in))."""
    d, bias = layer.d_model, layer.qkv.has_bias
    ref = torch.nn.MultiheadAttention(d, layer.n_head, bias=bias, batch_first=True,
                                      dtype=torch.float64)
    with torch.no_grad():
        ref.in_proj_weight.copy_(t(layer.qkv.W.T))  # rows: W_Q^T, W_K^T, W_V^T
        ref.out_proj.weight.copy_(t(layer.proj.W.T))
        if bias:
            ref.in_proj_bias.copy_(t(layer.qkv.b))
            ref.out_proj.bias.copy_(t(layer.proj.b))
    return ref


MHA_CASES = {
    "bidirectional": (False, True, None),
    "bidirectional+padding": (False, True, np.array([[1, 1, 1, 1, 0, 0], [1] * 6])),
    "causal": (True, True, None),
    "causal+right padding": (True, True, np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])),
    "causal, no bias": (True, False, None),
}


@pytest.mark.parametrize("case", list(MHA_CASES))
def test_multihead_attention_matches_torch_multiheadattention(case):
    causal, bias, attention_mask = MHA_CASES[case]
    rng = np.random.default_rng(2)
    layer = npf.MultiHeadAttention(12, 3, causal=causal, bias=bias, seed=3, dtype="float64")
    if bias:
        layer.qkv.b[:] = rng.standard_normal(36)
        layer.proj.b[:] = rng.standard_normal(12)
    x = rng.standard_normal((B, T, 12))
    dout = rng.standard_normal((B, T, 12))

    y = layer.forward(x, attention_mask)
    layer.zero_grad()
    dx = layer.backward(dout)

    ref = torch_mha_from(layer)
    xt = t(x, grad=True)
    kwargs = {"need_weights": False}
    if causal:
        kwargs["attn_mask"] = torch.as_tensor(~causal_mask(T))  # torch: True = blocked
    if attention_mask is not None:
        kwargs["key_padding_mask"] = torch.as_tensor(attention_mask == 0)  # True = ignore
    yt = ref(xt, xt, xt, **kwargs)[0]
    yt.backward(t(dout))

    assert_close(y, yt, "y")
    assert_close(dx, xt.grad, "dx")
    assert_close(layer.qkv.dW, ref.in_proj_weight.grad.T, "qkv.dW")
    assert_close(layer.proj.dW, ref.out_proj.weight.grad.T, "proj.dW")
    if bias:
        assert_close(layer.qkv.db, ref.in_proj_bias.grad, "qkv.db")
        assert_close(layer.proj.db, ref.out_proj.bias.grad, "proj.db")


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def torch_rope_attention(x, Wqkv, bqkv, Wo, bo, n_head, attention_mask, base=10000.0):
    """Causal self-attention with RoPE as in Hugging Face's Llama (rotate_half)."""
    Bx, Tx, d = x.shape
    d_head = d // n_head
    q, k, v = (x @ Wqkv + bqkv).split(d, dim=-1)  # (B, T, d) each
    q, k, v = (z.view(Bx, Tx, n_head, d_head).transpose(1, 2) for z in (q, k, v))
    inv_freq = base ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)
    freqs = torch.outer(torch.arange(Tx, dtype=torch.float64), inv_freq)  # (T, d_head/2)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    mask = torch.as_tensor(causal_mask(Tx) & (attention_mask[:, None, None, :] == 1))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, d_head)
    return out.transpose(1, 2).reshape(Bx, Tx, d) @ Wo + bo


def test_multihead_attention_with_rope_matches_a_torch_llama_style_attention():
    rng = np.random.default_rng(4)
    rope = npf.RoPE(4, T, dtype="float64")
    layer = npf.MultiHeadAttention(8, 2, causal=True, rope=rope, seed=5, dtype="float64")
    layer.qkv.b[:] = rng.standard_normal(24)
    layer.proj.b[:] = rng.standard_normal(8)
    x = rng.standard_normal((B, T, 8))
    attention_mask = np.array([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])  # left padding
    dout = rng.standard_normal((B, T, 8))

    y = layer.forward(x, attention_mask)
    layer.zero_grad()
    dx = layer.backward(dout)

    xt = t(x, grad=True)
    params = {name: t(p, grad=True) for name, p, _ in layer.named_parameters()}
    yt = torch_rope_attention(xt, params["qkv.W"], params["qkv.b"], params["proj.W"],
                              params["proj.b"], 2, attention_mask)
    yt.backward(t(dout))

    assert_close(y, yt, "y")
    assert_close(dx, xt.grad, "dx")
    for name, _, grad in layer.named_parameters():
        assert_close(grad, params[name].grad, f"d{name}")


def test_kv_cache_generation_matches_torch_full_forward():
    rng = np.random.default_rng(6)
    layer = npf.MultiHeadAttention(12, 3, causal=True, seed=7, dtype="float64")
    layer.qkv.b[:] = rng.standard_normal(36)
    x = rng.standard_normal((B, T, 12))
    cache = npf.KVCache(T)
    y = np.concatenate([layer.forward_cached(x[:, i:i + 1], cache) for i in range(T)], axis=1)
    xt = t(x)
    yt = torch_mha_from(layer)(xt, xt, xt, attn_mask=torch.as_tensor(~causal_mask(T)),
                               need_weights=False)[0]
    assert_close(y, yt, "y")
