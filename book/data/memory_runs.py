"""Peak memory of GPT-2 small training steps, traced on the CPU (book/precision.md).

Writes book/data/memory_runs.json. Run from the repository root:

    OPENBLAS_NUM_THREADS=1 python book/data/memory_runs.py

GPT-2 small's configuration (12 blocks, d_model 768, 12 heads, vocabulary 50257,
the tanh GELU) in float32 with the NumPy listings, at T = 1024 and batches of 1 and
2 sequences, with every cache kept and with one block per segment of recomputation.
Each run is one train_step with AdamW and next_token_loss under tracemalloc
(npformer.perf.traced_peak); the chapter sets the peaks beside step_memory's formula.
A step takes tens of seconds on a CPU, too long for the book's cells.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

import npformer as npf
from npformer.perf import step_memory, traced_peak

OUT = Path(__file__).resolve().parent / "memory_runs.json"
T = 1024
CONFIG = npf.GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, d_model=768,
                       activation="gelu_tanh")
RUNS = [(1, None), (1, 1), (2, None), (2, 1)]  # (B, blocks per segment)


def cpu_name() -> str:
    """The processor's name, from /proc/cpuinfo where there is one."""
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    rng = np.random.default_rng(0)
    runs = []
    for B, every in RUNS:
        model = npf.recompute(npf.GPT(CONFIG, seed=0, kernels="numpy"), every)
        ids = rng.integers(0, CONFIG.vocab_size, (B, T))
        t0 = time.perf_counter()
        peak = traced_peak(model, ids)
        seconds = time.perf_counter() - t0
        formula = step_memory(CONFIG, B, T, recompute=every).activations
        runs.append({"B": B, "recompute": every, "traced": peak, "seconds": round(seconds, 1)})
        print(f"B = {B}, recompute {every}: traced {peak / 1e9:.3f} GB, formula "
              f"{formula / 1e9:.3f} GB, {seconds:.0f} s", flush=True)
        del model
    out = {"command": "OPENBLAS_NUM_THREADS=1 python book/data/memory_runs.py",
           "config": dataclasses.asdict(CONFIG), "T": T, "runs": runs,
           "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(),
                       "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "-"),
                       "python": platform.python_version(), "numpy": np.__version__,
                       "date": datetime.date.today().isoformat()}}
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
