"""GRPO on the Addition task, from the fine-tuned model, for the chapter "Reinforcement
learning from verifiable rewards" (book/rl.md).

Starts from book/data/addition_sft.safetensors (book/data/addition_sft.py), which is also the
frozen reference, and trains it with npformer.rl.GRPOTrainer on training sums only (never a
test item). Every EVERY steps it evaluates on the 1000 sums of the Addition test set: greedy
exact match, and N_SAMPLES completions of each sum at temperature 1, whose counts of correct
answers give pass@1 and pass@N_SAMPLES (Chen et al.'s estimator). Writes
book/data/addition_rl.json: the configuration, each step's record (mean reward, KL, ...), the
evaluations (per-item grades, from the fine-tuned model at step 0 to the final one), a few
samples, the machine, the versions and the seconds; and the final weights,
book/data/addition_rl.safetensors. Run from the repository root, on one core:

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python book/data/addition_rl.py

The run checkpoints to /tmp/addition_rl.safetensors; a second run with --resume continues it.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

import npformer as npf
from npformer.evaluate import complete, exact_match
from npformer.rl import GRPOConfig, GRPOTrainer

HERE = Path(__file__).resolve().parent
START, LOG = HERE / "addition_sft.safetensors", HERE / "addition_rl.json"
WEIGHTS = HERE / "addition_rl.safetensors"  # the final policy, without the optimiser
CKPT = Path("/tmp/addition_rl.safetensors")
CONFIG = dict(steps=200, prompts=16, group_size=8, updates=2, max_new_tokens=6, lr=1e-4,
              clip=0.2, beta=0.04, seed=0, checkpoint_interval=25)
EVERY, N_SAMPLES, MAX_NEW = 25, 8, 6


def evaluate(model, trainer: GRPOTrainer, seed: int) -> dict:
    """Greedy exact match and N_SAMPLES samples of every test sum, graded."""
    task, template = trainer.task, trainer.template
    problems, grade = task.test_set(), template.grader(task)

    def render(p):
        return template.prompt(p.prompt)

    greedy, _ = exact_match(model, template.tok, problems, grade, render=render,
                            stop=template.end, max_new_tokens=MAX_NEW)
    got = complete(model, template.tok, [render(p) for p in problems], max_new_tokens=MAX_NEW,
                   temperature=1.0, n=N_SAMPLES, stop=template.end, seed=seed)
    ok = np.array([grade(problems[i // N_SAMPLES], c) for i, c in enumerate(got)])
    counts = ok.reshape(len(problems), N_SAMPLES).sum(axis=1)
    return {"greedy": "".join("01"[int(c)] for c in greedy),
            "counts": "".join(str(int(c)) for c in counts)}


def summary(ev: dict) -> dict:
    greedy = np.array([c == "1" for c in ev["greedy"]])
    counts = np.array([int(c) for c in ev["counts"]])
    out = {"greedy": float(greedy.mean())}
    for k in (1, N_SAMPLES):
        out[f"pass@{k}"] = float(npf.pass_at_k(N_SAMPLES, counts, k).mean())
    return out


def main() -> None:
    tic = time.perf_counter()
    if "--resume" in sys.argv:
        trainer = GRPOTrainer.resume(CKPT)
        log = json.loads(LOG.with_suffix(".partial.json").read_text())
    else:
        trainer = GRPOTrainer.start(START, GRPOConfig(**CONFIG))
        log = {"config": CONFIG, "every": EVERY, "n_samples": N_SAMPLES, "steps": [],
               "evals": [{"step": 0, **evaluate(trainer.reference, trainer, seed=0)}]}
        print(f"fine-tuned model: {summary(log['evals'][0])}", flush=True)
    while trainer.step < trainer.config.steps:
        log["steps"] += trainer.fit(until=trainer.step + EVERY, checkpoint_path=CKPT)
        log["evals"].append({"step": trainer.step,
                             **evaluate(trainer.model, trainer, seed=trainer.step)})
        r = log["steps"][-EVERY:]
        print(f"step {trainer.step}: reward {np.mean([x['reward'] for x in r]):.3f}, "
              f"kl {r[-1]['kl']:.4f}, {summary(log['evals'][-1])}, "
              f"{time.perf_counter() - tic:.0f} s", flush=True)
        LOG.with_suffix(".partial.json").write_text(json.dumps(log))
    problems = trainer.task.test_set()
    samples = complete(trainer.model, trainer.tok,
                       [trainer.template.prompt(p.prompt) for p in problems[:8]],
                       max_new_tokens=MAX_NEW, stop=trainer.template.end)
    log.update(samples=[[p.prompt, p.answer, s] for p, s in zip(problems[:8], samples)],
               seconds=round(time.perf_counter() - tic, 1), training_seconds=trainer.elapsed,
               machine=platform.machine(), processor=platform.processor(),
               python=platform.python_version(), numpy=np.__version__)
    LOG.write_text(json.dumps(log, indent=1) + "\n")
    npf.save(trainer.model, WEIGHTS)
    LOG.with_suffix(".partial.json").unlink(missing_ok=True)
    print(f"wrote {LOG} in {log['seconds']} s")


if __name__ == "__main__":
    main()
