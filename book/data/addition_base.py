"""The base model of Part V: a small GPT pretrained on plain sums, too long for a book build.

Writes book/data/addition_base.safetensors (the weights, a checkpoint of npf.save) and
book/data/addition_base.json (the log). Run from the repository root:

    OPENBLAS_NUM_THREADS=1 python book/data/addition_base.py

The corpus is STREAM_ITEMS training sums of the Addition task ("347+85=432\\n", one per
line, drawn outside the test set), a character tokenizer over Addition.alphabet, and the
trainer of the chapter "Training runs" on windows of the stream.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

import npformer as npf
from npformer.evaluate import Addition
from npformer.train import TrainConfig, Trainer

HERE = Path(__file__).resolve().parent
WEIGHTS, LOG = HERE / "addition_base.safetensors", HERE / "addition_base.json"
STREAM_ITEMS = 200_000
MODEL = dict(block_size=32, n_layer=3, n_head=4, d_model=96)
TRAIN = dict(steps=5000, batch_size=32, block_size=32, lr=3e-3, min_lr=3e-4,
             warmup_steps=200, weight_decay=0.1, eval_interval=500, eval_batches=16, seed=0)


def corpus(task: Addition, tok) -> tuple[np.ndarray, np.ndarray]:
    """Token streams: training sums (outside the test set) and the test set's sums."""
    train = "".join(task.text(p) for p in task.sample(STREAM_ITEMS, seed=1))
    val = "".join(task.text(p) for p in task.test_set())
    return (np.array(tok.encode(train), dtype=np.int64),
            np.array(tok.encode(val), dtype=np.int64))


def main() -> None:
    task = Addition()
    tok = npf.CharTokenizer(Addition.alphabet)
    train, val = corpus(task, tok)
    model = npf.GPT(npf.GPTConfig(vocab_size=tok.vocab_size, **MODEL), seed=0)
    trainer = Trainer(model, train, val, TrainConfig(**TRAIN))
    start = time.perf_counter()
    records = trainer.fit(progress=True)
    seconds = time.perf_counter() - start
    npf.save(trainer.model, WEIGHTS, step=trainer.step)
    LOG.write_text(json.dumps({
        "model": MODEL, "train": TRAIN, "stream_items": STREAM_ITEMS,
        "seconds": round(seconds, 1), "log": records,
        "machine": platform.processor() or platform.machine(), "python": sys.version.split()[0],
        "numpy": np.__version__}, indent=1) + "\n")


if __name__ == "__main__":
    main()
