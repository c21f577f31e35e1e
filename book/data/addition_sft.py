"""Supervised fine-tuning of Part V's base model into the chat template, measured.

Starts from book/data/addition_base.safetensors (plain sums "347+85=432\\n"), grows its
vocabulary by <|user|>, <|assistant|>, <|end|> and fine-tunes it on templated sums
"<|user|>347+85<|assistant|>432<|end|>" with the loss on the response only, twice on the
same budget (steps, examples, batches): every weight (full fine-tuning), LoRA adapters
on the attention's query and value plus the grown embedding, and LoRA adapters on every
linear layer plus the grown embedding. Each model is graded
greedily on the Addition test set (1000 items never trained on). Writes

- book/data/addition_sft.safetensors: the fully fine-tuned model (npf.load), the start of
  the preference and RL stages;
- book/data/addition_sft.json: configurations, training curves, per-item results,
  accuracies with 95% intervals and paired differences, machine, versions, seconds.

Run from the repository root, on one core (about five minutes):

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 \\
        python book/data/addition_sft.py
"""

from __future__ import annotations

import json
import platform
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

import npformer as npf
from npformer.evaluate import Addition, accuracy, exact_match, paired_difference
from npformer.sft import SFTConfig, SFTTrainer, chat_tokenizer

HERE = Path(__file__).resolve().parent
BASE = HERE / "addition_base.safetensors"
WEIGHTS, LOG = HERE / "addition_sft.safetensors", HERE / "addition_sft.json"
FULL = SFTConfig(steps=800, lr=3e-3, min_lr=3e-4)
LORA = SFTConfig(steps=800, lr=1e-2, min_lr=1e-3, lora_rank=8, lora_alpha=16.0)
LORA_ALL = SFTConfig(steps=800, lr=1e-2, min_lr=1e-3, lora_rank=8, lora_alpha=16.0,
                     lora_targets="attn.qkv,attn.proj,mlp.fc,mlp.proj")
SHOWN = range(0, 1000, 125)  # test items whose completions the log keeps
MAX_NEW = 6  # the longest answer (4 digits), the stop, and room for one more


def bits(correct: np.ndarray) -> str:
    return "".join("1" if c else "0" for c in correct)


def lenient(problems, completions) -> np.ndarray:
    """The answer's digits come first (after an "=" the base model may write), whatever
    follows them: does the model know the sum, format aside?"""
    return np.array([re.match(r"=?(\d*)", c).group(1) == p.answer
                     for p, c in zip(problems, completions)])


def evaluate_template(model, template, task, problems):
    """Greedy completions of the templated prompts: (strict, lenient, completions)."""
    strict, comps = exact_match(model, template.tok, problems, template.grader(task),
                                render=lambda p: template.prompt(p.prompt),
                                stop=template.end, max_new_tokens=MAX_NEW)
    return strict, lenient(problems, comps), comps


def acc(correct) -> dict:
    a = accuracy(correct)
    return {"k": a.k, "n": a.n, "rate": a.rate, "lo": a.lo, "hi": a.hi}


def paired(a, b) -> dict:
    d = paired_difference(a, b)
    return {"diff": d.diff, "lo": d.lo, "hi": d.hi, "p_value": d.p_value,
            "a_only": d.a_only, "b_only": d.b_only, "n": d.n}


def run(config: SFTConfig):
    trainer = SFTTrainer.start(BASE, config)
    t0 = time.perf_counter()
    records = trainer.fit()
    seconds = time.perf_counter() - t0
    curve = [{"step": r["step"], "loss": r["loss"], "val": r["val"]} for r in records]
    print(f"rank {config.lora_rank} {config.lora_targets}: {seconds:.0f} s, "
          f"val {curve[-1]['val']:.3f}", flush=True)
    return trainer, curve, seconds


def main() -> None:
    start = time.perf_counter()
    task = Addition()
    problems = task.test_set()
    plain_tok = npf.CharTokenizer(Addition.alphabet)
    template = npf.ChatTemplate(chat_tokenizer())

    base = npf.load(BASE)
    base_plain, _ = exact_match(base, plain_tok, problems, task.grade)  # "347+85=" -> ...
    npf.grow_vocab(base, template.tok.vocab_size)
    base_strict, base_lenient, base_comps = evaluate_template(base, template, task, problems)

    full, full_curve, full_s = run(FULL)
    npf.save(full.model, WEIGHTS, step=full.step,
             extra={"sft": asdict(FULL), "special_tokens": list(template.tok.specials)})
    sft_strict, sft_lenient, sft_comps = evaluate_template(full.model, template, task,
                                                           problems)
    lora, lora_curve, lora_s = run(LORA)
    lora_strict, _, _ = evaluate_template(lora.model, template, task, problems)
    lora_all, lora_all_curve, lora_all_s = run(LORA_ALL)
    lora_all_strict, _, _ = evaluate_template(lora_all.model, template, task, problems)
    n_trainable = {name: sum(p.size for _, p, _ in t.model.named_parameters())
                   for name, t in (("full", full), ("lora", lora), ("lora_all", lora_all))}

    LOG.write_text(json.dumps({
        "configs": {"full": asdict(FULL), "lora": asdict(LORA), "lora_all": asdict(LORA_ALL)},
        "trainable_parameters": n_trainable,
        "curves": {"full": full_curve, "lora": lora_curve, "lora_all": lora_all_curve},
        "train_seconds": {"full": round(full_s, 1), "lora": round(lora_s, 1),
                          "lora_all": round(lora_all_s, 1)},
        "accuracy": {
            "base_plain": acc(base_plain), "base_template": acc(base_strict),
            "base_template_lenient": acc(base_lenient), "sft": acc(sft_strict),
            "sft_lenient": acc(sft_lenient), "lora": acc(lora_strict),
            "lora_all": acc(lora_all_strict)},
        "paired": {
            "sft_vs_base_template": paired(sft_strict, base_strict),
            "sft_vs_base_plain": paired(sft_strict, base_plain),
            "sft_vs_lora": paired(sft_strict, lora_strict),
            "sft_vs_lora_all": paired(sft_strict, lora_all_strict),
            "lora_all_vs_lora": paired(lora_all_strict, lora_strict)},
        "correct": {"base_plain": bits(base_plain), "base_template": bits(base_strict),
                    "base_template_lenient": bits(base_lenient), "sft": bits(sft_strict),
                    "lora": bits(lora_strict), "lora_all": bits(lora_all_strict)},
        "examples": {"base_template": [base_comps[i] for i in SHOWN],
                     "sft": [sft_comps[i] for i in SHOWN],
                     "prompts": [problems[i].prompt for i in SHOWN]},
        "seconds": round(time.perf_counter() - start, 1),
        "machine": platform.processor() or platform.machine(),
        "python": sys.version.split()[0], "numpy": np.__version__}, indent=1) + "\n")


if __name__ == "__main__":
    main()
