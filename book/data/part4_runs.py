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
- "llama_layernorm", "llama_gelu", "llama_learned_pos": the Llama-style model with one
  substitution undone (LayerNorm, a GELU layer of the same weight count, learned
  positions with RoPE turned into the identity);
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


class LearnedPositions(npf.Llama):
    """The ablation "learned positions instead of RoPE": RoPE turned into the identity
    (cos = 1, sin = 0) and GPT's learned position table added to the token embeddings."""

    def __init__(self, config, seed=0):
        super().__init__(config, seed=seed)
        self.rope.cos[...], self.rope.sin[...] = 1, 0
        self.child("wpe", npf.PositionalEmbedding(config.block_size, config.d_model, seed=seed))

    def forward(self, ids):
        ids = self.check_ids(ids)
        x = self.wte(ids) + self.wpe(ids.shape[1])
        for block in self.h:
            x = block(x)
        self.cache = xf = self.ln_f(x)
        return xf @ self.wte.W.T

    def backward(self, dlogits):
        xf = self.cache
        V, d = self.wte.W.shape
        self.wte.dW += dlogits.reshape(-1, V).T @ xf.reshape(-1, d)
        dx = self.ln_f.backward(dlogits @ self.wte.W)
        for block in reversed(self.h):
            dx = block.backward(dx)
        self.wpe.backward(dx)
        self.wte.backward(dx)


def ablations(vocab_size: int) -> dict:
    """The Llama-style model with one of its substitutions undone, at about equal size."""
    llama = dict(vocab_size=vocab_size, n_kv_head=4, tie_embeddings=True, **SIZES)
    d = SIZES["d_model"]
    layernorm = npf.Llama(npf.LlamaConfig(d_ff=184, **llama), seed=0)
    for i, block in enumerate(layernorm.h):  # LayerNorm (gain and bias) instead of RMSNorm
        block.child("ln_1", npf.LayerNorm(d, eps=1e-5))
        block.child("ln_2", npf.LayerNorm(d, eps=1e-5))
    layernorm.child("ln_f", npf.LayerNorm(d, eps=1e-5))
    gelu = npf.Llama(npf.LlamaConfig(d_ff=184, **llama), seed=0)
    for i, block in enumerate(gelu.h):  # a GELU layer of width 276: SwiGLU's 3 d d_ff weights
        block.child("mlp", npf.FeedForward(d, 276, activation="gelu", bias=False, seed=i))
    return {"llama_layernorm": layernorm, "llama_gelu": gelu,
            "llama_learned_pos": LearnedPositions(npf.LlamaConfig(d_ff=184, **llama))}


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
    if "--ablations-only" in sys.argv:  # add the ablations to the existing log
        runs = json.loads(LOG.read_text())["runs"]
    for name, model in models(tok.vocab_size).items():
        if name in runs:
            continue
        runs[name], _ = train(model, pydoc[:cut_p], pydoc[cut_p:], STEPS, loads=name == "moe")
        if name == "llama":
            npf.save(model, CKPT)
        print(name, {k: v for k, v in runs[name].items() if k != "loads"}, flush=True)
        write(tok, runs)
    for name, model in ablations(tok.vocab_size).items():
        if name not in runs:
            runs[name], _ = train(model, pydoc[:cut_p], pydoc[cut_p:], STEPS)
            print(name, runs[name]["val_loss"], runs[name]["parameters"], flush=True)
            write(tok, runs)
    if "--ablations-only" in sys.argv:
        return 0
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
