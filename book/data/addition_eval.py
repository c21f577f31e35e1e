"""The samples behind the chapter "Evaluation with error bars", too slow for a book build.

Reads the base model (book/data/addition_base.safetensors), answers every test sum of the
Addition task greedily, and draws N_SAMPLES completions of each at temperature 1; writes
book/data/addition_eval.json: per test item, the greedy answer's grade, the grade of the
first sample, and the number of correct samples (pass@k needs only that count); the
log-likelihoods of four candidate answers of each sum (multiple choice), with and without
the end of line; the greedy grades of the same model with its weights rounded to bf16
and to fp8 (E4M3), for the paired comparisons; and the count of training items of the
base model's corpus whose pair is a test pair. Run from the repository root, on one core:

    OPENBLAS_NUM_THREADS=1 python book/data/addition_eval.py

Sampling runs in chunks of CHUNK test items, chunk i with seed i, so any chunk can be
drawn again alone (tests/test_evaluate.py redraws the first).
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

import npformer as npf
from npformer.evaluate import Addition, choice_logprob, complete, exact_match
from npformer.precision import round_to

HERE = Path(__file__).resolve().parent
WEIGHTS, LOG = HERE / "addition_base.safetensors", HERE / "addition_eval.json"
N_SAMPLES, TEMPERATURE, CHUNK = 20, 1.0, 100


def sample_counts(model, tok, task: Addition, problems: list, chunk: int) -> tuple:
    """(correct samples per item, grade of each item's first sample) for one chunk."""
    items = problems[chunk * CHUNK:(chunk + 1) * CHUNK]
    got = complete(model, tok, [p.prompt + "=" for p in items], max_new_tokens=5,
                   temperature=TEMPERATURE, n=N_SAMPLES, seed=chunk)
    ok = np.array([task.grade(items[i // N_SAMPLES], c) for i, c in enumerate(got)])
    ok = ok.reshape(len(items), N_SAMPLES)  # (items, samples)
    return ok.sum(axis=1), ok[:, 0]


def candidates(p, end: str) -> list[str]:
    """The right answer, one more, the last digit dropped, a 0 appended; then end."""
    c = int(p.answer)
    return [s + end for s in (str(c), str(c + 1), str(c // 10), str(c) + "0")]


def rounded(path, fmt: str):
    """The model at path with every weight rounded to the format fmt (stored as float32)."""
    model = npf.load(path)
    for _, p, _ in model.named_parameters(include_frozen=True):  # (name, weight, grad)
        p[...] = round_to(p, fmt)
    return model


def overlap(task: Addition) -> dict:
    """The base model's corpus (addition_base.py's draw) against the test set."""
    seen = {tuple(int(v) for v in p.prompt.split("+")) for p in task.sample(200_000, seed=1)}
    return {"train_items": 200_000, "distinct_pairs": len(seen),
            "test_pairs": len(task.test_pairs),
            "overlap": sum(task.is_test(a, b) for a, b in seen)}


def main() -> None:
    task, tok = Addition(), npf.CharTokenizer(Addition.alphabet)
    model, problems = npf.load(WEIGHTS), task.test_set()
    start = time.perf_counter()
    greedy, _ = exact_match(model, tok, problems, task.grade)
    counts, first = zip(*(sample_counts(model, tok, task, problems, c)
                          for c in range(len(problems) // CHUNK)))
    low = {fmt: exact_match(rounded(WEIGHTS, fmt), tok, problems, task.grade)[0]
           for fmt in ("bf16", "fp8_e4m3")}
    mc = [p for p in problems if int(p.answer) >= 10]  # a digit can be dropped
    logp = {name: choice_logprob(model, tok, [p.prompt + "=" for p in mc],
                                 [candidates(p, end) for p in mc])[0].round(5).tolist()
            for name, end in (("newline", "\n"), ("bare", ""))}
    seconds = time.perf_counter() - start
    bits = lambda x: "".join("1" if v else "0" for v in x)  # noqa: E731
    LOG.write_text(json.dumps({
        "n_samples": N_SAMPLES, "temperature": TEMPERATURE, "chunk": CHUNK,
        "greedy": bits(greedy), "first_sample": bits(np.concatenate(first)),
        "correct_samples": [int(c) for c in np.concatenate(counts)],
        "greedy_rounded": {fmt: bits(g) for fmt, g in low.items()},
        "choice_items": len(mc), "choice_logp": logp, "disjoint": overlap(task),
        "seconds": round(seconds, 1), "machine": platform.processor() or platform.machine(),
        "python": sys.version.split()[0], "numpy": np.__version__}, indent=1) + "\n")


if __name__ == "__main__":
    main()
