"""The server's measurements for book/server.md, too slow for a book build.

Writes book/data/server_runs.json. Run from the repository root, on one thread:

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 python book/data/server_runs.py

The trained GPT (book/data/gpt_baby.safetensors) is served by `npformer serve` in its
own process (one thread computes the model: the engine thread), on the loopback. C
clients (C = 1, 2, 4, ..., 32), threads of this process, each send a stream of requests
one after another (a closed loop: the next as soon as the last has finished): a prompt
of 8 .. 24 characters of validation text, MAX_TOKENS new tokens at temperature 0.8 with
a seed per request, streamed, so that the time to the first token is seen. Two servers
run side by side, one with --max-batch 1 (one request at a time) and one with
--max-batch 32 (continuous batching), and each number of clients is measured on one
and then the other, so that both see the same load of the machine. Each request's
latency (sent to [DONE]) and time to its first token are kept; every request sent is
counted, and every one completed with MAX_TOKENS tokens. The sweep is repeated REPEATS
times (the machine is shared; its load average is kept). For reference, the Engine
alone (no HTTP, no threads) decodes the same kind of requests, n at once, with
max_batch n, best of three.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

import npformer as npf
from npformer.data import load_corpus, train_val_split
from npformer.server import Client

HERE = Path(__file__).resolve().parent
OUT = HERE / "server_runs.json"
CLIENTS = (1, 2, 4, 8, 16, 32)
BATCHES = (1, 32)
MAX_TOKENS = 32
PER_CONFIG = 64  # requests per configuration and repeat, at least 4 per client
REPEATS = 3  # the machine is shared: each configuration is measured three times
LAUNCH = """import argparse, sys
from npformer.server import add_serve_command
parser = argparse.ArgumentParser(prog="npformer")
add_serve_command(parser.add_subparsers(dest="command", required=True))
args = parser.parse_args(sys.argv[1:])
sys.exit(args.func(args))
"""


def prompts(n: int, seed: int = 0) -> list[str]:
    _, val = train_val_split(load_corpus("pydoc"), 0.1)
    chars = set(npf.load_checkpoint(HERE / "gpt_baby.safetensors").extra["chars"])
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        i, k = int(rng.integers(0, len(val) - 32)), int(rng.integers(8, 25))
        text = val[i:i + k]
        if set(text) <= chars:
            out.append(text)
    return out


def start(max_batch: int):
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, "serve", str(HERE / "gpt_baby.safetensors"),
         "--port", "0", "--max-batch", str(max_batch), "--max-queue", "64"],
        stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    return proc, Client(int(line.rsplit(":", 1)[1]), timeout=300)


def run(client: Client, n_clients: int, texts: list[str]) -> dict:
    per_client = max(4, PER_CONFIG // n_clients)
    records, lock = [], threading.Lock()

    def one(c: int) -> None:
        for j in range(per_client):
            k = c * per_client + j
            t0 = time.perf_counter()
            first, n, reason = None, 0, None
            try:
                for chunk in client.stream(texts[k % len(texts)], max_tokens=MAX_TOKENS,
                                           temperature=0.8, seed=k):
                    first = time.perf_counter() if first is None else first
                    n += 1
                    reason = chunk["choices"][0]["finish_reason"]
                rec = {"ok": reason == "length", "tokens": n,
                       "latency": time.perf_counter() - t0, "ttft": first - t0}
            except Exception as exc:  # counted, never hidden
                rec = {"ok": False, "error": repr(exc)[:200]}
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=one, args=(c,)) for c in range(n_clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in records if r["ok"]]
    lat = np.array([r["latency"] for r in ok])
    ttft = np.array([r["ttft"] for r in ok])
    q = (50, 90, 99)
    return {"clients": n_clients, "sent": n_clients * per_client, "completed": len(ok),
            "failed": [r for r in records if not r["ok"]],
            "tokens": int(sum(r["tokens"] for r in ok)), "wall_s": wall,
            "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
            "latency_s": dict(zip(("p50", "p90", "p99"), np.percentile(lat, q).tolist())),
            "ttft_s": dict(zip(("p50", "p90", "p99"), np.percentile(ttft, q).tolist())),
            "latency_mean_s": float(lat.mean()),
            "latencies": np.round(lat, 5).tolist(), "ttfts": np.round(ttft, 5).tolist()}


def engine_alone(texts: list[str]) -> list[dict]:
    from npformer.server import load_run
    from npformer.serving import Engine

    model, tok, _ = load_run(HERE / "gpt_baby.safetensors")
    rows = []
    for n in CLIENTS:
        engine = Engine(model, max_batch=n)
        ids = [tok.encode(t) for t in texts[:n]]
        engine.generate(ids, 4)  # warm-up
        best = []
        for rep in range(3):
            t0 = time.perf_counter()
            out = engine.generate(ids, MAX_TOKENS, temperature=0.8, seed=rep)
            best.append(sum(map(len, out)) / (time.perf_counter() - t0))
        rows.append({"requests": n, "tokens_per_s": best})
    return rows


def main() -> None:
    texts = prompts(PER_CONFIG * 2)
    results = {"machine": {"platform": platform.platform(), "processor":
                           platform.processor() or platform.machine(),
                           "python": platform.python_version(), "numpy": np.__version__,
                           "cpus": os.cpu_count(), "threads": "OPENBLAS_NUM_THREADS=1"},
               "model": "gpt_baby.safetensors", "max_tokens": MAX_TOKENS,
               "temperature": 0.8, "runs": [], "load_average": [os.getloadavg()]}
    servers = {b: start(b) for b in BATCHES}  # both up; an idle one sleeps
    try:
        for _, client in servers.values():
            run(client, 4, texts)  # warm-up, not kept
        for rep in range(REPEATS):
            for n in CLIENTS:  # the two settings side by side, under the same load
                for max_batch, (_, client) in servers.items():
                    row = {"max_batch": max_batch, "repeat": rep, **run(client, n, texts)}
                    results["runs"].append(row)
                    results["load_average"].append(os.getloadavg())
                    print(f"{rep} batch {max_batch:2d} clients {n:2d}: "
                          f"{row['tokens_per_s']:5.0f} tok/s  latency p50 "
                          f"{row['latency_s']['p50']:.3f} p99 {row['latency_s']['p99']:.3f}"
                          f"  ttft p50 {row['ttft_s']['p50']:.3f}  "
                          f"{row['completed']}/{row['sent']}", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()  # SIGTERM: the graceful shutdown, exit status 0
        results["exit_codes"] = [proc.wait(timeout=60) for proc, _ in servers.values()]
    results["engine_alone"] = engine_alone(texts)
    OUT.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
