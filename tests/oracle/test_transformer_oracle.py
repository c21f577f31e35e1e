"""The encoder-decoder of book/seq2seq.md against torch autograd, float64, rtol 1e-10.

CrossAttention against torch.nn.MultiheadAttention called as cross-attention (query from
one sequence, key and value from another, key_padding_mask), with a memory as wide as the
model and a narrower one (kdim, vdim). Transformer against torch.nn.Transformer loaded
with the same weights, plus the same scaled embeddings and sinusoids in front and the
tied output layer behind: post-LN without the stacks' final LayerNorms (the paper; torch's
stacks built with norm=None), post-LN with them (plain nn.Transformer), and pre-LN with
shared embeddings. The label-smoothed loss against F.cross_entropy(label_smoothing=...).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from oracle_utils import REASON, assert_close, t

torch = pytest.importorskip("torch", reason=REASON)

import torch.nn.functional as F  # noqa: E402

import npformer as npf  # noqa: E402
from npformer.losses import smoothed_cross_entropy  # noqa: E402
from npformer.models.transformer import CrossAttention, Transformer, TransformerConfig  # noqa: E402

B, S, T = 3, 6, 5


def _randomize(module, seed=1, scale=0.5):
    rng = np.random.default_rng(seed)
    for _, p, _ in module.named_parameters():
        p[...] = rng.standard_normal(p.shape) * scale
    return module


def _src_mask():
    mask = np.ones((B, S), dtype=bool)
    mask[1, 4:] = False  # two pads
    mask[2, 2:] = False  # four pads
    return mask


def _copy(dst, array):
    with torch.no_grad():
        dst.copy_(torch.tensor(np.ascontiguousarray(array)))


# --------------------------------------------------------------------- cross-attention


def _torch_mha(cross: CrossAttention):
    d, dm = cross.d_model, cross.d_memory
    mha = torch.nn.MultiheadAttention(d, cross.n_head, batch_first=True, kdim=dm, vdim=dm,
                                      dtype=torch.float64)
    W = {n: p for n, p, _ in cross.named_parameters()}
    if dm == d:  # one stacked (3d, d) in_proj_weight: rows [q; k; v]
        _copy(mha.in_proj_weight, np.concatenate([W["q.W"], W["kv.W"]], axis=1).T)
    else:  # separate projections when kdim != embed_dim
        _copy(mha.q_proj_weight, W["q.W"].T)
        _copy(mha.k_proj_weight, W["kv.W"][:, :d].T)
        _copy(mha.v_proj_weight, W["kv.W"][:, d:].T)
    _copy(mha.in_proj_bias, np.concatenate([W["q.b"], W["kv.b"]]))
    _copy(mha.out_proj.weight, W["proj.W"].T)
    _copy(mha.out_proj.bias, W["proj.b"])
    return mha


@pytest.mark.parametrize("d_memory", [8, 6])
@pytest.mark.parametrize("padded", [False, True])
def test_cross_attention_matches_torch_multihead_attention(d_memory, padded):
    rng = np.random.default_rng(0)
    cross = _randomize(CrossAttention(8, 2, d_memory=d_memory, seed=0, dtype="float64"))
    x, memory = rng.standard_normal((B, T, 8)), rng.standard_normal((B, S, d_memory))
    mask = _src_mask() if padded else None
    dout = rng.standard_normal((B, T, 8))
    cross.zero_grad()
    out = cross(x, memory, mask)
    dx, dmemory = cross.backward(dout)

    mha = _torch_mha(cross)
    xt, mt = t(x, grad=True), t(memory, grad=True)
    kpm = None if mask is None else torch.tensor(~mask)
    ref, _ = mha(xt, mt, mt, key_padding_mask=kpm, need_weights=False)
    ref.backward(t(dout))
    assert_close(out, ref, "cross-attention output")
    assert_close(dx, xt.grad, "dL/dx: the decoder stream")
    assert_close(dmemory, mt.grad, "dL/dmemory: the encoder stream")
    g = {n: grad for n, _, grad in cross.named_parameters()}
    d = 8
    if d_memory == d:
        w = mha.in_proj_weight.grad.numpy()
        assert_close(g["q.W"], w[:d].T, "q.W")
        assert_close(g["kv.W"], w[d:].T, "kv.W")
    else:
        assert_close(g["q.W"], mha.q_proj_weight.grad.numpy().T, "q.W")
        assert_close(g["kv.W"][:, :d], mha.k_proj_weight.grad.numpy().T, "kv.W (keys)")
        assert_close(g["kv.W"][:, d:], mha.v_proj_weight.grad.numpy().T, "kv.W (values)")
    b = mha.in_proj_bias.grad.numpy()
    assert_close(g["q.b"], b[:d], "q.b")
    assert_close(g["kv.b"], b[d:], "kv.b")
    assert_close(g["proj.W"], mha.out_proj.weight.grad.numpy().T, "proj.W")
    assert_close(g["proj.b"], mha.out_proj.bias.grad, "proj.b")


# --------------------------------------------------------------------- the whole model


def torch_names(c: TransformerConfig) -> dict[str, tuple[str, bool]]:
    """npformer name -> (nn.Transformer parameter name, transposed?); cross-attention's
    q and kv are rows [0, d) and [d, 3d) of in_proj and are handled apart."""
    names = {}
    for n in range(c.n_layer):
        e, te = f"encoder.{n}.", f"encoder.layers.{n}."
        d, td = f"decoder.{n}.", f"decoder.layers.{n}."
        for ours, theirs in ((e + "attn.qkv", te + "self_attn.in_proj"),
                             (d + "self_attn.qkv", td + "self_attn.in_proj")):
            names[ours + ".W"], names[ours + ".b"] = (theirs + "_weight", True), \
                (theirs + "_bias", False)
        pairs = [(e + "attn.proj", te + "self_attn.out_proj"), (e + "mlp.fc", te + "linear1"),
                 (e + "mlp.proj", te + "linear2"),
                 (d + "self_attn.proj", td + "self_attn.out_proj"),
                 (d + "cross_attn.proj", td + "multihead_attn.out_proj"),
                 (d + "mlp.fc", td + "linear1"), (d + "mlp.proj", td + "linear2")]
        for ours, theirs in pairs:
            names[ours + ".W"], names[ours + ".b"] = (theirs + ".weight", True), \
                (theirs + ".bias", False)
        norms = [(e + "ln_1", te + "norm1"), (e + "ln_2", te + "norm2"),
                 (d + "ln_1", td + "norm1"), (d + "ln_2", td + "norm2"), (d + "ln_3", td + "norm3")]
        for ours, theirs in norms:
            names[ours + ".gamma"], names[ours + ".beta"] = (theirs + ".weight", False), \
                (theirs + ".bias", False)
    if c.final_norm:
        for ours, theirs in (("enc_ln_f", "encoder.norm"), ("dec_ln_f", "decoder.norm")):
            names[ours + ".gamma"], names[ours + ".beta"] = (theirs + ".weight", False), \
                (theirs + ".bias", False)
    return names


def build_torch(model: Transformer):
    c = model.config
    kw = dict(d_model=c.d_model, nhead=c.n_head, dim_feedforward=c.d_ff, dropout=0.0,
              activation="relu", layer_norm_eps=c.eps, batch_first=True,
              norm_first=c.norm_first, dtype=torch.float64)
    if c.final_norm:  # plain nn.Transformer: it always adds the stacks' final LayerNorms
        tr = torch.nn.Transformer(num_encoder_layers=c.n_layer, num_decoder_layers=c.n_layer,
                                  **kw)
    else:  # the paper's post-LN: stacks without them, passed as custom stacks
        enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(**kw), c.n_layer,
                                          norm=None, enable_nested_tensor=False)
        dec = torch.nn.TransformerDecoder(torch.nn.TransformerDecoderLayer(**kw), c.n_layer,
                                          norm=None)
        tr = torch.nn.Transformer(custom_encoder=enc, custom_decoder=dec, **kw)
    params = dict(tr.named_parameters())
    ours = {n: p for n, p, _ in model.named_parameters()}
    for name, (theirs, transpose) in torch_names(c).items():
        _copy(params[theirs], ours[name].T if transpose else ours[name])
    for n in range(c.n_layer):
        p = f"decoder.{n}.cross_attn."
        _copy(params[f"decoder.layers.{n}.multihead_attn.in_proj_weight"],
              np.concatenate([ours[p + "q.W"], ours[p + "kv.W"]], axis=1).T)
        _copy(params[f"decoder.layers.{n}.multihead_attn.in_proj_bias"],
              np.concatenate([ours[p + "q.b"], ours[p + "kv.b"]]))
    src_emb = t(ours["src_emb.W"], grad=True)
    tgt_emb = src_emb if c.share_embeddings else t(ours["tgt_emb.W"], grad=True)
    return tr, src_emb, tgt_emb


LAYOUTS = {
    "post-LN, no final norms (the paper)": dict(norm_first=False),
    "post-LN with final norms (plain nn.Transformer)": dict(norm_first=False, final_norm=True),
    "pre-LN, shared embeddings": dict(norm_first=True, share_embeddings=True),
}


@pytest.mark.filterwarnings("ignore:enable_nested_tensor")  # torch's pre-LN encoder note
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_transformer_logits_and_every_gradient_match_torch(layout):
    overrides = LAYOUTS[layout]
    shared = overrides.get("share_embeddings", False)
    config = TransformerConfig(src_vocab_size=9, tgt_vocab_size=9 if shared else 7,
                               block_size=8, n_layer=2, n_head=2, d_model=8, d_ff=12,
                               dropout=0.0, dtype="float64", **overrides)
    model = _randomize(Transformer(config, seed=0))
    rng = np.random.default_rng(2)
    src = rng.integers(0, config.src_vocab_size, size=(B, S))
    tgt = rng.integers(0, config.tgt_vocab_size, size=(B, T))
    mask = _src_mask()
    model.zero_grad()
    logits = model.forward(src, tgt, mask)
    dlogits = rng.standard_normal(logits.shape)
    model.backward(dlogits)

    tr, src_emb, tgt_emb = build_torch(model)
    pe = t(npf.sinusoidal_encoding(config.block_size, config.d_model, dtype="float64"))
    scale = math.sqrt(config.d_model)
    x = src_emb[torch.tensor(src)] * scale + pe[:S]
    y = tgt_emb[torch.tensor(tgt)] * scale + pe[:T]
    kpm = torch.tensor(~mask)  # torch: True = padding
    causal = torch.nn.Transformer.generate_square_subsequent_mask(T, dtype=torch.float64)
    out = tr(x, y, tgt_mask=causal, src_key_padding_mask=kpm, memory_key_padding_mask=kpm,
             tgt_is_causal=True)
    ref = out @ tgt_emb.T  # the tied output layer
    ref.backward(t(dlogits))
    assert_close(logits, ref, f"{layout}: logits")

    grads = {n: g for n, _, g in model.named_parameters()}
    tparams = dict(tr.named_parameters())
    checked = 0
    for name, (theirs, transpose) in torch_names(config).items():
        g = tparams[theirs].grad.numpy()
        assert_close(grads[name], g.T if transpose else g, f"{layout}: {name}")
        checked += 1
    for n in range(config.n_layer):
        p, d = f"decoder.{n}.cross_attn.", config.d_model
        w = tparams[f"decoder.layers.{n}.multihead_attn.in_proj_weight"].grad.numpy()
        b = tparams[f"decoder.layers.{n}.multihead_attn.in_proj_bias"].grad.numpy()
        assert_close(grads[p + "q.W"], w[:d].T, f"{layout}: {p}q.W")
        assert_close(grads[p + "kv.W"], w[d:].T, f"{layout}: {p}kv.W")
        assert_close(grads[p + "q.b"], b[:d], f"{layout}: {p}q.b")
        assert_close(grads[p + "kv.b"], b[d:], f"{layout}: {p}kv.b")
        checked += 4
    assert_close(grads["src_emb.W"], src_emb.grad, f"{layout}: src_emb.W")
    checked += 1
    if not shared:
        assert_close(grads["tgt_emb.W"], tgt_emb.grad, f"{layout}: tgt_emb.W")
        checked += 1
    assert checked == len(grads)  # every parameter array compared


# --------------------------------------------------------------------- label smoothing


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("ignore_index", [None, 0])
def test_label_smoothing_matches_torch_cross_entropy(smoothing, ignore_index):
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((2, 6, 9)) * 3
    targets = rng.integers(0, 9, size=(2, 6))
    targets[1, 3:] = 0  # padding id 0
    loss, dlogits = smoothed_cross_entropy(logits, targets, smoothing=smoothing,
                                           ignore_index=ignore_index)
    zt = t(logits, grad=True)
    ref = F.cross_entropy(zt.reshape(-1, 9), torch.tensor(targets).reshape(-1),
                          label_smoothing=smoothing,
                          ignore_index=-100 if ignore_index is None else ignore_index)
    ref.backward()
    assert_close(np.array(loss), ref, "loss")
    assert_close(dlogits, zt.grad, "dlogits")
