"""The mixed-precision runs of book/precision.md, too long for a cold book build.

Writes book/data/precision_runs.json. Run from the repository root:

    OPENBLAS_NUM_THREADS=1 python book/data/precision_runs.py

A GPT of two blocks (d_model = 64, character-level, the pydoc corpus), trained from the
same weights on the same batches four ways: float32; bf16-mixed; fp16-mixed without loss
scaling; fp16-mixed with the dynamic scaler. Its objective returns the gradient of the
loss divided by 2^9, the per-token gradient of a batch 2^9 times larger (half a million
tokens, as GPT-2 trained with). Each step logs the training loss and the share of the
blocks' weight gradients that are exactly zero; each run ends with the validation loss
over EVAL_BATCHES held-out batches. The book re-runs the first steps and compares.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

import npformer as npf
from npformer.data import encode_ids, load_corpus, make_tokenizer, sample_windows
from npformer.optim import AdamW, train_step, warmup_cosine
from npformer.precision import LossScaler, use_precision
from npformer.train import next_token_objective

HERE = Path(__file__).resolve().parent
LOG = HERE / "precision_runs.json"
STEPS, B, T, EVAL_BATCHES = 400, 8, 64, 16
SHRINK = 2.0**-9  # the gradient of a batch 2^9 times larger, per token
RUNS = {  # run name -> (precision, scaled)
    "fp32": ("fp32", False),
    "bf16-mixed": ("bf16-mixed", False),
    "fp16-mixed, no scaling": ("fp16-mixed", False),
    "fp16-mixed, scaled": ("fp16-mixed", True),
}


def setup():
    """(tokenizer, training ids, validation ids, GPTConfig, training batches)."""
    text = load_corpus("pydoc")[:300_000]
    tok = make_tokenizer(text, "char")
    ids = encode_ids(tok, text)
    train, val = ids[:270_000], ids[270_000:]
    cfg = npf.GPTConfig(vocab_size=tok.vocab_size, block_size=T, n_layer=2, n_head=2,
                        d_model=64)
    batches = [sample_windows(train, B, T, np.random.default_rng([3, k]))
               for k in range(STEPS)]
    return tok, train, val, cfg, batches


def large_batch(model, ids):
    """The loss, and the gradient of the loss times SHRINK."""
    loss, dlogits = next_token_objective(model, ids, None)
    return loss, dlogits * np.float32(SHRINK)


def run(cfg, batches, precision: str, scaled: bool, steps: int):
    """Train ``steps`` steps; returns (model, losses, zero shares, scales)."""
    model = use_precision(npf.GPT(cfg, seed=0), precision)
    opt = AdamW(model.named_parameters(), lr=3e-3, weight_decay=0.1)
    scaler = LossScaler(interval=100) if scaled else None
    weights = [g for name, _, g in model.named_parameters()
               if name.startswith("h.") and name.endswith(".W")]
    losses, zeros, scales = [], [], []
    for k in range(steps):
        lr = warmup_cosine(k, peak_lr=3e-3, warmup_steps=40, total_steps=STEPS, min_lr=3e-4)
        scales.append(None if scaler is None else scaler.scale)
        losses.append(train_step(model, opt, large_batch, batches[k], lr=lr,
                                 scaler=scaler)[0])
        zeros.append(float(np.mean(np.concatenate([g.ravel() for g in weights]) == 0)))
    return model, losses, zeros, scales, scaler


def validation(model, val) -> list[float]:
    rng = np.random.default_rng(7)
    return [float(next_token_objective(model, sample_windows(val, B, T, rng), None)[0])
            for _ in range(EVAL_BATCHES)]


def main() -> None:
    tok, train, val, cfg, batches = setup()
    out = {"command": "OPENBLAS_NUM_THREADS=1 python book/data/precision_runs.py",
           "date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
           "numpy": np.__version__, "machine": platform.machine(),
           "steps": STEPS, "batch": [B, T], "shrink": SHRINK, "runs": {}}
    for name, (precision, scaled) in RUNS.items():
        t0 = time.perf_counter()
        model, losses, zeros, scales, scaler = run(cfg, batches, precision, scaled, STEPS)
        out["runs"][name] = {
            "precision": precision, "scaled": scaled, "loss": losses, "zero_share": zeros,
            "scale": scales, "skipped": None if scaler is None else scaler.skipped,
            "val_loss": validation(model, val), "seconds": time.perf_counter() - t0}
        print(f"{name:24s} last loss {np.mean(losses[-50:]):.4f}, zero gradients "
              f"{np.mean(zeros):.1%}, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    LOG.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
