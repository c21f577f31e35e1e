"""Mixed precision by hand (book/precision.md): products of rounded operands with float32
sums, fp32 master weights, and dynamic loss scaling.

Rounding makes a mixed layer piecewise constant, so finite differences mean nothing here.
Its results are checked instead against the exact (float64) products of the unrounded
numbers, within the bound (mixed-bound) of the chapter: (2u + u^2) sum |a||b| for the
rounded operands, gamma_n = n u32 / (1 - n u32) times the same sum for the float32 sums,
and u (1 + u) |exact| for the rounding of the result, with u the format's unit roundoff.
"""
from __future__ import annotations

import numpy as np
import pytest

import npformer as npf
from npformer.linear import Linear
from npformer.optim import AdamW, train_step
from npformer.precision import LossScaler, MixedLinear, round_to, use_precision
from npformer.train import TrainConfig, Trainer, next_token_objective

UNIT = {"bf16": 2.0**-8, "fp16": 2.0**-11}
U32 = 2.0**-24


def _bound(a, b, exact, u, n):
    """The bound on |fl(a) fl(b) - a b| for a product of n terms, entry by entry."""
    size = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    return (2 * u + u * u + n * U32 / (1 - n * U32)) * size + u * (1 + u) * np.abs(exact)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_a_product_of_two_rounded_numbers_is_exact_in_float32(fmt):
    rng = np.random.default_rng(0)
    a, b = (round_to((rng.standard_normal(100_000) * 30).astype(np.float32), fmt)
            for _ in range(2))
    assert np.array_equal((a * b).astype(np.float64), a.astype(np.float64) * b)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_mixed_linear_is_within_the_bound_forward_and_backward(fmt):
    rng = np.random.default_rng(1)
    layer = use_precision(Linear(96, 40, seed=0), f"{fmt}-mixed")
    assert type(layer) is MixedLinear and layer.compute == fmt
    layer.b[...] = rng.standard_normal(40)
    x = rng.standard_normal((3, 20, 96)).astype(np.float32)
    dout = rng.standard_normal((3, 20, 40)).astype(np.float32)
    W = layer.W.astype(np.float64)
    y = layer.forward(x)
    dx = layer.backward(dout)
    x2, g2 = x.reshape(-1, 96), dout.reshape(-1, 40)
    u = UNIT[fmt]
    for got, a, b, exact, n in (
            (y.reshape(-1, 40), x2, layer.W, x2 @ W + layer.b, 96),
            (dx.reshape(-1, 96), g2, layer.W.T, g2 @ W.T, 40),
            (layer.dW, x2.T, g2, x2.T.astype(np.float64) @ g2, 60)):
        bound = _bound(a, b, exact, u, n)
        if got is y.reshape(-1, 40):
            bound += u * (1 + u) * np.abs(layer.b)  # the bias, added before the rounding
        assert got.dtype == np.float32
        assert (np.abs(got - exact) <= bound).all()
        assert np.abs(got - exact).max() > 0.01 * bound.max()  # a real bound, not a loose one
    exact = g2.astype(np.float64).sum(axis=0)  # db: rounded terms, float32 sum, rounded
    bound = (u + 60 * U32 / (1 - 60 * U32)) * np.abs(g2).sum(axis=0) + u * (1 + u) * np.abs(exact)
    assert (np.abs(layer.db - exact) <= bound).all()


def test_use_precision_swaps_only_linear_layers_and_back():
    cfg = npf.GPTConfig(vocab_size=30, block_size=8, n_layer=2, n_head=2, d_model=16)
    model = npf.GPT(cfg, seed=0)
    before = [(n, p) for n, p, _ in model.named_parameters()]
    use_precision(model, "bf16-mixed")
    kinds = {type(m).__name__ for _, m in model.named_modules()}
    assert "MixedLinear" in kinds and "Linear" not in kinds
    assert model.precision == "bf16-mixed"
    assert all(p is q for (_, p), (_, q, _) in zip(before, model.named_parameters()))
    npf.add_lora(model, rank=2, alpha=4)
    use_precision(model, "fp32")
    assert "MixedLinear" not in {type(m).__name__ for _, m in model.named_modules()}
    assert any(type(m).__name__ == "LoRALinear" for _, m in model.named_modules())


def test_bad_precisions_are_named():
    model64 = npf.GPT(npf.GPTConfig(vocab_size=30, block_size=8, n_layer=1, n_head=2,
                                    d_model=16, dtype="float64"), seed=0)
    with pytest.raises(ValueError, match="precision.*float32"):
        use_precision(model64, "fp16-mixed")
    with pytest.raises(ValueError, match="precision"):
        use_precision(model64, "fp8")
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="float16")
    with pytest.raises(ValueError, match="scale"):
        LossScaler(scale=3.0)
    with pytest.raises(ValueError, match="interval"):
        LossScaler(interval=0)
    with pytest.raises(ValueError, match="state"):
        LossScaler().load_state_dict({"scale": 2.0})


def _gpt(precision="fp32", seed=0):
    cfg = npf.GPTConfig(vocab_size=30, block_size=12, n_layer=2, n_head=2, d_model=16)
    return use_precision(npf.GPT(cfg, seed=seed), precision)


def _objective(factor=1.0):
    def objective(model, ids):
        loss, dlogits = next_token_objective(model, ids, None)
        return loss, dlogits * np.float32(factor)
    return objective


def test_a_power_of_two_scale_changes_no_float32_gradient():
    ids = np.random.default_rng(2).integers(0, 30, (4, 12))
    grads = []
    for scaler in (None, LossScaler(scale=2.0**20)):
        model = _gpt()
        opt = AdamW(model.named_parameters(), lr=1e-3)
        train_step(model, opt, _objective(), ids, scaler=scaler, max_norm=1.0)
        grads.append([g.copy() for _, _, g in model.named_parameters()])
    assert all(np.array_equal(a, b) for a, b in zip(*grads))


def test_an_overflow_skips_the_step_and_halves_the_scale_and_good_steps_double_it():
    ids = np.random.default_rng(3).integers(0, 30, (4, 12))
    model = _gpt("fp16-mixed")
    opt = AdamW(model.named_parameters(), lr=1e-3)
    scaler = LossScaler(scale=2.0**16, interval=2)
    params = np.concatenate([p.ravel() for _, p, _ in model.named_parameters()])
    loss, norm = train_step(model, opt, _objective(1e3), ids, scaler=scaler)  # overflows
    assert np.isfinite(loss) and not np.isfinite(norm)
    assert opt.t == 0 and scaler.skipped == 1 and scaler.scale == 2.0**15
    assert np.array_equal(params, np.concatenate([p.ravel() for _, p, _ in
                                                  model.named_parameters()]))
    for k in range(2):
        loss, norm = train_step(model, opt, _objective(), ids, scaler=scaler)
        assert np.isfinite(norm)
    assert opt.t == 2 and scaler.scale == 2.0**16 and scaler.good == 0


def test_loss_scaling_brings_back_fp16_gradients_that_underflow():
    """Gradients 2^-14 times a normal loss's: without scaling most underflow in fp16."""
    ids = np.random.default_rng(4).integers(0, 30, (4, 12))
    shares, grads = {}, {}
    for label, precision, scaler in (("fp32", "fp32", None),
                                     ("fp16", "fp16-mixed", None),
                                     ("fp16, scaled", "fp16-mixed", LossScaler(2.0**20))):
        model = _gpt(precision)
        opt = AdamW(model.named_parameters(), lr=1e-3)
        train_step(model, opt, _objective(2.0**-14), ids, scaler=scaler)
        g = np.concatenate([g.ravel() for n, _, g in model.named_parameters()
                            if n.startswith("h.") and n.endswith(".W")])
        shares[label], grads[label] = np.mean(g == 0), g
    assert shares["fp32"] == 0 and shares["fp16, scaled"] < 0.01 < 0.2 < shares["fp16"]
    err = np.abs(grads["fp16, scaled"] - grads["fp32"]).max() / np.abs(grads["fp32"]).max()
    assert err < 0.05  # fp16 operands: a few units of 2^-11 relative, through two blocks


def _trainer(tmp_path, steps, precision):
    ids = np.random.default_rng(5).integers(0, 30, 2000)
    config = TrainConfig(steps=steps, batch_size=4, block_size=12, warmup_steps=1,
                         eval_interval=2, eval_batches=1, log_interval=1,
                         precision=precision)
    return Trainer(_gpt(), ids[:1500], ids[1500:], config), ids


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_a_mixed_run_resumes_bit_for_bit_with_its_scaler(tmp_path, precision):
    whole, ids = _trainer(tmp_path, 6, precision)
    assert whole.model.precision == precision
    assert (whole.scaler is not None) == (precision == "fp16-mixed")
    whole.fit()
    half, _ = _trainer(tmp_path, 6, precision)
    half.fit(until=3)
    path = half.save(tmp_path / "ckpt.safetensors")
    resumed = Trainer.resume(path, ids[:1500], ids[1500:])
    assert resumed.model.precision == precision
    if precision == "fp16-mixed":
        assert resumed.scaler.state_dict() == half.scaler.state_dict()
    resumed.fit()
    for (name, p, _), (_, q, _) in zip(whole.model.named_parameters(),
                                       resumed.model.named_parameters()):
        assert np.array_equal(p, q), name


def test_the_command_line_trains_in_mixed_precision(tmp_path):
    from npformer.cli import main

    args = ["train", "gpt", "--data", "pydoc", "--out", str(tmp_path / "run"), "--steps", "3",
            "--n-layer", "1", "--d-model", "16", "--n-head", "2", "--block-size", "16",
            "--batch-size", "2", "--quiet", "--precision", "fp16-mixed"]
    assert main(args) == 0
    ckpt = npf.load_checkpoint(tmp_path / "run" / "ckpt.safetensors")
    assert ckpt.extra["train"]["precision"] == "fp16-mixed" and "scaler" in ckpt.extra
    assert main(["train", "gpt", "--out", str(tmp_path / "run"), "--resume", "--steps", "4",
                 "--quiet"]) == 0


def test_a_mixed_step_on_the_strict_device_reads_twice():
    from npformer.strict import Strict, register

    register()
    ids = np.random.default_rng(6).integers(0, 30, (4, 12))
    losses = []
    for device in ("cpu", "strict"):
        model = _gpt("fp16-mixed").to(device)
        opt = AdamW(model.named_parameters(), lr=1e-3)
        scaler = LossScaler(scale=2.0**10)
        Strict.reset()
        ids_d = npf.device.to_device(ids, device)
        losses.append(train_step(model, opt, _objective(), ids_d, scaler=scaler))
        if device == "strict":
            assert Strict.reads <= 2
    assert losses[0] == losses[1]
