"""Full-config reconstruction runs for book/encoder.md; writes book/data/encoder_runs.json.

    python bench/encoder_runs.py            # all runs (several minutes on one core)
    python bench/encoder_runs.py --check    # rerun the first 20 steps of each, compare with the log

Every run is seed 000's exact setting (EncoderConfig() defaults, batch 32, sequence
length 16, 500 Adam steps); they differ only in the learning rate and in which
parameters the optimiser may update. The book reads the log; it reruns only a
short prefix of one run live, to show that the log comes from this code.
"""

from __future__ import annotations

import os

# One BLAS thread: float32 sums then do not depend on the machine's core count.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import npformer as npf  # noqa: E402
from npformer.models.encoder import reconstruction_metrics

LOG = Path(__file__).resolve().parents[1] / "book" / "data" / "encoder_runs.json"
EVAL_SEED, EVAL_BATCH = 123, 256  # a held-out batch of fresh random sequences

RUNS = {  # name: (learning rate, frozen name prefixes, steps, what it is)
    "correct": (3e-3, (), 500, "all parameters trained, target held constant"),
    "frozen_wte": (3e-3, ("wte.",), 500, "embeddings frozen: exactly the seed's data"),
    "frozen_wte_long": (3e-3, ("wte.",), 4000, "embeddings frozen, 8 times longer"),
    "ln_f_only": (3e-3, ("wte.", "h."), 500, "seed bug 3 re-created: only ln_f updated"),
    "correct_lr_1e-3": (1e-3, (), 500, "all parameters trained, learning rate 1e-3"),
}


def run(name: str, steps: int | None = None) -> dict:
    lr, freeze, full_steps, about = RUNS[name]
    model = npf.Encoder(npf.EncoderConfig(), seed=0)
    start = time.perf_counter()
    history = npf.train_reconstruction(model, steps=steps or full_steps, batch_size=32,
                                       lr=lr, freeze=freeze, seed=0)
    seconds = time.perf_counter() - start
    ids = np.random.default_rng(EVAL_SEED).integers(0, model.config.vocab_size,
                                                    (EVAL_BATCH, model.config.block_size))
    out = model.forward(ids)  # (B, T, d)
    final = reconstruction_metrics(out, ids, model.wte.W)
    return {"about": about, "lr": lr, "freeze": list(freeze), "steps": steps or full_steps,
            "seconds": round(seconds, 1), "history": history, "final": final,
            "wte_std": float(model.wte.W.std()), "ln_f": ln_f_features(model, out)}


def ln_f_features(model: npf.Encoder, out: np.ndarray) -> dict:
    """Where ln_f puts its unit energy: per feature, the share of mean(xhat^2), gamma,
    and the output's mean and standard deviation over the eval batch (features sorted
    by share, largest first)."""
    xhat = model.ln_f.cache[0]  # (B, T, d), the normalised input of the last forward
    share = np.mean(xhat * xhat, axis=(0, 1)) / np.mean(np.sum(xhat * xhat, axis=-1))
    order = np.argsort(-share)
    return {"feature": order.tolist(), "share": share[order].tolist(),
            "gamma": model.ln_f.gamma[order].tolist(), "beta": model.ln_f.beta[order].tolist(),
            "out_mean": out.mean(axis=(0, 1))[order].tolist(),
            "out_std": out.std(axis=(0, 1))[order].tolist()}


def compact(obj):
    """Floats to 9 significant digits: exact for float32 values, and a smaller log."""
    if isinstance(obj, float):
        return float(f"{obj:.9g}")
    if isinstance(obj, dict):
        return {k: compact(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [compact(v) for v in obj]
    return obj


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare 20 steps with the log")
    args = parser.parse_args()
    if args.check:
        log = json.loads(LOG.read_text())
        for name in RUNS:
            new = run(name, steps=20)["history"]["mse"]
            old = log["runs"][name]["history"]["mse"][:20]
            diff = np.max(np.abs(np.subtract(new, old)) / np.asarray(old))
            print(f"{name}: max relative difference over 20 steps {diff:.1e}")
        return
    runs = {}
    for name in RUNS:
        runs[name] = run(name)
        print(f"{name}: {runs[name]['seconds']} s, {runs[name]['final']}", flush=True)
    log = {"command": "python bench/encoder_runs.py", "config": asdict(npf.EncoderConfig()),
           "batch_size": 32, "eval": {"seed": EVAL_SEED, "batch": EVAL_BATCH},
           "versions": {"python": platform.python_version(), "numpy": np.__version__},
           "runs": runs}
    LOG.parent.mkdir(parents=True, exist_ok=True)
    LOG.write_text(json.dumps(compact(log)) + "\n")
    print(f"wrote {LOG}", file=sys.stderr)


if __name__ == "__main__":
    main()
