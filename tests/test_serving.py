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
from hypothesis import given, settings
from hypothesis import strategies as st

import npformer as npf
from npformer.sampling import generate
from npformer.serving import (
    BlockAllocator,
    Engine,
    OutOfBlocks,
    PagedKVCache,
    SinkCache,
    band_mask,
    blocks_needed,
    extend,
    forward_masked,
    gather,
    paged_forward,
    stream_forward,
    write,
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


# --- the block tables' invariants, against a model of plain lists ------------------------

OPS = st.lists(st.tuples(st.sampled_from(["new", "append", "fork", "free"]),
                         st.integers(0, 7), st.integers(1, 9)), max_size=30)


def _check_invariants(cache, ref):
    alloc = cache.allocator
    held = np.zeros(alloc.num_blocks, dtype=np.int64)
    for table in cache.tables.values():
        assert len(set(table)) == len(table)
        held[table] += 1
    assert np.array_equal(alloc.refcount, held)  # refcount = tables holding the block
    free = set(alloc.free)
    assert len(free) == len(alloc.free)  # no block twice on the free list
    assert free == set(np.flatnonzero(held == 0).tolist())  # free + used partition the pool
    for sid, values in ref.items():
        assert cache.lengths[sid] == len(values)
        assert len(cache.tables[sid]) == -(-len(values) // cache.block_size)
        if values:
            k, v = gather(cache, 0, sid)  # (1, 1, L, 1)
            assert k.ravel().tolist() == values and v.ravel().tolist() == [-x for x in values]


@settings(max_examples=80, deadline=None)
@given(OPS, st.integers(1, 4), st.integers(3, 12))
def test_block_tables_keep_their_invariants(ops, block_size, num_blocks):
    cache = PagedKVCache(1, num_blocks, block_size, 1, 1, "float64")
    ref: dict[int, list[float]] = {}
    counter = 0
    for op, pick, T in ops:
        sids = sorted(ref)
        sid = sids[pick % len(sids)] if sids else None
        if op == "new" or sid is None:
            ref[cache.new_sequence()] = []
        elif op == "append":
            before = (list(cache.allocator.free), {s: list(t) for s, t in cache.tables.items()})
            try:
                slots = extend(cache, sid, T)
            except OutOfBlocks:  # refused whole: nothing changed
                assert blocks_needed(cache, sid, T) > len(cache.allocator.free)
                assert before == (cache.allocator.free, cache.tables)
                continue
            values = [float(counter + i) for i in range(T)]
            counter += T
            x = np.array(values).reshape(1, 1, T, 1)
            write(cache, 0, slots, x, -x)
            ref[sid] = ref[sid] + values
        elif op == "fork":
            ref[cache.fork(sid)] = list(ref[sid])
        else:
            cache.free(sid)
            del ref[sid]
        _check_invariants(cache, ref)


def test_copy_on_write_copies_only_a_shared_partly_filled_block():
    cache = PagedKVCache(1, 8, 4, 1, 1, "float64")
    a = cache.new_sequence()
    write(cache, 0, extend(cache, a, 6), *[np.arange(6.0).reshape(1, 1, 6, 1)] * 2)
    b = cache.fork(a)
    assert cache.tables[a] == cache.tables[b] and cache.allocator.refcount[0] == 2
    write(cache, 0, extend(cache, b, 1), *[np.full((1, 1, 1, 1), 9.0)] * 2)
    assert cache.tables[b][0] == cache.tables[a][0]  # the full block stays shared
    assert cache.tables[b][1] != cache.tables[a][1]  # the partly filled one was copied
    assert gather(cache, 0, a)[0].ravel().tolist() == [0, 1, 2, 3, 4, 5]
    assert gather(cache, 0, b)[0].ravel().tolist() == [0, 1, 2, 3, 4, 5, 9]


# --- continuous batching in float64: logits, and sampling with per-request seeds ---------


def test_packed_step_logits_equal_each_sequence_alone_in_float64():
    model = _model(GPT_PATH, "float64")
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, 103, n) for n in (9, 30, 4)]
    cache = _cache_for(model, num_blocks=16, block_size=8)
    sids = [cache.new_sequence() for _ in seqs]
    # step 1: prefill of 0 and 1; step 2: 0 decodes, 1 prefills more, 2 arrives; then decode
    plan = [[(0, 0, 8), (1, 0, 20)], [(0, 8, 9), (1, 20, 30), (2, 0, 3)], [(1, 30, 30), (2, 3, 4)]]
    got = {i: [] for i in range(3)}
    for step in plan:
        chunks = [(sids[i], seqs[i][a:b]) for i, a, b in step if b > a]
        logits = paged_forward(model, cache, chunks)
        starts = np.cumsum([0] + [len(c) for _, c in chunks])
        for (i, a, b), start in zip([s for s in step if s[2] > s[1]], starts):
            got[i].append(logits[start:start + b - a])
    for i, ids in enumerate(seqs):
        alone = model.forward_cached(ids[None], model.new_cache())[0]
        assert np.max(np.abs(np.concatenate(got[i]) - alone)) < 1e-12


def test_engine_samples_with_each_requests_own_seed():
    model = _model(GPT_PATH, "float64")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 103, n).tolist() for n in (3, 11, 6, 20)]
    news, seeds = [15, 9, 20, 6], [10, 11, 12, 13]
    engine = Engine(model, block_size=4, max_batch=3)
    got = engine.generate(prompts, news, temperature=0.9, top_k=20, seed=seeds)
    for p, n, s, tokens in zip(prompts, news, seeds, got):
        alone = generate(model, np.array([p]), n, temperature=0.9, top_k=20, seed=s)
        assert tokens == alone[0, len(p):].tolist()


def test_cancel_frees_the_blocks_and_leaves_the_others_alone():
    model = _model(GPT_PATH)
    engine = Engine(model, block_size=4, num_blocks=12, max_batch=2)
    a, b, c = (engine.submit([1, 2, 3, 4, 5], 10) for _ in range(3))
    engine.step()
    assert len(engine.running) == 2 and len(engine.waiting) == 1  # c waits for a slot
    engine.cancel(a)
    engine.cancel(a)  # a second cancel is a no-op
    events = engine.step()
    assert events[0].rid == a and events[0].reason == "cancelled" and events[0].token == -1
    out = {b: [], c: []}
    while events:
        for e in events:
            out.get(e.rid, []).append(e.token)
        events = engine.step() if engine.busy else []
    alone = generate(model, np.array([[1, 2, 3, 4, 5]]), 10, temperature=0)[0, 5:].tolist()
    assert out[b] == alone[1:] and out[c] == alone
    assert len(engine.cache.allocator.free) == 12


def test_stop_tokens_end_a_request_with_reason_stop():
    model = _model(GPT_PATH)
    alone = generate(model, np.array([[5, 6, 7]]), 12, temperature=0)[0, 3:].tolist()
    engine = Engine(model)
    rid = engine.submit([5, 6, 7], 12, stop=[alone[4]])
    events = [e for _ in range(12) for e in engine.step()]
    assert [e.token for e in events] == alone[:alone.index(alone[4]) + 1]
    assert events[-1].finished and events[-1].reason == "stop" and not engine.busy
    assert rid == 0


# --- attention sinks: the rolling buffer is band-masked attention ------------------------


@pytest.mark.parametrize("path", [GPT_PATH, LLAMA_PATH])
@pytest.mark.parametrize("sinks, window", [(0, 8), (2, 8), (4, 5), (1, 64)])
def test_rolling_window_equals_band_masked_attention(path, sinks, window):
    model = _model(path, "float64")
    attn = model.h[0].attn
    ids = np.random.default_rng(4).integers(0, 100, 64)
    cache = SinkCache(len(model.h), sinks, window, getattr(attn, "n_kv_head", attn.n_head),
                      attn.d_head, "float64")
    streamed = np.stack([stream_forward(model, cache, int(t), positions="absolute")
                         for t in ids])
    masked = forward_masked(model, ids, band_mask(64, sinks, window))
    assert np.max(np.abs(streamed - masked)) < 1e-12


def test_without_sinks_cache_positions_equal_stream_positions_under_rope():
    model = _model(LLAMA_PATH, "float64")
    attn = model.h[0].attn
    ids = np.random.default_rng(5).integers(0, 100, 40)
    runs = []
    for positions in ("cache", "absolute"):
        cache = SinkCache(2, 0, 10, attn.n_kv_head, attn.d_head, "float64")
        runs.append(np.stack([stream_forward(model, cache, int(t), positions=positions)
                              for t in ids]))
    assert np.max(np.abs(runs[0] - runs[1])) < 1e-12  # RoPE sees only differences


def test_band_mask_is_the_causal_mask_when_the_window_covers_everything():
    assert np.array_equal(band_mask(9, 0, 9), np.tril(np.ones((9, 9), bool)))
    m = band_mask(6, 1, 2)
    assert m[5].tolist() == [True, False, False, False, True, True]


# --- bad inputs -------------------------------------------------------------------------


def test_bad_inputs_are_refused_with_the_argument_named():
    alloc = BlockAllocator(2)
    b = alloc.allocate()
    alloc.release(b)
    with pytest.raises(ValueError, match="block: .*which is free"):
        alloc.release(b)  # a double free
    alloc.allocate(), alloc.allocate()
    with pytest.raises(OutOfBlocks, match="num_blocks"):
        alloc.allocate()
    cache = PagedKVCache(1, 2, 4, 1, 1)
    with pytest.raises(ValueError, match="sid"):
        cache.fork(7)
    sid = cache.new_sequence()
    with pytest.raises(OutOfBlocks):
        extend(cache, sid, 9)
    assert cache.tables[sid] == [] and cache.lengths[sid] == 0
    engine = Engine(_model(GPT_PATH), num_blocks=2)
    for kwargs, name in [(dict(prompt=[], max_new_tokens=3), "prompt"),
                         (dict(prompt=[1, 200], max_new_tokens=3), "prompt"),
                         (dict(prompt="abc", max_new_tokens=3), "prompt"),
                         (dict(prompt=[1] * 60, max_new_tokens=5), "max_new_tokens"),
                         (dict(prompt=[1], max_new_tokens=0), "max_new_tokens"),
                         (dict(prompt=[1] * 30, max_new_tokens=20), "max_new_tokens"),
                         (dict(prompt=[1], max_new_tokens=2, temperature=-1), "temperature"),
                         (dict(prompt=[1], max_new_tokens=2, top_k=0), "top_k"),
                         (dict(prompt=[1], max_new_tokens=2, stop=[103]), "stop")]:
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            engine.submit(**kwargs)
    with pytest.raises(ValueError, match="rid"):
        engine.cancel(0)
    with pytest.raises(ValueError, match="positions"):
        stream_forward(_model(GPT_PATH), SinkCache(4, 1, 4, 4, 32), 3)
    with pytest.raises(ValueError, match="model"):
        Engine(object())
