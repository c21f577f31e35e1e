"""npformer's GPT and GPT-2 loader against Hugging Face transformers and torch autograd.

A small random GPT2LMHeadModel is saved with save_pretrained (safetensors) to a temporary
directory and loaded with npf.load_pretrained_gpt2 in float64. Logits must agree to 1e-9;
with the same next-token loss, every parameter gradient must agree with torch's to the
oracle tolerance (rtol 1e-10, atol 1e-12). The tied wte gradient includes the head's use.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from oracle_utils import (
    REASON,
    assert_close,
    assert_float32_no_worse,
    float32_error,
    hf_to_ours,
    save_random_gpt2,
)

torch = pytest.importorskip("torch", reason=REASON)
transformers = pytest.importorskip("transformers", reason=REASON)

from safetensors.numpy import load_file, save_file  # noqa: E402

import npformer as npf  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = "1"

V, N_POS, D, N_LAYER, N_HEAD = 37, 16, 12, 2, 3



@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A random GPT2LMHeadModel (every parameter random, LayerNorms included), saved."""
    return save_random_gpt2(tmp_path_factory.mktemp("gpt2"), 0, vocab_size=V, n_positions=N_POS,
                            n_embd=D, n_layer=N_LAYER, n_head=N_HEAD)


def _torch_reference(path):
    model = transformers.GPT2LMHeadModel.from_pretrained(path, attn_implementation="eager")
    return model.double().eval()


def _ids(B=3, T=N_POS, seed=1):
    return np.random.default_rng(seed).integers(0, V, size=(B, T))


def test_config_maps_gpt2_facts(gpt2_dir):
    model = npf.load_pretrained_gpt2(gpt2_dir, dtype="float64")
    c = model.config
    assert (c.vocab_size, c.block_size, c.n_layer, c.n_head, c.d_model, c.d_ff) == \
        (V, N_POS, N_LAYER, N_HEAD, D, 4 * D)
    assert (c.activation, c.eps, c.dropout, c.dtype) == ("gelu_tanh", 1e-5, 0.0, "float64")
    assert not model.training


def test_checkpoint_holds_no_lm_head_and_conv1d_weights_are_in_out(gpt2_dir):
    state = load_file(gpt2_dir / "model.safetensors")
    assert "lm_head.weight" not in state
    assert state["transformer.h.0.attn.c_attn.weight"].shape == (D, 3 * D)
    assert state["transformer.h.0.mlp.c_proj.weight"].shape == (4 * D, D)


def test_logits_match_transformers_within_1e_9_in_float64(gpt2_dir):
    ours = npf.load_pretrained_gpt2(gpt2_dir, dtype="float64")
    ref = _torch_reference(gpt2_dir)
    ids = _ids()
    with torch.no_grad():
        expected = ref(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours.forward(ids), expected, rtol=0, atol=1e-9)
    assert_close(ours.forward(ids), expected, "logits")


def test_every_parameter_gradient_matches_torch_for_the_same_loss(gpt2_dir):
    ours = npf.load_pretrained_gpt2(gpt2_dir, dtype="float64")
    ref = _torch_reference(gpt2_dir)
    ids = _ids()

    logits = ours.forward(ids)
    loss, dlogits = npf.next_token_loss(logits, ids)
    ours.zero_grad()
    ours.backward(dlogits)

    tlogits = ref(torch.tensor(ids)).logits  # (B, T, V)
    tloss = torch.nn.functional.cross_entropy(tlogits[:, :-1].reshape(-1, V),
                                              torch.tensor(ids[:, 1:]).reshape(-1))
    tloss.backward()

    assert abs(loss - tloss.item()) < 1e-12
    tgrads = {hf_to_ours(n): p.grad for n, p in ref.named_parameters()}
    assert set(tgrads) == {name for name, _, _ in ours.named_parameters()}
    for name, _, g in ours.named_parameters():
        assert_close(g, tgrads[name], "d" + name)


def test_float32_load_is_as_accurate_as_transformers_in_float32(gpt2_dir):
    """Both float32 forwards measured against the float64 reference, never each other."""
    ours = npf.load_pretrained_gpt2(gpt2_dir)  # float32 by default
    ref = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
    ids = _ids()
    with torch.no_grad():
        theirs = ref(torch.tensor(ids)).logits
        truth = _torch_reference(gpt2_dir)(torch.tensor(ids)).logits
    got = ours.forward(ids)
    assert got.dtype == np.float32
    # Errors are relative to max(1, |logit|); measured 2e-7 on both sides.
    assert_float32_no_worse(got, theirs, truth, "GPT-2 logits", margin=1e-6)
    assert float32_error(got, truth) < 1e-4


def test_names_without_prefix_and_a_stored_tied_head_load_the_same(gpt2_dir, tmp_path):
    state = load_file(gpt2_dir / "model.safetensors")
    bare = {k.removeprefix("transformer."): v for k, v in state.items()}
    bare["lm_head.weight"] = bare["wte.weight"].copy()
    save_file(bare, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((gpt2_dir / "config.json").read_text())
    a = npf.load_pretrained_gpt2(gpt2_dir, dtype="float64")
    b = npf.load_pretrained_gpt2(tmp_path, dtype="float64")
    ids = _ids(B=2, T=5)
    assert np.array_equal(a.forward(ids), b.forward(ids))


def test_loader_rejects_missing_files_untied_heads_and_missing_tensors(gpt2_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model_dir: expected a directory holding "
                                                r"config.json and model.safetensors"):
        npf.load_pretrained_gpt2(tmp_path)
    state = load_file(gpt2_dir / "model.safetensors")
    config = json.loads((gpt2_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))

    untied = dict(state, **{"lm_head.weight": state["transformer.wte.weight"] + 1})
    save_file(untied, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"expected lm_head.weight tied to wte.weight"):
        npf.load_pretrained_gpt2(tmp_path)

    partial = {k: v for k, v in state.items() if "h.1.mlp.c_fc.bias" not in k}
    save_file(partial, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['h.1.mlp.c_fc.bias'\]"):
        npf.load_pretrained_gpt2(tmp_path)

    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(dict(config, activation_function="relu")))
    with pytest.raises(ValueError, match=r"config.json: expected activation_function in "
                                         r".*got 'relu'"):
        npf.load_pretrained_gpt2(tmp_path)
