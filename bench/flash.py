"""Tiled (flash) attention against the standard path: memory, time, block size, window.

    .venv/bin/python bench/flash.py                       # every part, writes book/data/flash.json
    .venv/bin/python bench/flash.py --parts time          # rerun one part, keep the others
    .venv/bin/python bench/flash.py --quick --json /tmp/flash.json   # a smoke run

Every part runs causal attention, forward and backward, on float32 arrays of shape
(B, h, T, d_h) = (1, h, T, 64):

- memory: the peak traced memory (tracemalloc, which traces NumPy's allocations) of
  forward + backward beyond the inputs, for both paths, T = 512 ... 8192, h = 2;
- time: NumPy on --threads threads (default 2, set before NumPy loads BLAS); the two
  paths interleaved in one process (standard, flash, standard, flash, ...) after a
  warm-up, the median of the repeats; T = 256 ... 4096, h = 4;
- block: the tiled path's time and peak memory against its block size at T = 2048;
  with --threads N other than 2, the timed parts are stored under "<part>_N_thread(s)";
- window: the tiled path's time with a sliding window of 256 keys and with the causal
  mask alone, and the number of tiles each visits, T = 512 ... 8192.

The JSON records the machine (CPU, NumPy, BLAS), the date and the load average before
and after the timed parts, because the time depends on what else the machine runs.
"""

from __future__ import annotations

import os
import sys


def _threads_from_argv(argv: list[str]) -> int:
    for i, arg in enumerate(argv):
        if arg == "--threads" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--threads="):
            return int(arg.split("=", 1)[1])
    return 2


if __name__ == "__main__":  # BLAS reads these once, when NumPy loads it
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_var] = str(_threads_from_argv(sys.argv[1:]))
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "16")  # as bench/run.py: idle threads sleep

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import npformer as npf  # noqa: E402
from npformer.attention import attention_backward, scaled_dot_product_attention  # noqa: E402
from npformer.flash import key_tiles  # noqa: E402

D_HEAD = 64
WINDOW = 256


def inputs(h: int, T: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((1, h, T, D_HEAD)).astype(np.float32) for _ in range(4))


def standard_step(q, k, v, dout, mask):
    out, cache = scaled_dot_product_attention(q, k, v, mask)
    return attention_backward(dout, cache)


def flash_step(q, k, v, dout, window=None, block_size=64):
    out, cache = npf.flash_attention(q, k, v, causal=True, window=window, block_size=block_size)
    return npf.flash_attention_backward(dout, cache)


def peak_mib(fn) -> float:
    """Peak traced memory of fn() beyond what was allocated before it, in MiB."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return (peak - base) / 2**20


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(fns: dict, repeats: int) -> dict:
    """Median seconds of each fn, run in turn (a, b, a, b, ...) after one warm-up each."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(seconds(fn))
    return {name: (statistics.median(t), t) for name, t in times.items()}


def tiles(T: int, window, b: int) -> int:
    return sum(1 for i0 in range(0, T, b)
               for _ in key_tiles(i0, min(i0 + b, T), T, T, True, window, b))


def machine(threads: int) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    blas = "unknown"
    try:
        from threadpoolctl import threadpool_info
        blas = ", ".join(f"{i['internal_api']} {i.get('version')} ({i['num_threads']} threads)"
                         for i in threadpool_info())
    except ImportError:
        pass
    return dict(cpu=cpu, cores=os.cpu_count(), numpy=np.__version__, blas=blas,
                python=platform.python_version(), threads=threads)


def part_memory(lengths, h=2) -> dict:
    res = dict(T=[], standard_MiB=[], flash_MiB=[], h=h, d_h=D_HEAD, dtype="float32",
               block_size=64)
    for T in lengths:
        q, k, v, dout = inputs(h, T)
        mask = np.tril(np.ones((T, T), dtype=bool))  # built before the measurement
        s = peak_mib(lambda: standard_step(q, k, v, dout, mask))
        f = peak_mib(lambda: flash_step(q, k, v, dout))
        print(f"memory T={T}: standard {s:.1f} MiB, flash {f:.2f} MiB", flush=True)
        res["T"].append(T)
        res["standard_MiB"].append(s)
        res["flash_MiB"].append(f)
    return res


def part_time(lengths, h=4, repeats=None, threads=2) -> dict:
    res = dict(T=[], standard_s=[], flash_s=[], repeats=[], standard_all=[], flash_all=[],
               h=h, d_h=D_HEAD, dtype="float32", block_size=64, threads=threads,
               load_before=os.getloadavg()[0])
    for T in lengths:
        q, k, v, dout = inputs(h, T)
        mask = np.tril(np.ones((T, T), dtype=bool))
        n = repeats or (9 if T <= 1024 else 5)
        got = interleaved({"standard": lambda: standard_step(q, k, v, dout, mask),
                           "flash": lambda: flash_step(q, k, v, dout)}, n)
        print(f"time T={T}: standard {got['standard'][0] * 1e3:.1f} ms, "
              f"flash {got['flash'][0] * 1e3:.1f} ms, "
              f"ratio {got['flash'][0] / got['standard'][0]:.2f}", flush=True)
        res["T"].append(T)
        res["repeats"].append(n)
        for name in ("standard", "flash"):
            res[f"{name}_s"].append(got[name][0])
            res[f"{name}_all"].append(got[name][1])
    res["load_after"] = os.getloadavg()[0]
    return res


def part_block(T=2048, sizes=(16, 32, 64, 128, 256, 512), h=2, repeats=5,
               threads=2) -> dict:
    q, k, v, dout = inputs(h, T)
    mask = np.tril(np.ones((T, T), dtype=bool))
    fns = {"standard": lambda: standard_step(q, k, v, dout, mask)}
    for b in sizes:
        fns[b] = (lambda b: lambda: flash_step(q, k, v, dout, block_size=b))(b)
    got = interleaved(fns, repeats)
    res = dict(T=T, h=h, block_size=list(sizes), flash_s=[got[b][0] for b in sizes],
               flash_MiB=[peak_mib(fns[b]) for b in sizes], standard_s=got["standard"][0],
               standard_MiB=peak_mib(fns["standard"]), repeats=repeats, threads=threads)
    print(f"block sizes at T={T}: {dict(zip(sizes, res['flash_s']))}", flush=True)
    return res


def part_window(lengths, causal_max=4096, h=2, b=64, repeats=5, threads=2) -> dict:
    res = dict(T=[], window=WINDOW, block_size=b, h=h, threads=threads, window_s=[], causal_s=[],
               tiles_window=[], tiles_causal=[], window_MiB=[])
    for T in lengths:
        q, k, v, dout = inputs(h, T)
        fns = {"window": lambda: flash_step(q, k, v, dout, window=WINDOW, block_size=b)}
        if T <= causal_max:
            fns["causal"] = lambda: flash_step(q, k, v, dout, block_size=b)
        got = interleaved(fns, repeats)
        res["T"].append(T)
        res["window_s"].append(got["window"][0])
        res["causal_s"].append(got["causal"][0] if "causal" in got else None)
        res["tiles_window"].append(tiles(T, WINDOW, b))
        res["tiles_causal"].append(tiles(T, None, b))
        res["window_MiB"].append(peak_mib(fns["window"]))
        print(f"window T={T}: {got['window'][0] * 1e3:.0f} ms "
              f"(causal {got['causal'][0] * 1e3 if 'causal' in got else float('nan'):.0f} ms)",
              flush=True)
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="book/data/flash.json")
    ap.add_argument("--parts", nargs="+", default=["memory", "time", "block", "window"],
                    choices=["memory", "time", "block", "window"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="small lengths, few repeats")
    args = ap.parse_args(argv)
    path = Path(args.json)
    results = json.loads(path.read_text()) if path.exists() else {}
    if args.quick:
        plan = dict(memory=lambda: part_memory([128, 256]),
                    time=lambda: part_time([128, 256], repeats=2, threads=args.threads),
                    block=lambda: part_block(T=128, sizes=(32, 64), repeats=1,
                                             threads=args.threads),
                    window=lambda: part_window([128, 256], repeats=1, threads=args.threads))
    else:
        plan = dict(memory=lambda: part_memory([512, 1024, 2048, 4096, 8192]),
                    time=lambda: part_time([256, 512, 1024, 2048, 4096], threads=args.threads),
                    block=lambda: part_block(threads=args.threads),
                    window=lambda: part_window([512, 1024, 2048, 4096, 8192],
                                               threads=args.threads))
    for part in args.parts:
        timed = part != "memory" and args.threads != 2  # the default key holds 2 threads
        key = f"{part}_{args.threads}_thread{'s' * (args.threads > 1)}" if timed else part
        results[key] = plan[part]()
        results[key]["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds")
    results["machine"] = machine(2)
    results["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
