"""Specification of the paged KV cache, continuous batching and attention sinks
(book/serving.md).

Paged attention is checked bitwise against the contiguous KVCache; the engine against
each request run alone (float64 logits to 1e-12, greedy tokens exactly); the block
tables' invariants by hypothesis against a reference model of plain lists.
"""

from __future__ import annotations

import dataclasses
from functools import cache

import numpy as np
import pytest

import npformer as npf
from npformer.sampling import generate
from npformer.serving import (
    Engine,
    PagedKVCache,
    paged_forward,
)

GPT_PATH = "book/data/gpt_baby.safetensors"
LLAMA_PATH = "book/data/part4_llama_pydoc.safetensors"


@cache
def _model(path, dtype="float32"):
    m = npf.load(path)
    if dtype == "float64":
        m64 = type(m)(dataclasses.replace(m.config, dtype="float64"), seed=0)
        for (_, p, _), (_, p64, _) in zip(m.named_parameters(), m64.named_parameters()):
            p64[...] = p
        m = m64
    return m.eval()


def _cache_for(model, num_blocks, block_size):
    attn = model.h[0].attn
    return PagedKVCache(len(model.h), num_blocks, block_size,
                        getattr(attn, "n_kv_head", attn.n_head), attn.d_head,
                        model.config.dtype)


# --- paged attention equals contiguous attention ----------------------------------------


@pytest.mark.parametrize("path", [GPT_PATH, LLAMA_PATH])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_paged_forward_is_bitwise_the_contiguous_kv_cache(path, dtype):
    model = _model(path, dtype)
    cache = _cache_for(model, num_blocks=24, block_size=4)
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, 40)
    decoy, sid = cache.new_sequence(), cache.new_sequence()  # blocks interleave
    kv = model.new_cache()
    for lo, hi in [(0, 7), (7, 8), (8, 19), (19, 20), (20, 40)]:
        paged_forward(model, cache, [(decoy, ids[lo:hi][::-1])])
        paged = paged_forward(model, cache, [(sid, ids[lo:hi])])
        assert np.array_equal(paged, model.forward_cached(ids[None, lo:hi], kv)[0])
    assert cache.tables[sid] != sorted(cache.tables[sid]) or cache.tables[sid][0] != 0


# --- continuous batching equals each request alone ---------------------------------------


def _staggered(engine, prompts, news, arrive):
    """Submit request i at step arrive[i]; run to completion; tokens per request."""
    out, rid_of, step = {}, {}, 0
    while len(rid_of) < len(prompts) or engine.busy:
        for i, a in enumerate(arrive):
            if a == step:
                rid_of[engine.submit(prompts[i], news[i])] = i
        for e in engine.step():
            out.setdefault(rid_of[e.rid], []).append(e.token)
        step += 1
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize("path", [GPT_PATH, LLAMA_PATH])
def test_engine_greedy_tokens_equal_each_request_alone(path):
    model = _model(path)
    rng = np.random.default_rng(0)
    lens, news, arrive = [5, 17, 3, 30, 9, 1], [20, 10, 30, 8, 12, 25], [0, 0, 2, 3, 3, 9]
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in lens]
    engine = Engine(model, block_size=8, num_blocks=18, max_batch=4, prefill_chunk=7)
    got = _staggered(engine, prompts, news, arrive)
    for p, n, tokens in zip(prompts, news, got):
        alone = generate(model, np.array([p]), n, temperature=0)[0, len(p):]
        assert tokens == alone.tolist()
    assert engine.cache.allocator.refcount.sum() == 0
    assert len(engine.cache.allocator.free) == 18
