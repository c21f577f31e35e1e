"""Measure data-parallel training on this machine; the chapter on many processes reads the log.

    OPENBLAS_NUM_THREADS=1 python bench/ddp.py --out book/data/ddp.json

needs the mpi extra (pip install -e '.[mpi]'). It measures, one thing at a time:

1. one process: the baby GPT's training step (4 layers, d_model 128, 4 heads, windows of
   64, global batch 12, float32), with one BLAS thread;
2. under ``mpiexec -n 2`` (launched by this script): the time of an Allreduce of float32
   arrays from 16 bytes to 16 MB, for the per-message alpha and beta of the ring model
   (fit_ring_allreduce: a whole all-reduce is 2 (R - 1) messages); and the same baby GPT
   step on two ranks, plain data parallelism and ZeRO-1, with the time spent inside MPI
   calls counted separately;
3. the optimiser's memory per rank, plain and ZeRO-1, measured with tracemalloc while the
   optimiser is built (NumPy reports its allocations to it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from npformer.data import load_corpus, make_tokenizer, train_val_split
from npformer.distributed import (
    AllReduceAdamW,
    DistributedTrainer,
    FlatBuffers,
    SingleProcess,
    ZeroAdamW,
    fit_ring_allreduce,
    world,
)
from npformer.models.gpt import GPT, GPTConfig
from npformer.train import TrainConfig, Trainer

BATCH, BLOCK = 12, 64


def baby(vocab_size: int) -> GPT:
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=BLOCK, n_layer=4, n_head=4,
                         d_model=128), seed=0)


def data():
    text = load_corpus("pydoc")
    tok = make_tokenizer(text, "char")
    train, val = train_val_split(text, 0.1)
    return tok, np.array(tok.encode(train)), np.array(tok.encode(val))


class Timed(SingleProcess):
    """A communicator that counts the seconds spent inside its collectives."""

    def __init__(self, comm) -> None:
        self.inner, self.rank, self.size, self.seconds = comm, comm.rank, comm.size, 0.0

    def _timed(self, name, *args):
        t0 = time.perf_counter()
        out = getattr(self.inner, name)(*args)
        self.seconds += time.perf_counter() - t0
        return out

    def allreduce(self, buf):
        return self._timed("allreduce", buf)

    def reduce_scatter(self, buf):
        return self._timed("reduce_scatter", buf)

    def allgather(self, send, recv):
        return self._timed("allgather", send, recv)

    def sum(self, value):
        return self._timed("sum", value)

    def barrier(self):
        return self._timed("barrier")


def time_steps(trainer, steps: int, comm=None) -> dict:
    """Median seconds of a training step, and of the MPI part of it."""
    trainer.train_step()  # warm up: first-touch allocations, BLAS start-up
    times, comm_times = [], []
    for _ in range(steps):
        if comm is not None:
            comm.inner.barrier()  # start together: measure the step, not the wait
            comm.seconds = 0.0
        t0 = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - t0)
        comm_times.append(comm.seconds if comm is not None else 0.0)
    step = statistics.median(times)
    return {"step_ms": 1e3 * step, "comm_ms": 1e3 * statistics.median(comm_times),
            "tokens_per_s": BATCH * BLOCK / step}


def optimizer_bytes(build) -> int:
    """Bytes NumPy allocated (and kept) while ``build()`` made an optimiser."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    opt = build()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del opt
    return after - before


def config(steps: int, batch_size: int = BATCH) -> TrainConfig:
    return TrainConfig(steps=steps + 10, batch_size=batch_size, block_size=BLOCK,
                       warmup_steps=10, eval_interval=10_000)


def one_process(steps: int) -> dict:
    tok, train, val = data()
    trainer = Trainer(baby(tok.vocab_size), train, val, config(steps))
    out = time_steps(trainer, steps)
    half = Trainer(baby(tok.vocab_size), train, val, config(steps, BATCH // 2))
    out["half_batch_step_ms"] = time_steps(half, steps)["step_ms"]  # alone on the machine
    model = baby(tok.vocab_size)
    out["n_params"] = int(sum(p.size for _, p, _ in model.named_parameters()))
    flat = FlatBuffers(model, shards=1)
    out["optimizer_bytes"] = optimizer_bytes(lambda: AllReduceAdamW(flat, SingleProcess()))
    return out


def worker(steps: int, path: Path) -> None:
    """Run under mpiexec: the all-reduce sweep, then the step on N ranks, both ways."""
    comm = world()
    sizes = [4 ** k for k in range(1, 12)]  # float32 elements: 16 bytes .. 16 MB
    sweep = []
    for n in sizes:
        buf = np.ones(n, dtype=np.float32)
        for _ in range(3):
            comm.allreduce(buf)  # warm up the path for this size
        ts = []
        for _ in range(15):
            comm.barrier()
            t0 = time.perf_counter()
            comm.allreduce(buf)
            ts.append(time.perf_counter() - t0)
        sweep.append({"bytes": 4 * n, "seconds": statistics.median(ts)})
    tok, train, val = data()
    grads = FlatBuffers(baby(tok.vocab_size), shards=comm.size).grads
    buckets = {}  # the baby GPT's gradient, all-reduced in one message or in k buckets
    for k in (1, 4, 16, 64):
        parts = np.array_split(grads, k)
        ts = []
        for _ in range(15):
            comm.barrier()
            t0 = time.perf_counter()
            for part in parts:
                comm.allreduce(part)
            ts.append(time.perf_counter() - t0)
        buckets[str(k)] = statistics.median(ts)
    runs = {}
    # Each rank's share of the work, with no communication, all ranks at once: what the
    # processes cost each other by sharing the machine.
    alone = Trainer(baby(tok.vocab_size), train, val, config(steps, BATCH // comm.size))
    alone.train_step()
    times = []
    for _ in range(steps):
        comm.barrier()
        t0 = time.perf_counter()
        alone.train_step()
        times.append(time.perf_counter() - t0)
    shared_ms = 1e3 * statistics.median(times)
    for zero in (False, True):
        timed = Timed(comm)
        trainer = DistributedTrainer(baby(tok.vocab_size), train, val, config(steps),
                                     comm=timed, zero=zero)
        runs["zero" if zero else "plain"] = time_steps(trainer, steps, timed)
        flat = FlatBuffers(baby(tok.vocab_size), shards=comm.size)
        runs["zero" if zero else "plain"]["optimizer_bytes"] = optimizer_bytes(
            lambda: ZeroAdamW(flat, comm) if zero else AllReduceAdamW(flat, comm))
    if comm.rank == 0:
        path.write_text(json.dumps({"ranks": comm.size, "allreduce": sweep, "runs": runs,
                                    "concurrent_share_step_ms": shared_ms,
                                    "bucketed_allreduce_s": buckets}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per configuration")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("book/data/ddp.json"))
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.steps, args.worker)
        return 0
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if mpiexec is None:
        print("error: mpiexec not found beside this python: pip install -e '.[mpi]'",
              file=sys.stderr)
        return 2
    single = one_process(args.steps)
    vocab_size = data()[0].vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / "ranks.json"
        subprocess.run([mpiexec, "-n", str(args.ranks), sys.executable, __file__,
                        "--steps", str(args.steps), "--worker", str(part)], check=True)
        multi = json.loads(part.read_text())
    alpha, beta = fit_ring_allreduce([r["bytes"] for r in multi["allreduce"]],
                                     [r["seconds"] for r in multi["allreduce"]], args.ranks)
    result = {
        "command": f"python bench/ddp.py --steps {args.steps} --ranks {args.ranks}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or
                    platform.machine(), "python": platform.python_version(),
                    "numpy": np.__version__,
                    "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default")},
        "model": {"n_layer": 4, "n_head": 4, "d_model": 128, "block_size": BLOCK,
                  "batch_size": BATCH, "vocab_size": vocab_size, "dtype": "float32"},
        "one_process": single, **multi, "alpha_s": alpha, "beta_s_per_byte": beta,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("alpha_s", "beta_s_per_byte")}))
    print("one process:", single)
    for name, run in multi["runs"].items():
        print(f"{args.ranks} ranks, {name}:", run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
