"""The serving measurements of book/serving.md, too slow for a cold book build.

Writes book/data/serving_runs.json. Run from the repository root, on one thread:

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 python book/data/serving_runs.py

1. Throughput. The trained GPT (book/data/gpt_baby.safetensors) serves n = 1, 2, 4, ...,
   32 requests (prompts of 4 .. 32 characters of validation text, 8 .. 32 new tokens
   each, greedy), all submitted at once to an Engine with max_batch = n, against the
   same requests run one at a time by npformer.sampling.generate (the KV cache of the
   GPT chapter). Each timing is repeated; the JSON keeps every repeat. Memory: the most
   blocks in use at once, against one contiguous cache of block_size positions per
   request.
2. Streaming. The Llama of Part IV (book/data/part4_llama_pydoc.safetensors, RoPE,
   trained on windows of 64 characters) reads STREAMS streams of LENGTH characters of
   pydoc validation text, one character at a time, through a SinkCache of C slots:
   no sinks (a plain rolling window), 1 .. 4 sinks, and a sliding window recomputed
   from scratch for every character. Each character's loss (nats) is kept per stream,
   averaged over bins of 64 positions.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

import npformer as npf
from npformer.sampling import generate
from npformer.serving import Engine, SinkCache, stream_forward
from npformer.softmax import log_softmax

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from part4_runs import corpora  # noqa: E402  (the Llama's tokenizer and corpus)

OUT = HERE / "serving_runs.json"
CONCURRENCY, REPEATS = [1, 2, 4, 8, 16, 32], 3
STREAMS, LENGTH, BIN = 8, 1024, 64
CACHES, SINKS = [64, 16], [0, 1, 2, 3, 4]


def requests(n: int, val: np.ndarray, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    lens, news = rng.integers(4, 33, n), rng.integers(8, 33, n)
    starts = rng.integers(0, len(val) - 64, n)
    return [val[s:s + m].tolist() for s, m in zip(starts, lens)], news.tolist()


def throughput(model, val: np.ndarray) -> list[dict]:
    rows = []
    for n in CONCURRENCY:
        prompts, news = requests(n, val, seed=n)
        tokens = int(sum(news))
        batched, alone, peak = [], [], 0
        for _ in range(REPEATS):
            engine = Engine(model, block_size=16, max_batch=n)
            t0 = time.perf_counter()
            out = engine.generate(prompts, news)
            batched.append(time.perf_counter() - t0)
            peak = engine.peak_blocks
            t0 = time.perf_counter()
            ref = [generate(model, np.array([p]), m, temperature=0)[0, len(p):].tolist()
                   for p, m in zip(prompts, news)]
            alone.append(time.perf_counter() - t0)
        same = sum(a == b for a, b in zip(out, ref))
        rows.append({"requests": n, "new_tokens": tokens, "batched_s": batched,
                     "alone_s": alone, "peak_blocks": int(peak), "block_size": 16,
                     "tokens_written": int(sum(len(p) + m - 1 for p, m in zip(prompts, news))),
                     "contiguous_positions": n * model.config.block_size,
                     "same_tokens_as_alone": int(same)})
        print(rows[-1], flush=True)
    return rows


def nll(logits: np.ndarray, target: int) -> float:
    return float(-log_softmax(logits.astype(np.float64))[target])


def streaming(model, val: np.ndarray) -> dict:
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(val) - LENGTH - 1, STREAMS)
    attn = model.h[0].attn
    out = {}
    for C in CACHES:
        for s in SINKS:
            name = f"C{C}_sinks{s}"
            losses = []
            for a in starts:
                ids = val[a:a + LENGTH + 1]
                cache = SinkCache(len(model.h), s, C - s, attn.n_kv_head, attn.d_head)
                losses.append([nll(stream_forward(model, cache, int(ids[t])), int(ids[t + 1]))
                               for t in range(LENGTH)])
            out[name] = losses
            print(name, np.mean(losses), flush=True)
        name, losses = f"C{C}_recompute", []
        for a in starts:
            ids = val[a:a + LENGTH + 1]
            losses.append([nll(model.forward(ids[None, max(0, t - C + 1):t + 1])[0, -1],
                               int(ids[t + 1])) for t in range(LENGTH)])
        out[name] = losses
        print(name, np.mean(losses), flush=True)
    return {k: np.asarray(v).reshape(STREAMS, -1, BIN).mean(-1).round(5).tolist()
            for k, v in out.items()}


def main() -> int:
    gpt = npf.load(HERE / "gpt_baby.safetensors").eval()
    text = npf.data.load_corpus("pydoc")
    tok = npf.CharTokenizer(text)
    gval = np.array(tok.encode(text), dtype=np.int64)[int(0.9 * len(text)):]  # as trained
    llama = npf.load(HERE / "part4_llama_pydoc.safetensors").eval()
    _, pydoc, _ = corpora()
    lval = pydoc[int(0.9 * len(pydoc)):]
    run = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                       "python": platform.python_version(), "numpy": np.__version__,
                       "threads": 1},
           "throughput": throughput(gpt, gval),
           "streaming": {"streams": STREAMS, "length": LENGTH, "bin": BIN,
                         "caches": CACHES, "sinks": SINKS,
                         "loss_per_bin": streaming(llama, lval)}}
    OUT.write_text(json.dumps(run, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
