"""npformer's Llama and its loader against Hugging Face transformers and torch autograd.

Random LlamaForCausalLM models (grouped-query and multi-head attention, tied and untied
embeddings, a non-default rope_theta given as rope_parameters) are saved with
save_pretrained to a temporary directory and loaded with npf.load_pretrained_llama.
In float64 the logits and every parameter gradient agree with transformers' to the
oracle tolerance; in float32 both sides are measured against the float64 reference;
greedy generation gives the same tokens.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from oracle_utils import REASON, assert_close, assert_float32_no_worse, float32_error

torch = pytest.importorskip("torch", reason=REASON)
transformers = pytest.importorskip("transformers", reason=REASON)

import npformer as npf  # noqa: E402
from npformer.models.llama import _from_hf, llama_hf_names  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = "1"

V, N_POS, D, D_FF, N_LAYER, N_HEAD = 37, 24, 32, 40, 2, 4
CASES = {  # name -> (n_kv_head, tied, rope_theta)
    "gqa": (2, False, 500000.0),
    "mqa_tied": (1, True, 10000.0),
    "mha": (4, False, 10000.0),
}


def _save_random_llama(path, n_kv_head, tied, theta):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=D_FF, num_hidden_layers=N_LAYER,
        num_attention_heads=N_HEAD, num_key_value_heads=n_kv_head,
        max_position_embeddings=N_POS, rms_norm_eps=1e-6, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        bos_token_id=0, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():  # norms' gains too: no parameter at a special value
            p.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=sorted(CASES))
def llama_dir(request, tmp_path_factory):
    n_kv_head, tied, theta = CASES[request.param]
    path = _save_random_llama(tmp_path_factory.mktemp(request.param), n_kv_head, tied, theta)
    return path, (n_kv_head, tied, theta)


def float64_throughout(model):
    """Make a float64 transformers Llama/Mixtral compute in float64 everywhere.

    As shipped, three steps round through float32 whatever the model's dtype: RMSNorm
    casts its input to float32, the rotary embedding computes its cos/sin tables in
    float32, and eager attention takes its softmax in float32. A float64 reference
    redoes those three in float64 (and uses the sdpa attention, which keeps the dtype).
    """
    c = model.config
    theta = c.rope_parameters["rope_theta"]
    d_head = c.hidden_size // c.num_attention_heads
    inv_freq = 1.0 / theta ** (torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)

    def rope(x, position_ids):
        angles = position_ids[..., None].double() * inv_freq  # (B, T, d_head / 2)
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def rms_norm(m):
        def forward(x):
            return m.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                               + m.variance_epsilon))
        return forward

    model.model.rotary_emb.forward = rope
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = rms_norm(m)
    return model


def _reference(path, dtype=torch.float64, exact=True):
    """transformers' model in dtype; float64 with exact=True is float64 throughout."""
    impl = "sdpa" if dtype == torch.float64 and exact else "eager"
    model = transformers.LlamaForCausalLM.from_pretrained(path, attn_implementation=impl)
    model = model.to(dtype).eval()
    return float64_throughout(model) if dtype == torch.float64 and exact else model


def _ids(B=3, T=N_POS, seed=1):
    return np.random.default_rng(seed).integers(0, V, size=(B, T))


def test_config_maps_the_hugging_face_facts(llama_dir):
    path, (n_kv_head, tied, theta) = llama_dir
    c = npf.load_pretrained_llama(path, dtype="float64").config
    assert (c.vocab_size, c.block_size, c.n_layer, c.n_head, c.n_kv_head, c.d_model,
            c.d_ff) == (V, N_POS, N_LAYER, N_HEAD, n_kv_head, D, D_FF)
    assert (c.tie_embeddings, c.rope_theta, c.norm_eps) == (tied, theta, 1e-6)


def test_logits_match_transformers_in_float64(llama_dir):
    path, _ = llama_dir
    ours = npf.load_pretrained_llama(path, dtype="float64")
    ids = _ids()
    with torch.no_grad():
        expected = _reference(path)(torch.tensor(ids)).logits.numpy()
    with torch.no_grad():
        as_shipped = _reference(path, exact=False)(torch.tensor(ids)).logits.numpy()
    got = ours.forward(ids)
    print(f"\nfloat64 max |logit difference| {np.abs(got - expected).max():.1e} "
          f"(against transformers as shipped, with its float32 steps: "
          f"{np.abs(got - as_shipped).max():.1e})")
    assert_close(got, expected, "logits")


def test_every_parameter_gradient_matches_torch(llama_dir):
    path, _ = llama_dir
    ours = npf.load_pretrained_llama(path, dtype="float64").train()
    ref = _reference(path).train()
    ids = _ids()
    loss, dlogits = npf.next_token_loss(ours.forward(ids), ids)
    ours.zero_grad()
    ours.backward(dlogits)
    tlogits = ref(torch.tensor(ids)).logits
    tloss = torch.nn.functional.cross_entropy(tlogits[:, :-1].reshape(-1, V),
                                              torch.tensor(ids[:, 1:]).reshape(-1))
    tloss.backward()
    assert abs(loss - tloss.item()) < 1e-12
    tgrads = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    names = llama_hf_names(ours.config)
    for name, _, g in ours.named_parameters():
        assert_close(g, _from_hf(name, [tgrads[t] for t in names[name]]), "d" + name)


def test_float32_is_as_accurate_as_transformers_in_float32(llama_dir):
    path, _ = llama_dir
    ours = npf.load_pretrained_llama(path)  # float32 by default
    ids = _ids()
    with torch.no_grad():
        theirs = _reference(path, torch.float32)(torch.tensor(ids)).logits
        truth = _reference(path)(torch.tensor(ids)).logits
    got = ours.forward(ids)
    assert got.dtype == np.float32
    # errors relative to max(1, |logit|); the bound is 1e-5, measured about 1e-6
    assert_float32_no_worse(got, theirs, truth, "Llama logits", margin=2e-6)
    assert float32_error(got, truth) < 1e-5


def test_greedy_generation_gives_transformers_tokens(llama_dir):
    path, _ = llama_dir
    ours = npf.load_pretrained_llama(path, dtype="float64")
    ref = _reference(path)
    prompt = _ids(B=2, T=5, seed=3)
    with torch.no_grad():
        theirs = ref.generate(torch.tensor(prompt), max_new_tokens=12, do_sample=False,
                              min_new_tokens=12).numpy()
    mine = npf.generate(ours, prompt, 12, temperature=0)
    np.testing.assert_array_equal(mine, theirs)


def test_half_loaded_models_are_never_returned(llama_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    path, _ = llama_dir
    state = load_file(path / "model.safetensors")
    state["model.layers.1.mlp.down_proj.weight"] = state[
        "model.layers.1.mlp.down_proj.weight"][:, :-1].copy()
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"h\.1\.mlp\.proj\.W"):
        npf.load_pretrained_llama(tmp_path)
