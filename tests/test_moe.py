"""Specification of the sparse mixture of experts and Mixtral-style Llama (book/moe.md)."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

import npformer as npf
from npformer.gradcheck import check_module, numerical_gradient, relative_error
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
    """Expert e's slots hold the rows that chose it, in row order; its other slots are 0."""
    moe = npf.SparseMoE(8, 6, 4, 1, seed=0, dtype="float64")
    x = np.random.default_rng(1).standard_normal((5, 8))
    moe.forward(x)
    top, counts, xe = moe.cache[2], moe.cache[4], moe.cache[6]
    assert xe.shape == (4, 5, 8)  # capacity_factor None: C = BT slots per expert
    np.testing.assert_array_equal(counts, np.bincount(top[:, 0], minlength=4))
    for e in range(4):
        rows = np.nonzero(top[:, 0] == e)[0]
        np.testing.assert_array_equal(xe[e, :len(rows)], x[rows])
        assert np.all(xe[e, len(rows):] == 0)


def _loop_reference(moe, x, v):
    """The per-expert loop (each expert gathers the rows that chose it), forward and
    backward of <v, y> with no auxiliary term: y, dx and the three weight gradients."""
    xs, g, k = x.reshape(-1, moe.d_model), v.reshape(-1, moe.d_model), moe.top_k
    p = softmax(xs @ moe.router.W)
    top = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    pk = np.take_along_axis(p, top, axis=-1)
    gates = pk / pk.sum(-1, keepdims=True)
    y, dx, c = np.zeros_like(xs), np.zeros_like(xs), np.zeros_like(gates)
    dgu, ddown = np.zeros_like(moe.w_gate_up), np.zeros_like(moe.w_down)
    for e in range(moe.n_expert):
        rows, slot = np.nonzero(top == e)
        h = xs[rows] @ moe.w_gate_up[e]
        a, b = h[:, :moe.d_ff], h[:, moe.d_ff:]
        s = 1 / (1 + np.exp(-a))
        act = a * s * b
        out = act @ moe.w_down[e]
        y[rows] += gates[rows, slot, None] * out
        c[rows, slot] = (g[rows] * out).sum(-1)
        dout_e = g[rows] * gates[rows, slot, None]
        ddown[e] += act.T @ dout_e
        dact = dout_e @ moe.w_down[e].T
        dh = np.concatenate([dact * b * s * (1 + a * (1 - s)), dact * a * s], axis=-1)
        dgu[e] += xs[rows].T @ dh
        dx[rows] += dh @ moe.w_gate_up[e].T
    dz = np.zeros_like(p)
    np.put_along_axis(dz, top, gates * (c - (gates * c).sum(-1, keepdims=True)), axis=-1)
    return y, dx + dz @ moe.router.W.T, xs.T @ dz, dgu, ddown


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_slots_equal_the_per_expert_loop_when_nothing_is_dropped(top_k):
    moe = npf.SparseMoE(8, 6, 4, top_k, seed=0, dtype="float64")
    rng = np.random.default_rng(1)
    x, v = rng.standard_normal((3, 7, 8)), rng.standard_normal((3, 7, 8))
    moe.zero_grad()
    y = moe.forward(x)
    assert np.all(moe.cache[5] < 4 * 21)  # every choice has a slot: none in the bin
    dx = moe.backward(v)
    ref = _loop_reference(moe, x, v)
    got = (y.reshape(-1, 8), dx.reshape(-1, 8), moe.router.dW, moe.dw_gate_up, moe.dw_down)
    for name, a, b in zip(("y", "dx", "router.dW", "dw_gate_up", "dw_down"), got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14, err_msg=name)


def test_dispatch_slots_queue_first_choices_first():
    """The chapter's figure: 3 rows, 3 experts, top-2, capacity 2. Row 2's first choice
    is expert 0's third; it goes to the overflow bin (slot E C = 6)."""
    from npformer.moe import dispatch_slots

    top = np.array([[0, 1], [0, 2], [0, 1]])
    slot, counts = dispatch_slots(top, 3, 2)
    np.testing.assert_array_equal(slot, [[0, 2], [1, 4], [6, 3]])
    np.testing.assert_array_equal(counts, [3, 2, 1])  # choices, dropped ones included
    slot, _ = dispatch_slots(top, 3, 3)  # room for all: nothing in the bin
    np.testing.assert_array_equal(slot, [[0, 3], [1, 6], [2, 4]])


def test_capacity_is_ceil_of_factor_times_even_share_at_most_the_rows():
    assert npf.SparseMoE(8, 6, 4, 2).capacity(15) == 15  # None: every row fits
    assert npf.SparseMoE(8, 6, 4, 2, capacity_factor=1.0).capacity(15) == 8  # ceil(7.5)
    assert npf.SparseMoE(8, 6, 4, 2, capacity_factor=1.25).capacity(16) == 10
    assert npf.SparseMoE(8, 6, 4, 2, capacity_factor=9.0).capacity(15) == 15
    assert _llama(capacity_factor=1.5).h[1].mlp.capacity_factor == 1.5


def _capped_layer(factor=0.5, top_k=2):
    """A float64 layer with capacity_factor below 1 on 15 rows: some choices are dropped."""
    moe = npf.SparseMoE(8, 6, 4, top_k, seed=0, dtype="float64", capacity_factor=factor)
    return moe, np.random.default_rng(1).standard_normal((3, 5, 8))


def test_dropped_choices_contribute_exactly_zero():
    moe, x = _capped_layer()
    y = moe.forward(x).reshape(-1, 8)
    xs, p, top, gates, counts, slot, xe, a, out, _ = moe.cache
    C = moe.capacity(15)
    dropped = slot == 4 * C
    assert C == 4 and dropped.sum() == 30 - np.minimum(counts, C).sum() > 0  # 30 choices
    assert np.all(out[dropped] == 0)
    # the queue by hand: first choices in row order, then second choices; C places each
    taken, expected = np.zeros(4, int), np.zeros_like(xs)
    for r in range(2):
        for i in range(15):
            e = top[i, r]
            if taken[e] < C:
                taken[e] += 1
                h = xs[i] @ moe.w_gate_up[e]
                act = h[:6] / (1 + np.exp(-h[:6])) * h[6:]
                expected[i] += gates[i, r] * (act @ moe.w_down[e])
            else:
                assert dropped[i, r]
    np.testing.assert_allclose(y, expected, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_gradients_with_dropped_choices_match_finite_differences(factor):
    moe, x = _capped_layer(factor)
    moe.forward(x)
    routing, slots = moe.cache[2].copy(), moe.cache[5].copy()
    assert np.any(slots == 4 * moe.capacity(15))  # some choice is dropped
    errors = check_module(moe, x)
    moe.forward(x)
    assert np.array_equal(moe.cache[2], routing) and np.array_equal(moe.cache[5], slots)
    assert max(errors.values()) < 1e-7, errors


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


def _aux_objective_gradients():
    """A model whose loss adds its aux loss, that loss as a function, and its gradients."""
    model = _randomize(_llama(aux_loss_coef=0.5))
    ids = np.random.default_rng(2).integers(0, 9, (2, 6))

    def loss():
        value, dlogits = next_token_loss(model.forward(ids), ids)
        return value + 0.5 * model.aux_loss, dlogits

    model.zero_grad()
    model.backward(loss()[1])
    return model, lambda: loss()[0]


def test_model_objective_gradient_includes_the_aux_loss():
    model, loss = _aux_objective_gradients()
    for name, p, g in model.named_parameters():
        assert _sampled_fd_error(loss, p, g) < 1e-5, name


def test_model_objective_gradient_matches_finite_differences_at_every_coordinate():
    """The chapter's check in full: the chapter samples sixteen coordinates of each array."""
    model, loss = _aux_objective_gradients()
    for name, p, g in model.named_parameters():
        assert relative_error(g, numerical_gradient(loss, p)) < 1e-7, name


def test_trainer_objective_adds_the_aux_term():
    from npformer.train import next_token_objective

    model = _randomize(_llama(aux_loss_coef=0.25))
    ids = np.random.default_rng(2).integers(0, 9, (2, 6))
    loss, _ = next_token_objective(model, ids, np.random.default_rng(0))
    ce, _ = next_token_loss(model.forward(ids), ids)
    assert loss == pytest.approx(ce + 0.25 * model.aux_loss, rel=1e-12)


def test_bad_capacity_factor_is_refused_by_name():
    for bad in (0, -1.0, float("nan"), float("inf"), "1.25", True):
        with pytest.raises(ValueError, match="^capacity_factor: expected None or a positive "
                                             "finite number, got "):
            npf.SparseMoE(8, 6, 4, 2, capacity_factor=bad)
        with pytest.raises(ValueError, match="^capacity_factor: expected None or a positive"):
            npf.LlamaConfig(**{**MOE, "capacity_factor": bad})


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
