"""scripts/gpu_check.sh, the one call a GPU machine gets, tried dry on the strict array,
and scripts/plain_tests.py, which runs the GPU tests where pytest is missing."""
from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["system", "nvidia_smi", "nvidia_smi_q", "versions", "nvcc", "cupy_config",
         "cupy_kernels", "cli_train", "cli_sample", "pytest_gpu", "bench_gpu"]
MUST_PASS = {"system", "versions", "cli_train", "cli_sample", "bench_gpu"}  # on any host


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils' timeout")
def test_the_dry_run_records_every_step_and_trains_on_the_strict_array(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry",
                           str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(tmp_path / "steps.tsv", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    assert [r["step"] for r in rows] == STEPS
    for r in rows:  # each step ran or says why not; those that need no GPU ran and passed
        assert r["status"] == "ok" or r["status"].startswith("skipped: "), r
        assert (tmp_path / f"{r['step']}.log").exists()
        if r["step"] in MUST_PASS:
            assert r["status"] == "ok" and r["exit"] == "0", r
    assert "--device strict" in next(r["command"] for r in rows if r["step"] == "cli_train")
    log = [json.loads(line) for line in (tmp_path / "cli_train_log.jsonl").open()]
    assert log and all(math.isfinite(rec["train_loss"]) for rec in log)
    bench = json.loads((tmp_path / "gpu_results.json").read_text())
    assert bench["machine"]["device"] == "strict" and not bench["errors"]
    row = bench["runs"]["fp32"]["gpt_baby"]
    assert row["host_reads_per_step"] <= 2  # the loss and the gradient norm
    assert row["fused"]["host_reads_per_step"] <= 2


TESTS = '''
import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("a", [10, 20])
def test_sums(a, b):
    assert a + b == pytest.approx(a + b + 1e-9) and a + b != pytest.approx(a + b + 1e-3)


def test_raises_and_a_folder(tmp_path):
    (tmp_path / "x").write_text("y")
    with pytest.raises(ValueError, match="bad"):
        raise ValueError("a bad value")


def test_fails():
    assert 1 == 2


def test_skips():
    pytest.importorskip("no_such_module_here")
'''


def test_plain_tests_runs_a_file_without_pytest(tmp_path):
    (tmp_path / "test_x.py").write_text(TESTS)
    (tmp_path / "pytest.py").write_text("raise ImportError('not installed here')\n")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "plain_tests.py"),
                           str(tmp_path / "test_x.py"), "-m", "gpu", "--junitxml",
                           str(tmp_path / "out.xml")], capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # test_fails failed
    lines = proc.stdout.splitlines()
    passed = sorted(line.split()[1] for line in lines if line.startswith("PASS "))
    assert passed == ["test_raises_and_a_folder", "test_sums[10-1]", "test_sums[10-2]",
                      "test_sums[20-1]", "test_sums[20-2]"]
    assert any(line.startswith("FAIL test_fails") for line in lines)
    assert "5 PASS, 1 FAIL, 1 SKIP" in proc.stdout
    assert 'failures="1"' in (tmp_path / "out.xml").read_text()
    other = subprocess.run([sys.executable, str(ROOT / "scripts" / "plain_tests.py"),
                            str(tmp_path / "test_x.py"), "-m", "slow"],
                           capture_output=True, text=True, timeout=120)
    assert other.returncode == 5 and "0 PASS, 0 FAIL, 0 SKIP" in other.stdout  # none ran
