"""Train the encoder-decoder of book/seq2seq.md on the date task; log as JSON, save weights.

The full run quoted in the chapter (which trains the same model for its first 2000 steps):

    OPENBLAS_NUM_THREADS=1 python bench/seq2seq_dates.py --steps 6000 --cooldown 3000 \
        --average-every 500 --out book/data/seq2seq_dates.json \
        --weights book/data/seq2seq_dates.safetensors

(One BLAS thread: these matrices are small, and on a shared machine a multithreaded
BLAS spends its time waiting for cores.)

Dates in fourteen human formats -> ISO 8601, characters on both sides; 100,000 training
pairs from 90 years, held-out pairs from the 10 years in npformer.seq2seq.HELD_OUT_YEARS.
Post-LN Transformer, 2 + 2 layers, d_model 64, 4 heads, d_ff 256, dropout 0.1, label
smoothing 0.1; Adam (0.9, 0.98, 1e-9), warmup 200 steps to (d_model * 200) ** -0.5, then
the inverse square root; over the last --cooldown steps that rate is scaled linearly down
to zero (the inverse square root alone stays above 1e-3 for tens of thousands of steps,
and the held-out accuracy of its weights jumps between evaluations); batch 64; gradient
clipping at 1. Every 500 steps the 2,000 held-out pairs of the chapter are decoded
greedily. As in the paper, the final model is the average of the last 5 checkpoints
(--average-every steps apart, inside the cooldown), saved with npf.save so that
``npf.load`` rebuilds it. At the end, 10,000 further held-out pairs and 2,000 pairs from
the training years are decoded greedily and by beam search (beam 4, alpha 0.6), by the
average and greedily by the last checkpoint alone, and every error of the average is
logged. Everything is seeded.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
from safetensors import safe_open

import npformer
from npformer.models.transformer import Transformer, TransformerConfig
from npformer.optim import Adam, train_loop, train_step, warmup_inverse_sqrt
from npformer.seq2seq import (
    DATE_FORMATS,
    HELD_OUT_YEARS,
    PAD,
    TRAIN_YEARS,
    date_pairs,
    date_vocabs,
    seq2seq_loss,
    translate,
)

D_MODEL, WARMUP, BATCH, EVAL_EVERY, CHUNK = 64, 200, 64, 500, 500
AVERAGE = 5  # the paper's base model averages its last 5 checkpoints


def format_of(text: str, label: str) -> str:
    """The strptime pattern of the format that writes label's date as text."""
    day = datetime.date.fromisoformat(label)
    return next(p for p, write in DATE_FORMATS.items() if write(day) == text)


def decode_all(model, texts, src_vocab, tgt_vocab, beam_size=1) -> list[str]:
    out = []
    for i in range(0, len(texts), CHUNK):  # chunks bound the beam's cache
        out += translate(model, texts[i:i + CHUNK], src_vocab, tgt_vocab, beam_size=beam_size)
    return out


def exact(outs: list[str], labels: list[str]) -> float:
    return float(np.mean([o == t for o, t in zip(outs, labels)]))


def _swap(model, weights: dict) -> dict:
    """Load weights into model in place; return the weights it had."""
    old = {n: p.copy() for n, p, _ in model.named_parameters()}
    for name, p, _ in model.named_parameters():
        p[...] = weights[name]
    return old


PEAK = (D_MODEL * WARMUP) ** -0.5


INIT_WARMUP = 100  # a continuation's warmup: its Adam moments start at zero


def _read_weights(path) -> dict[str, np.ndarray]:
    """name -> array of a weights file: an npf.save checkpoint or plain safetensors."""
    with safe_open(str(path), framework="np") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}
    if any(k.startswith("model.") for k in weights):
        weights = {k[len("model."):]: v for k, v in weights.items() if k.startswith("model.")}
    return weights


def new_run(steps: int, cooldown: int, init=None, init_lr: float = 0.0):
    """The model, its training pairs and the update of step ``step`` of a run of ``steps``.

    With ``init`` (a weights file) the run continues those weights: fresh Adam moments, a
    linear warmup of INIT_WARMUP steps to ``init_lr``, then a linear decay to 0 at ``steps``,
    and batches from their own generator.
    """
    src_vocab, tgt_vocab = date_vocabs()
    config = TransformerConfig(src_vocab_size=src_vocab.vocab_size,
                               tgt_vocab_size=tgt_vocab.vocab_size, block_size=32,
                               n_layer=2, n_head=4, d_model=D_MODEL, d_ff=4 * D_MODEL,
                               dropout=0.1, label_smoothing=0.1)
    train_texts, train_labels = date_pairs(100_000, TRAIN_YEARS, np.random.default_rng(1))
    train_src = src_vocab.batch(train_texts, config.block_size)  # (N, 32)
    train_tgt = tgt_vocab.batch(train_labels, bos=True, eos=True)  # (N, 12)
    model = Transformer(config, seed=0)
    if init is not None:
        weights = _read_weights(init)
        for name, p, _ in model.named_parameters():
            p[...] = weights[name]
    opt = Adam(model.named_parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)
    batch_rng = np.random.default_rng(3 if init is None else 13)

    def batch():
        rows = batch_rng.integers(0, len(train_src), size=BATCH)
        src = train_src[rows]
        return src[:, :(src != PAD).sum(axis=1).max()], train_tgt[rows]  # cut to the longest

    def update(step):
        if init is not None:  # warmup, then linear to 0
            lr = init_lr * min((step + 1) / INIT_WARMUP, (steps - step) / (steps - INIT_WARMUP))
        else:
            lr = warmup_inverse_sqrt(step, peak_lr=PEAK, warmup_steps=WARMUP)
            lr *= min(1.0, (steps - step) / cooldown) if cooldown else 1.0  # linear to 0
        return train_step(model, opt, lambda m, b: seq2seq_loss(m, *b), batch(), lr=lr,
                          max_norm=1.0)

    return model, config, len(train_texts), update


def first_losses(k: int, steps: int, cooldown: int, init=None,
                 init_lr: float = 0.0) -> list[float]:
    """The training losses of the first k steps of a run (what the tests compare with the
    committed log)."""
    _, _, _, update = new_run(steps, cooldown, init, init_lr)
    return [float(update(step)[0]) for step in range(k)]


def train(steps: int, cooldown: int = 0, average_every: int = 1000, log=print, *,
          init=None, init_lr: float = 0.0, eval_every: int = EVAL_EVERY
          ) -> tuple[dict, Transformer]:
    src_vocab, tgt_vocab = date_vocabs()
    model, config, n_train, update = new_run(steps, cooldown, init, init_lr)
    test_texts, test_labels = date_pairs(2_000, HELD_OUT_YEARS, np.random.default_rng(2))
    peak = PEAK
    snapshots = []

    def evaluate():
        acc = exact(decode_all(model.eval(), test_texts, src_vocab, tgt_vocab), test_labels)
        model.train()
        return acc

    def on_step(rec):
        if rec["val"] is not None:
            log(f"step {rec['step']:6d}  held-out exact match {rec['val']:.2%}  "
                f"{time.perf_counter() - t0:7.1f} s")
        if rec["step"] % average_every == 0 and rec["step"] > steps - AVERAGE * average_every:
            snapshots.append({n: p.copy() for n, p, _ in model.named_parameters()})

    t0 = time.perf_counter()
    records = train_loop(update, steps=steps, evaluate=evaluate, eval_every=eval_every,
                         on_step=on_step)
    losses = [r["loss"] for r in records]
    norms = [r["grad_norm"] for r in records]
    evals = [{"step": r["step"], "held_out_exact_match": r["val"]}
             for r in records if r["val"] is not None]
    wall = time.perf_counter() - t0
    last = {n: p.copy() for n, p, _ in model.named_parameters()}
    for name, p, _ in model.named_parameters():  # the average of the last checkpoints
        p[...] = np.mean([snap[name] for snap in snapshots], axis=0)

    model.eval()
    final = {}
    sets = {"held_out": date_pairs(10_000, HELD_OUT_YEARS, np.random.default_rng(5)),
            "train_years": date_pairs(2_000, TRAIN_YEARS, np.random.default_rng(4))}
    errors = []
    for name, (texts, labels) in sets.items():
        t1 = time.perf_counter()
        greedy = decode_all(model, texts, src_vocab, tgt_vocab)
        t_greedy = time.perf_counter() - t1
        t1 = time.perf_counter()
        beam = decode_all(model, texts, src_vocab, tgt_vocab, beam_size=4)
        t_beam = time.perf_counter() - t1
        with_last = _swap(model, last)
        last_greedy = decode_all(model, texts, src_vocab, tgt_vocab)
        _swap(model, with_last)
        final[name] = {"pairs": len(texts), "last_checkpoint_greedy_exact_match":
                       exact(last_greedy, labels), "greedy_exact_match": exact(greedy, labels),
                       "beam4_exact_match": exact(beam, labels),
                       "greedy_seconds": t_greedy, "beam4_seconds": t_beam}
        errors += [{"set": name, "input": x, "format": format_of(x, t), "label": t,
                    "greedy": g, "beam4": b}
                   for x, t, g, b in zip(texts, labels, greedy, beam) if g != t or b != t]
        log(f"{name}: {final[name]}")
    return {
        "command": f"python bench/seq2seq_dates.py --steps {steps} --cooldown {cooldown} "
                   f"--average-every {average_every}"
                   + (f" --init {init} --init-lr {init_lr} --eval-every {eval_every}"
                      if init is not None else ""),
        "init": None if init is None else {
            "path": str(init), "sha256": hashlib.sha256(Path(init).read_bytes()).hexdigest()},
        "config": asdict(config),
        "n_params": int(sum(p.size for _, p, _ in model.named_parameters())),
        "data": {"train_pairs": n_train, "train_years": list(TRAIN_YEARS),
                 "held_out_years": list(HELD_OUT_YEARS), "eval_pairs": len(test_texts),
                 "formats": list(DATE_FORMATS)},
        "averaged_checkpoints": {"count": len(snapshots), "every": average_every},
        "optim": {"name": "Adam", "betas": [0.9, 0.98], "eps": 1e-9, "clip": 1.0,
                  "schedule": "warmup_inverse_sqrt, then a linear cooldown to 0"
                  if init is None else f"continuation: {INIT_WARMUP} warmup steps to init_lr, "
                  "then linear to 0",
                  "peak_lr": peak if init is None else init_lr, "init_lr": init_lr,
                  "warmup": WARMUP if init is None else INIT_WARMUP, "cooldown": cooldown,
                  "batch": BATCH, "steps": steps},
        "train_loss": losses,
        "grad_norm": [round(x, 4) for x in norms],
        "evals": evals,
        "final": final,
        "errors": errors,
        "wall_time_s": wall,
        "seconds_per_step": wall / max(steps, 1),
        "machine": {"OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"),
                    "python": platform.python_version(), "numpy": np.__version__,
                    "cpus": os.cpu_count(), "processor": platform.machine()},
    }, model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--out", type=Path, default=Path("book/data/seq2seq_dates.json"))
    ap.add_argument("--weights", type=Path, default=Path("book/data/seq2seq_dates.safetensors"))
    ap.add_argument("--cooldown", type=int, default=3000,
                    help="the last steps, over which the learning rate falls linearly to 0")
    ap.add_argument("--average-every", type=int, default=500,
                    help="steps between the last 5 checkpoints that are averaged")
    ap.add_argument("--init", type=Path, default=None,
                    help="continue these weights (a short cooldown stage) instead of training "
                    "from scratch")
    ap.add_argument("--init-lr", type=float, default=8.8e-4,
                    help="with --init: the peak rate (the paper schedule's at step 20,000)")
    ap.add_argument("--eval-every", type=int, default=EVAL_EVERY)
    args = ap.parse_args()
    result, model = train(args.steps, args.cooldown, args.average_every,
                          log=lambda s: print(s, flush=True), init=args.init,
                          init_lr=args.init_lr, eval_every=args.eval_every)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    npformer.save(model, args.weights, step=args.steps,
                  extra={"task": "dates", "held_out_years": list(HELD_OUT_YEARS),
                         "averaged_checkpoints": result["averaged_checkpoints"]})
    print(f"wrote {args.out} and {args.weights}: {args.steps} steps in "
          f"{result['wall_time_s']:.0f} s")


if __name__ == "__main__":
    main()
