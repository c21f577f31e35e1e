"""Smoke test of bench/run.py: the quick run completes and writes the JSON that outside
checks read (the full benchmark is run by hand; see bench/run.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the benchmark compares against PyTorch (oracle extra)")

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("ratio_vs_torch", "npformer_ms", "torch_ms", "gflops", "mfu", "peak_mem_mb",
          "formula_mem_mb")


def test_bench_quick(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["matmul_peak_gflops"] > 0
    assert set(res["configs"]) == {"encoder", "mini_bert", "gpt_baby"}
    for key, r in res["configs"].items():
        for field in FIELDS:
            assert r[field] > 0, (key, field)
        assert r["first_loss"]["npformer"] == pytest.approx(r["first_loss"]["torch"], rel=1e-4)
        low, high = r["ratio_range"]  # the paired ratios' spread over the repeats
        assert 0 < low <= high
    assert res["load_before"] >= 0 and res["load_after"] >= 0
    assert res["kv_cache"]["new_tokens"] == 256
    assert res["kv_cache"]["speedup"] > 0  # a measurement, not a target: no timing assertions


def test_gpu_bench_runs_on_the_cpu(tmp_path):
    """bench/gpu.py's CPU mode runs the same code as on a GPU but CuPy's: the twins agree
    on the first loss (the script checks it) and the JSON has every field."""
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--device", "cpu",
                           "--quick", "--repeats", "1", "--warmup", "0", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["machine"]["device"] == "cpu"
    for name, r in res["runs"]["fp32"].items():
        assert r["ratio"] > 0 and r["host_reads_per_step"] == 0, name
        assert set(r["profile_ms"]) >= {"forward", "loss", "backward", "clip", "optimiser"}
