"""npformer.Encoder against a PyTorch post-LN encoder on the same weights, float64, rtol 1e-10."""

from __future__ import annotations

import numpy as np
import pytest
from oracle_utils import REASON, assert_close, t

torch = pytest.importorskip("torch", reason=REASON)

import npformer as npf  # noqa: E402
from npformer.losses import mse_loss  # noqa: E402


class TorchEncoder(torch.nn.Module):
    """wte(ids) + pe -> nn.TransformerEncoderLayer (post-LN, ReLU) x n_layer -> LayerNorm."""

    def __init__(self, model: npf.Encoder) -> None:
        super().__init__()
        c = model.config
        f64 = dict(dtype=torch.float64)
        self.wte = torch.nn.Embedding(c.vocab_size, c.d_model, **f64)
        self.register_buffer("pe", t(model.pe))
        self.layers = torch.nn.ModuleList([
            torch.nn.TransformerEncoderLayer(c.d_model, c.n_head, c.d_ff, dropout=0.0,
                                             activation="relu", layer_norm_eps=c.eps,
                                             batch_first=True, norm_first=False, **f64)
            for _ in range(c.n_layer)])
        self.ln_f = torch.nn.LayerNorm(c.d_model, eps=c.eps, **f64)
        with torch.no_grad():
            for name, p, _ in model.named_parameters():
                self.mapping(model)[name].copy_(t(torch_layout(name, p)))

    def mapping(self, model: npf.Encoder) -> dict[str, torch.nn.Parameter]:
        """npformer parameter name -> the torch parameter holding it (Linear weights as W.T)."""
        out = {"wte.W": self.wte.weight, "ln_f.gamma": self.ln_f.weight,
               "ln_f.beta": self.ln_f.bias}
        for k, layer in enumerate(self.layers):
            attn = layer.self_attn
            out.update({
                f"h.{k}.ln_1.gamma": layer.norm1.weight, f"h.{k}.ln_1.beta": layer.norm1.bias,
                f"h.{k}.attn.qkv.W": attn.in_proj_weight,
                f"h.{k}.attn.qkv.b": attn.in_proj_bias,
                f"h.{k}.attn.proj.W": attn.out_proj.weight,
                f"h.{k}.attn.proj.b": attn.out_proj.bias,
                f"h.{k}.ln_2.gamma": layer.norm2.weight, f"h.{k}.ln_2.beta": layer.norm2.bias,
                f"h.{k}.mlp.fc.W": layer.linear1.weight, f"h.{k}.mlp.fc.b": layer.linear1.bias,
                f"h.{k}.mlp.proj.W": layer.linear2.weight, f"h.{k}.mlp.proj.b": layer.linear2.bias,
            })
        assert sorted(out) == sorted(n for n, _, _ in model.named_parameters())
        return out

    def forward(self, ids):
        x = self.wte(ids) + self.pe[:ids.shape[1]]  # (B, T, d)
        for layer in self.layers:
            x = layer(x)  # x = norm1(x + sa(x)); x = norm2(x + ff(x))
        return self.ln_f(x)


def torch_layout(name: str, array: np.ndarray) -> np.ndarray:
    """Linear weights are stored (in, out) here and (out, in) in torch; the rest as they are."""
    return array.T if name.endswith(".W") and name != "wte.W" else array


def assert_gradients_match(model: npf.Encoder, ref: TorchEncoder) -> None:
    mapping = ref.mapping(model)
    for name, _, grad in model.named_parameters():
        assert_close(torch_layout(name, grad), mapping[name].grad, f"d{name}")


def make_model(config: npf.EncoderConfig) -> npf.Encoder:
    model = npf.Encoder(config, seed=0)
    rng = np.random.default_rng(1)
    for name, p, _ in model.named_parameters():  # non-trivial norms and biases
        if name.endswith((".b", ".beta")):
            p[...] = 0.1 * rng.standard_normal(p.shape)
        elif name.endswith(".gamma"):
            p[...] = 1 + 0.1 * rng.standard_normal(p.shape)
    return model


CONFIGS = {
    "seed setting": npf.EncoderConfig(dtype="float64"),
    "tiny, 3 layers": npf.EncoderConfig(vocab_size=7, block_size=6, n_layer=3, n_head=2,
                                        d_model=8, d_ff=12, dtype="float64"),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_encoder_output_and_mse_gradients_match_torch(name):
    model = make_model(CONFIGS[name])
    ids = np.random.default_rng(2).integers(0, model.config.vocab_size,
                                            (3, model.config.block_size))
    out = model.forward(ids)
    loss, dout = mse_loss(out, model.target(ids))
    model.zero_grad()
    model.backward(dout)

    ref = TorchEncoder(model)
    ids_t = torch.tensor(ids)
    out_t = ref(ids_t)
    target_t = ref.wte.weight[ids_t].detach()  # the stop-gradient target
    loss_t = torch.mean((out_t - target_t) ** 2)
    loss_t.backward()

    assert_close(out, out_t, "out")
    assert_close(np.array(loss), loss_t, "loss")
    assert_gradients_match(model, ref)


def test_encoder_gradients_for_an_arbitrary_upstream_gradient_match_torch():
    model = make_model(CONFIGS["tiny, 3 layers"])
    ids = np.random.default_rng(3).integers(0, 7, (2, 5))
    v = np.random.default_rng(4).standard_normal((2, 5, 8))
    model.zero_grad()
    model.forward(ids)
    model.backward(v)

    ref = TorchEncoder(model)
    (ref(torch.tensor(ids)) * t(v)).sum().backward()
    assert_gradients_match(model, ref)
