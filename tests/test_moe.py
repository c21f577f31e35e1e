"""Specification of the sparse mixture of experts and Mixtral-style Llama (book/moe.md)."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

import npformer as npf
from npformer.gradcheck import check_module
from npformer.losses import next_token_loss
from npformer.models.llama import llama_hf_state
from npformer.softmax import softmax

MOE = dict(vocab_size=9, block_size=6, n_layer=2, n_head=2, n_kv_head=1, d_model=8, d_ff=6,
           n_expert=4, top_k=2)


def _randomize(model, seed=1, scale=0.5):
    rng = np.random.default_rng(seed)
    for _, p, _ in model.named_parameters():
        p[...] = rng.standard_normal(p.shape) * scale
    return model


def _llama(dtype="float64", **overrides):
    return npf.Llama(npf.LlamaConfig(**{**MOE, **overrides}, dtype=dtype), seed=0)



def _sampled_fd_error(loss, p, g, n=12, eps=1e-6, seed=0):
    """Largest relative error of g against central differences at n random entries of p."""
    idx = np.random.default_rng(seed).choice(p.size, size=min(n, p.size), replace=False)
    worst = 0.0
    for i in idx:
        k = np.unravel_index(i, p.shape)
        old = p[k]
        p[k] = old + eps
        up = loss()
        p[k] = old - eps
        down = loss()
        p[k] = old
        num = (up - down) / (2 * eps)
        worst = max(worst, abs(num - g[k]) / (abs(num) + abs(g[k]) + 1e-4))  # FD noise ~1e-10
    return worst

def test_layer_matches_a_dense_reference():
    moe = npf.SparseMoE(8, 6, 4, 2, seed=0, dtype="float64")
    x = np.random.default_rng(1).standard_normal((2, 3, 8))
    y = moe.forward(x)
    xs = x.reshape(-1, 8)
    p = softmax(xs @ moe.router.W)
    expected = np.zeros_like(xs)
    for r in range(xs.shape[0]):
        chosen = np.argsort(-p[r])[:2]
        w = p[r, chosen] / p[r, chosen].sum()
        for e, we in zip(chosen, w):
            h = xs[r] @ moe.w_gate_up[e]
            a, b = h[:6], h[6:]
            expected[r] += we * ((a / (1 + np.exp(-a)) * b) @ moe.w_down[e])
    np.testing.assert_allclose(y.reshape(-1, 8), expected, rtol=1e-12, atol=1e-14)


def test_only_routed_tokens_reach_an_expert():
    moe = npf.SparseMoE(8, 6, 4, 1, seed=0, dtype="float64")
    x = np.random.default_rng(1).standard_normal((5, 8))
    moe.forward(x)
    top, routes = moe.cache[2], moe.cache[4]
    assert sum(len(rows) for rows, *_ in routes) == 5  # k = 1: each token runs once
    for e, (rows, *_rest) in enumerate(routes):
        np.testing.assert_array_equal(np.sort(rows), np.nonzero(top[:, 0] == e)[0])


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_layer_gradients_match_finite_differences(top_k):
    moe = npf.SparseMoE(8, 6, 4, top_k, seed=0, dtype="float64")
    x = np.random.default_rng(1).standard_normal((3, 4, 8))
    moe.forward(x)
    routing = moe.cache[2].copy()
    errors = check_module(moe, x)
    moe.forward(x)
    assert np.array_equal(moe.cache[2], routing)  # no crossing within +-eps
    assert max(errors.values()) < 1e-7, errors


def test_unchosen_logits_get_gradient_only_from_the_aux_loss():
    moe = npf.SparseMoE(8, 6, 4, 2, seed=0, dtype="float64")
    x = np.random.default_rng(1).standard_normal((6, 8))
    moe.forward(x)
    top = moe.cache[2]
    captured = {}
    moe.router.backward = lambda dz: captured.setdefault("dz", dz.copy()) @ moe.router.W.T
    moe.backward(np.random.default_rng(2).standard_normal((6, 8)))
    unchosen = np.ones((6, 4), bool)
    np.put_along_axis(unchosen, top, False, axis=-1)
    assert np.all(captured["dz"][unchosen] == 0)


def test_aux_loss_is_mixtral_pooled_formula():
    model = _randomize(_llama(n_layer=3))
    ids = np.random.default_rng(3).integers(0, 9, (2, 6))
    model.forward(ids)
    probs = [b.mlp.cache[1] for b in model.h]
    tops = [b.mlp.cache[2] for b in model.h]
    M = sum(p.shape[0] for p in probs)
    f = np.bincount(np.concatenate([t.ravel() for t in tops]), minlength=4) / M
    P = np.concatenate(probs).sum(0) / M
    assert model.aux_loss == pytest.approx(4 * np.dot(f, P), rel=1e-12)
    assert _llama(n_expert=0).forward(ids) is not None
    dense = _llama(n_expert=0)
    dense.forward(ids)
    assert dense.aux_loss == 0.0


def test_model_objective_gradient_includes_the_aux_loss():
    model = _randomize(_llama(aux_loss_coef=0.5))
    ids = np.random.default_rng(2).integers(0, 9, (2, 6))

    def objective():
        loss, dlogits = next_token_loss(model.forward(ids), ids)
        return loss + 0.5 * model.aux_loss, dlogits

    model.zero_grad()
    _, dlogits = objective()
    model.backward(dlogits)
    for name, p, g in model.named_parameters():
        assert _sampled_fd_error(lambda: objective()[0], p, g) < 1e-5, name


def test_trainer_objective_adds_the_aux_term():
    from npformer.train import next_token_objective

    model = _randomize(_llama(aux_loss_coef=0.25))
    ids = np.random.default_rng(2).integers(0, 9, (2, 6))
    loss, _ = next_token_objective(model, ids, np.random.default_rng(0))
    ce, _ = next_token_loss(model.forward(ids), ids)
    assert loss == pytest.approx(ce + 0.25 * model.aux_loss, rel=1e-12)


def test_bad_expert_settings():
    with pytest.raises(ValueError, match="^top_k: expected at most n_expert = 2, got 3"):
        npf.LlamaConfig(**{**MOE, "n_expert": 2, "top_k": 3})
    with pytest.raises(ValueError, match="^top_k: expected"):
        npf.SparseMoE(8, 6, 2, 3)
    with pytest.raises(ValueError, match="^n_expert: expected"):
        npf.LlamaConfig(**{**MOE, "n_expert": -1})


def test_generate_save_load_and_mixtral_directory(tmp_path):
    model = _randomize(_llama(block_size=12), scale=0.3)
    prompt = np.random.default_rng(4).integers(0, 9, (2, 3))
    np.testing.assert_array_equal(npf.generate(model, prompt, 6, temperature=0),
                                  npf.generate(model, prompt, 6, temperature=0,
                                               use_cache=False))
    npf.save(model, tmp_path / "moe.safetensors")
    ids = np.random.default_rng(5).integers(0, 9, (2, 6))
    np.testing.assert_array_equal(npf.load(tmp_path / "moe.safetensors").forward(ids),
                                  model.forward(ids))
    c = model.config
    hf = {"model_type": "mixtral", "vocab_size": 9, "hidden_size": 8, "intermediate_size": 6,
          "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
          "max_position_embeddings": 12, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.01,
          "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    state = llama_hf_state(model)
    assert state["model.layers.1.block_sparse_moe.experts.3.w2.weight"].shape == (8, 6)
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = npf.load_pretrained_llama(tmp_path, dtype="float64")
    assert loaded.config == c
    np.testing.assert_array_equal(loaded.forward(ids), model.forward(ids))


SCRIPT = """
import numpy as np, npformer as npf
from npformer.distributed import DistributedTrainer, MPIWorld
comm = MPIWorld()
text = np.tile(np.arange(9), 40)
cfg = npf.TrainConfig(steps=4, batch_size=4, block_size=6, lr=1e-2, warmup_steps=1,
                      eval_interval=4, eval_batches=1, log_interval=4)
model = npf.Llama(npf.LlamaConfig(vocab_size=9, block_size=6, n_layer=2, n_head=2,
                                  n_kv_head=1, d_model=8, d_ff=6, n_expert=4, top_k=2,
                                  aux_loss_coef=0.5, dtype="float64"), seed=0)
records = DistributedTrainer(model, text[:300], text[300:], cfg, comm=comm).fit()
if comm.rank == 0:
    np.savez("two.npz", loss=[r["train_loss"] for r in records],
             **{n: p for n, p, _ in model.named_parameters()})
"""


def test_two_mpi_processes_train_the_one_process_moe(tmp_path):
    """The routing statistics are summed over the ranks: one pooled auxiliary loss."""
    import os
    import shutil
    import subprocess
    import sys

    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if mpiexec is None:
        pytest.skip("mpiexec is not installed: pip install -e '.[mpi]'")
    (tmp_path / "script.py").write_text(SCRIPT)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    run = subprocess.run([mpiexec, "-n", "2", sys.executable, "script.py"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    text = np.tile(np.arange(9), 40)
    cfg = npf.TrainConfig(steps=4, batch_size=4, block_size=6, lr=1e-2, warmup_steps=1,
                          eval_interval=4, eval_batches=1, log_interval=4)
    model = _llama(aux_loss_coef=0.5)
    records = npf.Trainer(model, text[:300], text[300:], cfg).fit()
    two = np.load(tmp_path / "two.npz")
    np.testing.assert_allclose(two["loss"], [r["train_loss"] for r in records], rtol=1e-10)
    for name, p, _ in model.named_parameters():
        np.testing.assert_allclose(two[name], p, rtol=1e-9, atol=1e-12, err_msg=name)
