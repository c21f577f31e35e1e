"""`python -m npformer train|sample` (book/training.md): runs, resumes, refuses, one-line errors."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import numpy as np
import pytest

import npformer as npf
import npformer.checkpoint as ckpt_module
from npformer.cli import main

TEXT = ("def add(a, b):\n    return a + b\n\n# the quick brown fox jumps over the lazy dog\n"
        * 30)
TINY = ["--n-layer", "1", "--n-head", "2", "--d-model", "16", "--block-size", "16",
        "--batch-size", "2", "--eval-interval", "4", "--eval-batches", "1",
        "--log-interval", "2", "--dropout", "0.1"]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


def train(corpus, out, *extra):
    return main(["train", "gpt", "--data", str(corpus), "--out", str(out), "--steps", "8",
                 "--quiet", *TINY, *extra])


def params(run_dir):
    model = npf.load(run_dir / "ckpt.safetensors")
    return {name: p for name, p, _ in model.named_parameters()}


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


def one_line_error(capsys, code, rc, match):
    err = capsys.readouterr().err
    assert rc == code, err
    assert err.endswith("\n") and err.count("\n") == 1, err  # exactly one line
    assert "Traceback" not in err
    assert match in err, err


def test_train_writes_a_checkpoint_and_a_json_log(corpus, tmp_path, capsys):
    assert train(corpus, tmp_path / "run") == 0
    assert capsys.readouterr().out == ""  # --quiet
    ck = npf.load_checkpoint(tmp_path / "run" / "ckpt.safetensors")
    assert ck.step == 8 and type(ck.model) is npf.GPT and ck.model.config.d_model == 16
    assert ck.extra["cli_model"] == "gpt" and ck.extra["tokenizer"]["kind"] == "char"
    recs = records(tmp_path / "run")
    assert [r["step"] for r in recs] == [2, 4, 6, 8]
    assert [r["val_loss"] is None for r in recs] == [True, False, True, False]
    assert set(recs[0]) == {"step", "train_loss", "val_loss", "lr", "tokens_per_s", "time"}


def test_no_progress_bar_when_stderr_is_not_a_terminal(corpus, tmp_path, capsys):
    rc = main(["train", "gpt", "--data", str(corpus), "--out", str(tmp_path / "run"),
               "--steps", "4", *TINY])
    out, err = capsys.readouterr()
    assert rc == 0 and err == ""  # capsys's stderr is not a TTY: no tqdm output
    assert out.startswith("step 4, val loss ")


def test_an_interrupted_run_resumes_bit_exactly(corpus, tmp_path, signal_after_step, capsys):
    """8 steps in one go == Ctrl-C after step 4, then --resume: every parameter bit."""
    assert train(corpus, tmp_path / "a") == 0
    disarm = signal_after_step(signal.SIGINT, 4)
    assert train(corpus, tmp_path / "b") == 130
    assert "stopped at step 4 of 8; checkpoint saved" in capsys.readouterr().err
    assert npf.load_checkpoint(tmp_path / "b" / "ckpt.safetensors").step == 4
    disarm()
    rc = main(["train", "gpt", "--out", str(tmp_path / "b"), "--resume", "--quiet"])
    assert rc == 0, capsys.readouterr().err
    a, b = params(tmp_path / "a"), params(tmp_path / "b")
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    assert records(tmp_path / "a") == [
        {**r, "tokens_per_s": ra["tokens_per_s"], "time": ra["time"]}
        for r, ra in zip(records(tmp_path / "b"), records(tmp_path / "a"))]


def test_a_folder_with_a_checkpoint_is_not_overwritten_without_being_asked(
        corpus, tmp_path, capsys):
    assert train(corpus, tmp_path / "run", "--steps", "4") == 0
    before = (tmp_path / "run" / "ckpt.safetensors").read_bytes()
    rc = train(corpus, tmp_path / "run")
    one_line_error(capsys, 2, rc, "already holds a checkpoint; pass --resume to continue "
                                  "that run or --overwrite to replace it")
    assert (tmp_path / "run" / "ckpt.safetensors").read_bytes() == before


def test_overwrite_starts_again_and_keeps_the_old_log(corpus, tmp_path):
    run = tmp_path / "run"
    assert train(corpus, run, "--steps", "4") == 0
    old_log = (run / "log.jsonl").read_text()
    assert train(corpus, run, "--overwrite", "--seed", "1") == 0
    assert (run / "log.1.jsonl").read_text() == old_log
    assert [r["step"] for r in records(run)] == [2, 4, 6, 8]
    assert npf.load_checkpoint(run / "ckpt.safetensors").step == 8


def test_resume_can_extend_a_run_and_appends_to_its_log(corpus, tmp_path):
    run = tmp_path / "run"
    assert train(corpus, run) == 0
    first = (run / "log.jsonl").read_text()
    assert main(["train", "gpt", "--out", str(run), "--resume", "--steps", "12",
                 "--quiet"]) == 0
    assert (run / "log.jsonl").read_text().startswith(first)
    assert [r["step"] for r in records(run)] == [2, 4, 6, 8, 10, 12]


def test_resume_rejects_settings_that_would_change_the_run(corpus, tmp_path, capsys):
    assert train(corpus, tmp_path / "run") == 0
    rc = main(["train", "gpt", "--out", str(tmp_path / "run"), "--resume", "--lr", "0.1"])
    one_line_error(capsys, 2, rc, "--lr: expected nothing on --resume")
    rc = main(["train", "gpt", "--out", str(tmp_path / "run"), "--resume", "--steps", "4"])
    one_line_error(capsys, 2, rc, "steps: expected at least 8 (the checkpoint's step), got 4")


def test_resume_rejects_a_changed_corpus(corpus, tmp_path, capsys):
    assert train(corpus, tmp_path / "run") == 0
    corpus.write_text(TEXT + "more")
    rc = main(["train", "gpt", "--out", str(tmp_path / "run"), "--resume"])
    one_line_error(capsys, 2, rc, "--data: expected the corpus this run trained on")


def test_resume_rejects_another_model(corpus, tmp_path, capsys):
    assert train(corpus, tmp_path / "run") == 0
    rc = main(["train", "bert", "--out", str(tmp_path / "run"), "--resume"])
    one_line_error(capsys, 2, rc, "holds a gpt run, got 'bert'")


def test_bert_trains_by_masked_lm_with_one_extra_token_and_its_own_dropout(corpus, tmp_path):
    rc = main(["train", "bert", "--data", str(corpus), "--out", str(tmp_path / "bert"),
               "--steps", "4", "--quiet", *[a for a in TINY if a not in ("--dropout", "0.1")]])
    assert rc == 0
    ck = npf.load_checkpoint(tmp_path / "bert" / "ckpt.safetensors")
    chars = ck.extra["tokenizer"]["chars"]
    assert type(ck.model) is npf.BERT and ck.extra["train"]["objective"] == "masked_lm"
    assert ck.model.config.vocab_size == len(chars) + 1 == ck.extra["train"]["mask_id"] + 1
    assert ck.model.config.dropout == npf.BERTConfig().dropout  # the model's own default
    assert main(["sample", str(tmp_path / "bert")]) == 2  # sampling is for GPT runs


def test_resume_without_a_checkpoint_is_an_error(tmp_path, capsys):
    rc = main(["train", "gpt", "--out", str(tmp_path / "empty"), "--resume"])
    one_line_error(capsys, 2, rc, "--resume: expected a checkpoint")


@pytest.mark.parametrize("case, args, message", [
    ("missing data path", ["--data", "{tmp}/nope.txt"], "data: expected 'pydoc', 'stdlib' "
                                                          "or an existing file or folder"),
    ("empty corpus", ["--data", "{tmp}/empty.txt"], "data: expected a non-empty corpus"),
    ("block size larger than the data", ["--data", "{corpus}", "--block-size", "1000"],
     "block_size: expected at most"),
    ("no data", [], "--data: expected pydoc or stdlib or a path, got nothing"),
    ("zero steps", ["--data", "{corpus}", "--steps", "0"], "steps: expected a positive integer"),
    ("bad head count", ["--data", "{corpus}", "--n-head", "3"], "d_model: expected a multiple"),
    ("vocab size without bpe", ["--data", "{corpus}", "--vocab-size", "300"],
     "--vocab-size: expected nothing unless --tokenizer bpe, got 300"),
    ("not a number", ["--data", "{corpus}", "--lr", "fast"], "argument --lr: invalid float"),
])
def test_bad_arguments_give_one_line_errors(case, args, message, corpus, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    args = [a.format(tmp=tmp_path, corpus=corpus) for a in args]
    try:
        rc = main(["train", "gpt", "--out", str(tmp_path / "run"), "--quiet", *args])
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    one_line_error(capsys, 2, rc, message)
    assert not (tmp_path / "run" / "ckpt.safetensors").exists()


def test_an_unknown_model_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "transformerxl", "--out", str(tmp_path)])
    one_line_error(capsys, 2, exc.value.code, "invalid choice: 'transformerxl'")


def test_a_model_missing_from_this_build_is_a_one_line_error(corpus, tmp_path, capsys,
                                                             monkeypatch):
    monkeypatch.setitem(ckpt_module._BUILTIN, "GPT", ("npformer.models.no_such_module", "GPT",
                                                      "GPTConfig"))
    rc = train(corpus, tmp_path / "run")
    one_line_error(capsys, 2, rc, "model: expected a model of this installation, got 'GPT' "
                                  "(npformer.models.no_such_module is missing)")


def test_a_diverging_run_exits_1_and_writes_no_checkpoint(corpus, tmp_path, capsys):
    rc = train(corpus, tmp_path / "run", "--lr", "1e30", "--eval-interval", "1")
    one_line_error(capsys, 1, rc, "training stopped: the ")
    assert not (tmp_path / "run" / "ckpt.safetensors").exists()


def test_bpe_tokenizer_runs_and_is_stored_in_the_checkpoint(corpus, tmp_path):
    assert train(corpus, tmp_path / "run", "--tokenizer", "bpe", "--vocab-size", "270") == 0
    spec = npf.load_checkpoint(tmp_path / "run" / "ckpt.safetensors").extra["tokenizer"]
    assert spec["kind"] == "bpe" and 0 < len(spec["merges"]) <= 14
    assert main(["train", "gpt", "--out", str(tmp_path / "run"), "--resume", "--steps", "10",
                 "--quiet"]) == 0
    assert npf.load_checkpoint(tmp_path / "run" / "ckpt.safetensors").step == 10


def test_python_dash_m_npformer_reports_errors_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "npformer", "train", "gpt", "--data",
                           str(tmp_path / "nope"), "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("npformer train: error: data: expected")


def test_sample_continues_the_prompt_reproducibly(corpus, tmp_path, capsys):
    assert train(corpus, tmp_path / "run") == 0
    argv = ["sample", str(tmp_path / "run"), "--prompt", "def add", "--max-new-tokens", "20",
            "--temperature", "0.8", "--top-k", "5", "--top-p", "0.9", "--seed", "3"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert first.startswith("def add") and len(first) == len("def add") + 20 + 1  # + newline
    assert main(argv) == 0 and capsys.readouterr().out == first  # the seed fixes the draw
    ckpt_file = str(tmp_path / "run" / "ckpt.safetensors")
    assert main(["sample", ckpt_file, "--prompt", "def add", "--max-new-tokens", "20",
                 "--temperature", "0.8", "--top-k", "5", "--top-p", "0.9", "--seed", "3"]) == 0
    assert capsys.readouterr().out == first


def test_sample_errors_are_one_line(corpus, tmp_path, capsys):
    assert train(corpus, tmp_path / "run") == 0
    rc = main(["sample", str(tmp_path / "run"), "--prompt", "\u00e9"])
    one_line_error(capsys, 2, rc, "npformer sample: error: text: expected characters of the "
                                  "vocabulary")
    for flag, value in (("--top-k", "0"), ("--top-p", "1.5"), ("--max-new-tokens", "many")):
        with pytest.raises(SystemExit) as exc:
            main(["sample", str(tmp_path / "run"), flag, value])
        one_line_error(capsys, 2, exc.value.code, f"argument {flag}: expected a positive")
    for value in ("-1", "nan", "inf", "hot"):  # 0 is allowed: greedy, as in generate()
        with pytest.raises(SystemExit) as exc:
            main(["sample", str(tmp_path / "run"), "--temperature", value])
        one_line_error(capsys, 2, exc.value.code, "argument --temperature: expected a number "
                                                  ">= 0")
    rc = main(["sample", str(tmp_path / "nowhere")])
    one_line_error(capsys, 2, rc, "path: expected a checkpoint file")
    model = npf.GPT(npf.GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=1, d_model=4))
    npf.save(model, tmp_path / "bare.safetensors")
    rc = main(["sample", str(tmp_path / "bare.safetensors")])
    one_line_error(capsys, 2, rc, "run: expected a GPT run trained with 'npformer train gpt'")


def test_the_encoder_trains_on_text_by_reconstruction(corpus, tmp_path, capsys):
    args = [a for a in TINY if a not in ("--dropout", "0.1")]
    rc = main(["train", "encoder", "--data", str(corpus), "--out", str(tmp_path / "enc"),
               "--steps", "4", "--quiet", *args])
    assert rc == 0, capsys.readouterr().err
    ck = npf.load_checkpoint(tmp_path / "enc" / "ckpt.safetensors")
    assert type(ck.model) is npf.Encoder and ck.extra["train"]["objective"] == "reconstruction"
    assert ck.model.config.d_ff == 64  # 4 d_model by default
    rc = main(["train", "encoder", "--data", str(corpus), "--out", str(tmp_path / "enc2"),
               "--dropout", "0.1"])
    one_line_error(capsys, 2, rc,
                   "--dropout: expected nothing (the encoder model has no such setting)")


def test_an_unwritable_run_folder_is_a_one_line_error(corpus, tmp_path, capsys):
    (tmp_path / "taken").write_text("a file, not a folder")
    rc = train(corpus, tmp_path / "taken")
    one_line_error(capsys, 1, rc, "File exists")


# --------------------------------------------------------------------------- run folders, signals


def test_sigterm_stops_like_ctrl_c_with_a_checkpoint_and_status_143(corpus, tmp_path,
                                                                     signal_after_step,
                                                                     capsys):
    signal_after_step(signal.SIGTERM, 4)
    assert train(corpus, tmp_path / "run") == 143
    err = capsys.readouterr().err
    assert "stopped at step 4 of 8; checkpoint saved; continue with --resume (SIGTERM)" in err
    assert npf.load_checkpoint(tmp_path / "run" / "ckpt.safetensors").step == 4
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler is removed


def test_a_second_run_on_a_busy_folder_fails_at_once_naming_the_holder(corpus, tmp_path):
    """A real second process: the first trains; the second, fresh or --resume, is refused;
    then the first is killed with SIGKILL and its lock does not block the next run."""
    out = tmp_path / "run"
    base = [sys.executable, "-m", "npformer", "train", "gpt", "--out", str(out), "--quiet"]
    fresh = [*base, "--data", str(corpus), *TINY, "--warmup-steps", "2"]  # resumable anywhere
    first = subprocess.Popen([*fresh, "--steps", "100000"], stderr=subprocess.PIPE)
    try:
        for _ in range(600):  # until the first run holds the folder and has a checkpoint
            if (out / "ckpt.safetensors").exists():
                break
            assert first.poll() is None, first.stderr.read().decode()
            subprocess.run(["sleep", "0.05"])
        for second_cmd in ([*fresh, "--steps", "8", "--overwrite"], [*base, "--resume"]):
            second = subprocess.run(second_cmd, capture_output=True, text=True, timeout=120)
            assert second.returncode == 2, second.stderr
            assert "is in use by a run that is still going" in second.stderr
            assert f"pid {first.pid}" in second.stderr
    finally:
        first.kill()
        first.wait()
    killed_at = npf.load_checkpoint(out / "ckpt.safetensors").step
    resumed = subprocess.run([*base, "--resume", "--steps", str(killed_at + 4)],
                             capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert npf.load_checkpoint(out / "ckpt.safetensors").step == killed_at + 4


def test_sample_with_temperature_0_is_greedy_decoding(corpus, tmp_path, capsys):
    assert train(corpus, tmp_path / "run") == 0
    capsys.readouterr()
    outs = []
    for seed in ("1", "2"):
        assert main(["sample", str(tmp_path / "run"), "--prompt", "def ", "--temperature", "0",
                     "--max-new-tokens", "12", "--seed", seed]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]  # no randomness left
    ck = npf.load_checkpoint(tmp_path / "run" / "ckpt.safetensors")
    tok = npf.data.tokenizer_from_spec(ck.extra["tokenizer"])
    ids = npf.data.encode_ids(tok, "def ")[None, :]
    for _ in range(12):  # argmax, one token at a time, by hand
        nxt = ck.model.forward(ids[:, -ck.model.config.block_size:])[:, -1].argmax(-1)
        ids = np.concatenate([ids, nxt[:, None]], axis=1)
    assert outs[0] == tok.decode(ids[0]) + "\n"


def test_serve_names_a_missing_run(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nothing")]) == 2
    assert "run: expected a run folder holding ckpt.safetensors" in capsys.readouterr().err
