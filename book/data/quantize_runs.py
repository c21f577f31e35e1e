"""The measurements of book/quantize.md, too slow for a book build.

Writes book/data/quantize_runs.json and book/data/quantize_gpt_baby_int4.safetensors.
Run from the repository root, on one core:

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 \
        python book/data/quantize_runs.py

The trained GPT of book/gpt.md (book/data/gpt_baby.safetensors; character level, the
pydoc corpus, the first 90% for training and the last 10% for validation, as that
chapter splits it) is quantized by round-to-nearest (RTN) and by GPTQ at 8, 4 and 3
bits: every Linear layer of the blocks (attention qkv and proj, feed-forward fc and
proj); the embeddings (the token embedding is also the output layer), the norms and
the biases stay float32. GPTQ's calibration is CALIB windows of 64 characters drawn
from the training split only (seed 0), passed through the model as quantized so far.
Each model is scored on the whole validation split, cut into windows of 64 characters
as book/gpt.md cuts it: the log keeps each window's mean loss in nats, so that the
chapter can compute paired intervals. The log also keeps the bytes each model stores,
the time the quantization took, and the time of a forward pass over 16 windows and
over a single token, float32 against the int8 and int4 layouts.

The fine-tuned addition model of book/sft.md (book/data/addition_sft.safetensors) is
quantized to 4 bits in groups of 32 (its d_model is 96) by RTN and by GPTQ, with
calibration from training sums only, and answers the 1000 test sums greedily; the log
keeps every sum's grade.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

import npformer as npf
from npformer.data import encode_ids, sample_windows
from npformer.evaluate import Addition, exact_match
from npformer.quantize import linear_sites, quantize_model, save_quantized, stored_bytes
from npformer.sft import ChatTemplate, chat_tokenizer
from npformer.softmax import log_softmax
from npformer.tokenizer import CharTokenizer

HERE = Path(__file__).resolve().parent
GPT_PATH, SFT_PATH = HERE / "gpt_baby.safetensors", HERE / "addition_sft.safetensors"
LOG, SAVED = HERE / "quantize_runs.json", HERE / "quantize_gpt_baby_int4.safetensors"
CALIB, T = 128, 64
SCHEMES = [  # (method, bits, group size, symmetric)
    ("rtn", 8, None, True), ("gptq", 8, None, True),
    ("rtn", 4, None, False), ("gptq", 4, None, False),
    ("rtn", 4, 64, False), ("gptq", 4, 64, False),
    ("rtn", 4, 32, False), ("gptq", 4, 32, False),
    ("rtn", 3, 64, False), ("gptq", 3, 64, False),
]
SAVE_SCHEME = ("gptq", 4, 64, False)


def gpt_data():
    """(tokenizer, training ids, validation windows x (n, 64), targets y (n, 64))."""
    from pydoc_data.topics import topics

    tok = CharTokenizer(npf.load_checkpoint(GPT_PATH).extra["chars"])
    text = "\n".join(topics[k] for k in sorted(topics))
    data = encode_ids(tok, text).astype(np.int64)
    n_train = int(0.9 * len(data))
    train, val = data[:n_train], data[n_train:]
    windows = val[:(len(val) - 1) // T * T + 1]  # whole windows, plus one target
    return tok, train, windows[:-1].reshape(-1, T), windows[1:].reshape(-1, T)


def calibration(train: np.ndarray) -> np.ndarray:
    """CALIB windows of T characters of the training split, at seeded random starts."""
    return sample_windows(train, CALIB, T, np.random.default_rng(0))


def window_nats(model, x: np.ndarray, y: np.ndarray, batch: int = 64) -> np.ndarray:
    """The mean loss in nats of each window (n,), float64."""
    out = []
    for i in range(0, len(x), batch):
        logp = log_softmax(model.forward(x[i:i + batch]).astype(np.float64))  # (b, T, V)
        nats = -np.take_along_axis(logp, y[i:i + batch, :, None], axis=-1)[..., 0]
        out.append(nats.mean(axis=1))
    return np.concatenate(out)


def timings(x: np.ndarray, rounds: int = 40) -> dict:
    """Seconds of a forward pass over 16 windows and over one token, float32 against the
    int8 and int4 (g64) layouts: the models take turns, round after round, so that a
    busy machine slows them alike; the fastest and the median of the rounds."""
    models = {"float32": npf.load(GPT_PATH).eval(),
              "int8": quantize_model(npf.load(GPT_PATH).eval(), 8, None, "rtn"),
              "int4 g64": quantize_model(npf.load(GPT_PATH).eval(), 4, 64, "rtn")}
    inputs = {"16 windows": x[:16], "1 token": x[:1, :1]}
    seconds = {(m, i): [] for m in models for i in inputs}
    for _ in range(rounds):
        for (m, i), times in seconds.items():
            t0 = time.perf_counter()
            models[m].forward(inputs[i])
            times.append(time.perf_counter() - t0)
    return {m: {i: {"min": min(seconds[m, i]), "median": float(np.median(seconds[m, i]))}
                for i in inputs} for m in models}


def gpt_runs() -> dict:
    tok, train, x_val, y_val = gpt_data()
    calib = calibration(train)
    rows = []
    for scheme in [None, *SCHEMES]:
        model = npf.load(GPT_PATH).eval()
        linear = sum(p.nbytes for *_, lin in linear_sites(model)
                     for _, p, _ in lin.named_parameters(include_frozen=True)
                     if p.ndim == 2)
        t0 = time.perf_counter()
        if scheme is not None:
            method, bits, group, sym = scheme
            quantize_model(model, bits, group, method, calib, symmetric=sym)
            linear = sum(stored_bytes(model, f"{name}.{part}")  # codes, steps, zeros
                         for name in model.quantization["layers"]
                         for part in ("qweight", "scales", "zeros"))
        seconds = time.perf_counter() - t0
        nats = window_nats(model, x_val, y_val)
        row = {"method": "float32" if scheme is None else scheme[0],
               "bits": 32 if scheme is None else scheme[1],
               "group_size": None if scheme is None else scheme[2],
               "symmetric": None if scheme is None else scheme[3],
               "quantize_seconds": round(seconds, 2),
               "bytes_total": stored_bytes(model), "bytes_linear_weights": int(linear),
               "val_nats": float(nats.mean()),
               "window_nats": [round(float(v), 7) for v in nats]}
        rows.append(row)
        print(f"{row['method']:8s} {row['bits']:2d} {str(row['group_size']):4s} "
              f"val {row['val_nats']:.4f}  {row['bytes_total']:8d} B  {seconds:5.1f} s",
              flush=True)
        if scheme == SAVE_SCHEME:
            save_quantized(model, SAVED, overwrite=True)
    return {"calibration_windows": CALIB, "window": T, "val_windows": len(x_val),
            "val_chars": int(y_val.size), "runs": rows, "timings": timings(x_val)}


def addition_runs() -> dict:
    template, task = ChatTemplate(chat_tokenizer()), Addition()
    tok, grade = template.tok, template.grader(task)
    test = task.test_set()
    rows = [template.render(p.prompt, p.answer)[0] for p in task.sample(512, seed=5)]
    length = max(set(map(len, rows)), key=[len(r) for r in rows].count)
    calib = np.stack([r for r in rows if len(r) == length])  # (B, T): training sums only
    out = {"calibration_rows": len(calib), "calibration_length": int(length), "runs": []}
    for scheme in (None, ("rtn", 4, 32, False), ("gptq", 4, 32, False)):
        model = npf.load(SFT_PATH).eval()
        if scheme is not None:
            quantize_model(model, scheme[1], scheme[2], scheme[0], calib,
                           symmetric=scheme[3])
        t0 = time.perf_counter()
        correct, _ = exact_match(model, tok, test, grade,
                                 render=lambda p: template.prompt(p.prompt),
                                 stop=template.end, max_new_tokens=6)
        name = "float32" if scheme is None else f"{scheme[0]} int4 g32"
        out["runs"].append({"name": name, "bytes_total": stored_bytes(model),
                            "correct": "".join("1" if c else "0" for c in correct)})
        print(f"addition {name:14s} exact match {correct.mean():.3f} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    return out


def main() -> None:
    t0 = time.perf_counter()
    log = {"command": "python book/data/quantize_runs.py",
           "machine": {"platform": platform.platform(), "processor": platform.processor(),
                       "python": sys.version.split()[0], "numpy": np.__version__,
                       "threads": 1},
           "gpt": gpt_runs(), "addition": addition_runs()}
    log["seconds"] = round(time.perf_counter() - t0, 1)
    LOG.write_text(json.dumps(log, indent=1) + "\n")
    print(f"wrote {LOG} and {SAVED} in {log['seconds']} s")


if __name__ == "__main__":
    main()
