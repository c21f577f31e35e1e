"""FeedForward and TransformerBlock against torch autograd, float64, rtol 1e-10 (atol 1e-12).

Each NumPy module is copied into a torch module with the same structure, parameter by
parameter through named_parameters() and a table of renames; outputs, the input gradient
and every parameter gradient are compared. The block is checked against torch's own
nn.TransformerEncoderLayer (norm_first=False: post-LN, norm_first=True: pre-LN).
"""

from __future__ import annotations

import numpy as np
import pytest
from oracle_utils import REASON, assert_close, t

torch = pytest.importorskip("torch", reason=REASON)

import torch.nn.functional as F  # noqa: E402

import npformer as npf  # noqa: E402

D, D_FF = 8, 12


def _randomize(module, seed=1, scale=0.5):
    rng = np.random.default_rng(seed)
    for _, p, _ in module.named_parameters():
        p[...] = rng.standard_normal(p.shape) * scale
    return module


def _leaf_rename(ours: str) -> str:
    """npformer name -> torch name for modules built alike: fc.W -> fc.weight, ..."""
    prefix, leaf = ours.rsplit(".", 1)
    return prefix + "." + {"W": "weight", "b": "bias", "gamma": "weight", "beta": "bias"}[leaf]


def _copy_into(module, tmod, rename) -> None:
    """Copy every npformer parameter into ``tmod``; W is (in, out), torch stores (out, in)."""
    tparams = dict(tmod.named_parameters())
    assert {rename(n) for n, _, _ in module.named_parameters()} == set(tparams)
    with torch.no_grad():
        for name, p, _ in module.named_parameters():
            tparams[rename(name)].copy_(t(p.T if name.endswith(".W") else p))


def _assert_grads_match(module, tmod, rename) -> None:
    """Every parameter gradient, matched by name through ``rename``."""
    tparams = dict(tmod.named_parameters())
    for name, _, g in module.named_parameters():
        tg = tparams[rename(name)].grad
        assert_close(g, tg.T if name.endswith(".W") else tg, "d" + name)


class TorchFFN(torch.nn.Module):
    def __init__(self, activation: str, bias: bool):
        super().__init__()
        width = 2 * D_FF if activation == "swiglu" else D_FF
        self.fc = torch.nn.Linear(D, width, bias=bias, dtype=torch.float64)
        self.proj = torch.nn.Linear(D_FF, D, bias=bias, dtype=torch.float64)
        self.activation = activation

    def forward(self, x):
        h = self.fc(x)
        if self.activation == "swiglu":
            gate, value = h.chunk(2, dim=-1)
            a = F.silu(gate) * value
        elif self.activation == "relu":
            a = F.relu(h)
        else:
            a = F.gelu(h, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.proj(a)


@pytest.mark.parametrize("activation, bias", [
    ("gelu", True), ("gelu_tanh", True), ("relu", True), ("swiglu", True), ("swiglu", False)])
def test_feedforward_output_and_gradients_match_torch(activation, bias):
    rng = np.random.default_rng(0)
    ffn = _randomize(npf.FeedForward(D, D_FF, activation=activation, bias=bias, seed=0,
                                     dtype="float64"))
    x = rng.standard_normal((3, 5, D))
    dout = rng.standard_normal((3, 5, D))
    y = ffn.forward(x)
    ffn.zero_grad()
    dx = ffn.backward(dout)

    tffn = TorchFFN(activation, bias)
    _copy_into(ffn, tffn, _leaf_rename)
    xt = t(x, grad=True)
    yt = tffn(xt)
    yt.backward(t(dout))

    assert_close(y, yt, "y")
    assert_close(dx, xt.grad, "dx")
    _assert_grads_match(ffn, tffn, _leaf_rename)


# --------------------------------------------------------------------- the block

# npformer name -> torch.nn.TransformerEncoderLayer name: the whole "pretrained loader"
ENCODER_LAYER_NAMES = {
    "ln_1.gamma": "norm1.weight", "ln_1.beta": "norm1.bias",
    "attn.qkv.W": "self_attn.in_proj_weight", "attn.qkv.b": "self_attn.in_proj_bias",
    "attn.proj.W": "self_attn.out_proj.weight", "attn.proj.b": "self_attn.out_proj.bias",
    "ln_2.gamma": "norm2.weight", "ln_2.beta": "norm2.bias",
    "mlp.fc.W": "linear1.weight", "mlp.fc.b": "linear1.bias",
    "mlp.proj.W": "linear2.weight", "mlp.proj.b": "linear2.bias",
}
TORCH_ACTIVATION = {"relu": "relu", "gelu": "gelu",
                    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh")}
PAD = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])  # 1 = token, 0 = padding


def _encoder_layer(block, activation: str, norm: str):
    layer = torch.nn.TransformerEncoderLayer(
        D, 2, D_FF, dropout=0.0, activation=TORCH_ACTIVATION[activation],
        layer_norm_eps=block.ln_1.eps, batch_first=True, norm_first=block.prenorm,
        dtype=torch.float64)
    if norm == "rmsnorm":
        layer.norm1 = torch.nn.RMSNorm(D, eps=block.ln_1.eps, dtype=torch.float64)
        layer.norm2 = torch.nn.RMSNorm(D, eps=block.ln_2.eps, dtype=torch.float64)
    return layer


@pytest.mark.parametrize("prenorm, norm, activation, masking", [
    (False, "layernorm", "gelu", "padded"),  # BERT
    (False, "layernorm", "gelu", "causal"),
    (False, "layernorm", "relu", "causal+padded"),  # the original transformer's FFN
    (True, "layernorm", "gelu_tanh", "causal"),  # GPT-2
    (True, "layernorm", "gelu_tanh", "padded"),
    (True, "layernorm", "gelu_tanh", "causal+padded"),
    (True, "rmsnorm", "gelu", "causal+padded"),
    (False, "rmsnorm", "relu", "padded"),
])
def test_block_matches_torch_transformer_encoder_layer(prenorm, norm, activation, masking):
    rng = np.random.default_rng(0)
    block = _randomize(npf.TransformerBlock(D, 2, D_FF, prenorm=prenorm, norm=norm,
                                            activation=activation, causal="causal" in masking,
                                            seed=0, dtype="float64"))
    x = rng.standard_normal((3, 5, D))
    dout = rng.standard_normal((3, 5, D))
    mask = PAD if "padded" in masking else None
    y = block.forward(x, mask)
    block.zero_grad()
    dx = block.backward(dout)

    layer = _encoder_layer(block, activation, norm)
    rename = {n: ENCODER_LAYER_NAMES[n] for n, _, _ in block.named_parameters()}
    _copy_into(block, layer, rename.get)
    xt = t(x, grad=True)
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)  # True = may not attend
    yt = layer(xt, src_mask=causal if "causal" in masking else None,
               src_key_padding_mask=torch.tensor(PAD == 0) if mask is not None else None,
               is_causal="causal" in masking)
    yt.backward(t(dout))

    assert_close(y, yt, "y")
    assert_close(dx, xt.grad, "dx")
    _assert_grads_match(block, layer, rename.get)
