"""Train the encoder-decoder of book/seq2seq.md on the date task; log as JSON, save weights.

The full run quoted in the chapter:

    OPENBLAS_NUM_THREADS=1 python bench/seq2seq_dates.py --steps 20000 \
        --out book/data/seq2seq_dates.json --weights book/data/seq2seq_dates.safetensors

and the chapter's run of 1000 steps, the first steps of the same run evaluated every 250
(the chapter re-runs its first 20 steps and reads the rest from these files):

    OPENBLAS_NUM_THREADS=1 python bench/seq2seq_dates.py --steps 1000 --eval-every 250 \
        --out book/data/seq2seq_dates_1000.json \
        --weights book/data/seq2seq_dates_1000.safetensors

(One BLAS thread: these matrices are small, and on a shared machine a multithreaded
BLAS spends its time waiting for cores.)

Dates in fourteen human formats -> ISO 8601, characters on both sides; 100,000 training
pairs from 90 years; validation and test pairs from the 10 years in
npformer.seq2seq.HELD_OUT_YEARS, no input in both (npformer.seq2seq.held_out_split).
Post-LN Transformer, 2 + 2 layers, d_model 64, 4 heads, d_ff 256, dropout 0.1, label
smoothing 0.1; Adam (0.9, 0.98, 1e-9), warmup 200 steps to (d_model * 200) ** -0.5, then
the paper's inverse square root; batch 64; gradient clipping at 1. Every 500 steps the
2,000 validation pairs are decoded greedily, and the weights of the first evaluation with
the highest exact match are kept ("early stopping"): those are the saved model. At the
end the 10,000 test pairs and 2,000 pairs from the training years are decoded greedily
and by beam search (beam 4, alpha 0.6) by the kept weights, and greedily by the last
checkpoint and by the average of the last 5 checkpoints (1000 steps apart, the paper's
recipe), for comparison; every error of the kept weights is logged. Everything is seeded.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

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
    held_out_split,
    seq2seq_loss,
    translate,
)

D_MODEL, WARMUP, BATCH, EVAL_EVERY, CHUNK = 64, 200, 64, 500, 500
AVERAGE, AVERAGE_EVERY = 5, 1000  # the paper's base model averages its last 5 checkpoints


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


def new_run():
    """The model, its config, the number of training pairs and the update of step ``step``."""
    src_vocab, tgt_vocab = date_vocabs()
    config = TransformerConfig(src_vocab_size=src_vocab.vocab_size,
                               tgt_vocab_size=tgt_vocab.vocab_size, block_size=32,
                               n_layer=2, n_head=4, d_model=D_MODEL, d_ff=4 * D_MODEL,
                               dropout=0.1, label_smoothing=0.1)
    train_texts, train_labels = date_pairs(100_000, TRAIN_YEARS, np.random.default_rng(1))
    train_src = src_vocab.batch(train_texts, config.block_size)  # (N, 32)
    train_tgt = tgt_vocab.batch(train_labels, bos=True, eos=True)  # (N, 12)
    model = Transformer(config, seed=0)
    opt = Adam(model.named_parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)
    batch_rng = np.random.default_rng(3)

    def batch():
        rows = batch_rng.integers(0, len(train_src), size=BATCH)
        src = train_src[rows]
        return src[:, :(src != PAD).sum(axis=1).max()], train_tgt[rows]  # cut to the longest

    def update(step):
        lr = warmup_inverse_sqrt(step, peak_lr=PEAK, warmup_steps=WARMUP)
        return train_step(model, opt, lambda m, b: seq2seq_loss(m, *b), batch(), lr=lr,
                          max_norm=1.0)

    return model, config, len(train_texts), update


def first_losses(k: int) -> list[float]:
    """The training losses of the first k steps (what the tests compare with the log)."""
    _, _, _, update = new_run()
    return [float(update(step)[0]) for step in range(k)]


def train(steps: int, log=print, *, eval_every: int = EVAL_EVERY
          ) -> tuple[dict, Transformer]:
    src_vocab, tgt_vocab = date_vocabs()
    model, config, n_train, update = new_run()
    (val_texts, val_labels), (test_texts, test_labels) = held_out_split()
    snapshots = []
    best = {"step": None, "validation_exact_match": -1.0, "weights": None}

    def evaluate():
        acc = exact(decode_all(model.eval(), val_texts, src_vocab, tgt_vocab), val_labels)
        model.train()
        return acc

    def on_step(rec):
        if rec["val"] is not None:
            log(f"step {rec['step']:6d}  validation exact match {rec['val']:.2%}  "
                f"{time.perf_counter() - t0:7.1f} s")
            if rec["val"] > best["validation_exact_match"]:  # the first of the best
                best.update(step=rec["step"], validation_exact_match=rec["val"],
                            weights={n: p.copy() for n, p, _ in model.named_parameters()})
        if rec["step"] % AVERAGE_EVERY == 0 and rec["step"] > steps - AVERAGE * AVERAGE_EVERY:
            snapshots.append({n: p.copy() for n, p, _ in model.named_parameters()})

    t0 = time.perf_counter()
    records = train_loop(update, steps=steps, evaluate=evaluate, eval_every=eval_every,
                         on_step=on_step)
    wall = time.perf_counter() - t0
    last = {n: p.copy() for n, p, _ in model.named_parameters()}
    average = {n: np.mean([snap[n] for snap in snapshots], axis=0) for n in last}
    _swap(model, best["weights"])  # the kept weights, from here on

    model.eval()
    final = {}
    sets = {"test": (test_texts, test_labels),
            "train_years": date_pairs(2_000, TRAIN_YEARS, np.random.default_rng(4))}
    errors = []
    for name, (texts, labels) in sets.items():
        t1 = time.perf_counter()
        greedy = decode_all(model, texts, src_vocab, tgt_vocab)
        t_greedy = time.perf_counter() - t1
        t1 = time.perf_counter()
        beam = decode_all(model, texts, src_vocab, tgt_vocab, beam_size=4)
        t_beam = time.perf_counter() - t1
        others = {}
        for other, weights in (("last_checkpoint", last), ("average_of_last_5", average)):
            kept = _swap(model, weights)
            outs = decode_all(model, texts, src_vocab, tgt_vocab)
            _swap(model, kept)
            others[f"{other}_greedy_exact_match"] = exact(outs, labels)
            others[f"{other}_greedy_errors"] = [[x, o] for x, o, t in zip(texts, outs, labels)
                                                if o != t]
        final[name] = {"pairs": len(texts), "greedy_exact_match": exact(greedy, labels),
                       "beam4_exact_match": exact(beam, labels), **others,
                       "greedy_seconds": t_greedy, "beam4_seconds": t_beam}
        errors += [{"set": name, "input": x, "format": format_of(x, t), "label": t,
                    "greedy": g, "beam4": b}
                   for x, t, g, b in zip(texts, labels, greedy, beam) if g != t or b != t]
        log(f"{name}: {final[name]}")
    return {
        "command": f"python bench/seq2seq_dates.py --steps {steps} --eval-every {eval_every}",
        "config": asdict(config),
        "n_params": int(sum(p.size for _, p, _ in model.named_parameters())),
        "data": {"train_pairs": n_train, "train_years": list(TRAIN_YEARS),
                 "held_out_years": list(HELD_OUT_YEARS), "validation_pairs": len(val_texts),
                 "test_pairs": len(test_texts), "formats": list(DATE_FORMATS)},
        "selected": {"rule": "the first evaluation with the highest validation exact match",
                     "step": best["step"],
                     "validation_exact_match": best["validation_exact_match"]},
        "averaged_checkpoints": {"count": len(snapshots), "every": AVERAGE_EVERY},
        "optim": {"name": "Adam", "betas": [0.9, 0.98], "eps": 1e-9, "clip": 1.0,
                  "schedule": "warmup_inverse_sqrt", "peak_lr": PEAK, "warmup": WARMUP,
                  "batch": BATCH, "steps": steps},
        "train_loss": [r["loss"] for r in records],
        "grad_norm": [round(r["grad_norm"], 4) for r in records],
        "evals": [{"step": r["step"], "validation_exact_match": r["val"]}
                  for r in records if r["val"] is not None],
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
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--out", type=Path, default=Path("book/data/seq2seq_dates.json"))
    ap.add_argument("--weights", type=Path, default=Path("book/data/seq2seq_dates.safetensors"))
    ap.add_argument("--eval-every", type=int, default=EVAL_EVERY)
    args = ap.parse_args()
    for path in (args.out, args.weights):
        if path.exists():
            raise SystemExit(f"error: {path} exists; move it away or name another --out/--weights")
    result, model = train(args.steps, log=lambda s: print(s, flush=True),
                          eval_every=args.eval_every)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    npformer.save(model, args.weights, step=result["selected"]["step"],
                  extra={"task": "dates", "held_out_years": list(HELD_OUT_YEARS),
                         "selected": result["selected"]})
    print(f"wrote {args.out} and {args.weights}: {args.steps} steps in "
          f"{result['wall_time_s']:.0f} s; kept step {result['selected']['step']}")


if __name__ == "__main__":
    main()
