"""The Part IV experiments, too long for a cold book build (book/llama.md, moe.md, lora.md).

Writes book/data/part4_runs.json (every run's log) and book/data/part4_llama_pydoc.safetensors
(the pydoc-trained Llama that the LoRA runs fine-tune). Run from the repository root:

    OPENBLAS_NUM_THREADS=1 python book/data/part4_runs.py

Runs, all character-level, d_model = 64, two blocks, batch 8 x 64 tokens, AdamW:
- "gpt" and "llama": the book's GPT against the Llama-style model at (nearly) equal
  parameter count, on the pydoc corpus;
- "dense" and "moe": a Llama whose feed-forward layers are 4 SwiGLU experts of width 64,
  top-2, against a dense Llama of width 128 (the same active feed-forward parameters),
  with the experts' load (share of assignments per layer) logged during training;
- "lora_r4", "lora_r8", "full": the pydoc Llama fine-tuned on the standard library's
  Python sources, with LoRA adapters of rank 4 and 8 on query and value, or in full.
tests/test_part4_runs.py re-runs the first steps of each and compares with this log.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

import npformer as npf
from npformer.data import encode_ids, load_corpus, make_tokenizer

HERE = Path(__file__).resolve().parent
LOG, CKPT = HERE / "part4_runs.json", HERE / "part4_llama_pydoc.safetensors"
STEPS, FT_STEPS, EVERY = 800, 300, 50
TRAIN = dict(batch_size=8, block_size=64, lr=3e-3, min_lr=3e-4, warmup_steps=40,
             weight_decay=0.1, grad_clip=1.0, eval_batches=8, seed=0)
SIZES = dict(block_size=64, n_layer=2, n_head=4, d_model=64)


def corpora():
    """(tokenizer, pydoc ids, stdlib ids): one character vocabulary for both."""
    pydoc = load_corpus("pydoc")[:400_000]
    code = load_corpus("stdlib")[:400_000]
    tok = make_tokenizer(pydoc + code, "char")
    return tok, encode_ids(tok, pydoc), encode_ids(tok, code)


def models(vocab_size: int) -> dict:
    """The five model configurations, by run name."""
    return {
        "gpt": npf.GPT(npf.GPTConfig(vocab_size=vocab_size, d_ff=256, **SIZES), seed=0),
        "llama": npf.Llama(npf.LlamaConfig(vocab_size=vocab_size, n_kv_head=4, d_ff=184,
                                           tie_embeddings=True, **SIZES), seed=0),
        "dense": npf.Llama(npf.LlamaConfig(vocab_size=vocab_size, n_kv_head=2, d_ff=128,
                                           tie_embeddings=True, **SIZES), seed=0),
        "moe": npf.Llama(npf.LlamaConfig(vocab_size=vocab_size, n_kv_head=2, d_ff=64,
                                         n_expert=4, top_k=2, tie_embeddings=True,
                                         **SIZES), seed=0),
    }


def expert_loads(model) -> list[list[float]]:
    """Each layer's share of top-k assignments per expert in the last forward pass."""
    return [(np.bincount(b.mlp.cache[2].ravel(), minlength=b.mlp.n_expert)
             / b.mlp.cache[2].size).round(4).tolist() for b in model.h]


def train(model, train_ids, val_ids, steps, loads=False, **changes) -> tuple[dict, object]:
    cfg = npf.TrainConfig(steps=steps, eval_interval=EVERY, log_interval=EVERY,
                          **{**TRAIN, **changes})
    trainer = npf.Trainer(model, train_ids, val_ids, cfg)
    first_losses, load_log, curve = [], [], []
    start = time.perf_counter()
    while trainer.step < steps:
        loss, _ = trainer.train_step()
        if len(first_losses) < 3:
            first_losses.append(loss)
        if loads and trainer.step % 10 == 0:
            load_log.append({"step": trainer.step, "loads": expert_loads(model)})
        if trainer.step % EVERY == 0 or trainer.step == steps:
            curve.append({"step": trainer.step, "val_loss": trainer.evaluate()})
    seconds = time.perf_counter() - start
    val = curve[-1]["val_loss"]
    n = sum(p.size for _, p, _ in model.named_parameters())
    total = sum(p.size for _, p, _ in model.named_parameters(include_frozen=True))
    return {"val_loss": val, "first_losses": first_losses, "seconds": seconds,
            "trainable": n, "parameters": total, "curve": curve, "loads": load_log}, trainer


def main() -> int:
    tok, pydoc, code = corpora()
    cut_p, cut_c = int(0.9 * len(pydoc)), int(0.9 * len(code))
    runs = {}
    if "--finetune-only" in sys.argv:  # keep the pretraining runs of the existing log
        runs = {k: v for k, v in json.loads(LOG.read_text())["runs"].items()
                if k in models(tok.vocab_size)}
    for name, model in models(tok.vocab_size).items():
        if name in runs:
            continue
        runs[name], _ = train(model, pydoc[:cut_p], pydoc[cut_p:], STEPS, loads=name == "moe")
        if name == "llama":
            npf.save(model, CKPT)
        print(name, {k: v for k, v in runs[name].items() if k != "loads"}, flush=True)
        write(tok, runs)
    base = npf.load(CKPT)
    runs["pydoc_llama_on_code"] = {"val_loss": npf.Trainer(
        base, code[:cut_c], code[cut_c:],
        npf.TrainConfig(steps=1, **{**TRAIN, "warmup_steps": 0})).evaluate()}
    for name, rank in (("lora_r4", 4), ("lora_r8", 8), ("full", None)):
        model = npf.load(CKPT)
        if rank:
            npf.add_lora(model, rank=rank, alpha=2 * rank)
        runs[name], _ = train(model, code[:cut_c], code[cut_c:], FT_STEPS,
                              lr=1e-2 if rank else 1e-3, warmup_steps=10, weight_decay=0.0)
        print(name, {k: v for k, v in runs[name].items() if k != "loads"}, flush=True)
        write(tok, runs)
    return 0


def write(tok, runs: dict) -> None:
    LOG.write_text(json.dumps({"steps": STEPS, "ft_steps": FT_STEPS, "train": TRAIN,
                               "sizes": SIZES, "vocab_size": tok.vocab_size,
                               "runs": runs}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
