"""Preferences on the addition task: a Bradley-Terry reward model and DPO, from the SFT model.

Reads book/data/addition_sft.safetensors (the fine-tuned model of book/sft.md) and writes
book/data/addition_dpo.json (the log the chapter book/preferences.md reads) and
book/data/addition_dpo.safetensors (the policy's weights). Run from the
repository root, on one core:

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 python book/data/addition_dpo.py

1. Pairs: the SFT model samples SAMPLES answers at temperature 1 (KV cache) for each of
   TRAIN_PROMPTS training prompts and HELD_PROMPTS other training-side prompts (no test
   item, no prompt shared with the first set); the verifier grades them; a prompt with a
   correct and a wrong answer gives a pair (npformer.preference.sample_pairs).
2. A reward model (the SFT trunk and a scalar head) trained with the Bradley-Terry loss on
   the training pairs; its accuracy on the held-out pairs.
3. DPO with the pipeline's stage (npformer.preference.dpo_stage), the SFT model as the
   reference; held-out preference accuracy and implicit-reward margins during training.
4. Before and after: greedy exact match on the task's 1000 test items (paired), and the KL
   divergence to the reference estimated on the policy's own samples.
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

import npformer as npf
from npformer.evaluate import Addition, accuracy, complete, exact_match, paired_difference
from npformer.optim import AdamW, train_step
from npformer.preference import (
    DPOConfig,
    addition_template,
    dpo_stage,
    encode_pairs,
    implicit_rewards,
    last_positions,
    sample_pairs,
    sequence_logprob,
    token_logprobs,
)
from npformer.sft import pad_batch

HERE = Path(__file__).resolve().parent
SFT, LOG = HERE / "addition_sft.safetensors", HERE / "addition_dpo.json"
WEIGHTS = HERE / "addition_dpo.safetensors"
TRAIN_PROMPTS, HELD_PROMPTS, SAMPLES, SEED = 2000, 600, 8, 0
DPO = DPOConfig(steps=300, batch_pairs=32, beta=0.1, lr=1e-5, min_lr=1e-6, warmup_steps=10,
                eval_interval=20, seed=0)
RM = dict(steps=400, batch_pairs=32, lr=1e-3, eval_interval=25, seed=0)
KL_SAMPLES = 4  # samples per held-out prompt for the KL estimate


def held_out_problems(task, train):
    """Training-side prompts that are not among the training pairs' prompts."""
    seen = {p.prompt for p in train}
    fresh = [p for p in task.sample(3 * HELD_PROMPTS, seed=SEED + 3000) if p.prompt not in seen]
    return list({p.prompt: p for p in fresh}.values())[:HELD_PROMPTS]


def pair_accuracy(r: np.ndarray) -> dict:
    """Rewards of encoded pairs (2N,) [chosen; rejected]: accuracy and margins."""
    N = len(r) // 2
    acc = accuracy(r[:N] > r[N:])
    margin = r[:N] - r[N:]
    return {"accuracy": acc.rate, "lo": acc.lo, "hi": acc.hi, "k": acc.k, "n": acc.n,
            "margin_mean": float(margin.mean()), "chosen_mean": float(r[:N].mean()),
            "rejected_mean": float(r[N:].mean())}


def train_reward_model(sft, template, train_pairs, held_pairs) -> dict:
    rm = npf.RewardModel.from_gpt(sft, seed=RM["seed"])
    ids, mask = encode_pairs(template, train_pairs)
    last = last_positions(mask)
    hids, hmask = encode_pairs(template, held_pairs)
    hlast = last_positions(hmask)
    P, B = len(train_pairs), RM["batch_pairs"]
    opt = AdamW(rm.named_parameters(), lr=RM["lr"], weight_decay=0.0)
    rng = np.random.default_rng([RM["seed"], 4])

    def objective(model, rows):
        r = model.forward(ids[rows], last[rows])  # (2N,)
        loss, dw, dl = npf.bradley_terry_loss(r[:len(rows) // 2], r[len(rows) // 2:])
        return loss, np.concatenate([dw, dl])

    def held() -> dict:
        rm.eval()
        r = rm.forward(hids, hlast)
        rm.train()
        return pair_accuracy(r)

    curve = [{"step": 0, **held()}]
    for step in range(1, RM["steps"] + 1):
        pick = rng.choice(P, size=min(B, P), replace=False)
        loss, _ = train_step(rm, opt, objective, np.concatenate([pick, pick + P]), max_norm=1.0)
        if step % RM["eval_interval"] == 0:
            curve.append({"step": step, "loss": loss, **held()})
    return {"config": RM, "curve": curve, "held_out": curve[-1]}


def kl_to_reference(policy, reference, template, problems, seed) -> dict:
    """KL(pi || pi_ref) on the policy's own samples: k1 = log pi - log pi_ref per sample
    (unbiased; its mean and a normal 95% interval) and k3 = (ratio - 1) - log ratio with
    ratio = pi_ref / pi (unbiased and never negative)."""
    tok = template.tok
    prompts = [template.prompt(p.prompt) for p in problems]
    outs = complete(policy, tok, prompts, max_new_tokens=6, temperature=1.0, n=KL_SAMPLES,
                    stop=template.end, seed=seed)
    rows = []
    for i, o in enumerate(outs):
        p_ids, r_ids = tok.encode(prompts[i // KL_SAMPLES]), tok.encode(o)
        rows.append((np.array(p_ids + r_ids), np.r_[np.zeros(len(p_ids)), np.ones(len(r_ids))]))
    ids, mask = pad_batch(rows, template.end_id)
    mask = mask[:, 1:]
    logp = sequence_logprob(token_logprobs(policy, ids), mask)
    logp_ref = sequence_logprob(token_logprobs(reference, ids), mask)
    k1 = logp - logp_ref
    k3 = np.expm1(-k1) + k1
    half = 1.959963984540054 * k1.std(ddof=1) / np.sqrt(len(k1))
    return {"samples": len(k1), "k1": float(k1.mean()), "k1_lo": float(k1.mean() - half),
            "k1_hi": float(k1.mean() + half), "k3": float(k3.mean())}


def paired(before: np.ndarray, after: np.ndarray) -> dict:
    """after minus before on the same items (npformer.evaluate.paired_difference): the
    difference, its paired bootstrap 95% interval and the exact McNemar p-value."""
    r = paired_difference(after, before)
    return {"diff": r.diff, "lo": r.lo, "hi": r.hi, "p_mcnemar": r.p_value,
            "gained": r.a_only, "lost": r.b_only, "n": r.n}


def main() -> None:
    global SFT, LOG, WEIGHTS
    if len(sys.argv) == 3:  # other paths: addition_dpo.py SFT_CHECKPOINT OUT_FOLDER
        SFT, out = Path(sys.argv[1]), Path(sys.argv[2])
        LOG, WEIGHTS = out / "addition_dpo.json", out / "addition_dpo.safetensors"
    t0 = time.perf_counter()
    task, template = Addition(), addition_template()
    sft = npf.load(SFT)
    train_problems = task.sample(TRAIN_PROMPTS, seed=SEED + 1000)  # dpo_stage's prompts
    held_problems = held_out_problems(task, train_problems)
    held_pairs = sample_pairs(sft, template, task, held_problems, samples=SAMPLES,
                              seed=SEED + 4000)
    test = task.test_set()
    render = lambda p: template.prompt(p.prompt)  # noqa: E731
    before, _ = exact_match(sft, template.tok, test, template.grader(task), render=render,
                            stop=template.end)
    hids, hmask = encode_pairs(template, held_pairs)
    with tempfile.TemporaryDirectory() as run:
        def evaluate(trainer) -> dict:
            return pair_accuracy(implicit_rewards(trainer, hids, hmask, held_ref_lp))

        held_ref_lp = token_logprobs(sft, hids)
        t1 = time.perf_counter()
        trainer = dpo_stage(SFT, run, DPO, prompts=TRAIN_PROMPTS, samples=SAMPLES, seed=SEED,
                            evaluate=evaluate)
        dpo_seconds = time.perf_counter() - t1
        curve = [json.loads(line) for line in (Path(run) / "log.jsonl").read_text().splitlines()]
        train_pairs = trainer.pairs
    policy = trainer.policy
    npf.save(policy, WEIGHTS)  # the weights alone: the chapter samples them
    start = {"step": 0, "accuracy": None, "margin_mean": 0.0, "chosen_mean": 0.0,
             "rejected_mean": 0.0}  # pi = pi_ref: every implicit reward 0, every pair a tie
    after, _ = exact_match(policy, template.tok, test, template.grader(task), render=render,
                           stop=template.end)
    kl = kl_to_reference(policy, sft, template, held_problems, seed=SEED + 5000)
    kl_sft = kl_to_reference(sft, sft, template, held_problems[:50], seed=SEED + 5000)
    rm = train_reward_model(sft, template, train_pairs, held_pairs)
    acc_before, acc_after = accuracy(before), accuracy(after)
    LOG.write_text(json.dumps({
        "train_prompts": TRAIN_PROMPTS, "held_prompts": len(held_problems),
        "samples": SAMPLES, "train_pairs": len(train_pairs), "held_pairs": len(held_pairs),
        "example_pairs": [asdict(p) for p in train_pairs[:6]],
        "prompt_overlap": len({p.prompt for p in train_pairs} & {p.prompt for p in held_pairs}),
        "test_overlap": sum(task.is_test(*map(int, p.prompt.split("+")))
                            for p in train_pairs + held_pairs),
        "dpo": {"config": asdict(DPO), "curve": [start, *curve], "seconds": dpo_seconds,
                "held_out": curve[-1], "kl": kl, "kl_sft_check": kl_sft},
        "reward_model": rm,
        "task": {"before": vars(acc_before), "after": vars(acc_after),
                 "paired": paired(before, after),
                 "before_bits": "".join("01"[int(c)] for c in before),
                 "after_bits": "".join("01"[int(c)] for c in after)},
        "seconds": round(time.perf_counter() - t0, 1),
        "machine": platform.processor() or platform.machine(),
        "python": sys.version.split()[0], "numpy": np.__version__,
    }, indent=1) + "\n")
    print(f"pairs {len(train_pairs)} train / {len(held_pairs)} held-out; reward model "
          f"{rm['held_out']['accuracy']:.3f}; DPO held-out {curve[-1]['accuracy']:.3f}; "
          f"exact match {acc_before} -> {acc_after}; KL k1 {kl['k1']:.4f}; "
          f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
