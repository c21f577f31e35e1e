"""The one contract every model keeps (book/linear.md, "The model contract"), checked
over every model, and the package-wide rule that no module calls another's private name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import npformer
from npformer.models.bert import BERT, BERTConfig
from npformer.models.encoder import Encoder, EncoderConfig
from npformer.models.gpt import GPT, GPTConfig
from npformer.models.llama import Llama, LlamaConfig
from npformer.models.transformer import Transformer, TransformerConfig
from npformer.preference import RewardModel

PACKAGE = Path(npformer.__file__).resolve().parent

MODELS = {
    "GPT": lambda: GPT(GPTConfig(vocab_size=13, block_size=6, n_layer=2, n_head=2, d_model=8,
                                 dtype="float64"), seed=0),
    "BERT": lambda: BERT(BERTConfig(vocab_size=13, block_size=6, n_layer=2, n_head=2,
                                    d_model=8, d_ff=16, dropout=0.0, dtype="float64"), seed=0),
    "Encoder": lambda: Encoder(EncoderConfig(vocab_size=13, block_size=6, n_layer=2, n_head=2,
                                             d_model=8, d_ff=16, dtype="float64"), seed=0),
    "Transformer": lambda: Transformer(TransformerConfig(
        src_vocab_size=13, tgt_vocab_size=11, block_size=6, n_layer=2, n_head=2, d_model=8,
        d_ff=16, dropout=0.0, dtype="float64"), seed=0),
    "Llama": lambda: Llama(LlamaConfig(vocab_size=13, block_size=6, n_layer=2, n_head=2,
                                       n_kv_head=1, d_model=8, d_ff=16, n_expert=4,
                                       dtype="float64"), seed=0),
    "RewardModel": lambda: RewardModel(GPTConfig(vocab_size=13, block_size=6, n_layer=2,
                                                 n_head=2, d_model=8, dtype="float64"), seed=0),
}
IDS = np.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
INPUTS = {"Transformer": (IDS, IDS[:, :4]),  # an encoder-decoder reads a source and a target
          "RewardModel": (IDS, np.array([4, 2]))}  # and a reward model where to read: (B,)
SCORES_SEQUENCES = {"RewardModel"}  # one number per sequence, and no next-token path


def test_every_model_class_in_the_package_is_covered():
    models = {name for name, obj in vars(npformer).items()
              if isinstance(obj, type) and issubclass(obj, npformer.Module)
              and hasattr(obj, "check_ids")}
    assert models <= set(MODELS), sorted(models - set(MODELS))


@pytest.mark.parametrize("name", MODELS)
def test_forward_maps_ids_to_an_array_of_the_models_dtype(name):
    model = MODELS[name]()
    inputs = INPUTS.get(name, (IDS,))
    out = model.forward(*inputs)
    assert isinstance(out, np.ndarray) and out.dtype == np.float64
    assert out.shape[:2] == inputs[-1].shape


@pytest.mark.parametrize("name", MODELS)
def test_backward_accumulates_and_returns_none_for_integer_ids(name):
    model = MODELS[name]()
    inputs = INPUTS.get(name, (IDS,))
    dout = np.random.default_rng(0).standard_normal(model.forward(*inputs).shape)
    model.zero_grad()
    assert model.backward(dout) is None  # token ids have no gradient: the docstring says so
    once = {n: g.copy() for n, _, g in model.named_parameters()}
    model.forward(*inputs)
    model.backward(dout)
    for n, _, g in model.named_parameters():
        np.testing.assert_allclose(g, 2 * once[n], rtol=1e-12, atol=1e-15, err_msg=n)
    assert "None" in type(model).backward.__doc__ or "no gradient" in type(model).backward.__doc__
    model.zero_grad()
    assert all(not g.any() for _, _, g in model.named_parameters())


@pytest.mark.parametrize("name", MODELS)
def test_backward_before_forward_says_so(name):
    model = MODELS[name]()
    with pytest.raises(RuntimeError, match="^backward: call "):
        model.backward(np.zeros(IDS.shape + (8,)))


@pytest.mark.parametrize("name", MODELS)
def test_named_parameters_lists_each_array_once_with_its_gradient(name):
    params = list(MODELS[name]().named_parameters())
    names = [n for n, _, _ in params]
    assert len(set(names)) == len(names)
    assert len({id(p) for _, p, _ in params}) == len(params)  # tied weights appear once
    for n, p, g in params:
        assert g.shape == p.shape and g.dtype == p.dtype, n
        assert g is not p and not np.shares_memory(g, p), n


@pytest.mark.parametrize("name", MODELS)
def test_check_ids_is_public_and_names_bad_ids(name):
    model = MODELS[name]()
    assert np.array_equal(model.check_ids(IDS), IDS)
    for bad in (IDS.astype(bool), IDS.astype(float), IDS[0], np.full((1, 7), 1)):
        with pytest.raises(ValueError, match=r"^(src_)?ids: expected "):
            model.check_ids(bad)


@pytest.mark.parametrize("name", [n for n in MODELS if hasattr(MODELS[n](), "new_cache")
                                  and n not in SCORES_SEQUENCES])
def test_a_decoder_gives_the_same_logits_one_token_at_a_time(name):
    model = MODELS[name]().eval()
    *source, ids = INPUTS.get(name, (IDS,))  # the encoder-decoder's cache holds its source
    full = model.forward(*source, ids)  # (B, T, V)
    cache = model.new_cache(*source)
    steps = [model.forward_cached(ids[:, t:t + 1], cache) for t in range(ids.shape[1])]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------- private names stay private


def _private_uses(path: Path) -> list[str]:
    """Calls obj._name(...) on anything but self/cls/super(), and imports of another
    npformer module's _name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("npformer"):
            found += [f"{path.name}:{node.lineno}: from {node.module} import {a.name}"
                      for a in node.names if a.name.startswith("_")]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            attr, owner = node.func.attr, node.func.value
            if not attr.startswith("_") or attr.startswith("__"):
                continue
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and getattr(owner.func, "id", "") == "super":
                continue
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node.func)}(...)")
    return found


def test_no_module_calls_another_modules_private_name():
    uses = [u for f in sorted(PACKAGE.rglob("*.py")) for u in _private_uses(f)]
    assert uses == []


def test_the_private_name_check_finds_what_it_looks_for(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from npformer.attention import _causal_rule\n"
                 "def g(model):\n    self = model\n    return model._check_ids(1), self._x()\n")
    assert len(_private_uses(f)) == 2
