"""The training path on a device, without a GPU: every model family's step, ``generate``
and ``beam_search`` run on the strict array of ``npformer.strict`` (book/gpu.md; CuPy's rules: no
implicit host conversion, no mixing with host arrays), equal the NumPy run, and read
the host at most twice per training step (the loss and the gradient norm)."""
from __future__ import annotations

import numpy as np
import pytest

import npformer as npf
from npformer.device import device_of, read_host, to_device, to_host
from npformer.module import CounterGenerator, FlatStore, check_ids
from npformer.optim import AdamW, train_step
from npformer.strict import Strict, register, strict
from npformer.train import masked_lm_objective, next_token_objective

register()
MAX_READS = 2  # the loss and the gradient norm
# Float64 on both sides: the same NumPy kernels run, so the two runs agree to rounding.
# They differ only where the device takes its own route: the embedding scatter adds
# repeated rows with np.add.at, the host with a sparse product, in another order. A key
# bias's gradient is exactly zero in exact arithmetic (softmax ignores a shift of every
# score), so it holds rounding noise alone (up to about 1e-12 here): the bound ATOL.
RTOL, ATOL = 1e-12, 1e-11


def _ids(vocab: int, shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, shape)


def _steps(model, objective, batches, *, device: str, host_batch=False, **kw):
    """Train 2 steps with AdamW and clipping; return (losses, norms, reads per step)."""
    if device != "cpu":
        model.to(device)
    opt = AdamW(model.named_parameters(), lr=1e-2, weight_decay=0.1)
    rng = np.random.default_rng(1)
    losses, norms, reads = [], [], []
    for ids in batches:
        batch = ids if host_batch else to_device(ids, device)
        Strict.reset()
        loss, norm = train_step(model, opt, lambda m, b: objective(m, b, rng, **kw), batch,
                                max_norm=0.5)
        reads.append(Strict.reads)
        losses.append(loss)
        norms.append(norm)
    return losses, norms, reads


def _params(model) -> dict[str, np.ndarray]:
    return {n: to_host(p) for n, p, _ in model.named_parameters(include_frozen=True)}


def _same_run(make, objective, batches, **kw):
    ref, dev = make(), make()
    l0, n0, _ = _steps(ref, objective, batches, device="cpu", **kw)
    l1, n1, reads = _steps(dev, objective, batches, device="strict", **kw)
    np.testing.assert_allclose(l1, l0, rtol=RTOL)
    np.testing.assert_allclose(n1, n0, rtol=RTOL)
    p0, p1 = _params(ref), _params(dev)
    for name in p0:
        np.testing.assert_allclose(p1[name], p0[name], rtol=1e-10, atol=ATOL, err_msg=name)
    assert dev.device == "strict" and device_of(next(dev.named_parameters())[1]) == "strict"
    assert max(reads) <= MAX_READS, f"host reads per step: {reads}"
    return reads


GPT_CFG = dict(vocab_size=13, block_size=8, n_layer=2, n_head=2, d_model=16, dtype="float64")


def test_gpt_step_on_device_equals_numpy_and_reads_twice():
    batches = [_ids(13, (2, 8), s) for s in range(2)]
    _same_run(lambda: npf.GPT(npf.GPTConfig(**GPT_CFG), seed=0), next_token_objective,
              batches)


def test_moving_back_to_cpu_gives_numpy_arrays():
    model = npf.GPT(npf.GPTConfig(**GPT_CFG), seed=0).to("strict").to("cpu")
    assert model.device == "cpu"
    assert all(isinstance(p, np.ndarray) and isinstance(g, np.ndarray)
               for _, p, g in model.named_parameters())


def test_optimizer_built_before_the_move_refuses():
    model = npf.GPT(npf.GPTConfig(**GPT_CFG), seed=0)
    opt = AdamW(model.named_parameters(), lr=1e-3)
    model.to("strict")
    ids = to_device(_ids(13, (2, 8)), "strict")
    with pytest.raises(RuntimeError, match="optimiser.*after"):
        train_step(model, opt, lambda m, b: next_token_objective(m, b, None), ids)


def test_host_ids_for_a_device_model_are_refused():
    model = npf.GPT(npf.GPTConfig(**GPT_CFG), seed=0).to("strict")
    with pytest.raises(ValueError, match="ids: expected an array on 'strict'"):
        model.forward(_ids(13, (2, 8)))


def test_bad_ids_on_a_device_fail_at_the_next_read():
    ids = strict(np.array([[1, 2], [3, 99]]))
    check_ids(ids, vocab_size=10)  # nothing read yet
    with pytest.raises(ValueError, match="ids: expected token ids in \\[0, 10\\), got 99"):
        read_host(strict(np.float64(1.0)))


def test_counter_generator_is_the_same_stream_on_every_device():
    a, b = CounterGenerator(7), CounterGenerator(7, "strict")
    x, y = a.random((3, 5)), b.random((3, 5))
    assert isinstance(y, Strict)
    np.testing.assert_array_equal(to_host(y), x)
    assert 0 <= x.min() and x.max() < 1
    u = CounterGenerator(3).random(200_000, dtype=np.float32)
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002  # 5 sigma or more


def test_flat_store_whole_buffer_equals_per_parameter_update():
    cfg = npf.GPTConfig(**GPT_CFG)
    flat, loose = npf.GPT(cfg, seed=0), npf.GPT(cfg, seed=0)
    assert FlatStore.of(list(flat.named_parameters())) is not None
    triples = [(n, p.copy(), g) for n, p, g in loose.named_parameters()]  # not the store's
    for (n, p, _), (_, q, _) in zip(loose.named_parameters(), triples):
        q[...] = p
    assert FlatStore.of(triples) is None
    ids = _ids(13, (2, 8))
    for model, params in ((flat, list(flat.named_parameters())), (loose, triples)):
        opt = AdamW(params, lr=1e-2, weight_decay=0.1)
        model.zero_grad()
        _, dlogits = npf.losses.next_token_loss(model.forward(ids), ids)
        model.backward(dlogits)
        for (_, _, g), (_, _, g2) in zip(model.named_parameters(), params):
            g2[...] = g
        opt.step()
    for (n, p, _), (_, q, _) in zip(flat.named_parameters(), triples):
        np.testing.assert_allclose(p, q, rtol=1e-14, atol=1e-16, err_msg=n)


def test_bert_step_on_device_equals_numpy_and_reads_twice():
    cfg = dict(vocab_size=30, block_size=8, n_layer=2, n_head=2, d_model=16, d_ff=32,
               dropout=0.0, dtype="float64")  # a device's dropout stream is its own
    batches = [np.random.default_rng(s).integers(5, 29, (2, 8)) for s in range(2)]
    _same_run(lambda: npf.BERT(npf.BERTConfig(**cfg), seed=0), masked_lm_objective,
              batches, mask_id=29, host_batch=True)  # masked on the host, then moved


def test_encoder_step_on_device_equals_numpy_and_reads_twice():
    from npformer.train import reconstruction_objective
    cfg = npf.EncoderConfig(dtype="float64")
    batches = [_ids(cfg.vocab_size, (2, cfg.block_size), s) for s in range(2)]
    _same_run(lambda: npf.Encoder(cfg, seed=0), reconstruction_objective, batches)


@pytest.mark.parametrize("n_expert, capacity_factor", [(0, None), (4, None), (4, 0.75)])
def test_llama_step_on_device_equals_numpy_and_reads_twice(n_expert, capacity_factor):
    """Experts too: their slots have sizes known from the shapes alone (capacity 0.75 drops
    choices), and the auxiliary loss is read with the task's loss."""
    cfg = dict(vocab_size=17, block_size=8, n_layer=2, n_head=4, n_kv_head=2, d_model=16,
               d_ff=24, n_expert=n_expert, top_k=2, capacity_factor=capacity_factor,
               dtype="float64")
    batches = [_ids(17, (2, 8), s) for s in range(2)]
    _same_run(lambda: npf.Llama(npf.LlamaConfig(**cfg), seed=0), next_token_objective,
              batches)


def test_generate_on_device_gives_the_numpy_tokens_with_one_read_per_token():
    cfg = npf.GPTConfig(**GPT_CFG)
    ref, dev = npf.GPT(cfg, seed=0), npf.GPT(cfg, seed=0).to("strict")
    prompt = _ids(13, (2, 3))
    want = npf.generate(ref, prompt, 4, seed=5)
    Strict.reset()
    got = npf.generate(dev, prompt, 4, seed=5)
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, want)
    assert Strict.reads <= 4 + 1  # the prompt's check, then one read per new token


def test_save_from_device_writes_the_cpu_tensors(tmp_path):
    cfg = npf.GPTConfig(**GPT_CFG)
    npf.save(npf.GPT(cfg, seed=0), tmp_path / "cpu.safetensors")
    npf.save(npf.GPT(cfg, seed=0).to("strict"), tmp_path / "dev.safetensors")
    import safetensors.numpy
    a = safetensors.numpy.load_file(tmp_path / "cpu.safetensors")
    b = safetensors.numpy.load_file(tmp_path / "dev.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    model = npf.load(tmp_path / "dev.safetensors", device="strict")
    assert model.device == "strict"


def test_dropout_on_device_continues_the_same_stream_after_moving_back():
    cfg = npf.GPTConfig(**{**GPT_CFG, "dropout": 0.2})
    a = npf.GPT(cfg, seed=0).to("strict")
    b = npf.GPT(cfg, seed=0).to("strict").to("cpu")  # the same generator, on the host
    ids = _ids(13, (2, 8))
    np.testing.assert_allclose(to_host(a.forward(to_device(ids, "strict"))), b.forward(ids),
                               rtol=1e-12, atol=1e-14)


def _records(B: int, S: int, n: int, V: int, seed: int) -> np.ndarray:
    """Rows of source (S, padded) then target (<s> y </s> <pad>...): seq2seq_objective's."""
    from npformer.seq2seq import BOS, EOS, PAD
    rng = np.random.default_rng(seed)
    src = rng.integers(3, V, (B, S))
    src[0, S - 2:] = PAD
    tgt = np.full((B, n + 2), PAD)
    tgt[:, 0], tgt[:, 1:n] = BOS, rng.integers(3, V, (B, n - 1))
    tgt[:, n] = EOS
    return np.concatenate([src, tgt], axis=1)


TRANSFORMER_CFG = dict(src_vocab_size=11, tgt_vocab_size=11, block_size=8, n_layer=2,
                       n_head=2, d_model=16, d_ff=24, dropout=0.0, dtype="float64")


@pytest.mark.parametrize("shared", [False, True])
def test_transformer_step_on_device_equals_numpy_and_reads_twice(shared):
    from npformer.seq2seq import seq2seq_objective
    cfg = npf.TransformerConfig(**TRANSFORMER_CFG, share_embeddings=shared)
    batches = [_records(3, 8, 5, 11, s) for s in range(2)]
    _same_run(lambda: npf.Transformer(cfg, seed=0), seq2seq_objective, batches,
              host_batch=True)


def test_beam_search_and_greedy_on_device_give_the_numpy_output():
    from npformer.seq2seq import beam_search, greedy_decode
    cfg = npf.TransformerConfig(**TRANSFORMER_CFG)
    ref, dev = npf.Transformer(cfg, seed=0), npf.Transformer(cfg, seed=0).to("strict")
    src = _ids(11, (2, 6))
    ids0, scores0 = beam_search(ref, src, beam_size=3, max_new_tokens=5)
    Strict.reset()
    ids1, scores1 = beam_search(dev, src, beam_size=3, max_new_tokens=5)
    assert Strict.reads <= 5 + 1  # one read a step, and the source's check
    np.testing.assert_array_equal(ids1, ids0)
    np.testing.assert_allclose(scores1, scores0, rtol=1e-12)
    Strict.reset()
    np.testing.assert_array_equal(greedy_decode(dev, src, max_new_tokens=5),
                                  greedy_decode(ref, src, max_new_tokens=5))
    assert Strict.reads <= 5 + 1


def test_expert_aux_loss_waits_for_the_next_read_and_costs_none():
    cfg = npf.LlamaConfig(vocab_size=17, block_size=8, n_layer=2, n_head=4, n_kv_head=2,
                          d_model=16, d_ff=24, n_expert=4, top_k=2, dtype="float64")
    ref, dev = npf.Llama(cfg, seed=0), npf.Llama(cfg, seed=0).to("strict")
    ids = _ids(17, (2, 8))
    ref.forward(ids)
    Strict.reset()
    dev.forward(to_device(ids, "strict"))
    assert Strict.reads == 0 and device_of(dev.aux_loss) == "strict"
    (zero,) = read_host(dev.wte.W.sum() * 0)  # any read carries it along: one copy
    assert Strict.reads == 1 and zero == 0.0 and isinstance(dev.aux_loss, float)
    assert dev.aux_loss == pytest.approx(ref.aux_loss, rel=1e-12)


def test_lora_trains_on_device_like_numpy():
    def make():
        model = npf.GPT(npf.GPTConfig(**GPT_CFG), seed=0)
        return npf.add_lora(model, rank=2, alpha=4.0)
    batches = [_ids(13, (2, 8), s) for s in range(2)]
    _same_run(make, next_token_objective, batches)


def test_flash_kernel_on_device_equals_numpy():
    cfg = npf.GPTConfig(**{**GPT_CFG, "attention_kernel": "flash"})
    batches = [_ids(13, (2, 8), s) for s in range(2)]
    _same_run(lambda: npf.GPT(cfg, seed=0), next_token_objective, batches)


def test_cuda_without_cupy_or_a_gpu_names_what_is_missing():
    import importlib.util
    model = npf.GPT(npf.GPTConfig(**GPT_CFG), seed=0)
    if importlib.util.find_spec("cupy") is None:
        with pytest.raises(RuntimeError, match=r"device 'cuda': CuPy is not installed"):
            model.to("cuda")
    else:  # CuPy without a GPU (with one, tests/test_gpu.py runs instead)
        import cupy
        try:
            if cupy.cuda.runtime.getDeviceCount() > 0:
                pytest.skip("a GPU is present")
        except Exception:
            pass
        with pytest.raises(RuntimeError, match=r"device 'cuda': CuPy"):
            model.to("cuda")
    assert model.device == "cpu"  # nothing moved


def test_an_unknown_device_is_refused_by_name():
    with pytest.raises(ValueError, match=r"device: expected one of \[.*'cuda'.*\], got 'tpu'"):
        npf.GPT(npf.GPTConfig(**GPT_CFG), seed=0).to("tpu")


def test_the_command_line_trains_and_samples_on_a_device(tmp_path, capsys):
    from npformer.cli import main
    args = ["train", "gpt", "--data", "pydoc", "--out", str(tmp_path / "run"), "--steps", "3",
            "--n-layer", "1", "--d-model", "16", "--n-head", "2", "--block-size", "16",
            "--batch-size", "2", "--quiet", "--device", "strict"]
    assert main(args) == 0
    assert main(["sample", str(tmp_path / "run"), "--max-new-tokens", "5",
                 "--device", "strict"]) == 0
    assert main(["train", "gpt", "--out", str(tmp_path / "run"), "--resume", "--steps", "4",
                 "--quiet", "--device", "strict"]) == 0
    assert npf.load(tmp_path / "run" / "ckpt.safetensors").device == "cpu"
