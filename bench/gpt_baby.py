"""Train the book's "baby" GPT on the Python documentation and log the losses as JSON.

The full run whose log and trained model book/gpt.md loads (the chapter trains the same
model for a few hundred steps):

    OPENBLAS_NUM_THREADS=1 python bench/gpt_baby.py --steps 2000 \
        --out book/data/gpt_baby.json --save book/data/gpt_baby.safetensors

(One BLAS thread: these matrices are small, and on a shared machine a multithreaded
BLAS spends its time waiting for cores.)

Character-level model on pydoc_data.topics (90% train, 10% validation): 4 layers,
4 heads, d_model 128, block 64, batch 12, dropout 0; AdamW betas (0.9, 0.99),
weight decay 0.1, gradient clipping at 1.0; learning rate 1e-3 with 100 warmup steps
and a cosine decay to 1e-4. The log holds every step's training loss, learning rate
and gradient norm (before clipping), the losses on fixed batches every 100 steps, a
seeded sample of 160 characters at several steps (the same prompt, settings and seed
each time, so only the model changes), two samples of 300 characters at the end, and
the trained model's attention weights, every layer and head, on 24 held-out characters.
With --save, the trained model is also written with npf.save (weights only, float32,
about 3.3 MB; the tokenizer's characters are in the checkpoint's ``extra`` field), so that
``npf.load(path)`` gives the model back. Everything is seeded: the same command gives the same log
up to the floating-point nondeterminism of multithreaded BLAS.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

import npformer
from npformer.data import sample_windows
from npformer.models.gpt import GPT, GPTConfig
from npformer.optim import AdamW, train_loop, train_step, warmup_cosine
from npformer.sampling import generate
from npformer.softmax import cross_entropy
from npformer.tokenizer import CharTokenizer

BATCH, BLOCK, PEAK_LR, MIN_LR, WARMUP = 12, 64, 1e-3, 1e-4, 100
SAMPLE_PROMPT = 'The "for" statement'
SAMPLE_SETTINGS = [{"temperature": 0.8, "top_k": 20}, {"temperature": 0.7, "top_p": 0.9}]
PROGRESS_STEPS = (0, 100, 200, 500, 1000, 2000, 4000, 6000)  # a sample after these many steps
PROGRESS_SETTINGS = {"temperature": 0.8, "top_k": 20}
ATTENTION_WINDOW = 24  # characters of held-out text whose attention weights are logged


def pydoc_corpus() -> str:
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics))


def get_batch(data: np.ndarray, rng: np.random.Generator, batch: int = BATCH,
              block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Random windows of block + 1 tokens: inputs x (B, T) and next tokens y (B, T)."""
    w = sample_windows(data, batch, block + 1, rng)  # (B, T + 1)
    return w[:, :-1], w[:, 1:]


def next_char_objective(model: GPT, batch) -> tuple[float, np.ndarray]:
    x, y = batch
    return cross_entropy(model.forward(x), y)  # (mean loss, dlogits (B, T, V))


def estimate_loss(model: GPT, batches) -> float:
    model.eval()
    losses = [next_char_objective(model, batch)[0] for batch in batches]
    model.train()
    return float(np.mean(losses))


def split_data() -> tuple[CharTokenizer, np.ndarray, np.ndarray]:
    """The tokenizer and the token ids of the first 90% (training) and the rest."""
    text = pydoc_corpus()
    tok = CharTokenizer(text)
    data = np.array(tok.encode(text), dtype=np.int64)
    n = int(0.9 * len(data))
    return tok, data[:n], data[n:]


def fixed_batches(train_data: np.ndarray, val_data: np.ndarray, eval_batches: int = 20):
    """The evaluation batches of every logged evaluation, from their own generator."""
    eval_rng = np.random.default_rng(2)
    return {"train": [get_batch(train_data, eval_rng) for _ in range(eval_batches)],
            "val": [get_batch(val_data, eval_rng) for _ in range(eval_batches)]}


def new_run(steps: int, vocab_size: int, train_data: np.ndarray, lrs: list | None = None):
    """The model, its optimiser and the update of step ``step`` of a run of ``steps``."""
    cfg = GPTConfig(vocab_size=vocab_size, block_size=BLOCK, n_layer=4, n_head=4,
                    d_model=128, dropout=0.0)
    model = GPT(cfg, seed=0)
    opt = AdamW(model.named_parameters(), lr=PEAK_LR, betas=(0.9, 0.99), weight_decay=0.1)
    rng = np.random.default_rng(1)  # training batches

    def update(step: int) -> tuple[float, float]:
        lr = warmup_cosine(step, peak_lr=PEAK_LR, warmup_steps=min(WARMUP, steps),
                           total_steps=steps, min_lr=MIN_LR)
        if lrs is not None:
            lrs.append(lr)
        return train_step(model, opt, next_char_objective, get_batch(train_data, rng), lr=lr,
                          max_norm=1.0)

    return model, cfg, update


def first_losses(k: int, steps: int) -> list[float]:
    """The training losses of the first k steps of a run of ``steps`` (what the tests
    compare with the committed log)."""
    tok, train_data, _ = split_data()
    _, _, update = new_run(steps, tok.vocab_size, train_data)
    return [float(update(step)[0]) for step in range(k)]


def train(steps: int, eval_every: int = 100, eval_batches: int = 20, log=print,
          save: Path | None = None) -> dict:
    tok, train_data, val_data = split_data()
    text = pydoc_corpus()
    n = len(train_data)
    evals, lrs, progress = [], [], []
    model, cfg, update = new_run(steps, tok.vocab_size, train_data, lrs)
    fixed = fixed_batches(train_data, val_data, eval_batches)
    prompt = np.array([tok.encode(SAMPLE_PROMPT)])  # (1, T)

    def on_eval(r: dict) -> None:
        if r["val"] is not None:
            evals.append({"step": r["step"], **r["val"]})
            log(f"step {r['step']:5d}  train {r['val']['train']:.4f}  "
                f"val {r['val']['val']:.4f}  {time.perf_counter() - t0:7.1f} s")
        if r["step"] in PROGRESS_STEPS or r["step"] == steps:  # generate() has its own seed
            out = generate(model, prompt, 160, seed=0, **PROGRESS_SETTINGS)
            progress.append({"step": r["step"], "text": tok.decode(out[0, prompt.shape[1]:])})

    t0 = time.perf_counter()
    records = train_loop(update, steps=steps, eval_every=eval_every, evaluate_first=True,
                         evaluate=lambda: {k: estimate_loss(model, b) for k, b in fixed.items()},
                         on_step=on_eval)
    train_loss = [r["loss"] for r in records if r["loss"] is not None]
    grad_norm = [r["grad_norm"] for r in records if r["grad_norm"] is not None]
    wall = time.perf_counter() - t0
    window = val_data[:ATTENTION_WINDOW]  # held-out text: every head's attention on it
    model.eval()
    model.forward(window[None, :])
    model.train()
    attention = {"text": tok.decode(window),
                 "weights": [np.round(block.attn.cache.p[0], 4).tolist() for block in model.h]}
    if save is not None:
        npformer.save(model, save, step=steps,
                      extra={"chars": "".join(tok.chars), "corpus": "pydoc_data.topics",
                             "log": "gpt_baby.json"})
    samples = [{"settings": kw, "text": tok.decode(generate(model, prompt, 300, seed=0, **kw)[0])}
               for kw in SAMPLE_SETTINGS]
    return {
        "command": f"python bench/gpt_baby.py --steps {steps}"
                   + (f" --save {save}" if save is not None else ""),
        "config": asdict(cfg),
        "n_params": int(sum(p.size for _, p, _ in model.named_parameters())),
        "corpus": {"name": "pydoc_data.topics", "chars": len(text), "vocab": tok.vocab_size,
                   "train_tokens": int(n), "val_tokens": len(val_data)},
        "optim": {"name": "AdamW", "betas": [0.9, 0.99], "weight_decay": 0.1, "clip": 1.0,
                  "peak_lr": PEAK_LR, "min_lr": MIN_LR, "warmup": WARMUP,
                  "batch": BATCH, "block": BLOCK, "steps": steps},
        "samples": samples,
        "progress": {"prompt": SAMPLE_PROMPT, "settings": PROGRESS_SETTINGS, "seed": 0,
                     "samples": progress},
        "attention": attention,
        "train_loss": train_loss,
        "lr": lrs,
        "grad_norm": grad_norm,
        "evals": evals,
        "wall_time_s": wall,
        "seconds_per_step": wall / max(steps, 1),
        "machine": {"OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"),
                    "python": platform.python_version(), "numpy": np.__version__,
                    "npformer": npformer.__name__, "cpus": os.cpu_count(),
                    "processor": platform.machine()},
    }


def _dumps(obj) -> str:
    """JSON with every list of numbers on one line."""
    return re.sub(r"\[\s+([-0-9.,e\s]+?)\s+\]",
                  lambda m: "[" + " ".join(m.group(1).split()) + "]",
                  json.dumps(obj, indent=1)) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=Path("book/data/gpt_baby.json"))
    ap.add_argument("--save", type=Path, default=None,
                    help="also write the trained model here with npf.save")
    args = ap.parse_args()
    result = train(args.steps, save=args.save)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(_dumps(result))
    print(f"wrote {args.out}: {args.steps} steps in {result['wall_time_s']:.0f} s")


if __name__ == "__main__":
    main()
