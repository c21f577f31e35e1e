"""One GPT training step on one GPU: npformer's NumPy listings through CuPy, and its
fused CUDA kernels (book/kernels.md), against PyTorch eager on the same weights and the
same batch.

    PYTHONPATH=src python3 bench/gpu.py --json bench/gpu_results.json   # a GPU machine
    .venv/bin/python bench/gpu.py --device cpu --quick                  # a smoke run
    .venv/bin/python bench/gpu.py --device strict --quick               # CuPy's rules, no GPU

Models: GPT-2 small (12 layers, 12 heads, d_model 768, vocabulary 50,304, 1,024
positions, the book's exact GELU, dropout 0) at batch 8 x 1,024, and the book's baby GPT
(4 layers, 4 heads, d_model 128, 64 positions, character vocabulary 96) at batch 12 x 64.
Both sides start from the same float32 weights (npformer's, copied into a torch.nn
twin) and train on the same batch: forward, next-token cross-entropy, backward,
global-norm clipping at 1.0 and AdamW (lr 6e-4, betas (0.9, 0.95), weight decay 0.1 on
the same parameters as npformer's default_no_decay). PyTorch runs eager with
F.scaled_dot_product_attention (causal) and fused AdamW.

Precisions: "fp32" (TF32 off on both sides) and "tf32" (CuPy's CUPY_TF32=1, read when
CuPy loads, so each precision runs in a process of its own; torch's allow_tf32). The
first step of each side is a check: the two losses must agree to 1e-3 relatively.

The three sides (listing, fused, torch) are timed interleaved, in a rotating order.
Reported per model and precision: the median ms/step over the repeats (every step ends
with a synchronisation of the device), tokens/s, the fraction of the matrix-product peak
measured at the start (a (B T) x d x 4d product in that precision), npformer's peak
device memory (the CuPy pool's high-water mark) and torch's (max_memory_reserved),
npformer's host reads per step (copies device -> host through its device table) and a
profile of one step by phase (forward, loss, backward, clip, optimiser), each phase
timed between synchronisations. The JSON names the device, the library versions and
the date.

A model that fails (an error, or first losses that differ) is recorded with its error
and the run goes on; the exit status is then 1. With --json, the file is rewritten after
each model, so a run stopped part-way keeps what it measured.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {  # name: (GPTConfig fields, batch size)
    "gpt2_small": (dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12,
                        d_model=768), 8),
    "gpt_baby": (dict(vocab_size=96, block_size=64, n_layer=4, n_head=4, d_model=128), 12),
}
QUICK = {"gpt_baby": MODELS["gpt_baby"],
         "gpt_small_quick": (dict(vocab_size=512, block_size=128, n_layer=2, n_head=4,
                                  d_model=128), 4)}
LR, BETAS, WD, CLIP = 6e-4, (0.9, 0.95), 0.1, 1.0


def _traceback_tail(lines: int = 12) -> str:
    import traceback
    return "".join(traceback.format_exc().splitlines(keepends=True)[-lines:])


def _sync(device: str) -> None:
    if device == "cuda":
        import cupy
        cupy.cuda.Device().synchronize()


def _torch_sync(torch, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def torch_gpt(torch, c):
    """GPT-2's architecture in torch.nn, the parameter layout of npformer's GPT."""
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = c.d_model
            self.ln_1, self.ln_2 = nn.LayerNorm(d, eps=c.eps), nn.LayerNorm(d, eps=c.eps)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.fc_proj = nn.Linear(d, c.d_ff), nn.Linear(c.d_ff, d)

        def forward(self, x):
            B, T, d = x.shape
            H = c.n_head
            q, k, v = self.qkv(self.ln_1(x)).view(B, T, 3, H, d // H).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, d_h)
            x = x + self.proj(a.transpose(1, 2).reshape(B, T, d))
            return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(c.vocab_size, c.d_model)
            self.wpe = nn.Embedding(c.block_size, c.d_model)
            self.h = nn.ModuleList([Block() for _ in range(c.n_layer)])
            self.ln_f = nn.LayerNorm(c.d_model, eps=c.eps)

        def loss(self, ids):
            x = self.wte(ids) + self.wpe.weight[:ids.shape[1]]
            for block in self.h:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.T  # (B, T, V), the tied head
            V = logits.shape[-1]
            return F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))

    return GPT()


def copy_weights(torch, model, twin) -> dict[str, object]:
    """npformer's parameters into the twin; returns npformer name -> torch parameter."""
    import numpy as np
    pairs = {"wte.W": twin.wte.weight, "wpe.W": twin.wpe.weight,
             "ln_f.gamma": twin.ln_f.weight, "ln_f.beta": twin.ln_f.bias}
    for i, b in enumerate(twin.h):
        for ours, theirs in (("ln_1", b.ln_1), ("ln_2", b.ln_2)):
            pairs[f"h.{i}.{ours}.gamma"], pairs[f"h.{i}.{ours}.beta"] = theirs.weight, theirs.bias
        for ours, theirs in (("attn.qkv", b.qkv), ("attn.proj", b.proj), ("mlp.fc", b.fc),
                             ("mlp.proj", b.fc_proj)):
            pairs[f"h.{i}.{ours}.W"], pairs[f"h.{i}.{ours}.b"] = theirs.weight, theirs.bias
    params = {n: p for n, p, _ in model.named_parameters()}
    if set(params) != set(pairs):
        raise SystemExit(f"copy_weights: unmatched {sorted(set(params) ^ set(pairs))[:4]}")
    with torch.no_grad():
        for name, p in params.items():
            w = p.T if name.endswith(".W") and not name.startswith(("wte", "wpe")) else p
            pairs[name].copy_(torch.from_numpy(np.ascontiguousarray(w)))
    return pairs


def matmul_peak(device: str, n_rows: int, d: int, repeats: int = 10) -> float:
    """FLOP/s of a (n_rows, d) x (d, 4d) float32 product, best of repeats."""
    import numpy as np

    from npformer.device import to_device
    a = to_device(np.random.default_rng(0).standard_normal((n_rows, d), np.float32), device)
    b = to_device(np.random.default_rng(1).standard_normal((d, 4 * d), np.float32), device)
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n_rows * d * 4 * d / best


def bench_one(name: str, fields: dict, B: int, device: str, precision: str, repeats: int,
              warmup: int) -> dict:
    """Both sides' step on one model, in this process's precision."""
    import numpy as np
    import torch

    import npformer as npf
    from npformer import device as D
    from npformer.losses import next_token_loss
    from npformer.optim import AdamW, default_no_decay, train_step
    from npformer.perf import shape_of, train_flops

    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    cfg = npf.GPTConfig(**fields, dropout=0.0)
    T = cfg.block_size
    ids_host = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T))
    model = npf.GPT(cfg, seed=0, kernels="numpy")  # the book's listings
    twin = torch_gpt(torch, cfg)
    pairs = copy_weights(torch, model, twin)
    tdev = "cuda" if device == "cuda" else "cpu"
    twin.to(tdev)
    decay = {n: not default_no_decay(n, p) for n, p, _ in model.named_parameters()}
    by_id = {id(p): n for n, p in pairs.items()}
    groups = [{"params": [p for p in twin.parameters() if decay[by_id[id(p)]]],
               "weight_decay": WD},
              {"params": [p for p in twin.parameters() if not decay[by_id[id(p)]]],
               "weight_decay": 0.0}]
    fused = {"fused": True} if tdev == "cuda" else {}
    t_opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, **fused)
    t_ids = torch.from_numpy(ids_host).to(tdev)

    model.to(device)
    opt = AdamW(model.named_parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    ids = D.to_device(ids_host, device)
    kernels = importlib.util.find_spec("numba") is not None or device == "cuda"
    if kernels:  # the same model with the fused kernels (book/kernels.md)
        model_f = npf.GPT(cfg, seed=0, kernels="fused").to(device)
        opt_f = AdamW(model_f.named_parameters(), lr=LR, betas=BETAS, weight_decay=WD)

    def objective(m, batch):
        return next_token_loss(m.forward(batch), batch, kernels=m.kernels)

    reads = [0]
    dev = D.get_device(device)
    counted = D.register_device(device, dev.array_type, to=dev.to,
                                to_host=lambda x: (reads.__setitem__(0, reads[0] + 1),
                                                   dev.to_host(x))[1])

    def npf_step() -> float:
        loss, _ = train_step(model, opt, objective, ids, max_norm=CLIP)
        _sync(device)
        return loss

    def fused_step() -> float:
        loss, _ = train_step(model_f, opt_f, objective, ids, max_norm=CLIP)
        _sync(device)
        return loss

    def torch_step() -> float:
        t_opt.zero_grad(set_to_none=True)
        loss = twin.loss(t_ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), CLIP)
        t_opt.step()
        _torch_sync(torch, tdev)
        return loss.detach()

    sides = {"npformer": npf_step, "torch": torch_step}
    if kernels:
        sides["fused"] = fused_step
    first = {side: float(step()) for side, step in sides.items()}
    for side in set(sides) - {"torch"}:
        if abs(first[side] - first["torch"]) > 1e-3 * abs(first["torch"]):
            raise SystemExit(f"{name} {precision}: first losses differ: {side} "
                             f"{first[side]:.6f}, torch {first['torch']:.6f}")
    for _ in range(warmup):
        for step in sides.values():
            step()
    if device == "cuda":
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()
        torch.cuda.reset_peak_memory_stats()
    times = {side: [] for side in sides}
    reads[0] = 0
    read_counts = dict.fromkeys(sides, 0)
    order = list(sides.items())
    for k in range(repeats):  # interleaved in a rotating order: the same machine for all
        for side, step in order[k % len(order):] + order[:k % len(order)]:
            before = reads[0]
            t0 = time.perf_counter()
            step()
            times[side].append(time.perf_counter() - t0)
            read_counts[side] += reads[0] - before
    reads_per_step = read_counts["npformer"] / repeats
    D.register_device(device, counted.array_type, to=counted.to, to_host=dev.to_host)

    profile = {}  # one npformer step by phase, each between synchronisations
    marks = [("zero_grad", lambda: model.zero_grad())]
    state = {}
    marks += [("forward", lambda: state.__setitem__("logits", model.forward(ids))),
              ("loss", lambda: state.__setitem__("out", next_token_loss(state["logits"], ids))),
              ("backward", lambda: model.backward(state["out"][1])),
              ("clip", lambda: opt.clip_grad_norm(CLIP)),
              ("optimiser", lambda: opt.step())]
    for phase, run in marks:
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        profile[phase] = 1e3 * (time.perf_counter() - t0)

    flops = train_flops(shape_of(model, B, T))["total"]
    peak = matmul_peak(device, B * T, cfg.d_model)
    row = {"batch": [B, T], "parameters": sum(p.size for _, p, _ in model.named_parameters()),
           "flops_per_step": flops, "matmul_peak_tflops": peak / 1e12,
           "host_reads_per_step": reads_per_step, "profile_ms": profile}
    for side in times:
        ms = 1e3 * statistics.median(times[side])
        row[side] = {"ms_per_step": ms, "ms_spread": [1e3 * min(times[side]),
                                                      1e3 * max(times[side])],
                     "tokens_per_s": B * T / (ms / 1e3), "mfu": flops / (ms / 1e3) / peak}
    row["ratio"] = row["npformer"]["ms_per_step"] / row["torch"]["ms_per_step"]
    if kernels:
        row["fused"]["host_reads_per_step"] = read_counts["fused"] / repeats
        row["fused_ratio"] = row["fused"]["ms_per_step"] / row["torch"]["ms_per_step"]
    if device == "cuda":
        import cupy
        row["npformer"]["peak_memory_mb"] = cupy.get_default_memory_pool().total_bytes() / 2**20
        row["torch"]["peak_memory_mb"] = torch.cuda.max_memory_reserved() / 2**20
    # The step's FLOPs are its matrix products': their time if every one ran at the peak.
    row["profile_ms"]["matmul_at_peak"] = flops / peak * 1e3
    return row


def child(args) -> None:
    """One precision, every model: print each model's row as a JSON line when it is done,
    or its error (the next model still runs)."""
    if args.device == "strict":  # the host array with CuPy's rules (book/gpu.md)
        from npformer.strict import register
        register()
    for name in args.models:
        fields, B = {**MODELS, **QUICK}[name]
        try:
            row = bench_one(name, fields, B, args.device, args.precision, args.repeats,
                            args.warmup)
        except (Exception, SystemExit):  # recorded; the next model runs
            row = {"error": _traceback_tail()}
        if args.device == "cuda":
            import cupy
            cupy.get_default_memory_pool().free_all_blocks()
        print(json.dumps({"model": name, "row": row}), flush=True)


def machine(device: str) -> dict:
    import numpy as np
    import torch
    info = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "numpy": np.__version__,
            "torch": torch.__version__, "cpu": platform.processor() or platform.machine()}
    if device == "cuda":
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(0)
        info.update(device=props["name"].decode(), cupy=cupy.__version__,
                    cuda_runtime=cupy.cuda.runtime.runtimeGetVersion())
    else:
        info["device"] = device  # cpu, or strict: the host with CuPy's rules
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu", "strict"))
    ap.add_argument("--quick", action="store_true", help="small models, few repeats")
    ap.add_argument("--models", type=lambda s: s.split(","), default=None,
                    help=f"comma-separated, of {', '.join({**MODELS, **QUICK})} "
                         "(default: the first two, or the last two with --quick)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--precision", choices=("fp32", "tf32"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.repeats is None:
        args.repeats = 3 if args.quick else 10
    if args.models is None:
        args.models = list(QUICK if args.quick else MODELS)
    unknown = [m for m in args.models if m not in {**MODELS, **QUICK}]
    if unknown:
        ap.error(f"--models: expected names from {sorted({**MODELS, **QUICK})}, got {unknown}")
    if args.precision is not None:  # a child process
        child(args)
        return
    results = {"machine": machine(args.device), "settings": {
        "lr": LR, "betas": BETAS, "weight_decay": WD, "clip": CLIP, "repeats": args.repeats,
        "warmup": args.warmup, "quick": args.quick, "models": args.models}, "runs": {},
        "errors": {}}

    def report(precision: str, name: str, r: dict) -> None:
        if "error" in r:  # kept apart, so "runs" holds complete rows only
            results["errors"].setdefault(precision, {})[name] = r["error"]
            print(f"{name:16s} {precision}: FAILED\n{r['error']}", flush=True)
        else:
            results["runs"].setdefault(precision, {})[name] = r
            fused = (f", fused {r['fused']['ms_per_step']:8.1f} ms, ratio "
                     f"{r['fused_ratio']:.2f}" if "fused" in r else "")
            print(f"{name:16s} {precision}: npformer {r['npformer']['ms_per_step']:8.1f} ms, "
                  f"torch {r['torch']['ms_per_step']:8.1f} ms, ratio {r['ratio']:.2f}{fused}, "
                  f"{r['host_reads_per_step']:.0f} host reads/step", flush=True)
        if args.json is not None:  # after each model: a run stopped part-way keeps its rows
            args.json.write_text(json.dumps(results, indent=1) + "\n")

    precisions = ("fp32", "tf32") if args.device == "cuda" else ("fp32",)
    for precision in precisions:
        env = dict(os.environ, CUPY_TF32="1" if precision == "tf32" else "0",
                   PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, __file__, "--device", args.device, "--precision", precision,
               "--repeats", str(args.repeats), "--warmup", str(args.warmup),
               "--models", ",".join(args.models)]
        # The child's stderr passes through; its stdout is one JSON line per model.
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) as proc:
            done = set()
            for line in proc.stdout:
                if line.startswith('{"model": '):
                    out = json.loads(line)
                    done.add(out["model"])
                    report(precision, out["model"], out["row"])
                else:
                    print(line, end="")
        for name in args.models:
            if name not in done:  # the child died before this model's row
                report(precision, name, {"error": f"the {precision} process exited with "
                                                  f"status {proc.returncode} first"})
    if args.json is not None:
        print(f"wrote {args.json}")
    if results["errors"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
