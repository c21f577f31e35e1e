"""npformer's Mixtral-style Llama against transformers' MixtralForCausalLM.

Random Mixtral models (4 experts, top-2, grouped-query attention) are saved with
save_pretrained and loaded with npf.load_pretrained_llama. In float64 (the reference made
float64 throughout, its experts run with experts_implementation="eager") the logits agree
to the oracle tolerance, and so does every parameter gradient of the objective
cross-entropy + aux_loss_coef * aux_loss; the auxiliary loss equals transformers' value
(computed there in float32); float32 logits are measured against the float64 reference;
greedy generation gives the same tokens.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from oracle_utils import REASON, assert_close, assert_float32_no_worse, float32_error

torch = pytest.importorskip("torch", reason=REASON)
transformers = pytest.importorskip("transformers", reason=REASON)

from test_llama_oracle import float64_throughout  # noqa: E402

import npformer as npf  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = "1"

V, N_POS, D, D_FF, N_LAYER, N_HEAD, N_KV, E, K, COEF = 37, 16, 16, 12, 2, 4, 2, 4, 2, 0.02


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=V, hidden_size=D, intermediate_size=D_FF, num_hidden_layers=N_LAYER,
        num_attention_heads=N_HEAD, num_key_value_heads=N_KV, max_position_embeddings=N_POS,
        num_local_experts=E, num_experts_per_tok=K, router_aux_loss_coef=COEF,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6,
        bos_token_id=0, eos_token_id=None, pad_token_id=None)
    model = transformers.MixtralForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(path, safe_serialization=True)
    return path


def _router64(m):
    def forward(h):
        logits = torch.nn.functional.linear(h.reshape(-1, m.hidden_dim), m.weight)
        probs = torch.softmax(logits, dim=-1)
        top_v, top_i = torch.topk(probs, m.top_k, dim=-1)
        return logits, top_v / top_v.sum(dim=-1, keepdim=True), top_i
    return forward


def _reference(path, dtype=torch.float64, exact=True):
    exact = exact and dtype == torch.float64
    model = transformers.MixtralForCausalLM.from_pretrained(
        path, attn_implementation="sdpa" if exact else "eager",
        experts_implementation="eager")
    model = model.to(dtype).eval()
    if exact:
        float64_throughout(model)
        for m in model.modules():
            if type(m).__name__.endswith("TopKRouter"):
                m.forward = _router64(m)
    return model


def _aux_loss64(router_logits):
    """Hugging Face's load_balancing_loss_func, in float64 (all layers' rows pooled)."""
    logits = torch.cat(router_logits)  # (M, E)
    p = torch.softmax(logits, dim=-1)
    top = torch.topk(p, K, dim=-1).indices
    f = torch.zeros(E, dtype=torch.float64).scatter_add_(
        0, top.reshape(-1), torch.ones(top.numel(), dtype=torch.float64)) / p.shape[0]
    return E * torch.sum(f * p.mean(dim=0))


def _ids(B=3, T=N_POS, seed=1):
    return np.random.default_rng(seed).integers(0, V, size=(B, T))


def test_config(mixtral_dir):
    c = npf.load_pretrained_llama(mixtral_dir).config
    assert (c.n_expert, c.top_k, c.aux_loss_coef, c.n_kv_head, c.rope_theta) == \
        (E, K, COEF, N_KV, 1e6)


def test_logits_and_aux_loss_match_in_float64(mixtral_dir):
    ours = npf.load_pretrained_llama(mixtral_dir, dtype="float64")
    ids = _ids()
    with torch.no_grad():
        out = _reference(mixtral_dir)(torch.tensor(ids), output_router_logits=True)
        shipped = _reference(mixtral_dir, exact=False)(torch.tensor(ids)).logits.numpy()
    got = ours.forward(ids)
    print(f"\nMixtral float64 max |logit difference| {np.abs(got - out.logits.numpy()).max():.1e}"
          f" (against transformers as shipped: {np.abs(got - shipped).max():.1e}); aux_loss "
          f"{ours.aux_loss:.6f} vs {out.aux_loss.item():.6f}")
    assert_close(got, out.logits, "logits")
    assert ours.aux_loss == pytest.approx(_aux_loss64(out.router_logits).item(), rel=1e-12)
    assert ours.aux_loss == pytest.approx(out.aux_loss.item(), rel=1e-6)  # float32 there


def test_every_gradient_of_the_objective_matches_torch(mixtral_dir):
    ours = npf.load_pretrained_llama(mixtral_dir, dtype="float64").train()
    ref = _reference(mixtral_dir).train()
    ids = _ids()
    loss, dlogits = npf.next_token_loss(ours.forward(ids), ids)
    ours.zero_grad()
    ours.backward(dlogits)
    out = ref(torch.tensor(ids), output_router_logits=True)
    tloss = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, V),
                                              torch.tensor(ids[:, 1:]).reshape(-1))
    (tloss + COEF * _aux_loss64(out.router_logits)).backward()
    assert abs(loss + COEF * ours.aux_loss - tloss.item()
               - COEF * _aux_loss64(out.router_logits).item()) < 1e-12
    t = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    for name, _, g in ours.named_parameters():
        i = name.split(".")[1] if name.startswith("h.") else None
        hf = {"wte.W": t["model.embed_tokens.weight"], "ln_f.gamma": t["model.norm.weight"],
              "lm_head.W": t["lm_head.weight"].T}.get(name)
        if hf is None:
            L = f"model.layers.{i}."
            leaf = name.split(".", 2)[2]
            hf = {
                "ln_1.gamma": t[L + "input_layernorm.weight"],
                "ln_2.gamma": t[L + "post_attention_layernorm.weight"],
                "attn.qkv.W": np.concatenate([t[L + f"self_attn.{x}_proj.weight"].T
                                              for x in "qkv"], axis=1),
                "attn.proj.W": t[L + "self_attn.o_proj.weight"].T,
                "mlp.router.W": t[L + "mlp.gate.weight"].T,
                "mlp.w_gate_up": t[L + "mlp.experts.gate_up_proj"].swapaxes(1, 2),
                "mlp.w_down": t[L + "mlp.experts.down_proj"].swapaxes(1, 2),
            }[leaf]
        assert_close(g, hf, "d" + name)


def test_float32_against_the_float64_reference(mixtral_dir):
    ours = npf.load_pretrained_llama(mixtral_dir)
    ids = _ids()
    with torch.no_grad():
        theirs = _reference(mixtral_dir, torch.float32)(torch.tensor(ids)).logits
        truth = _reference(mixtral_dir)(torch.tensor(ids)).logits
    got = ours.forward(ids)
    assert got.dtype == np.float32
    assert_float32_no_worse(got, theirs, truth, "Mixtral logits", margin=2e-6)
    assert float32_error(got, truth) < 1e-5


def test_greedy_generation_gives_transformers_tokens(mixtral_dir):
    ours = npf.load_pretrained_llama(mixtral_dir, dtype="float64")
    prompt = _ids(B=2, T=4, seed=3)
    with torch.no_grad():
        theirs = _reference(mixtral_dir).generate(torch.tensor(prompt), max_new_tokens=10,
                                                 min_new_tokens=10, do_sample=False)
    np.testing.assert_array_equal(npf.generate(ours, prompt, 10, temperature=0),
                                  theirs.numpy())
