"""Benchmark one full npformer training step against an equivalent PyTorch eager model.

    .venv/bin/python bench/run.py                      # full run, 2 threads, prints a table
    .venv/bin/python bench/run.py --json bench/results.json
    .venv/bin/python bench/run.py --quick              # smoke run: few repeats

For each configuration (the encoder seed, Mini-BERT with its masked-LM head, the baby
GPT) both sides start from the same float32 weights (copied from the npformer model
into plain torch.nn modules), see the same batch and run the same step: forward, loss,
backward, global-norm clipping at 1.0 and AdamW (the same decay groups). The two steps
are timed interleaved (npformer, torch, npformer, torch, ...) after a warm-up, in one
process, with the same thread count on both sides (OPENBLAS/OMP/MKL_NUM_THREADS set
before numpy is imported, threadpoolctl, torch.set_num_threads; OPENBLAS_THREAD_TIMEOUT=16
so that numpy's idle BLAS threads stop spinning on the cores torch's threads need, unless
the environment sets it already). The first step of each
side is a correctness check: the losses must agree to rtol 1e-4 and the pre-clip
gradient norms to rtol 1e-3, or the script stops. Dropout is 0 on both sides, so that
the two computations are the same function.

Reported per configuration: the median step times and their ratio npformer / torch, with
the range of the paired ratios over the repeats, for the book's NumPy listings and (where
Numba is installed, under "fused") for the fused kernels of book/kernels.md, timed
interleaved with the other two;
FLOPs per step (``npformer.perf.train_flops``, derived in book/performance.md); achieved
GFLOP/s; MFU against the float32 matmul peak measured at the start (a 2048 x 2048
np.matmul, best of several); the peak traced memory of a fresh npformer model + AdamW +
one step (tracemalloc traces numpy's allocations) beside the estimate of
``npformer.perf.formula_memory``. Then one DPO step (book/preferences.md: the
policy's and the frozen reference's forward passes, the loss, the policy's backward pass,
AdamW) against the same loss in PyTorch eager on the same weights, as a ratio. Last,
tokens/s of npf.generate for 256 new tokens with and without the KV cache. The JSON also
records the machine, the date of the run and the load average before and after it, and,
after the timing, a profile of a few steps of each side: npformer's functions by self time
(cProfile) and torch's aten operators by self CPU time (torch.profiler).
"""

from __future__ import annotations

import os
import sys


def _threads_from_argv(argv: list[str]) -> int:
    """--threads N (or --threads=N) read before numpy is imported; default 2."""
    for i, arg in enumerate(argv):
        if arg == "--threads" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--threads="):
            return int(arg.split("=", 1)[1])
    return 2


if __name__ == "__main__":  # BLAS reads these once, when numpy loads it
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_var] = str(_threads_from_argv(sys.argv[1:]))
    # OpenBLAS's idle threads spin for 2^28 cycles (about 0.1 s) after each call by
    # default; interleaved with torch on few cores they take the cores torch's threads
    # need (measured: torch's step about 2x slower). 2^16 cycles (tens of microseconds)
    # lets them sleep between the two sides' steps without slowing torch's (measured).
    # The minimum, 4, is too short: npformer's step alone measured 20-30% slower with
    # it than with 16, presumably from waking the threads again for every product.
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "16")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

import npformer as npf  # noqa: E402
from npformer.kernels import HAVE_NUMBA  # noqa: E402
from npformer.losses import mse_loss, next_token_loss  # noqa: E402
from npformer.models.bert import bert_mask_tokens  # noqa: E402
from npformer.optim import AdamW, train_step  # noqa: E402
from npformer.perf import Shape, formula_memory, shape_of, train_flops  # noqa: E402
from npformer.sampling import generate  # noqa: E402
from npformer.softmax import cross_entropy  # noqa: E402

MB = 1024 * 1024


# ------------------------------------------------------------------------ torch twins
def build_torch(torch):
    """The torch.nn twins of the three npformer models (a closure over the torch module)."""
    nn, F = torch.nn, torch.nn.functional

    class Attention(nn.Module):
        def __init__(self, d: int, n_head: int, causal: bool) -> None:
            super().__init__()
            self.n_head, self.causal = n_head, causal
            self.qkv = nn.Linear(d, 3 * d)  # the same fused layout as npformer's
            self.proj = nn.Linear(d, d)

        def forward(self, x):
            B, T, d = x.shape
            H = self.n_head
            q, k, v = self.qkv(x).view(B, T, 3, H, d // H).permute(2, 0, 3, 1, 4)
            s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d // H))  # (B, H, T, T)
            if self.causal:
                mask = torch.ones(T, T, dtype=torch.bool).tril()
                s = s.masked_fill(~mask, float("-inf"))
            out = torch.softmax(s, dim=-1) @ v  # (B, H, T, d_head)
            return self.proj(out.transpose(1, 2).reshape(B, T, d))

    class MLP(nn.Module):
        def __init__(self, d: int, ff: int, act: str) -> None:
            super().__init__()
            self.fc, self.proj = nn.Linear(d, ff), nn.Linear(ff, d)
            self.act = nn.GELU() if act == "gelu" else nn.ReLU()

        def forward(self, x):
            return self.proj(self.act(self.fc(x)))

    class Block(nn.Module):
        def __init__(self, d, n_head, ff, *, prenorm, act, causal, eps) -> None:
            super().__init__()
            self.prenorm = prenorm
            self.ln_1 = nn.LayerNorm(d, eps=eps)
            self.attn = Attention(d, n_head, causal)
            self.ln_2 = nn.LayerNorm(d, eps=eps)
            self.mlp = MLP(d, ff, act)

        def forward(self, x):
            if self.prenorm:  # GPT-2
                x = x + self.attn(self.ln_1(x))
                return x + self.mlp(self.ln_2(x))
            h = self.ln_1(x + self.attn(x))  # BERT and the encoder: post-LN
            return self.ln_2(h + self.mlp(h))

    class Encoder(nn.Module):
        def __init__(self, c, pe: np.ndarray) -> None:
            super().__init__()
            self.wte = nn.Embedding(c.vocab_size, c.d_model)
            self.register_buffer("pe", torch.from_numpy(pe.copy()))
            self.h = nn.ModuleList([Block(c.d_model, c.n_head, c.d_ff, prenorm=False,
                                          act="relu", causal=False, eps=c.eps)
                                    for _ in range(c.n_layer)])
            self.ln_f = nn.LayerNorm(c.d_model, eps=c.eps)

        def loss(self, ids):
            target = self.wte.weight[ids].detach()  # a constant, as npformer's target()
            x = self.wte(ids) + self.pe[:ids.shape[1]]
            for block in self.h:
                x = block(x)
            return F.mse_loss(self.ln_f(x), target)

    class MLMHead(nn.Module):
        def __init__(self, d: int, V: int, eps: float) -> None:
            super().__init__()
            self.dense, self.act = nn.Linear(d, d), nn.GELU()
            self.ln = nn.LayerNorm(d, eps=eps)
            self.bias = nn.Parameter(torch.zeros(V))

    class BERT(nn.Module):
        def __init__(self, c) -> None:
            super().__init__()
            self.wte = nn.Embedding(c.vocab_size, c.d_model)
            self.wpe = nn.Embedding(c.block_size, c.d_model)
            self.type_emb = nn.Embedding(c.type_vocab_size, c.d_model)
            self.ln_emb = nn.LayerNorm(c.d_model, eps=c.eps)
            self.h = nn.ModuleList([Block(c.d_model, c.n_head, c.d_ff, prenorm=False,
                                          act="gelu", causal=False, eps=c.eps)
                                    for _ in range(c.n_layer)])
            self.mlm = MLMHead(c.d_model, c.vocab_size, c.eps)

        def loss(self, ids, positions, y):
            T = ids.shape[1]
            x = self.wte(ids) + self.wpe.weight[:T] + self.type_emb.weight[0]  # segment 0
            h = self.ln_emb(x)
            for block in self.h:
                h = block(h)
            z = self.mlm.ln(self.mlm.act(self.mlm.dense(h[positions])))  # (N, H)
            return F.cross_entropy(z @ self.wte.weight.T + self.mlm.bias, y)  # tied decoder

    class GPT(nn.Module):
        def __init__(self, c) -> None:
            super().__init__()
            self.wte = nn.Embedding(c.vocab_size, c.d_model)
            self.wpe = nn.Embedding(c.block_size, c.d_model)
            self.h = nn.ModuleList([Block(c.d_model, c.n_head, c.d_ff, prenorm=True,
                                          act="gelu", causal=True, eps=c.eps)
                                    for _ in range(c.n_layer)])
            self.ln_f = nn.LayerNorm(c.d_model, eps=c.eps)

        def loss(self, ids):
            T = ids.shape[1]
            x = self.wte(ids) + self.wpe.weight[:T]
            for block in self.h:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.T  # (B, T, V), tied head
            V = logits.shape[-1]
            return F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))

    return {"encoder": Encoder, "mini_bert": BERT, "gpt_baby": GPT}


def copy_weights(torch, npf_model, torch_model) -> dict[int, str]:
    """Copy every npformer parameter into the torch twin; return id(torch param) -> name.

    Names match module by module: Linear W (d_in, d_out) -> weight (d_out, d_in) and
    b -> bias; Embedding W -> weight; LayerNorm gamma/beta -> weight/bias; any other
    parameter (BERT's mlm.bias) by its own name. Every parameter must be used once.
    """
    nn = torch.nn
    src = {name: p for name, p, _ in npf_model.named_parameters()}
    names: dict[int, str] = {}

    def put(t_param, np_name: str, transpose: bool = False) -> None:
        arr = src.pop(np_name)
        arr = arr.T if transpose else arr
        if tuple(t_param.shape) != arr.shape:
            raise SystemExit(f"copy_weights: {np_name} {arr.shape} vs torch {t_param.shape}")
        with torch.no_grad():
            t_param.copy_(torch.from_numpy(np.ascontiguousarray(arr)))
        names[id(t_param)] = np_name

    done: set[int] = set()
    for mname, mod in torch_model.named_modules():
        pre = mname + "." if mname else ""
        if isinstance(mod, nn.Linear):
            put(mod.weight, pre + "W", transpose=True)
            put(mod.bias, pre + "b")
        elif isinstance(mod, nn.Embedding):
            put(mod.weight, pre + "W")
        elif isinstance(mod, nn.LayerNorm):
            put(mod.weight, pre + "gamma")
            put(mod.bias, pre + "beta")
        else:
            continue
        done.update(id(p) for p in mod.parameters())
    for pname, p in torch_model.named_parameters():
        if id(p) not in done:
            put(p, pname)
    if src:
        raise SystemExit(f"copy_weights: npformer parameters left unmapped: {sorted(src)}")
    return names


# ------------------------------------------------------------------------ the configs
@dataclass
class Case:
    shape: Shape
    make_npf: Callable[[], object]  # a fresh npformer model (the same weights each call)
    npf_objective: Callable[[object, object], tuple]  # (model, batch) -> (loss, dout)
    torch_loss: Callable[[object], object]  # forward + loss; returns the loss tensor
    betas: tuple[float, float]
    weight_decay: float
    lr: float


def make_cases(torch, twins) -> dict[str, Case]:
    rng = np.random.default_rng(0)
    cases = {}

    # Encoder seed: MSE reconstruction of wte.W[ids].
    ec = npf.EncoderConfig()
    ids_e = rng.integers(0, ec.vocab_size, (32, ec.block_size))
    ids_e_t = torch.from_numpy(ids_e)

    def enc_np(model, _batch) -> tuple[float, np.ndarray]:
        return mse_loss(model.forward(ids_e), model.target(ids_e))

    cases["encoder"] = Case(
        shape_of(npf.Encoder(ec), *ids_e.shape, name="encoder"),
        lambda: npf.Encoder(ec, seed=0), enc_np, lambda m: m.loss(ids_e_t),
        (0.9, 0.999), 0.01, 1e-3)

    # Mini-BERT: the chapter's masked-LM step (forward_mlm on the masked rows only).
    bc = npf.BERTConfig(dropout=0.0)
    special = np.arange(5)  # [PAD] [UNK] [CLS] [SEP] [MASK]
    rows = rng.integers(5, bc.vocab_size, (8, bc.block_size))
    rows[:, 0], rows[:, -1] = 2, 3
    inputs, targets = bert_mask_tokens(rows, rng, bc.vocab_size, 4, special, p=0.15)
    positions = targets != -100
    inputs_t, pos_t = torch.from_numpy(inputs), torch.from_numpy(positions)
    y_t = torch.from_numpy(targets[positions])

    def bert_np(model, _batch) -> tuple[float, np.ndarray]:
        return cross_entropy(model.forward_mlm(inputs, positions), targets[positions],
                             kernels=model.kernels)

    cases["mini_bert"] = Case(
        shape_of(npf.BERT(bc), *rows.shape, head_rows=int(positions.sum()), name="mini_bert"),
        lambda: npf.BERT(bc, seed=0), bert_np, lambda m: m.loss(inputs_t, pos_t, y_t),
        (0.9, 0.999), 0.01, 1e-3)

    # GPT baby: next-token loss over every position.
    gc_ = npf.GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, d_model=128)
    ids_g = rng.integers(0, gc_.vocab_size, (12, gc_.block_size))
    ids_g_t = torch.from_numpy(ids_g)

    def gpt_np(model, _batch) -> tuple[float, np.ndarray]:
        return next_token_loss(model.forward(ids_g), ids_g, kernels=model.kernels)

    cases["gpt_baby"] = Case(
        shape_of(npf.GPT(gc_), *ids_g.shape, name="gpt_baby"),
        lambda: npf.GPT(gc_, seed=0), gpt_np, lambda m: m.loss(ids_g_t),
        (0.9, 0.99), 0.1, 1e-3)
    return cases


# ---------------------------------------------------------------------------- running
def matmul_peak(n: int = 2048, repeats: int = 7) -> float:
    """Best float32 np.matmul rate in GFLOP/s (2 n^3 FLOPs per product)."""
    a = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
    b = np.random.default_rng(2).standard_normal((n, n), dtype=np.float32)
    out = np.empty((n, n), dtype=np.float32)
    np.matmul(a, b, out=out)  # warm-up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def npf_stepper(case: Case, model):
    opt = AdamW(model.named_parameters(), lr=case.lr, betas=case.betas,
                weight_decay=case.weight_decay)

    def step() -> tuple[float, float]:  # the book's one training step
        return train_step(model, opt, case.npf_objective, None, max_norm=1.0)

    return step, opt


def torch_stepper(torch, case: Case, model, names: dict[int, str], decay: dict[str, bool]):
    params = list(model.parameters())
    groups = [{"params": [p for p in params if decay[names[id(p)]]],
               "weight_decay": case.weight_decay},
              {"params": [p for p in params if not decay[names[id(p)]]], "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=case.lr, betas=case.betas,
                            eps=1e-8)

    def step() -> tuple[float, float]:
        opt.zero_grad(set_to_none=True)
        loss = case.torch_loss(model)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss.item(), norm.item()

    return step


def traced_peak_mb(case: Case) -> float:
    """Peak traced bytes of building the npformer model and AdamW and one step."""
    gc.collect()
    tracemalloc.start()
    try:
        model = case.make_npf().use_kernels("numpy")  # formula_memory counts the listings'
        step, _ = npf_stepper(case, model)
        step()
        return tracemalloc.get_traced_memory()[1] / MB
    finally:
        tracemalloc.stop()


def bench_case(torch, twins, key: str, case: Case, warmup: int, repeats: int,
               peak_gflops: float, profile_steps: int = 0) -> dict:
    """The listing's step ("npformer_ms"), the fused kernels' step ("fused", where Numba
    is installed) and torch's, from the same weights, timed interleaved. The paired ratios
    pair each repeat's steps."""
    model = case.make_npf().use_kernels("numpy")  # the book's NumPy listings
    tmodel = twins[key](model.config, model.pe) if key == "encoder" else twins[key](model.config)
    names = copy_weights(torch, model, tmodel)
    np_step, opt = npf_stepper(case, model)
    t_step = torch_stepper(torch, case, tmodel, names, opt.decay)
    steps = {"npformer": np_step, "torch": t_step}
    if HAVE_NUMBA:  # the same model with the fused kernels (book/kernels.md)
        steps["fused"] = npf_stepper(case, case.make_npf().use_kernels("fused"))[0]

    first = {side: step() for side, step in steps.items()}  # the correctness check
    loss_t, norm_t = first["torch"]
    for side in set(steps) - {"torch"}:
        loss_np, norm_np = first[side]
        if not math.isclose(loss_np, loss_t, rel_tol=1e-4):
            raise SystemExit(f"{key}: losses differ: {side} {loss_np!r}, torch {loss_t!r}")
        if not math.isclose(norm_np, norm_t, rel_tol=1e-3):
            raise SystemExit(f"{key}: gradient norms differ: {side} {norm_np!r}, "
                             f"torch {norm_t!r}")
    loss_np, norm_np = first["npformer"]

    for _ in range(warmup):
        for step in steps.values():
            step()
    gc.collect()
    times = {side: [] for side in steps}
    order = list(steps.items())
    for k in range(repeats):  # interleaved, in a rotating order: A B C, B C A, C A B, ...
        for side, step in order[k % len(order):] + order[:k % len(order)]:
            t0 = time.perf_counter()  # (each side follows torch, whose idle OpenMP
            step()  # threads spin for a while, equally often)
            times[side].append(time.perf_counter() - t0)
    t_np, t_t = times["npformer"], times["torch"]
    np_ms, t_ms = 1e3 * statistics.median(t_np), 1e3 * statistics.median(t_t)
    profiles = {"steps": profile_steps,
                "npformer": profile_npformer(np_step, profile_steps),
                "torch": profile_torch(torch, t_step, profile_steps)} if profile_steps else None
    fused = None
    if "fused" in steps:
        t_f = times["fused"]
        f_ms = 1e3 * statistics.median(t_f)
        fused = {"npformer_ms": f_ms, "ratio_vs_torch": f_ms / t_ms,
                 "ratio_range": [min(a / b for a, b in zip(t_f, t_t)),
                                 max(a / b for a, b in zip(t_f, t_t))],
                 "speedup_over_listing": np_ms / f_ms,
                 "first_loss": first["fused"][0], "first_grad_norm": first["fused"][1],
                 "profile": profile_npformer(steps["fused"], profile_steps)
                 if profile_steps else None}
    flops = train_flops(case.shape)
    achieved = flops["total"] / (np_ms / 1e3) / 1e9
    mem = formula_memory(case.shape)
    peak = traced_peak_mb(case)
    return {
        "ratio_vs_torch": np_ms / t_ms,
        "npformer_ms": np_ms,
        "torch_ms": t_ms,
        "gflops": achieved,  # achieved GFLOP/s of the npformer step
        "mfu": achieved / peak_gflops,
        "peak_mem_mb": peak,
        "formula_mem_mb": mem["total_mb"],
        "formula_mem_parts_mb": {k: v for k, v in mem.items() if k != "total_mb"},
        "gflop_per_step": flops["total"] / 1e9,
        "flops_parts": flops,
        "torch_gflops": flops["total"] / (t_ms / 1e3) / 1e9,
        "torch_mfu": flops["total"] / (t_ms / 1e3) / 1e9 / peak_gflops,
        "npformer_ms_min": 1e3 * min(t_np),
        "torch_ms_min": 1e3 * min(t_t),
        # the spread of the paired ratios: each npformer step over the torch step after it
        "ratio_range": [min(a / b for a, b in zip(t_np, t_t)),
                        max(a / b for a, b in zip(t_np, t_t))],
        "repeats": repeats,
        "warmup": warmup,
        "n_params": case.shape.n_params,
        "tokens_per_step": case.shape.B * case.shape.T,
        "first_loss": {"npformer": loss_np, "torch": loss_t},
        "first_grad_norm": {"npformer": norm_np, "torch": norm_t},
        "profile": profiles,
        "fused": fused,
    }


def _npformer_qualnames() -> dict[tuple[str, int], str]:
    """(file, first line) -> qualified name, for every function and method of npformer."""
    import importlib
    import inspect
    import pkgutil

    names = {}
    for info in pkgutil.walk_packages(npf.__path__, "npformer."):
        if info.name.endswith("__main__"):
            continue
        mod = importlib.import_module(info.name)
        for obj in vars(mod).values():
            funcs = [obj] if inspect.isfunction(obj) else (
                [v for v in vars(obj).values() if inspect.isfunction(v)]
                if inspect.isclass(obj) else [])
            for f in funcs:
                if f.__module__ == mod.__name__:
                    names[(f.__code__.co_filename, f.__code__.co_firstlineno)] = f.__qualname__
    return names


def profile_npformer(step, steps: int, top: int = 15) -> dict:
    """cProfile of `steps` steps: total and the functions with the most self time, per step."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    qual = _npformer_qualnames()
    rows = []
    for (file, line, func), (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():
        if file == "~":  # a C function: <method 'reduce' of 'numpy.ufunc' objects> and such
            m = re.fullmatch(r"<method '(\w+)' of '([\w.]+)' objects>", func)
            name = f"{m.group(2)}.{m.group(1)}" if m else func  # numpy.ufunc.reduce
        else:
            name = qual.get((file, line), f"{Path(file).name}:{func}")
        rows.append({"name": name, "ms": 1e3 * tottime / steps})
    total = sum(r["ms"] for r in rows)
    rows.sort(key=lambda r: -r["ms"])
    return {"total_ms": total, "top": [{**r, "share": r["ms"] / total} for r in rows[:top]]}


def profile_torch(torch, step, steps: int, top: int = 15) -> dict:
    """torch.profiler over `steps` steps: total and the operators with the most self time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages()
    rows = [{"name": e.key, "ms": e.self_cpu_time_total / 1e3 / steps} for e in events]
    total = sum(r["ms"] for r in rows)
    rows.sort(key=lambda r: -r["ms"])
    return {"total_ms": total, "top": [{**r, "share": r["ms"] / total} for r in rows[:top]]}


def bench_kv_cache(new_tokens: int, repeats: int, prompt_len: int = 16) -> dict:
    """Greedy generation of new_tokens from a baby-GPT-shaped model, with and without cache.

    The baby GPT's block_size of 64 would make both paths fall back to recomputing a
    64-token window, so this model has block_size = prompt_len + new_tokens (the same
    layers, d_model, heads and vocabulary; only the position table is longer). B = 1.
    """
    c = npf.GPTConfig(vocab_size=65, block_size=prompt_len + new_tokens, n_layer=4, n_head=4,
                      d_model=128)
    model = npf.GPT(c, seed=0)
    prompt = np.random.default_rng(3).integers(0, c.vocab_size, (1, prompt_len))
    out, times = {}, {True: [], False: []}
    generate(model, prompt, 8, temperature=0.0, use_cache=True)  # warm-up
    for _ in range(repeats):
        for use_cache in (True, False):
            t0 = time.perf_counter()
            out[use_cache] = generate(model, prompt, new_tokens, temperature=0.0,
                                      use_cache=use_cache)
            times[use_cache].append(time.perf_counter() - t0)
    with_s, without_s = statistics.median(times[True]), statistics.median(times[False])
    return {
        "new_tokens": new_tokens,
        "speedup": without_s / with_s,
        "tokens_per_s_cache": new_tokens / with_s,
        "tokens_per_s_no_cache": new_tokens / without_s,
        "seconds_cache": with_s,
        "seconds_no_cache": without_s,
        "prompt_len": prompt_len,
        "batch": 1,
        "repeats": repeats,
        "same_tokens": bool(np.array_equal(out[True], out[False])),
    }


def bench_dpo(torch, twins, warmup: int, repeats: int) -> dict:
    """One DPO step (book/preferences.md) on the baby GPT: the policy's and the frozen
    reference's forward passes, the DPO loss on the response tokens, the policy's backward
    pass, clipping and AdamW; against the same loss in PyTorch eager on the same weights,
    timed interleaved. N = 6 pairs (12 rows of T = 64), responses of 16 to 48 tokens."""
    from npformer.preference import dpo_token_loss, token_logprobs
    from npformer.sft import TokenLogProbs

    c = npf.GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, d_model=128)
    rng = np.random.default_rng(5)
    ids = rng.integers(0, c.vocab_size, (12, c.block_size))
    mask = np.zeros((12, c.block_size - 1))
    for row, n in enumerate(rng.integers(16, 49, size=12)):
        mask[row, -n:] = 1  # the response: the last n targets
    beta = 0.1
    policy = npf.GPT(c, seed=0).use_kernels("numpy")  # the book's NumPy listings, both
    reference = npf.GPT(c, seed=1).use_kernels("numpy")
    twin, twin_ref = twins["gpt_baby"](c), twins["gpt_baby"](c)
    names = copy_weights(torch, policy, twin)
    copy_weights(torch, reference, twin_ref)
    ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask.astype(np.float32))

    def objective(model, _batch):
        tlp = TokenLogProbs(model)
        loss, dlp = dpo_token_loss(tlp.forward(ids), token_logprobs(reference, ids), mask, beta)
        return loss, tlp.dlogits(dlp)

    def seq_logprob(m):  # the twin's logits, as in its loss: blocks, ln_f, the tied head
        x = m.wte(ids_t) + m.wpe.weight[:ids_t.shape[1]]
        for block in m.h:
            x = block(x)
        logp = torch.log_softmax(m.ln_f(x)[:, :-1] @ m.wte.weight.T, dim=-1)
        return (logp.gather(-1, ids_t[:, 1:, None])[..., 0] * mask_t).sum(-1)  # (2N,)

    def torch_loss(m):
        with torch.no_grad():
            ref = seq_logprob(twin_ref)
        d = seq_logprob(m) - ref
        return -torch.nn.functional.logsigmoid(beta * (d[:6] - d[6:])).mean()

    case = Case(None, None, objective, torch_loss, (0.9, 0.99), 0.1, 1e-4)
    np_step, opt = npf_stepper(case, policy)
    t_step = torch_stepper(torch, case, twin, names, opt.decay)
    (loss_np, norm_np), (loss_t, norm_t) = np_step(), t_step()
    if not (math.isclose(loss_np, loss_t, rel_tol=1e-4) and
            math.isclose(norm_np, norm_t, rel_tol=1e-3)):
        raise SystemExit(f"dpo: first step differs: npformer {loss_np!r} {norm_np!r}, "
                         f"torch {loss_t!r} {norm_t!r}")
    for _ in range(warmup):
        np_step(), t_step()
    times: dict[str, list[float]] = {"npformer": [], "torch": []}
    for k in range(repeats):
        for side, step in ((("npformer", np_step), ("torch", t_step)) if k % 2 == 0 else
                           (("torch", t_step), ("npformer", np_step))):
            t0 = time.perf_counter()
            step()
            times[side].append(time.perf_counter() - t0)
    np_ms = 1e3 * statistics.median(times["npformer"])
    t_ms = 1e3 * statistics.median(times["torch"])
    ratios = [a / b for a, b in zip(times["npformer"], times["torch"])]
    return {"ratio_vs_torch": np_ms / t_ms, "npformer_ms": np_ms, "torch_ms": t_ms,
            "ratio_range": [min(ratios), max(ratios)], "repeats": repeats, "warmup": warmup,
            "pairs": 6, "rows": 12, "block_size": c.block_size, "beta": beta,
            "first_loss": {"npformer": loss_np, "torch": loss_t},
            "first_grad_norm": {"npformer": norm_np, "torch": norm_t}}


def _numba_version() -> str | None:
    try:
        import numba
    except ImportError:
        return None
    return numba.__version__


def _cpu_model() -> str:
    """The processor's name (Intel or AMD, and which), from /proc/cpuinfo where there is one."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(threads: int, torch) -> dict:
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "threads": threads,
        "torch_threads": torch.get_num_threads(),
        "numba": _numba_version(),
        "env": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                               "MKL_NUM_THREADS", "OPENBLAS_THREAD_TIMEOUT")},
    }
    try:
        from threadpoolctl import threadpool_info

        info["blas"] = [{k: d.get(k) for k in ("internal_api", "version", "num_threads")}
                        for d in threadpool_info()]
    except ImportError:
        pass
    return info


def print_table(res: dict) -> None:
    print(f"\nfloat32 matmul peak: {res['matmul_peak_gflops']:.1f} GFLOP/s "
          f"({res['machine']['threads']} threads)")
    head = (f"{'config':<10} {'npf ms':>9} {'torch ms':>9} {'ratio':>6} {'fused ms':>9} "
            f"{'ratio':>6} {'GFLOP':>7} {'GFLOP/s':>8} {'MFU':>6} {'peak MB':>8} {'formula':>8}")
    print(head)
    print("-" * len(head))
    for key, r in res["configs"].items():
        f = r.get("fused")
        fused = f"{f['npformer_ms']:9.2f} {f['ratio_vs_torch']:6.2f}" if f else f"{'-':>16}"
        print(f"{key:<10} {r['npformer_ms']:9.2f} {r['torch_ms']:9.2f} "
              f"{r['ratio_vs_torch']:6.2f} {fused} {r['gflop_per_step']:7.3f} "
              f"{r['gflops']:8.1f} {100 * r['mfu']:5.1f}% {r['peak_mem_mb']:8.1f} "
              f"{r['formula_mem_mb']:8.1f}")
    if "dpo" in res:
        d = res["dpo"]
        print(f"\nDPO step (baby GPT, {d['pairs']} pairs, policy + reference): npformer "
              f"{d['npformer_ms']:.2f} ms, torch {d['torch_ms']:.2f} ms, "
              f"ratio {d['ratio_vs_torch']:.2f}")
    kv = res["kv_cache"]
    print(f"\nKV cache, {kv['new_tokens']} new tokens: {kv['tokens_per_s_cache']:.0f} tok/s "
          f"with, {kv['tokens_per_s_no_cache']:.0f} tok/s without, "
          f"speedup {kv['speedup']:.2f}x (same tokens: {kv['same_tokens']})")
    print(f"total runtime: {res['runtime_s']:.1f} s")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="BLAS and torch threads (2)")
    ap.add_argument("--quick", action="store_true", help="a fast smoke run: few repeats")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per side")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--profile-steps", type=int, default=None,
                    help="steps profiled per side after the timing, 0 for none (10; quick: 2)")
    ap.add_argument("--ddp", action="store_true",
                    help="also time data-parallel training on 2 MPI ranks (bench/ddp.py; "
                         "needs the mpi extra)")
    args = ap.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 40)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    if args.profile_steps is None:
        args.profile_steps = 2 if args.quick else 10

    start = time.perf_counter()
    import torch

    torch.set_num_threads(args.threads)
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.threads)
    except ImportError:
        pass
    torch.manual_seed(0)
    twins = build_torch(torch)

    res: dict = {"machine": machine_info(args.threads, torch),
                 "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "load_before": os.getloadavg()[0]}  # other work on the machine, 1 min
    res["matmul_peak_gflops"] = matmul_peak(repeats=3 if args.quick else 7)
    res["configs"] = {}
    for key, case in make_cases(torch, twins).items():
        print(f"{key} ...", file=sys.stderr, flush=True)
        res["configs"][key] = bench_case(torch, twins, key, case, warmup, repeats,
                                         res["matmul_peak_gflops"], args.profile_steps)
    print("dpo ...", file=sys.stderr, flush=True)
    res["dpo"] = bench_dpo(torch, twins, warmup, repeats)
    print("kv_cache ...", file=sys.stderr, flush=True)
    res["kv_cache"] = bench_kv_cache(256, repeats=1 if args.quick else 3)
    if args.ddp:  # its own processes, one BLAS thread each: see bench/ddp.py
        print("ddp ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "ddp.json"
            subprocess.run([sys.executable, str(Path(__file__).with_name("ddp.py")),
                            "--steps", "5" if args.quick else "30", "--out", str(out)],
                           check=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
            res["ddp"] = json.loads(out.read_text())
    res["quick"] = bool(args.quick)
    res["load_after"] = os.getloadavg()[0]
    res["runtime_s"] = time.perf_counter() - start
    print_table(res)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return res


if __name__ == "__main__":
    main()
