"""Speculative decoding of the book's GPT on one CPU core: train the draft, then measure.

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 python book/data/speculative_runs.py

writes book/data/speculative_draft.safetensors (a one-layer GPT, d_model 48, trained on
the training split of the GPT chapter's text) and book/data/speculative_runs.json, which
book/speculative.md reads:

- the draft's training log (loss every 100 steps on fixed validation batches, with the
  target's loss on the same batches);
- the time of one cached call of the target, of the draft GPT and of the n-gram draft,
  against the number of positions fed (1 to 9), medians of interleaved repeats;
- for temperatures 0 (greedy) and 1, both drafts and gamma = 1..8: on the same 50
  prompts of 8 characters from the validation text, 48 new tokens each, the time of
  speculative_generate and of npf.generate (plain KV-cache decoding) on each prompt
  (interleaved, so that load on the machine affects both alike), the kept drafts,
  rejections, target and draft calls per prompt, a histogram of (drafted, kept) per step,
  and, at temperature 0, how many outputs equal the plain greedy output.

Times are the process's CPU time (time.process_time), the least of REPEATS runs: the
machine this ran on was shared with other jobs, which inflate wall-clock times by
whatever share of the cores they take; on an idle core the two agree.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np

import npformer as npf
from npformer.data import sample_windows
from npformer.optim import AdamW, train_step, warmup_cosine
from npformer.softmax import cross_entropy
from npformer.speculative import NGramDraft, speculative_generate

HERE = Path(__file__).parent
DRAFT = dict(n_layer=1, n_head=2, d_model=48, d_ff=192)
STEPS, BATCH, PEAK_LR, MIN_LR, WARMUP = 2000, 16, 3e-3, 3e-4, 100
ORDER, PROMPTS, PROMPT_LEN, NEW = 5, 50, 8, 48
GAMMAS, TEMPERATURES = range(1, 9), (0.0, 1.0)
REPEATS = 2


def timed(fn):
    """(fn(), the least CPU time of REPEATS calls, in seconds)."""
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t0)
    return out, best


def split():
    ckpt = npf.load_checkpoint(HERE / "gpt_baby.safetensors")
    tok = npf.CharTokenizer(ckpt.extra["chars"])
    text = "\n".join(topics[k] for k in sorted(topics))
    data = np.array(tok.encode(text), dtype=np.int64)
    n = int(0.9 * len(data))
    return ckpt.model.eval(), tok, data[:n], data[n:]


def objective(model, batch):
    x, y = batch
    return cross_entropy(model.forward(x), y)


def train_draft(target, tok, train_ids, val_ids):
    cfg = npf.GPTConfig(vocab_size=tok.vocab_size, block_size=64, dropout=0.0, **DRAFT)
    model = npf.GPT(cfg, seed=0)
    opt = AdamW(model.named_parameters(), lr=PEAK_LR, betas=(0.9, 0.99), weight_decay=0.1)
    rng, eval_rng = np.random.default_rng(1), np.random.default_rng(2)
    val = [sample_windows(val_ids, 12, 65, eval_rng) for _ in range(20)]  # (12, 65) each

    def val_loss(m):
        m.eval()
        loss = float(np.mean([objective(m, (w[:, :-1], w[:, 1:]))[0] for w in val]))
        m.train()
        return loss

    log, t0 = [], time.process_time()
    for step in range(STEPS):
        lr = warmup_cosine(step, peak_lr=PEAK_LR, warmup_steps=WARMUP, total_steps=STEPS,
                           min_lr=MIN_LR)
        w = sample_windows(train_ids, BATCH, 65, rng)
        loss, _ = train_step(model, opt, objective, (w[:, :-1], w[:, 1:]), lr=lr,
                             max_norm=1.0)
        if (step + 1) % 100 == 0 or step == 0:
            log.append({"step": step + 1, "train": float(loss), "val": val_loss(model)})
            print(log[-1], flush=True)
    seconds = time.process_time() - t0  # includes the evaluations
    model.eval()
    npf.save(model, HERE / "speculative_draft.safetensors",
             extra={"chars": "".join(tok.chars), "corpus": "pydoc_data.topics"})
    return model, {"config": DRAFT, "steps": STEPS, "batch": BATCH, "peak_lr": PEAK_LR,
                   "min_lr": MIN_LR, "warmup": WARMUP, "train_seconds": seconds, "log": log,
                   "target_val": val_loss(target), "n_params": int(sum(
                       p.size for _, p, _ in model.named_parameters()))}


def call_times(models, val_ids, reps=200):
    """Median ms of one cached call on T_new = 1..9 positions after 20 cached tokens."""
    times = {name: {t: [] for t in range(1, 10)} for name in models}
    ctx = val_ids[None, :29]
    for _ in range(reps):
        for name, m in models.items():
            for t in range(1, 10):
                cache = m.new_cache()
                m.forward_cached(ctx[:, :20], cache)
                t0 = time.process_time()
                m.forward_cached(ctx[:, 20:20 + t], cache)
                times[name][t].append(time.process_time() - t0)
    return {name: {t: 1e3 * float(np.median(v)) for t, v in d.items()}
            for name, d in times.items()}


def measure(target, drafts, val_ids):
    starts = np.random.default_rng(3).integers(0, len(val_ids) - PROMPT_LEN - NEW, PROMPTS)
    base = {str(T): [] for T in TEMPERATURES}
    runs = {(d, T, g): {"draft": d, "temperature": T, "gamma": g, "seconds": [],
                        "accepted": [], "rejected": [], "steps": [], "target_calls": [],
                        "draft_calls": [], "hist": {}, "same_as_plain": 0}
            for d in drafts for T in TEMPERATURES for g in GAMMAS}
    for i, s in enumerate(starts):
        prompt = val_ids[None, s:s + PROMPT_LEN]
        for T in TEMPERATURES:
            ref, seconds = timed(lambda: npf.generate(target, prompt, NEW, temperature=T,
                                                      seed=i))
            base[str(T)].append(seconds)
            for d, draft in drafts.items():
                for g in GAMMAS:
                    r = runs[d, T, g]
                    (out, st), seconds = timed(lambda: speculative_generate(
                        target, draft, prompt, NEW, gamma=g, temperature=T, seed=i))
                    r["seconds"].append(seconds)
                    r["accepted"].append(sum(st.accepted))
                    r["rejected"].append(sum(n < k for n, k in zip(st.accepted, st.drafted)))
                    r["steps"].append(len(st.accepted))
                    r["target_calls"].append(st.target_calls)
                    r["draft_calls"].append(st.draft_calls)
                    for k, n in zip(st.drafted, st.accepted):
                        r["hist"][f"{k},{n}"] = r["hist"].get(f"{k},{n}", 0) + 1
                    r["same_as_plain"] += int(T == 0 and np.array_equal(out, ref))
        print(f"prompt {i + 1}/{PROMPTS}", flush=True)
    return starts, base, list(runs.values())


def main():
    target, tok, train_ids, val_ids = split()
    draft_gpt, draft_log = train_draft(target, tok, train_ids, val_ids)
    ngram = NGramDraft(train_ids, tok.vocab_size, order=ORDER)
    drafts = {"gpt": draft_gpt, "ngram": ngram}
    calls = call_times({"target": target, **drafts}, val_ids)
    print(calls, flush=True)
    starts, base, runs = measure(target, drafts, val_ids)
    out = {"command": "OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 python "
                      "book/data/speculative_runs.py",
           "machine": {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
                       "numpy": np.__version__, "machine": platform.machine(),
                       "processor": platform.processor() or "unknown",
                       "threads": os.environ.get("OPENBLAS_NUM_THREADS", "unset")},
           "draft_gpt": draft_log, "ngram": {"order": ORDER},
           "prompts": {"n": PROMPTS, "prompt_len": PROMPT_LEN, "new_tokens": NEW,
                       "starts": starts.tolist()},
           "timer": f"time.process_time, least of {REPEATS} runs", "call_ms": calls,
           "plain_seconds": base, "runs": runs}
    (HERE / "speculative_runs.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
