"""Specification of Mini-BERT, BERT's masking rule and the pretrained loader (book/bert.md).

Gradients are checked by central differences in float64 (tol 1e-7). The loader is tested
on small Hugging Face-style directories written here, so it needs no optional extra.
"""

import dataclasses
import json
import math
import re

import numpy as np
import pytest

import npformer as npf
from npformer.gradcheck import check_module
from npformer.models.bert import (
    BERT,
    BERTConfig,
    bert_mask_tokens,
    bert_param_counts,
    bert_param_total,
    mlm_sequences,
    mlm_step_loss,
)
from npformer.optim import AdamW
from npformer.pretrained import (
    bert_hf_renames,
    bert_hf_state,
    l2_normalize,
    load_bert_hf_state,
    load_pretrained_bert,
    mean_pool,
    sentence_embeddings,
)
from npformer.recipes import evaluate_mlm, train_mlm

TINY = BERTConfig(vocab_size=11, block_size=6, n_layer=2, n_head=2, d_model=8, d_ff=12,
                  dropout=0.0, dtype="float64")
GRAD = BERTConfig(vocab_size=9, block_size=5, n_layer=2, n_head=2, d_model=4, d_ff=6,
                  dropout=0.0, dtype="float64")  # small enough for finite differences
SPECIAL = [0, 1, 2, 3, 4]  # [PAD] [UNK] [CLS] [SEP] [MASK]
MASK_ID = 4
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "c", "d", "e", "##s"]


def _randomize(model, seed=1, scale=0.3):
    """Noise on every parameter: biases and norm shifts non-zero, norm gains near 1."""
    rng = np.random.default_rng(seed)
    for _, p, _ in model.named_parameters():
        p += rng.standard_normal(p.shape) * scale
    return model


def _batch(config=TINY, seed=2, B=2, T=5):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, config.vocab_size, (B, T))
    mask = np.ones((B, T), dtype=np.int64)
    mask[-1, T - 2:] = 0  # padding at the end of the last row
    return ids, mask


def _walk(module):
    yield module
    for child in module._children.values():
        yield from _walk(child)


def _arrays(obj):
    if isinstance(obj, np.ndarray):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _arrays(item)


# ------------------------------------------------------------------------------ config


def test_config_defaults_are_the_notes_mini_bert():
    c = BERTConfig()
    got = (c.n_layer, c.d_model, c.n_head, c.d_ff, c.block_size, c.vocab_size,
           c.type_vocab_size, c.eps, c.tie_head, c.dtype)
    assert got == (3, 192, 4, 768, 64, 8192, 2, 1e-12, True, "float32")


def test_config_round_trips_through_json():
    c = dataclasses.replace(TINY, tie_head=False, dropout=0.25)
    assert BERTConfig(**json.loads(json.dumps(dataclasses.asdict(c)))) == c


@pytest.mark.parametrize("field, value, match", [
    ("vocab_size", 0, r"vocab_size: expected a positive integer, got 0"),
    ("block_size", 2.5, r"block_size: expected a positive integer, got 2.5"),
    ("n_layer", -1, r"n_layer: expected a positive integer, got -1"),
    ("n_head", 3, r"d_model: expected a multiple of n_head = 3, got 8"),
    ("d_ff", True, r"d_ff: expected a positive integer, got True"),
    ("type_vocab_size", 0, r"type_vocab_size: expected a positive integer, got 0"),
    ("eps", 0.0, r"eps: expected a positive finite number, got 0.0"),
    ("eps", math.inf, r"eps: expected a positive finite number, got inf"),
    ("dropout", 1.0, r"dropout: expected a probability in \[0, 1\), got 1.0"),
    ("tie_head", 1, r"tie_head: expected True or False, got 1"),
    ("dtype", "float16", r"dtype: expected one of \('float32', 'float64'\), got float16"),
])
def test_config_rejects_invalid_fields_naming_them(field, value, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(TINY, **{field: value})


def test_bert_requires_a_bert_config():
    with pytest.raises(ValueError, match="config: expected a BERTConfig, got dict"):
        BERT({"vocab_size": 11})


# ------------------------------------------------------------------------------ gradients


def test_full_model_gradients_match_central_differences():
    model = _randomize(BERT(GRAD, seed=0))
    ids, mask = _batch(GRAD)
    errors = check_module(model, ids, mask, wrt_inputs=False, tol=1e-7)
    assert set(errors) == {name for name, _, _ in model.named_parameters()}
    assert max(errors.values()) < 1e-7


def test_chapter_model_gradients_match_central_differences_at_every_coordinate():
    """The chapter's model in full: the chapter samples sixteen coordinates of each array."""
    model = _randomize(BERT(TINY, seed=0))
    ids, mask = _batch(TINY)
    assert mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    errors = check_module(model, ids, mask, wrt_inputs=False, tol=1e-7)
    assert set(errors) == {name for name, _, _ in model.named_parameters()}


def test_gradients_with_dropout_token_types_and_untied_head_match_central_differences():
    cfg = dataclasses.replace(GRAD, n_layer=1, dropout=0.3, tie_head=False)
    model = _randomize(BERT(cfg, seed=0))
    for m in _walk(model):
        if hasattr(m, "freeze_mask"):
            m.freeze_mask = True  # the same masks at every evaluation of the loss
    ids, mask = _batch(cfg)
    types = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 1, 0]])
    errors = check_module(model, ids, mask, types, wrt_inputs=False, tol=1e-7)
    assert "mlm.decoder.W" in errors and max(errors.values()) < 1e-7


def test_encode_backward_matches_central_differences():
    cfg = dataclasses.replace(GRAD, n_layer=1)
    model = _randomize(BERT(cfg, seed=0))
    ids, mask = _batch(cfg)
    v = np.random.default_rng(5).standard_normal((2, 5, cfg.d_model))
    params = [(n, p) for n, p, _ in model.named_parameters() if not n.startswith("mlm.")]

    def fn(*arrays):
        for (_, p), a in zip(params, arrays):
            p[...] = a
        model.zero_grad()
        h = model.encode(ids, attention_mask=mask)
        model.backward(v)
        grads = {n: g for n, _, g in model.named_parameters()}
        return float(np.sum(h * v)), [grads[n].copy() for n, _ in params]

    errors = npf.gradcheck(fn, [p.copy() for _, p in params], names=[n for n, _ in params])
    assert max(errors.values()) < 1e-7


def test_forward_mlm_equals_the_full_head_at_the_selected_positions():
    model = _randomize(BERT(TINY, seed=0))
    ids, mask = _batch()
    rng = np.random.default_rng(3)
    positions = rng.random(ids.shape) < 0.5
    g = rng.standard_normal((int(positions.sum()), TINY.vocab_size))
    model.zero_grad()
    sel = model.forward_mlm(ids, positions, mask)
    model.backward(g)
    grads = {n: d.copy() for n, _, d in model.named_parameters()}
    model.zero_grad()
    full = model.forward(ids, mask)
    dfull = np.zeros_like(full)
    dfull[positions] = g
    model.backward(dfull)
    np.testing.assert_allclose(sel, full[positions], rtol=1e-12, atol=1e-12)
    for name, _, d in model.named_parameters():
        np.testing.assert_allclose(grads[name], d, rtol=1e-10, atol=1e-12, err_msg=name)


# ------------------------------------------------------------------------------ weight tying


def test_tied_head_uses_the_embedding_array_and_lists_it_once():
    model = BERT(TINY, seed=0)
    names = [name for name, _, _ in model.named_parameters()]
    assert model.mlm.tied.W is model.wte.W
    assert names.count("wte.W") == 1 and not any("decoder" in n for n in names)
    arrays = [p for _, p, _ in model.named_parameters()]
    assert len({id(p) for p in arrays}) == len(arrays)
    AdamW(model.named_parameters(), lr=1e-3)  # the optimiser accepts the list: no duplicates
    model.wte.W[3, 2] = 7.0
    ids = np.array([[5, 6]])
    assert model.forward(ids).shape == (1, 2, TINY.vocab_size)
    np.testing.assert_array_equal(model.mlm.tied.W, model.wte.W)


def test_tied_gradient_is_the_sum_of_the_input_and_output_uses():
    tied = _randomize(BERT(TINY, seed=0))
    untied = BERT(dataclasses.replace(TINY, tie_head=False), seed=0)
    for (_, p, _), (_, q, _) in zip(tied.named_parameters(), untied.named_parameters()):
        q[...] = p
    untied.mlm.decoder.W[...] = tied.wte.W.T
    ids, mask = _batch()
    dlogits = np.random.default_rng(4).standard_normal((2, 5, TINY.vocab_size))
    outs = []
    for m in (tied, untied):
        m.zero_grad()
        outs.append(m.forward(ids, mask))
        m.backward(dlogits)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    both = untied.wte.dW + untied.mlm.decoder.dW.T
    np.testing.assert_allclose(tied.wte.dW, both, rtol=1e-12, atol=1e-12)
    assert np.linalg.norm(untied.mlm.decoder.dW) > 0.1 and np.linalg.norm(untied.wte.dW) > 0.1


# ------------------------------------------------------------------------------ behaviour


@pytest.mark.parametrize("tie_head", [True, False])
def test_every_parameter_gets_a_gradient_and_moves_after_one_adamw_step(tie_head):
    cfg = dataclasses.replace(TINY, tie_head=tie_head, dropout=0.1, dtype="float32")
    model = BERT(cfg, seed=0)
    ids = np.random.default_rng(0).integers(5, cfg.vocab_size, (4, 6))
    types = np.zeros_like(ids)
    types[:, 3:] = 1  # both token-type rows in use
    inputs, targets = bert_mask_tokens(ids, np.random.default_rng(1), cfg.vocab_size, MASK_ID,
                                       SPECIAL, p=0.5)
    before = {n: p.copy() for n, p, _ in model.named_parameters()}
    model.zero_grad()
    positions = targets != -100
    logits = model.forward_mlm(inputs, positions, None, types)
    _, dlogits = npf.cross_entropy(logits, targets[positions])
    model.backward(dlogits)
    for name, _, g in model.named_parameters():
        assert np.abs(g).max() > 0, f"{name} received no gradient"
    AdamW(model.named_parameters(), lr=1e-3, weight_decay=0.01).step()
    for name, p, _ in model.named_parameters():
        assert not np.array_equal(p, before[name]), f"{name} did not move"


def test_float32_model_stays_float32_end_to_end():
    cfg = dataclasses.replace(TINY, dropout=0.1, dtype="float32")
    model = BERT(cfg, seed=0)
    ids, mask = _batch(cfg)
    for kind in ("full", "mlm", "encode"):
        model.zero_grad()
        if kind == "full":
            out = model.forward(ids, mask)
        elif kind == "mlm":
            out = model.forward_mlm(ids, ids > 5, mask)
        else:
            out = model.encode(ids, attention_mask=mask)
        assert out.dtype == np.float32
        floats = [a for m in _walk(model) for a in _arrays(m.cache) if a.dtype.kind == "f"]
        assert floats and all(a.dtype == np.float32 for a in floats), kind
        model.backward(np.ones_like(out))
        for name, p, g in model.named_parameters():
            assert p.dtype == np.float32 and g.dtype == np.float32, name
            assert np.isfinite(g).all(), name


def test_padding_changes_nothing_at_the_real_tokens():
    model = _randomize(BERT(TINY, seed=0))
    ids = np.array([[2, 5, 6, 7, 3]])
    alone = model.encode(ids)
    padded = model.encode(np.array([[2, 5, 6, 7, 3], [2, 8, 3, 0, 0]]),
                          attention_mask=np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]))
    short = model.encode(np.array([[2, 8, 3]]))
    np.testing.assert_allclose(padded[0], alone[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(padded[1, :3], short[0], rtol=1e-12, atol=1e-12)


def test_token_type_row_zero_is_added_when_no_token_types_are_given():
    model = _randomize(BERT(TINY, seed=0))
    ids, mask = _batch()
    h = model.encode(ids, attention_mask=mask)
    np.testing.assert_array_equal(h, model.encode(ids, mask, np.zeros_like(ids)))
    model.type_emb.W[0] += np.linspace(-1, 1, TINY.d_model)  # a constant shift would be
    assert np.abs(model.encode(ids, attention_mask=mask) - h).max() > 1e-3  # normalised away


def test_blocks_are_post_ln_so_every_hidden_state_is_normalised():
    model = BERT(dataclasses.replace(TINY, dtype="float64"), seed=0)  # gamma = 1, beta = 0
    h = model.encode(np.random.default_rng(0).integers(0, 11, (3, 6)))
    np.testing.assert_allclose(h.mean(axis=-1), 0, atol=1e-12)
    np.testing.assert_allclose(h.var(axis=-1), 1, rtol=1e-9)
    assert all(not block.prenorm for block in model.h)


@pytest.mark.parametrize("call, match", [
    (lambda m: m.forward(np.zeros((2, 7), dtype=int)),
     r"ids: expected shape \(B, T\) with 1 <= T <= block_size = 6, got \(2, 7\)"),
    (lambda m: m.forward(np.array([[1, 11]])), r"ids: expected values in \[0, 11\), got 11"),
    (lambda m: m.forward(np.array([[1.0, 2.0]])), r"ids: expected an integer array, got dtype"),
    (lambda m: m.forward(np.array([[1, 2]]), np.array([[1, 2]])),
     r"attention_mask: expected values in \[0, 2\), got 2"),
    (lambda m: m.forward(np.array([[1, 2]]), np.array([1, 1])),
     r"attention_mask: expected shape \(1, 2\) \(that of ids\), got \(2,\)"),
    (lambda m: m.encode(np.array([[1, 2]]), None, np.array([[0, 2]])),
     r"token_type_ids: expected values in \[0, 2\), got 2"),
    (lambda m: m.forward_mlm(np.array([[1, 2]]), np.array([[1, 0]])),
     r"positions: expected a bool array of shape \(1, 2\), got int64"),
])
def test_model_inputs_are_validated(call, match):
    with pytest.raises(ValueError, match=match):
        call(BERT(TINY, seed=0))


def test_backward_before_forward_is_an_error():
    with pytest.raises(RuntimeError, match="backward: call encode, forward or forward_mlm first"):
        BERT(TINY, seed=0).backward(np.zeros((1, 2, 11)))


# ------------------------------------------------------------------------------ counting


@pytest.mark.parametrize("tie_head", [True, False])
def test_param_counts_match_the_model_name_by_name(tie_head):
    cfg = BERTConfig(vocab_size=50, block_size=9, n_layer=3, n_head=2, d_model=6, d_ff=10,
                     type_vocab_size=3, tie_head=tie_head)
    built: dict[str, int] = {}
    for name, p, _ in BERT(cfg, seed=0).named_parameters():
        key = re.sub(r"^h\.\d+\.", "h.*.", name)
        built[key] = built.get(key, 0) + p.size
    counts = bert_param_counts(cfg)
    assert built == {k: v * (cfg.n_layer if k.startswith("h.*.") else 1)
                     for k, v in counts.items()}
    assert bert_param_total(cfg) == sum(built.values())


def test_param_total_of_the_notes_config_and_what_the_notes_counted():
    tied, untied = BERTConfig(), BERTConfig(tie_head=False)
    assert (bert_param_total(tied), bert_param_total(untied)) == (2_966_144, 4_539_008)
    c = bert_param_counts(tied)
    weights = sum(v for k, v in c.items() if k.startswith("h.*.") and k.endswith(".W"))
    assert sum(v for k, v in c.items() if k.startswith("h.*.")) == 444_864  # all 16 arrays
    one_ln = c["h.*.ln_1.gamma"] + c["h.*.ln_1.beta"]
    assert weights + one_ln == 442_752  # the published per-layer number: no biases, one LN
    notes_rest = c["wte.W"] + c["wpe.W"] + 192 * 8192 + c["type_emb.W"]  # untied, no bias
    assert 3 * 442_752 + notes_rest == 4_486_656


# ------------------------------------------------------------------------------ masking


def test_bert_mask_tokens_follows_the_80_10_10_rule_within_five_standard_deviations():
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 1000, (500, 64))
    inputs, targets = bert_mask_tokens(ids, rng, 1000, MASK_ID, SPECIAL)
    chosen = targets != -100
    n, k = ids.size, int(chosen.sum())
    cases = [(k / n, 0.15, n), ((inputs == MASK_ID)[chosen].mean(), 0.8, k),
             (((inputs != ids) & (inputs != MASK_ID))[chosen].mean(), 0.1, k),
             ((inputs == ids)[chosen].mean(), 0.1 + 0.1 / 995, k)]
    for observed, q, base in cases:
        assert abs(observed - q) < 5 * math.sqrt(q * (1 - q) / base), (observed, q)


def test_bert_mask_tokens_never_touches_special_tokens_or_padding():
    rng = np.random.default_rng(1)
    ids = rng.integers(5, 50, (300, 20))
    ids[:, 0], ids[:, -1] = 2, 3
    ids[::2, 12:] = 0  # padding
    ids[5, 3] = MASK_ID  # a literal [MASK] in the text is special too
    inputs, targets = bert_mask_tokens(ids, rng, 50, MASK_ID, SPECIAL, p=0.6)
    special = np.isin(ids, SPECIAL)
    chosen = targets != -100
    assert not chosen[special].any() and np.array_equal(inputs[special], ids[special])
    assert np.array_equal(targets[chosen], ids[chosen])
    assert np.array_equal(inputs[~chosen], ids[~chosen])
    replaced = inputs[(inputs != ids) & (inputs != MASK_ID)]
    assert replaced.size > 100 and not np.isin(replaced, SPECIAL).any()


def test_bert_mask_tokens_is_reproducible_from_the_seed():
    ids = np.random.default_rng(0).integers(5, 30, (4, 16))
    a = bert_mask_tokens(ids, np.random.default_rng(7), 30, MASK_ID, SPECIAL)
    b = bert_mask_tokens(ids, np.random.default_rng(7), 30, MASK_ID, SPECIAL)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kwargs, match", [
    ({"rng": 0}, r"rng: expected a numpy.random.Generator, got int"),
    ({"vocab_size": 0}, r"vocab_size: expected a positive integer, got 0"),
    ({"ids": np.array([[1, 30]])}, r"ids: expected values in \[0, 30\), got 30"),
    ({"ids": np.array([[1.5]])}, r"ids: expected an integer array, got dtype float64"),
    ({"mask_id": 30}, r"mask_id: expected values in \[0, 30\), got 30"),
    ({"special_ids": [0, 31]}, r"special_ids: expected values in \[0, 30\), got 31"),
    ({"special_ids": list(range(30))}, r"special_ids: expected fewer than vocab_size = 30"),
    ({"p": 0.0}, r"p: expected a probability in \(0, 1\), got 0.0"),
    ({"p": 1}, r"p: expected a probability in \(0, 1\), got 1"),
])
def test_bert_mask_tokens_validates_its_arguments(kwargs, match):
    args = {"ids": np.array([[5, 6]]), "rng": np.random.default_rng(0), "vocab_size": 30,
            "mask_id": MASK_ID, "special_ids": SPECIAL, "p": 0.15}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        bert_mask_tokens(**args)


def test_mlm_sequences_wraps_rows_in_cls_and_sep_and_drops_the_tail():
    rows = mlm_sequences(np.arange(10, 33), 6, cls_id=2, sep_id=3)  # 23 ids, 4 per row
    assert rows.shape == (5, 6)
    assert (rows[:, 0] == 2).all() and (rows[:, -1] == 3).all()
    np.testing.assert_array_equal(rows[:, 1:-1].reshape(-1), np.arange(10, 30))
    with pytest.raises(ValueError, match=r"block_size: expected at least 3"):
        mlm_sequences(np.arange(10), 2, 2, 3)
    with pytest.raises(ValueError, match=r"ids: expected at least block_size - 2 = 4 ids, got 3"):
        mlm_sequences(np.arange(3), 6, 2, 3)


# ------------------------------------------------------------------------------ training


def test_train_mlm_lowers_the_held_out_loss_and_logs_every_step():
    cfg = BERTConfig(vocab_size=12, block_size=8, n_layer=1, n_head=2, d_model=16, d_ff=32,
                     dropout=0.0)
    rows = np.tile(np.array([2, 5, 6, 7, 8, 9, 10, 3]), (40, 1))  # one sentence, learnable
    rows[::2, 1:7] = rows[::2, 1:7][:, ::-1]  # and its reverse
    model = BERT(cfg, seed=0)
    before, _ = evaluate_mlm(model, rows[:8], mask_id=MASK_ID, special_ids=SPECIAL)
    log = train_mlm(model, rows, rows[:8], steps=30, batch_size=8, lr=1e-2, warmup=3,
                    eval_every=10, mask_id=MASK_ID, special_ids=SPECIAL, seed=0)
    assert log["step"] == list(range(1, 31)) and log["eval_step"] == [10, 20, 30]
    assert log["val_loss"][-1] < 0.6 * before
    assert model.training  # evaluation switched dropout off and back


def test_train_mlm_stops_on_a_non_finite_loss():
    model = BERT(dataclasses.replace(TINY, dtype="float32"), seed=0)
    model.wte.W[...] = np.nan
    rows = np.tile(np.array([2, 5, 6, 7, 3]), (4, 1))
    with pytest.raises(FloatingPointError, match="step 0: expected a finite loss"):
        train_mlm(model, rows, rows, steps=2, batch_size=4, mask_id=MASK_ID,
                  special_ids=SPECIAL, warmup=1)


def test_mlm_step_loss_returns_the_loss_and_the_accuracy_counts():
    model = BERT(dataclasses.replace(TINY, dtype="float32"), seed=0)
    ids = np.array([[2, 5, 6, 7, 3]])
    targets = np.array([[-100, 5, -100, 7, -100]])
    loss, correct, count = mlm_step_loss(model, ids, targets)
    assert count == 2 and 0 <= correct <= 2 and 0 < loss < 10


# ------------------------------------------------------------------------------ loader


def _hf_dir(tmp_path, model, extra=None, config=None):
    from safetensors.numpy import save_file

    c = model.config
    state = {k: v.astype(np.float32) for k, v in bert_hf_state(model).items()}
    state["pooler.dense.weight"] = np.ones((c.d_model, c.d_model), dtype=np.float32)
    state["pooler.dense.bias"] = np.ones(c.d_model, dtype=np.float32)
    state["embeddings.position_ids"] = np.arange(c.block_size)[None]
    state.update(extra or {})
    save_file(state, str(tmp_path / "model.safetensors"))
    hf = {"model_type": "bert", "vocab_size": c.vocab_size, "hidden_size": c.d_model,
          "max_position_embeddings": c.block_size, "num_hidden_layers": c.n_layer,
          "num_attention_heads": c.n_head, "intermediate_size": c.d_ff, "hidden_act": "gelu",
          "layer_norm_eps": 1e-12, "type_vocab_size": c.type_vocab_size,
          "hidden_dropout_prob": 0.1, "tie_word_embeddings": c.tie_head}
    hf.update(config or {})
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return tmp_path


def _gelu(x):
    from scipy.special import erf

    return 0.5 * x * (1 + erf(x / math.sqrt(2)))


def _ln(x, w, b, eps=1e-12):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


def _hf_bert_reference(s, ids, mask, n_layer, n_head):
    """Hugging Face BERT's last hidden state, written directly on its (out, in) weights."""
    B, T = ids.shape
    x = (s["embeddings.word_embeddings.weight"][ids]
         + s["embeddings.position_embeddings.weight"][:T]
         + s["embeddings.token_type_embeddings.weight"][0])  # row 0: all token types are 0
    x = _ln(x, s["embeddings.LayerNorm.weight"], s["embeddings.LayerNorm.bias"])
    add = np.where(mask[:, None, None, :] == 1, 0.0, np.finfo(np.float64).min)  # additive mask
    for i in range(n_layer):
        p = f"encoder.layer.{i}."

        def lin(name, h, p=p):
            return h @ s[p + name + ".weight"].T + s[p + name + ".bias"]

        def heads(h):
            return h.reshape(B, T, n_head, -1).transpose(0, 2, 1, 3)

        q, k, v = (heads(lin(f"attention.self.{n}", x)) for n in ("query", "key", "value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1]) + add
        w = np.exp(scores - scores.max(-1, keepdims=True))
        ctx = ((w / w.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(B, T, -1)
        x = _ln(lin("attention.output.dense", ctx) + x, s[p + "attention.output.LayerNorm.weight"],
                s[p + "attention.output.LayerNorm.bias"])
        f = lin("output.dense", _gelu(lin("intermediate.dense", x)))
        x = _ln(f + x, s[p + "output.LayerNorm.weight"], s[p + "output.LayerNorm.bias"])
    return x


@pytest.mark.parametrize("tie_head", [True, False])
def test_loader_round_trip_through_a_hugging_face_style_directory(tmp_path, tie_head):
    cfg = dataclasses.replace(TINY, dtype="float32", tie_head=tie_head)
    src = _randomize(BERT(cfg, seed=3), seed=4)
    bert, tok = load_pretrained_bert(_hf_dir(tmp_path, src))
    assert bert.config == dataclasses.replace(cfg, dropout=0.1)
    assert not bert.training and bert.not_loaded == []
    for (name, p, _), (_, q, _) in zip(src.named_parameters(), bert.named_parameters()):
        np.testing.assert_array_equal(p, q, err_msg=name)
    assert (bert.mlm.tied is bert.wte) == tie_head
    ids, mask = tok.batch_encode(["a b c", "d es"])
    np.testing.assert_array_equal(ids, [[2, 5, 6, 7, 3], [2, 8, 9, 10, 3]])
    assert bert.encode(ids, attention_mask=mask).shape == (2, 5, 8)


def test_loader_renames_transposes_and_fuses_like_hugging_face_bert(tmp_path):
    """Distinct random q, k, v projections; our encode equals BERT's equations on HF names."""
    cfg = dataclasses.replace(TINY, dtype="float64")
    rng = np.random.default_rng(8)
    state = {n: rng.standard_normal(a.shape) * 0.3
             for n, a in bert_hf_state(BERT(cfg, seed=0)).items()}
    model = BERT(cfg, seed=1)
    assert load_bert_hf_state(model, state) == []
    W = model.h[1].attn.qkv.W
    np.testing.assert_array_equal(W[:, 8:16], state["encoder.layer.1.attention.self.key.weight"].T)
    ids, mask = _batch()
    ref = _hf_bert_reference(state, ids, mask, cfg.n_layer, cfg.n_head)
    ours = model.encode(ids, attention_mask=mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], ref[real], rtol=1e-10, atol=1e-12)


def test_loader_reports_a_missing_head_strips_the_bert_prefix_and_skips_ignored_names():
    cfg = dataclasses.replace(TINY, dtype="float32")
    src = _randomize(BERT(cfg, seed=3), seed=4)
    state = {("bert." + k if not k.startswith("cls.") else k): v
             for k, v in bert_hf_state(src).items() if not k.startswith("cls.")}
    state["bert.pooler.dense.bias"] = np.zeros(8)
    state["cls.seq_relationship.bias"] = np.zeros(2)
    model = BERT(cfg, seed=0)
    missing = load_bert_hf_state(model, state)
    assert missing == ["mlm.bias", "mlm.dense.W", "mlm.dense.b", "mlm.ln.gamma", "mlm.ln.beta"]
    np.testing.assert_array_equal(model.h[0].attn.qkv.W, src.h[0].attn.qkv.W)


@pytest.mark.parametrize("change, match", [
    ({"encoder.layer.9.attention.self.query.weight": np.zeros((8, 8))},
     r"state: expected Hugging Face BERT names, got unknown keys \['encoder.layer.9"),
    ({"embeddings.position_embeddings.weight": np.zeros((7, 8))},
     r"state\['embeddings.position_embeddings.weight'\]: expected shape \(6, 8\) for 'wpe.W'"),
])
def test_loader_rejects_unknown_names_and_wrong_shapes(change, match):
    model = BERT(TINY, seed=0)
    state = bert_hf_state(model)
    state.update(change)
    with pytest.raises(ValueError, match=match):
        load_bert_hf_state(model, state)


def test_loader_rejects_a_missing_file_and_an_unsupported_config(tmp_path):
    with pytest.raises(ValueError, match=r"model_dir: expected a directory with config.json"):
        load_pretrained_bert(tmp_path)
    _hf_dir(tmp_path, BERT(TINY, seed=0), config={"hidden_act": "relu"})
    with pytest.raises(ValueError, match=r"config.json: expected hidden_act = 'gelu', got 'relu'"):
        load_pretrained_bert(tmp_path)


def test_rename_table_covers_every_parameter_once():
    for tie in (True, False):
        cfg = dataclasses.replace(TINY, tie_head=tie)
        table = bert_hf_renames(cfg)
        ours = [row[0] for row in table]
        assert sorted(ours) == sorted(n for n, _, _ in BERT(cfg).named_parameters())
        hf = [n for row in table for n in row[1]]
        written = set(bert_hf_state(BERT(cfg)))
        assert len(hf) == len(set(hf)) and written == set(hf) | {"cls.predictions.decoder.bias"}


# ------------------------------------------------------------------------------ embeddings


def test_mean_pool_ignores_padding_and_l2_normalize_gives_unit_rows():
    hidden = np.arange(24, dtype=np.float64).reshape(2, 3, 4)
    mask = np.array([[1, 1, 0], [1, 0, 0]])
    np.testing.assert_array_equal(mean_pool(hidden, mask), [hidden[0, :2].mean(0), hidden[1, 0]])
    e = l2_normalize(mean_pool(hidden, mask))
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1, rtol=1e-15)
    np.testing.assert_array_equal(l2_normalize(np.zeros((1, 3))), 0)
    with pytest.raises(ValueError, match=r"mask: expected shape \(2, 3\) \(B, T\), got \(2,\)"):
        mean_pool(hidden, np.ones(2))


def test_sentence_embeddings_do_not_depend_on_the_batch(tmp_path):
    src = _randomize(BERT(dataclasses.replace(TINY, dtype="float64"), seed=3), seed=4)
    bert, tok = load_pretrained_bert(_hf_dir(tmp_path, src), dtype="float64")
    texts = ["a b c", "d", "es a b", "c c"]
    together = sentence_embeddings(bert, tok, texts)
    apart = np.concatenate([sentence_embeddings(bert, tok, [t]) for t in texts])
    np.testing.assert_allclose(together, apart, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1, rtol=1e-12)


# --- The committed Mini-BERT run (book/data/bert_runs.py) -----------------------------------

DATA = __import__("pathlib").Path(__file__).resolve().parents[1] / "book" / "data"
# float32 training: BLAS kernels sum in a different order on another CPU, so a re-run matches
# the log to rounding, which the first steps amplify only a little.
LOG_TOL = 2e-3


def _bert_runs():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bert_runs", DATA / "bert_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_mini_bert_log_matches_a_rerun_of_its_first_steps():
    full = json.loads((DATA / "bert_mlm_full.json").read_text())
    steps = 6
    _, log, _ = _bert_runs().run(full["steps"], full["batch_size"], full["lr"], full["warmup"],
                                 full["eval_every"], full["dropout"], until=steps)
    assert log["step"] == list(range(1, steps + 1))
    np.testing.assert_allclose(log["loss"], full["log"]["loss"][:steps], rtol=0, atol=LOG_TOL)
    np.testing.assert_allclose(log["lr"], full["log"]["lr"][:steps], rtol=1e-6)


def test_committed_mini_bert_checkpoint_is_small_and_beats_the_unigram_baseline():
    from safetensors import safe_open

    path = DATA / "bert_mlm.safetensors"
    assert path.stat().st_size < 6.5e6
    with safe_open(str(path), framework="np") as f:
        config = BERTConfig(**json.loads(f.metadata()["config"]))
        bert = BERT(config, seed=0)
        for name, p, _ in bert.named_parameters():
            p[...] = f.get_tensor(name)
    tok = npf.WordPiece(DATA / "bert_vocab.txt")
    with np.load(DATA / "bert_corpus.npz") as f:
        train, val = f["train"].astype(np.int64), f["val"].astype(np.int64)
    special = [tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id]
    _, acc = evaluate_mlm(bert, val, mask_id=tok.mask_id, special_ids=special)
    counts = np.bincount(train[~np.isin(train, special)], minlength=tok.vocab_size)
    targets = val[~np.isin(val, special)]
    assert acc >= 2 * np.mean(targets == counts.argmax())
