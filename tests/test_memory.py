"""Specification of the memory accounting of a training step (book/precision.md, "Memory,
counted"): ``parameter_count``, ``block_activations`` and ``step_memory`` in
``npformer.perf``, against the models' own parameters, their caches and tracemalloc."""
from __future__ import annotations

import numpy as np
import pytest

import npformer as npf
from npformer.perf import (
    STATE_BYTES,
    best_segment,
    block_activations,
    kept_bytes,
    parameter_count,
    step_memory,
    traced_peak,
)
from npformer.strict import register

register()

# The traced peak is the formula's plus what the formula leaves out, Python's own objects and
# the loss's index arrays: 20 to 170 kB at the sizes below, under 2% of each peak.
TOLERANCE = 0.03


def _cached_bytes(module) -> int:
    """Bytes of the distinct arrays (views resolved to their base) in module's caches."""
    seen = {}

    def visit(obj):
        if isinstance(obj, np.ndarray):
            while isinstance(obj.base, np.ndarray):
                obj = obj.base
            seen[id(obj)] = obj.nbytes
        elif isinstance(obj, (tuple, list)):
            for item in obj:
                visit(item)

    for _, m in module.named_modules():
        visit(m.cache)
    return sum(seen.values())


GPTS = [dict(activation=a, dropout=p, bias=b, dtype=dt)
        for a in ("gelu", "gelu_tanh", "relu", "swiglu") for p in (0.0, 0.1)
        for b, dt in ((True, "float32"), (False, "float64"))]
LLAMAS = [dict(n_kv_head=kv, dropout=p, tie_embeddings=tie, dtype=dt)
          for kv in (1, 2, 4) for p in (0.0, 0.1) for tie, dt in ((False, "float32"),
                                                                   (True, "float64"))]


def _gpt_config(**kw):
    return npf.GPTConfig(vocab_size=29, block_size=16, n_layer=2, n_head=2, d_model=16, **kw)


def _llama_config(**kw):
    return npf.LlamaConfig(vocab_size=29, block_size=16, n_layer=2, n_head=4, d_model=32,
                           d_ff=40, **kw)


@pytest.mark.parametrize("kw", GPTS + LLAMAS, ids=str)
def test_the_count_is_the_caches_to_the_byte(kw):
    if "n_kv_head" in kw:
        model = npf.Llama(_llama_config(**kw), seed=0, kernels="numpy")
    else:
        model = npf.GPT(_gpt_config(**kw), seed=0, kernels="numpy")
    B, T = 3, 16
    model.forward(np.random.default_rng(0).integers(0, 29, (B, T)))
    assert parameter_count(model.config) == sum(p.size for _, p, _ in model.named_parameters())
    for block in model.h:
        assert _cached_bytes(block) == sum(block_activations(model.config, B, T).values())


def test_state_is_16_bytes_a_parameter_in_every_precision():
    assert {p: sum(row) for p, row in STATE_BYTES.items()} == \
        {"fp32": 16, "bf16-mixed": 16, "fp16-mixed": 16}
    cfg = _gpt_config()
    model = npf.GPT(cfg, seed=0)
    opt = npf.AdamW(model.named_parameters(), lr=1e-3)
    model.zero_grad()
    opt.step()  # allocates the moments
    nbytes = sum(p.nbytes + g.nbytes for _, p, g in model.named_parameters()) + \
        sum(m.nbytes for m in opt.state.values())  # m and v, parameter by parameter
    mem = step_memory(cfg, 2, 16)
    assert mem.state == nbytes and mem.master == 0
    half = step_memory(cfg, 2, 16, precision="bf16-mixed")
    assert half.state == mem.state and half.master == 4 * parameter_count(cfg)
    assert 2 * half.activations < 1.01 * mem.activations  # every activation in 2 bytes


MEASURED = [("gpt", dict(vocab_size=103, block_size=64, n_layer=4, n_head=4, d_model=128),
             (12, 64)),  # the baby GPT and its batch
            ("gpt", dict(vocab_size=64, block_size=64, n_layer=6, n_head=4, d_model=64,
                         dropout=0.1), (4, 64)),
            ("gpt", dict(vocab_size=1000, block_size=64, n_layer=4, n_head=4, d_model=64),
             (8, 64)),  # the loss's moment sets the peak
            ("llama", dict(vocab_size=103, block_size=64, n_layer=4, n_head=4, n_kv_head=2,
                           d_model=128), (12, 64)),
            ("llama", dict(vocab_size=64, block_size=64, n_layer=6, n_head=4, n_kv_head=1,
                           d_model=64, dropout=0.1, tie_embeddings=True), (4, 64))]


@pytest.mark.parametrize("kind, kw, shape", MEASURED)
@pytest.mark.parametrize("every", [None, 1, 2])
def test_the_formula_is_the_traced_peak(kind, kw, shape, every):
    make, Config = (npf.GPT, npf.GPTConfig) if kind == "gpt" else (npf.Llama, npf.LlamaConfig)
    cfg = Config(**kw)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, shape)
    traced = traced_peak(npf.recompute(make(cfg, seed=0, kernels="numpy"), every), ids)
    formula = step_memory(cfg, *shape, recompute=every).activations
    assert formula <= traced < (1 + TOLERANCE) * formula, (traced, formula)


def test_kept_bytes_of_segments():
    assert kept_bytes(6, None, 1, 10) == (60, 60, 60)
    assert kept_bytes(6, 1, 1, 10) == (6, 5 + 10, 0)  # the last block's backward pass
    assert kept_bytes(6, 2, 1, 10) == (3, 2 + 20, 0)
    assert kept_bytes(5, 2, 1, 10) == (3, max(2 + 10, 1 + 20), 0)  # a short last segment
    assert kept_bytes(6, 6, 1, 10) == (1, 60, 0)


def test_best_segment_follows_the_square_root_rule():
    shallow = npf.GPTConfig(vocab_size=64, block_size=64, n_layer=24, n_head=4, d_model=64)
    assert best_segment(shallow, 4, 64) == 1  # M_blk / M_in = 28 > 24 blocks
    # 400 blocks whose caches dwarf the update's square of the gradients
    deep = npf.GPTConfig(vocab_size=64, block_size=256, n_layer=400, n_head=4, d_model=32)
    k = best_segment(deep, 8, 256)
    peaks = [step_memory(deep, 8, 256, recompute=j).activations for j in range(1, 401)]
    assert peaks[k - 1] == min(peaks) and k > 1
    ratio = sum(block_activations(deep, 8, 256).values()) / (8 * 256 * 32 * 4)
    assert abs(k - (400 / ratio) ** 0.5) <= 1  # n_seg* = sqrt(N M_in / M_blk)


def test_bad_arguments():
    cfg = _gpt_config()
    with pytest.raises(ValueError, match="precision: expected one of"):
        step_memory(cfg, 1, 8, precision="bf16")
    with pytest.raises(ValueError, match="T: expected at most block_size = 16, got 17"):
        step_memory(cfg, 1, 17)
    with pytest.raises(ValueError, match="B: expected a positive integer"):
        step_memory(cfg, 0, 8)
    with pytest.raises(ValueError, match="recompute: expected a positive integer"):
        step_memory(cfg, 1, 8, recompute=0)
    with pytest.raises(ValueError, match="config: expected dtype 'float32' for 'bf16-mixed'"):
        step_memory(_gpt_config(dtype="float64"), 1, 8, precision="bf16-mixed")
    with pytest.raises(ValueError, match="config: expected a GPTConfig or a LlamaConfig"):
        parameter_count(npf.BERTConfig())
    with pytest.raises(ValueError, match="config: expected dense blocks"):
        parameter_count(_llama_config(n_expert=4))
    with pytest.raises(ValueError, match="config: expected attention_kernel 'standard'"):
        block_activations(_gpt_config(attention_kernel="flash"), 1, 8)
    with pytest.raises(ValueError, match="model: expected a model on the host"):
        traced_peak(npf.GPT(cfg, seed=0).to("strict"), np.zeros((1, 4), dtype=int))
