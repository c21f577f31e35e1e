"""The post-training stages from the command line: sft, dpo, grpo and eval (book/running.md)."""

import json
from pathlib import Path

import numpy as np
import pytest

import npformer as npf
from npformer.cli import main

DATA = Path(__file__).resolve().parent.parent / "book" / "data"
BASE, SFT = DATA / "addition_base.safetensors", DATA / "addition_sft.safetensors"


def weights(path):
    model = npf.load(path)
    return {n: p.copy() for n, p, _ in model.named_parameters(include_frozen=True)}


def test_sft_starts_refuses_resumes_and_matches_an_unbroken_run(tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    common = ["--eval-interval", "5", "--quiet"]
    assert main(["sft", "--from", str(BASE), "--out", a, "--steps", "6", *common]) == 0
    assert main(["sft", "--from", str(BASE), "--out", a, "--steps", "6", *common]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["sft", "--out", a, "--resume", "--steps", "10", "--quiet"]) == 0
    assert main(["sft", "--from", str(BASE), "--out", b, "--steps", "6", *common]) == 0
    assert main(["sft", "--out", b, "--resume", "--steps", "10", "--quiet"]) == 0
    wa, wb = weights(Path(a) / "ckpt.safetensors"), weights(Path(b) / "ckpt.safetensors")
    assert wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)
    assert json.loads((Path(a) / "stage.json").read_text())["stage"] == "sft"
    steps = [json.loads(line)["step"] for line in open(Path(a) / "log.jsonl")]
    assert steps[-1] == 10


def test_resume_is_refused_with_from_and_for_another_stage(tmp_path, capsys):
    out = str(tmp_path / "g")
    assert main(["grpo", "--from", str(SFT), "--out", out, "--steps", "1", "--prompts", "1",
                 "--group-size", "2", "--quiet"]) == 0
    assert main(["grpo", "--from", str(SFT), "--out", out, "--resume", "--steps", "2"]) == 2
    assert "--from" in capsys.readouterr().err
    assert main(["sft", "--out", out, "--resume", "--steps", "2"]) == 2
    assert "a sft run" in capsys.readouterr().err
    assert main(["grpo", "--out", out, "--resume", "--steps", "2", "--quiet"]) == 0
    assert len(open(Path(out) / "log.jsonl").read().splitlines()) == 2


def test_a_stage_needs_a_start_that_exists(tmp_path, capsys):
    assert main(["dpo", "--out", str(tmp_path / "d")]) == 2
    assert "--from: expected the checkpoint to start from" in capsys.readouterr().err
    assert main(["sft", "--from", str(tmp_path / "none"), "--out", str(tmp_path / "s")]) == 2
    assert "--from: expected a run folder with a checkpoint" in capsys.readouterr().err
    assert main(["sft", "--out", str(tmp_path / "s"), "--resume"]) == 2


def test_dpo_overwrite_keeps_the_old_log_and_pairs_aside(tmp_path):
    out = tmp_path / "d"
    args = ["dpo", "--from", str(SFT), "--out", str(out), "--steps", "2", "--prompts", "12",
            "--samples", "4", "--batch-pairs", "2", "--quiet"]
    assert main(args) == 0
    assert (out / "pairs.json").exists() and (out / "log.jsonl").exists()
    assert main(args + ["--overwrite"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert any(n.startswith("log.") and n != "log.jsonl" for n in names)
    assert any(n.startswith("pairs.") and n != "pairs.json" for n in names)


@pytest.mark.parametrize("path, how", [(SFT, "in the template"), (BASE, "in the plain format")])
def test_eval_asks_each_stage_in_its_own_format(path, how, capsys):
    assert main(["eval", str(path), "--items", "20", "--samples", "2"]) == 0
    out = capsys.readouterr().out
    assert f"greedy exact match on 20 test sums, {how}:" in out
    assert "pass@2 at temperature 1.0:" in out
