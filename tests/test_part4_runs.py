"""The committed Part IV runs (book/data/part4_runs.py): their first steps, re-run here, give
the logged losses, and the committed pydoc Llama is the one the LoRA runs start from.

BLAS kernels differ between CPUs, so the logged float32 losses are matched within a
relative 1e-4, not bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import npformer as npf

DATA = Path(__file__).resolve().parents[1] / "book" / "data"
sys.path.insert(0, str(DATA))
import part4_runs  # noqa: E402

LOG = json.loads((DATA / "part4_runs.json").read_text())


@pytest.fixture(scope="module")
def corpora():
    tok, pydoc, code = part4_runs.corpora()
    assert tok.vocab_size == LOG["vocab_size"]
    return pydoc, code


def _first_losses(model, train_ids, **changes):
    steps = part4_runs.FT_STEPS if "warmup_steps" in changes else part4_runs.STEPS
    cfg = npf.TrainConfig(steps=steps, eval_interval=part4_runs.EVERY,
                          log_interval=part4_runs.EVERY, **{**part4_runs.TRAIN, **changes})
    trainer = npf.Trainer(model, train_ids, train_ids[:1000], cfg)  # the schedule of the run
    return [trainer.train_step()[0] for _ in range(3)]


@pytest.mark.parametrize("name", ["gpt", "llama", "dense", "moe"])
def test_pretraining_runs_start_as_logged(corpora, name):
    pydoc, _ = corpora
    model = part4_runs.models(LOG["vocab_size"])[name]
    got = _first_losses(model, pydoc[:int(0.9 * len(pydoc))])
    np.testing.assert_allclose(got, LOG["runs"][name]["first_losses"], rtol=1e-4)


@pytest.mark.parametrize("name, rank", [("lora_r4", 4), ("lora_r8", 8), ("full", None)])
def test_fine_tuning_runs_start_as_logged(corpora, name, rank):
    _, code = corpora
    model = npf.load(part4_runs.CKPT)
    if rank:
        npf.add_lora(model, rank=rank, alpha=2 * rank)
    got = _first_losses(model, code[:int(0.9 * len(code))], lr=1e-2 if rank else 1e-3,
                        warmup_steps=10, weight_decay=0.0)
    np.testing.assert_allclose(got, LOG["runs"][name]["first_losses"], rtol=1e-4)


@pytest.mark.parametrize("name", ["llama_layernorm", "llama_gelu", "llama_learned_pos"])
def test_ablation_runs_start_as_logged(corpora, name):
    pydoc, _ = corpora
    model = part4_runs.ablations(LOG["vocab_size"])[name]
    got = _first_losses(model, pydoc[:int(0.9 * len(pydoc))])
    np.testing.assert_allclose(got, LOG["runs"][name]["first_losses"], rtol=1e-4)
