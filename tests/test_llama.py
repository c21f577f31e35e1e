"""Specification of grouped-query attention and the Llama-style decoder (book/llama.md)."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import npformer as npf
from npformer.attention import MultiHeadAttention
from npformer.gradcheck import check_module, numerical_gradient, relative_error
from npformer.losses import next_token_loss
from npformer.models.llama import GroupedQueryAttention, llama_hf_state
from npformer.sampling import generate

TINY = dict(vocab_size=7, block_size=6, n_layer=2, n_head=4, n_kv_head=2, d_model=16,
            d_ff=12)


def _randomize(model, seed=1, scale=0.5):
    rng = np.random.default_rng(seed)
    for _, p, _ in model.named_parameters():
        p[...] = rng.standard_normal(p.shape) * scale
    return model


def _model(dtype="float64", seed=0, **overrides):
    return npf.Llama(npf.LlamaConfig(**{**TINY, **overrides}, dtype=dtype), seed=seed)


def _ids(shape=(2, 6), vocab=7, seed=2):
    return np.random.default_rng(seed).integers(0, vocab, size=shape)


# ------------------------------------------------------------------ configuration



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

def test_config_defaults_and_json_round_trip():
    cfg = npf.LlamaConfig(vocab_size=11, block_size=8, n_layer=1, n_head=4, d_model=32)
    assert cfg.n_kv_head == 4 and cfg.d_ff == 88 and cfg.rope_theta == 10000.0
    assert cfg.norm_eps == 1e-6 and not cfg.tie_embeddings and cfg.n_expert == 0
    again = npf.LlamaConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert again == cfg
    positional = npf.LlamaConfig(11, 8, 1, 4, 2, 32, 64)  # the positional order
    assert (positional.n_kv_head, positional.d_model, positional.d_ff) == (2, 32, 64)


@pytest.mark.parametrize("overrides, name", [
    (dict(n_head=4, n_kv_head=3), "n_kv_head"),
    (dict(n_kv_head=0), "n_kv_head"),
    (dict(d_model=15), "d_model"),
    (dict(d_model=12, n_head=4, n_kv_head=2), "d_model"),  # odd d_head: no RoPE pairs
    (dict(n_expert=2, top_k=3), "top_k"),
    (dict(rope_theta=0.0), "rope_theta"),
    (dict(dtype="float16"), "dtype"),
    (dict(tie_embeddings=1), "tie_embeddings"),
])
def test_config_rejects_bad_values_naming_them(overrides, name):
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        npf.LlamaConfig(**{**TINY, **overrides})


# ------------------------------------------------------------------ grouped-query attention


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_gqa_gradients_match_finite_differences(n_kv_head):
    rope = npf.RoPE(4, 8, dtype="float64")
    layer = GroupedQueryAttention(16, 4, n_kv_head, rope=rope, seed=0, dtype="float64")
    x = np.random.default_rng(1).standard_normal((2, 5, 16))
    errors = check_module(layer, x)
    assert max(errors.values()) < 1e-7, errors


def test_gqa_equals_mha_with_repeated_kv_heads():
    d, h, hkv, dh = 16, 4, 2, 4
    rope = npf.RoPE(dh, 8, dtype="float64")
    gqa = GroupedQueryAttention(d, h, hkv, rope=rope, seed=3, dtype="float64")
    W = gqa.qkv.W
    rep = lambda w: np.repeat(w.reshape(d, hkv, 1, dh), h // hkv, axis=2).reshape(d, d)  # noqa
    mha = MultiHeadAttention(d, h, causal=True, bias=False, rope=rope, seed=0, dtype="float64")
    mha.qkv.W[...] = np.concatenate([W[:, :d], rep(W[:, d:d + hkv * dh]),
                                     rep(W[:, d + hkv * dh:])], axis=1)
    mha.proj.W[...] = gqa.proj.W
    x = np.random.default_rng(4).standard_normal((3, 6, d))
    np.testing.assert_allclose(gqa(x), mha(x), rtol=1e-12, atol=1e-14)


def test_gqa_shared_head_gradient_is_the_group_sum():
    """dK of a shared head equals the sum of the dK that MHA gives its g copies."""
    d, h, hkv, dh = 16, 4, 2, 4
    rope = npf.RoPE(dh, 8, dtype="float64")
    gqa = GroupedQueryAttention(d, h, hkv, rope=rope, seed=3, dtype="float64")
    mha = MultiHeadAttention(d, h, causal=True, bias=False, rope=rope, seed=0, dtype="float64")
    W = gqa.qkv.W
    rep = lambda w: np.repeat(w.reshape(d, hkv, 1, dh), h // hkv, axis=2).reshape(d, d)  # noqa
    mha.qkv.W[...] = np.concatenate([W[:, :d], rep(W[:, d:d + hkv * dh]),
                                     rep(W[:, d + hkv * dh:])], axis=1)
    mha.proj.W[...] = gqa.proj.W
    x = np.random.default_rng(4).standard_normal((2, 5, d))
    g = np.random.default_rng(5).standard_normal((2, 5, d))
    for m in (gqa, mha):
        m.zero_grad()
        m.forward(x)
    dx_gqa, dx_mha = gqa.backward(g), mha.backward(g)
    np.testing.assert_allclose(dx_gqa, dx_mha, rtol=1e-11, atol=1e-13)
    summed = mha.qkv.dW[:, d:].reshape(d, 2, hkv, h // hkv, dh).sum(axis=3).reshape(d, -1)
    np.testing.assert_allclose(gqa.qkv.dW[:, d:], summed, rtol=1e-11, atol=1e-13)


def test_gqa_cache_holds_kv_heads_only_and_matches_forward():
    model = _randomize(_model())
    ids = _ids()
    cache = model.new_cache()
    parts = [model.forward_cached(ids[:, a:b], cache) for a, b in ((0, 2), (2, 5), (5, 6))]
    assert cache[0].k.shape == (2, 2, 6, 4)
    np.testing.assert_allclose(np.concatenate(parts, 1), model.forward(ids), rtol=1e-11,
                               atol=1e-12)


# ------------------------------------------------------------------ the model


@pytest.mark.parametrize("tie", [False, True])
def test_model_gradients_match_finite_differences(tie):
    model = _randomize(_model(tie_embeddings=tie, n_layer=1))
    ids = _ids()
    model.zero_grad()
    _, dlogits = next_token_loss(model.forward(ids), ids)
    model.backward(dlogits)
    names = [n for n, _, _ in model.named_parameters()]
    assert ("lm_head.W" in names) != tie
    for name, p, g in model.named_parameters():
        loss = lambda: next_token_loss(model.forward(ids), ids)[0]  # noqa: E731
        assert _sampled_fd_error(loss, p, g) < 1e-5, name


def test_two_block_model_gradients_match_finite_differences_at_every_coordinate():
    """The chapter's check in full: the chapter samples sixteen coordinates of each array."""
    model = _randomize(_model())
    ids = _ids()
    model.zero_grad()
    _, dlogits = next_token_loss(model.forward(ids), ids)
    model.backward(dlogits)
    assert "lm_head.W" in [n for n, _, _ in model.named_parameters()]
    for name, p, g in model.named_parameters():
        num = numerical_gradient(lambda: next_token_loss(model.forward(ids), ids)[0], p)
        assert relative_error(g, num) < 1e-7, name


def test_no_biases_and_parameter_names():
    names = {n for n, _, _ in _model().named_parameters()}
    assert not any(n.endswith(".b") for n in names)
    assert {"wte.W", "h.0.ln_1.gamma", "h.0.attn.qkv.W", "h.0.attn.proj.W", "h.0.ln_2.gamma",
            "h.0.mlp.fc.W", "h.0.mlp.proj.W", "ln_f.gamma", "lm_head.W"} <= names


def test_causal():
    model = _randomize(_model())
    ids = _ids()
    changed = ids.copy()
    changed[:, -1] = (changed[:, -1] + 1) % 7
    np.testing.assert_array_equal(model.forward(ids)[:, :-1], model.forward(changed)[:, :-1])


def test_float32_forward_and_backward_stay_float32():
    model = _model(dtype="float32")
    ids = _ids()
    logits = model.forward(ids)
    assert logits.dtype == np.float32
    _, dlogits = next_token_loss(logits, ids)
    model.backward(dlogits)
    assert all(g.dtype == np.float32 for _, _, g in model.named_parameters())


def test_generate_with_and_without_cache_agree():
    model = _randomize(_model(n_kv_head=1, block_size=12), scale=0.3)
    prompt = _ids((2, 3))
    a = generate(model, prompt, 8, temperature=0, use_cache=True)
    b = generate(model, prompt, 8, temperature=0, use_cache=False)
    np.testing.assert_array_equal(a, b)


def test_bad_ids_and_cache():
    model = _model()
    with pytest.raises(ValueError, match="^ids: expected"):
        model.forward(np.array([[0, 7]]))
    with pytest.raises(ValueError, match="^ids: expected"):
        model.forward(np.zeros((1, 7), dtype=int))
    with pytest.raises(ValueError, match="^cache: expected"):
        model.forward_cached(np.zeros((1, 2), dtype=int), [])
    with pytest.raises(RuntimeError):
        _model().backward(np.zeros((1, 2, 7)))


def test_save_load_round_trip(tmp_path):
    model = _randomize(_model(tie_embeddings=True))
    npf.save(model, tmp_path / "llama.safetensors")
    again = npf.load(tmp_path / "llama.safetensors")
    assert isinstance(again, npf.Llama) and again.config == model.config
    ids = _ids()
    np.testing.assert_array_equal(again.forward(ids), model.forward(ids))


def test_trainer_lowers_the_loss():
    text = np.tile(np.arange(7), 40)
    cfg = npf.TrainConfig(steps=30, batch_size=4, block_size=6, lr=1e-2, warmup_steps=2,
                          eval_interval=30, eval_batches=1, log_interval=30)
    model = _model(dtype="float32")
    trainer = npf.Trainer(model, text[:200], text[200:], cfg)
    first = trainer.evaluate()
    trainer.fit()
    assert trainer.evaluate() < first - 0.5


def test_cli_trains_llama(tmp_path, capsys):
    from npformer.cli import main

    corpus = tmp_path / "text.txt"
    corpus.write_text("abcabcabd " * 200)
    rc = main(["train", "llama", "--data", str(corpus), "--out", str(tmp_path / "run"),
               "--steps", "3", "--n-layer", "1", "--n-head", "2", "--d-model", "16",
               "--block-size", "8", "--batch-size", "2", "--eval-interval", "3",
               "--eval-batches", "1", "--log-interval", "1", "--quiet"])
    assert rc == 0
    assert isinstance(npf.load(tmp_path / "run" / "ckpt.safetensors"), npf.Llama)
    rc = main(["train", "llama", "--data", str(corpus), "--out", str(tmp_path / "moe"),
               "--steps", "2", "--n-layer", "1", "--n-head", "2", "--n-kv-head", "1",
               "--n-expert", "4", "--top-k", "2", "--d-model", "16", "--block-size", "8",
               "--batch-size", "2", "--eval-interval", "2", "--eval-batches", "1", "--quiet"])
    c = npf.load(tmp_path / "moe" / "ckpt.safetensors").config
    assert rc == 0 and (c.n_kv_head, c.n_expert, c.top_k) == (1, 4, 2)
    assert main(["train", "gpt", "--data", str(corpus), "--out", str(tmp_path / "gpt"),
                 "--steps", "2", "--n-kv-head", "1", "--quiet"]) != 0  # GPT has no K/V heads
    assert "--n-kv-head: expected nothing" in capsys.readouterr().err


# ------------------------------------------------------------------ Hugging Face directories


def _hf_dir(tmp_path, model, **config):
    c = model.config
    hf = {"model_type": "llama", "vocab_size": c.vocab_size, "hidden_size": c.d_model,
          "intermediate_size": c.d_ff, "num_hidden_layers": c.n_layer,
          "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_head,
          "max_position_embeddings": c.block_size, "rms_norm_eps": c.norm_eps,
          "rope_theta": c.rope_theta, "tie_word_embeddings": c.tie_embeddings,
          "hidden_act": "silu", **config}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    save_file(llama_hf_state(model), str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.mark.parametrize("tie", [False, True])
def test_hf_directory_round_trip(tmp_path, tie):
    model = _randomize(_model(tie_embeddings=tie, rope_theta=500.0))
    loaded = npf.load_pretrained_llama(_hf_dir(tmp_path, model), dtype="float64")
    assert loaded.config == model.config and not loaded.training
    ids = _ids()
    np.testing.assert_array_equal(loaded.forward(ids), model.forward(ids))


def test_hf_rope_parameters_give_theta(tmp_path):
    model = _model()
    path = _hf_dir(tmp_path, model, rope_theta=None,
                   rope_parameters={"rope_type": "default", "rope_theta": 123.0})
    assert npf.load_pretrained_llama(path).config.rope_theta == 123.0


def test_hf_bad_directories(tmp_path):
    model = _model()
    path = _hf_dir(tmp_path, model)
    with pytest.raises(FileNotFoundError, match="model_dir"):
        npf.load_pretrained_llama(tmp_path / "nothing")
    hf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**hf, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match='model_type "llama" or "mixtral", got \'gpt2\''):
        npf.load_pretrained_llama(path)
    (path / "config.json").write_text(json.dumps({**hf, "rope_scaling": {"rope_type":
                                                                          "llama3"}}))
    with pytest.raises(ValueError, match="rope_type 'llama3'"):
        npf.load_pretrained_llama(path)
    (path / "config.json").write_text(json.dumps(hf))
    state = load_file(path / "model.safetensors")
    missing = {k: v for k, v in state.items() if "layers.1.mlp.up_proj" not in k}
    save_file(missing, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing.*layers.1.mlp.up_proj"):
        npf.load_pretrained_llama(path)
    bad = dict(state)
    bad["model.layers.0.self_attn.k_proj.weight"] = np.zeros((3, 16), dtype=np.float64)
    save_file(bad, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="h.0.attn.qkv.W"):
        npf.load_pretrained_llama(path)


@pytest.mark.parametrize("n_expert", [0, 4])
def test_data_parallel_trainer_runs_llama(n_expert):
    from npformer.distributed import DistributedTrainer, SingleProcess

    text = np.tile(np.arange(7), 40)
    cfg = npf.TrainConfig(steps=4, batch_size=4, block_size=6, lr=1e-2, warmup_steps=1,
                          eval_interval=4, eval_batches=1, log_interval=4)
    one = npf.Trainer(_model(dtype="float32", n_expert=n_expert), text[:200], text[200:], cfg)
    dp = DistributedTrainer(_model(dtype="float32", n_expert=n_expert), text[:200],
                            text[200:], cfg, comm=SingleProcess())
    a, b = one.fit(), dp.fit()
    np.testing.assert_allclose([r["train_loss"] for r in a], [r["train_loss"] for r in b],
                               rtol=1e-6)


@pytest.mark.skipif(shutil.which("mpiexec", path=os.path.dirname(sys.executable)) is None,
                    reason="mpiexec is not installed: pip install -e '.[mpi]'")
def test_llama_under_mpiexec_trains_the_one_process_run(tmp_path):
    """Data parallelism over two MPI processes gives the one-process Llama (dense)."""
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    (tmp_path / "corpus.txt").write_text("def add(a, b):\n    return a + b\n# the fox\n" * 40)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "npformer", "train", "llama", "--data", "corpus.txt",
           "--quiet", "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--block-size",
           "16", "--batch-size", "4", "--eval-interval", "4", "--eval-batches", "1",
           "--log-interval", "2", "--warmup-steps", "2", "--dtype", "float64", "--steps", "6"]
    one = subprocess.run([*cli, "--out", "one"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    two = subprocess.run([mpiexec, "-n", "2", *cli, "--out", "two"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    a, b = (npf.load(tmp_path / d / "ckpt.safetensors") for d in ("one", "two"))
    for (name, p, _), (_, q, _) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_allclose(q, p, rtol=1e-10, atol=1e-12, err_msg=name)
