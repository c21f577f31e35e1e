"""Specification of supervised fine-tuning (book/sft.md): special tokens, the grown
embedding, token log-probabilities and their backward pass, the response-only loss, and
padding and packing, which leave the loss and its gradients unchanged."""

import json
from pathlib import Path

import numpy as np
import pytest

import npformer as npf
from npformer.evaluate import Addition, exact_match
from npformer.gradcheck import relative_error
from npformer.optim import AdamW
from npformer.sft import (
    SPECIAL_TOKENS,
    backward_packed,
    forward_packed,
    pack_rows,
    packed_positions,
    pad_batch,
)

ALPHABET = Addition.alphabet


def _tok():
    return npf.add_special_tokens(npf.CharTokenizer(ALPHABET), SPECIAL_TOKENS)


def _gpt(vocab_size=13, dtype="float64", seed=0, block_size=24):
    cfg = npf.GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=2, n_head=2,
                        d_model=16, dtype=dtype)
    return npf.GPT(cfg, seed=seed)


def _perturb(model, scale=0.1, seed=2):
    """Random LayerNorms and biases too, so that no gradient is zero by accident."""
    rng = np.random.default_rng(seed)
    for _, p, _ in model.named_parameters():
        p += rng.standard_normal(p.shape) * scale
    return model


def _examples(template, n=5, seed=3):
    return [template.render(p.prompt, p.answer) for p in Addition().sample(n, seed=seed)]


def _sampled_fd(f, model, grads, k=10, eps=1e-6, seed=5):
    """Central differences of f() at k random entries of every parameter (float64):
    the normwise relative error against the hand gradient at those entries, per name."""
    rng = np.random.default_rng(seed)
    errors = {}
    for name, p, _ in model.named_parameters():
        flat = p.reshape(-1)  # a view: perturbs the parameter in place
        idx = rng.choice(flat.size, size=min(k, flat.size), replace=False)
        num = np.empty(len(idx))
        for j, i in enumerate(idx):
            old = flat[i]
            flat[i] = old + eps
            up = f()
            flat[i] = old - eps
            down = f()
            flat[i] = old
            num[j] = (up - down) / (2 * eps)
        errors[name] = relative_error(grads[name].reshape(-1)[idx], num)
    return errors


def _grads(model):
    return {n: g.copy() for n, _, g in model.named_parameters()}


def _sft_step(model, ids, mask, segments=None):
    """Loss and every parameter gradient of the SFT loss on one batch."""
    model.zero_grad()
    tlp = npf.TokenLogProbs(model)
    loss, dlp = npf.sft_loss(tlp.forward(ids, segments), mask[:, 1:])
    tlp.backward(dlp)
    return float(loss), _grads(model)


# ---- the tokenizer and the template ---------------------------------------------------

def test_special_tokens_are_appended_and_old_ids_unchanged():
    base = npf.CharTokenizer(ALPHABET)
    tok = _tok()
    assert tok.vocab_size == base.vocab_size + 3
    assert [tok.encode(s) for s in SPECIAL_TOKENS] == [[13], [14], [15]]
    text = "<|user|>347+85<|assistant|>432<|end|>"
    ids = tok.encode(text)
    assert ids == [13, *base.encode("347+85"), 14, *base.encode("432"), 15]
    assert tok.decode(ids) == text
    assert tok.encode("12+3=15\n") == base.encode("12+3=15\n")


def test_template_mask_marks_the_answer_and_end():
    template = npf.ChatTemplate(_tok())
    assert template.prompt("347+85") == "<|user|>347+85<|assistant|>"
    ids, mask = template.render("347+85", "432")
    assert ids.dtype == np.int64 and mask.dtype == np.float64 and ids.shape == mask.shape
    assert mask.tolist() == [0.0] * 8 + [1.0] * 4  # <|user|> 6 chars <|assistant|> | 432 <|end|>
    assert ids[-1] == 15 and ids[7] == 14


@pytest.mark.parametrize("call, name", [
    (lambda: npf.add_special_tokens(npf.CharTokenizer("ab"), ()), "specials"),
    (lambda: npf.add_special_tokens(npf.CharTokenizer("ab"), ("<a>", "<a>")), "specials"),
    (lambda: npf.add_special_tokens(_tok(), ("<|end|>",)), "specials"),
    (lambda: _tok().decode([16]), "ids"),
    (lambda: npf.ChatTemplate(npf.CharTokenizer("ab")), "tok"),
    (lambda: npf.ChatTemplate(_tok(), end="<|eos|>"), "end"),
    (lambda: npf.ChatTemplate(_tok()).render("<|end|>1+1", "2"), "text"),
    (lambda: npf.ChatTemplate(_tok()).render("1+1", "2<|end|>"), "response"),
    (lambda: npf.grow_vocab(_gpt(), 12), "vocab_size"),
    (lambda: npf.grow_vocab(npf.Linear(2, 2), 16), "model"),
    (lambda: npf.sft_loss(np.zeros((1, 3)), np.zeros((1, 3))), "mask"),
    (lambda: npf.sft_loss(np.zeros((1, 3)), np.ones((1, 4))), "mask"),
    (lambda: npf.TokenLogProbs(_gpt()).forward(np.zeros((2, 1), dtype=np.int64)), "ids"),
])
def test_bad_inputs_raise_value_errors_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        call()


# ---- growing the embedding ------------------------------------------------------------

def test_grow_vocab_keeps_old_rows_bit_for_bit_and_rebuilds_the_flat_store():
    model = _perturb(_gpt(dtype="float32"))
    old = {n: p.copy() for n, p, _ in model.named_parameters()}
    npf.grow_vocab(model, 16)
    W = model.wte.W
    assert W.shape == (16, 16) and model.config.vocab_size == 16
    assert np.array_equal(W[:13], old["wte.W"])  # bit for bit
    np.testing.assert_allclose(W[13:], np.broadcast_to(
        old["wte.W"].astype(np.float64).mean(axis=0), (3, 16)), rtol=0, atol=1e-7)
    for n, p, _ in model.named_parameters():
        if n != "wte.W":
            assert np.array_equal(p, old[n]), n
    assert model.store.current()  # every parameter and gradient a view of the new store
    flat = model.store.groups["float32"].params
    assert np.shares_memory(model.wte.W, flat) and model.head_weight is model.wte.W


def test_grown_model_keeps_old_token_logits_and_trains_and_round_trips(tmp_path):
    model = _perturb(_gpt())
    ids = np.random.default_rng(0).integers(0, 13, (2, 10))
    before = model.forward(ids)
    npf.grow_vocab(model, 16)
    after = model.forward(ids)
    # the tied head: old logits are h . W_v with the same h and the same rows (float64)
    np.testing.assert_allclose(after[..., :13], before, rtol=0, atol=1e-12)
    # each new token's logit is the mean of the old logits: h . mean(W) = mean(h . W)
    np.testing.assert_allclose(after[..., 13:], np.repeat(
        before.mean(axis=-1, keepdims=True), 3, axis=-1), rtol=0, atol=1e-12)
    opt = AdamW(model.named_parameters(), lr=1e-2)
    template = npf.ChatTemplate(_tok())
    ids, mask = pad_batch(_examples(template), pad_id=15)
    _sft_step(model, ids, mask)
    assert np.abs(model.wte.dW[13:]).sum() > 0  # the new rows learn
    w_before = model.wte.W.copy()
    opt.step()
    assert not np.array_equal(model.wte.W, w_before)  # the optimiser steps the grown array
    path = npf.save(model, tmp_path / "grown.safetensors", opt, step=1)
    loaded = npf.load(path)
    for (n, p, _), (m, q, _) in zip(model.named_parameters(), loaded.named_parameters()):
        assert n == m and np.array_equal(p, q), n
    assert loaded.config.vocab_size == 16 and loaded.store.current()


def test_grow_vocab_with_seed_adds_noise_to_the_new_rows_only():
    a = npf.grow_vocab(_gpt(), 16)
    b = npf.grow_vocab(_gpt(), 16, seed=1)
    assert np.array_equal(a.wte.W[:13], b.wte.W[:13])
    assert not np.array_equal(a.wte.W[13:], b.wte.W[13:])
    assert np.abs(a.wte.W[13:] - b.wte.W[13:]).max() < 0.02 * 6


# ---- token log-probabilities and the loss ---------------------------------------------

def test_token_logprobs_are_the_log_softmax_at_the_targets():
    model = _perturb(_gpt(16))
    ids = np.random.default_rng(0).integers(0, 16, (3, 9))
    lp = npf.TokenLogProbs(model).forward(ids)
    logits = model.forward(ids[:, :-1])
    ref = np.array([[logits[b, t, ids[b, t + 1]] - np.log(np.exp(logits[b, t]).sum())
                     for t in range(8)] for b in range(3)])
    assert lp.shape == (3, 8)
    np.testing.assert_allclose(lp, ref, rtol=0, atol=1e-12)


def test_token_logprobs_backward_matches_finite_differences():
    """d(sum_bt w_bt lp_bt)/dtheta by the hand backward against central differences
    (float64, eps 1e-6): normwise relative error below 1e-7 for every parameter."""
    model = _perturb(_gpt(16))
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 16, (2, 7))
    w = rng.standard_normal((2, 6))
    tlp = npf.TokenLogProbs(model)
    model.zero_grad()
    tlp.forward(ids)
    tlp.backward(w)
    errors = _sampled_fd(lambda: float((w * tlp.forward(ids)).sum()), model, _grads(model))
    assert max(errors.values()) < 1e-7, errors


def test_sft_loss_gradient_matches_finite_differences_and_its_formula():
    model = _perturb(npf.grow_vocab(_gpt(), 16))
    template = npf.ChatTemplate(_tok())
    ids, mask = pad_batch(_examples(template, 3), pad_id=15)
    loss, grads = _sft_step(model, ids, mask)
    lp = npf.TokenLogProbs(model).forward(ids)
    m = mask[:, 1:]
    assert loss == pytest.approx(-(m * lp).sum() / m.sum(), rel=1e-15)
    _, dlp = npf.sft_loss(lp, m)
    assert np.array_equal(dlp, -m / m.sum())

    def f():
        return float(npf.sft_loss(npf.TokenLogProbs(model).forward(ids), m)[0])
    errors = _sampled_fd(f, model, grads)
    assert max(errors.values()) < 1e-7, errors


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_prompt_positions_get_exactly_zero_logit_gradient(dtype):
    model = _perturb(npf.grow_vocab(_gpt(dtype=dtype), 16))
    template = npf.ChatTemplate(_tok())
    ids, mask = pad_batch(_examples(template, 6), pad_id=15)
    tlp = npf.TokenLogProbs(model)
    _, dlp = npf.sft_loss(tlp.forward(ids), mask[:, 1:])
    dz = tlp.dlogits(dlp)
    prompt = mask[:, 1:] == 0
    assert prompt.sum() > 0 and dz.dtype == np.dtype(dtype)
    assert (dz[prompt] == 0.0).all()  # exactly: 0 * (onehot - p)
    assert (dz[~prompt] != 0.0).all(axis=-1).all()


# ---- padding and packing ---------------------------------------------------------------

def test_right_padding_leaves_loss_and_gradients_unchanged():
    """The padded batch equals the mean over the examples one by one, each weighted by
    its number of response tokens: float64, to 1e-12."""
    model = _perturb(npf.grow_vocab(_gpt(), 16))
    rows = _examples(npf.ChatTemplate(_tok()), 5)
    ids, mask = pad_batch(rows, pad_id=15)
    assert len({len(i) for i, _ in rows}) > 1  # lengths differ: there is padding
    loss, grads = _sft_step(model, ids, mask)
    n = sum(m[1:].sum() for _, m in rows)
    loss_sum, grad_sum = 0.0, {k: 0.0 for k in grads}
    for i, m in rows:
        l1, g1 = _sft_step(model, i[None], m[None])
        w = m[1:].sum() / n
        loss_sum += w * l1
        grad_sum = {k: grad_sum[k] + w * g1[k] for k in grads}
    assert abs(loss - loss_sum) < 1e-12
    for k in grads:
        np.testing.assert_allclose(grads[k], grad_sum[k], rtol=0, atol=1e-12, err_msg=k)


def test_padding_does_not_change_any_logit_of_the_example():
    model = _perturb(_gpt())
    ids = np.random.default_rng(0).integers(0, 13, (1, 8))
    padded = np.concatenate([ids, np.full((1, 5), 12)], axis=1)
    np.testing.assert_allclose(model.forward(padded)[:, :8], model.forward(ids),
                               rtol=0, atol=1e-12)


def test_packed_positions_restart_at_each_example():
    seg = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    assert packed_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]


def test_packing_with_block_diagonal_mask_equals_padding():
    model = _perturb(npf.grow_vocab(_gpt(block_size=32), 16))
    rows = _examples(npf.ChatTemplate(_tok()), 7)
    ids_p, mask_p = pad_batch(rows, pad_id=15)
    ids_k, mask_k, seg = pack_rows(rows, 32)
    assert ids_k.shape[0] < ids_p.shape[0]  # packing used fewer rows
    assert (np.diff(seg, axis=1) != 0).sum() > ids_k.shape[0]  # some row holds two examples
    loss_p, grads_p = _sft_step(model, ids_p, mask_p)
    loss_k, grads_k = _sft_step(model, ids_k, mask_k, seg)
    assert abs(loss_p - loss_k) < 1e-12
    for k in grads_p:
        np.testing.assert_allclose(grads_k[k], grads_p[k], rtol=0, atol=1e-12, err_msg=k)


def test_packing_without_the_mask_would_change_the_loss():
    """The plain causal mask and continuing positions let later examples see earlier ones."""
    model = _perturb(npf.grow_vocab(_gpt(block_size=32), 16))
    rows = _examples(npf.ChatTemplate(_tok()), 7)
    ids_p, mask_p = pad_batch(rows, pad_id=15)
    ids_k, mask_k, _ = pack_rows(rows, 32)
    loss_p, _ = _sft_step(model, ids_p, mask_p)
    loss_plain, _ = _sft_step(model, ids_k, mask_k)
    assert abs(loss_p - loss_plain) > 1e-3


def test_forward_packed_with_one_segment_is_forward():
    model = _perturb(_gpt())
    ids = np.random.default_rng(0).integers(0, 13, (2, 9))
    seg = np.zeros_like(ids)
    logits = forward_packed(model, ids, seg)
    np.testing.assert_allclose(logits, model.forward(ids), rtol=0, atol=1e-12)
    dz = np.random.default_rng(1).standard_normal(logits.shape)
    model.zero_grad()
    forward_packed(model, ids, seg)
    backward_packed(model, dz)
    packed = _grads(model)
    model.zero_grad()
    model.forward(ids)
    model.backward(dz)
    for k, g in _grads(model).items():
        np.testing.assert_allclose(packed[k], g, rtol=0, atol=1e-12, err_msg=k)
    assert all("attend" not in vars(block.attn) for block in model.h)  # restored


# ---- the training stage ----------------------------------------------------------------

def _stage_config(**changes):
    from npformer.sft import SFTConfig
    return SFTConfig(**{**dict(steps=6, batch_size=4, n_train=40, n_val=4, warmup_steps=2,
                               eval_interval=3), **changes})


@pytest.fixture(scope="module")
def base_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("base") / "base.safetensors"
    return npf.save(_perturb(_gpt(dtype="float32"), scale=0.02), path)


@pytest.mark.parametrize("lora_rank", [0, 2])
def test_stage_resumes_bit_exactly(base_path, tmp_path, lora_rank):
    from npformer.sft import SFTTrainer
    config = _stage_config(lora_rank=lora_rank)
    straight = SFTTrainer.start(base_path, config)
    straight.fit()
    first = SFTTrainer.start(base_path, config)
    first.fit(until=3, checkpoint_path=tmp_path / "sft.safetensors")
    resumed = SFTTrainer.resume(tmp_path / "sft.safetensors")
    assert resumed.step == 3 and resumed.config == config
    resumed.fit()
    assert resumed.step == straight.step == 6
    for (n, p, _), (m, q, _) in zip(straight.model.named_parameters(include_frozen=True),
                                    resumed.model.named_parameters(include_frozen=True)):
        assert n == m and np.array_equal(p, q), n
    a, b = straight.optimizer.state_dict(), resumed.optimizer.state_dict()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    trained = {n for n, _, _ in resumed.model.named_parameters()}
    assert "wte.W" in trained  # LoRA runs train the grown embedding too
    assert (len(trained) > 1) if lora_rank == 0 else all(
        n == "wte.W" or "lora_" in n for n in trained)


def test_stage_starts_from_the_previous_checkpoint_with_the_grown_vocabulary(base_path):
    from npformer.sft import SFTTrainer
    base = npf.load(base_path)
    trainer = SFTTrainer.start(base_path, _stage_config())
    assert trainer.model.config.vocab_size == 16
    assert np.array_equal(trainer.model.wte.W[:13], base.wte.W)
    records = trainer.fit()
    assert records[0]["val"] is not None and records[-1]["val"] is not None
    assert all(np.isfinite(r["loss"]) for r in records[1:])


def test_stage_stops_when_asked_saves_and_logs(base_path, tmp_path):
    from npformer.sft import SFTTrainer
    trainer = SFTTrainer.start(base_path, _stage_config())
    calls = iter(range(100))
    ckpt, log = tmp_path / "run.safetensors", tmp_path / "log.jsonl"
    trainer.fit(checkpoint_path=ckpt, log_path=log, should_stop=lambda: next(calls) >= 2)
    assert trainer.step == 2 and SFTTrainer.resume(ckpt).step == 2
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2] and lines[0]["val"] is not None


def test_stage_rejects_a_checkpoint_it_did_not_write(base_path):
    from npformer.sft import SFTTrainer
    with pytest.raises(ValueError, match="^path: expected a checkpoint written by SFTTrainer"):
        SFTTrainer.resume(base_path)


# ---- on the strict device (the GPU path) -----------------------------------------------

@pytest.mark.parametrize("packed", [False, True])
def test_sft_step_on_the_strict_device_equals_the_host(packed):
    """grow_vocab, TokenLogProbs, sft_loss (and packing) under CuPy's rules: two AdamW steps
    on the strict stand-in equal the host's to a few roundings (float64)."""
    from npformer.device import to_device, to_host
    from npformer.optim import train_step
    from npformer.strict import Strict, register
    register()
    rows = _examples(npf.ChatTemplate(_tok()), 6)
    ids, mask, seg = pack_rows(rows, 32) if packed else (*pad_batch(rows, 15), None)

    def run(device):
        model = npf.grow_vocab(_perturb(_gpt(block_size=32)).to(device), 16)
        opt = AdamW(model.named_parameters(), lr=1e-2)
        batch = tuple(None if a is None else to_device(a, device) for a in (ids, mask, seg))

        def objective(m, b):
            tlp = npf.TokenLogProbs(m)
            loss, dlp = npf.sft_loss(tlp.forward(b[0], b[2]), b[1][:, 1:])
            return loss, tlp.dlogits(dlp)
        losses = []
        for _ in range(2):
            if packed:  # backward_packed instead of model.backward: a wrapper model
                losses.append(_packed_step(model, opt, objective, batch))
            else:
                losses.append(train_step(model, opt, objective, batch, max_norm=0.5)[0])
        return losses, {n: to_host(p) for n, p, _ in model.named_parameters()}

    host_losses, host = run("cpu")
    Strict.reset()
    dev_losses, dev = run("strict")
    np.testing.assert_allclose(dev_losses, host_losses, rtol=1e-12)
    for name in host:
        np.testing.assert_allclose(dev[name], host[name], rtol=1e-10, atol=1e-11, err_msg=name)


def _packed_step(model, opt, objective, batch):
    from npformer.device import read_host
    model.zero_grad()
    tlp = npf.TokenLogProbs(model)
    loss, dlp = npf.sft_loss(tlp.forward(batch[0], batch[2]), batch[1][:, 1:])
    tlp.backward(dlp)
    opt.step()
    return read_host(loss)[0]


# ---- the committed run (book/data/addition_sft.py) ---------------------------------------

DATA = Path(__file__).resolve().parents[1] / "book" / "data"


def test_committed_sft_checkpoint_gives_the_logged_test_results():
    """The first 100 test items, graded greedily in the template, as the log records them."""
    log = json.loads((DATA / "addition_sft.json").read_text())
    model = npf.load(DATA / "addition_sft.safetensors")
    template = npf.ChatTemplate(_tok())
    task = Addition()
    problems = task.test_set()[:100]
    correct, _ = exact_match(model, template.tok, problems, template.grader(task),
                             render=lambda p: template.prompt(p.prompt), stop=template.end,
                             max_new_tokens=6)
    assert "".join("1" if c else "0" for c in correct) == log["correct"]["sft"][:100]
    assert model.config.vocab_size == 16 and log["accuracy"]["sft"]["n"] == 1000
    k = log["correct"]["sft"].count("1")
    assert log["accuracy"]["sft"]["k"] == k
