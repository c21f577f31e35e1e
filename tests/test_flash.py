"""Tiled (flash) attention: equal to the standard path, small cache, skipped tiles, errors.

The specification is the attention chapter's scaled_dot_product_attention and
attention_backward, with the mask built from its definition: query i (at position
i + Tk - Tq) sees key j when j <= i + Tk - Tq (causal) and j > i + Tk - Tq - w (window w).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npformer as npf
from npformer.attention import MultiHeadAttention, attention_backward, scaled_dot_product_attention
from npformer.flash import FlashCache, key_tiles
from npformer.gradcheck import gradcheck
from npformer.losses import next_token_loss

EXACT = 1e-12  # float64: the two paths add the same terms in another order


def reference_mask(Tq, Tk, causal, window):
    if not causal:
        return None
    i, j = np.arange(Tq)[:, None] + Tk - Tq, np.arange(Tk)
    mask = j <= i
    if window is not None:
        mask &= j > i - window
    return mask


def both_paths(lead, Tq, Tk, d_h, d_v, causal, window, b, seed=0):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((*lead, Tq, d_h)), rng.standard_normal((*lead, Tk, d_h))
    v, dout = rng.standard_normal((*lead, Tk, d_v)), rng.standard_normal((*lead, Tq, d_v))
    out, cache = scaled_dot_product_attention(q, k, v, reference_mask(Tq, Tk, causal, window))
    want = (out, *attention_backward(dout, cache))
    out_f, cache_f = npf.flash_attention(q, k, v, causal=causal, window=window, block_size=b)
    got = (out_f, *npf.flash_attention_backward(dout, cache_f))
    return want, got


def largest_difference(*args, **kwargs) -> float:
    want, got = both_paths(*args, **kwargs)
    return max(float(np.abs(w - g).max()) for w, g in zip(want, got))


@pytest.mark.parametrize("b", [1, 3, 8, 16, 64])
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, 1), (True, 5),
                                            (True, 12), (True, 100)])
def test_equals_standard_path_self_attention(causal, window, b):
    assert largest_difference((2, 3), 29, 29, 8, 6, causal, window, b) < EXACT


@pytest.mark.parametrize("Tq, Tk", [(7, 19), (19, 7), (1, 13), (13, 1), (16, 32)])
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, 4)])
@pytest.mark.parametrize("b", [2, 5, 16])
def test_equals_standard_path_cross_attention(Tq, Tk, causal, window, b):
    assert largest_difference((3,), Tq, Tk, 4, 5, causal, window, b) < EXACT


def test_no_leading_axes_and_many_leading_axes():
    assert largest_difference((), 10, 10, 3, 2, True, None, 4) < EXACT
    assert largest_difference((2, 1, 3), 10, 12, 3, 2, True, 3, 4) < EXACT


@settings(max_examples=60, deadline=None)
@given(lead=st.lists(st.integers(1, 3), max_size=2).map(tuple), Tq=st.integers(1, 40),
       Tk=st.integers(1, 40), d_h=st.integers(1, 6), d_v=st.integers(1, 6),
       causal=st.booleans(), window=st.none() | st.integers(1, 45), b=st.integers(1, 20),
       seed=st.integers(0, 2**16))
def test_equals_standard_path_any_shape(lead, Tq, Tk, d_h, d_v, causal, window, b, seed):
    window = window if causal else None
    assert largest_difference(lead, Tq, Tk, d_h, d_v, causal, window, b, seed=seed) < EXACT


def test_rows_without_keys_get_zero_output_and_gradients():
    """Causal with Tq > Tk: the first Tq - Tk queries see no key at all."""
    want, got = both_paths((2,), 9, 4, 3, 3, True, None, 4)
    out, dq = got[0], got[1]
    assert np.array_equal(out[:, :5], np.zeros_like(out[:, :5]))
    assert np.array_equal(dq[:, :5], np.zeros_like(dq[:, :5]))
    assert max(float(np.abs(w - g).max()) for w, g in zip(want, got)) < EXACT


def test_backward_by_finite_differences():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 11, 4)) for _ in range(3))
    dout = rng.standard_normal((2, 11, 4))

    def loss(q, k, v):
        out, cache = npf.flash_attention(q, k, v, causal=True, window=4, block_size=3)
        return float(np.sum(out * dout)), npf.flash_attention_backward(dout, cache)

    errs = gradcheck(loss, [q, k, v], names=["q", "k", "v"])
    assert max(errs.values()) < 1e-7, errs


@pytest.mark.parametrize("Tq, Tk, causal, window", [(37, 37, False, None), (37, 37, True, None),
                                                     (37, 37, True, 9), (10, 30, True, None),
                                                     (30, 10, True, 5), (30, 10, False, None)])
@pytest.mark.parametrize("b", [1, 4, 7, 64])
def test_key_tiles_visits_exactly_the_tiles_with_an_allowed_pair(Tq, Tk, causal, window, b):
    allowed = reference_mask(Tq, Tk, causal, window)
    allowed = np.ones((Tq, Tk), dtype=bool) if allowed is None else allowed
    for i0 in range(0, Tq, b):
        i1 = min(i0 + b, Tq)
        visited = {j0: (j1, masked) for j0, j1, masked in
                   key_tiles(i0, i1, Tq, Tk, causal, window, b)}
        for j0 in range(0, Tk, b):
            tile = allowed[i0:i1, j0:j0 + b]
            assert (j0 in visited) == bool(tile.any()), (i0, j0)  # skipped iff empty
            if j0 in visited:
                j1, masked = visited[j0]
                assert j1 == min(j0 + b, Tk)
                if masked is None:
                    assert tile.all()  # a tile without a mask is wholly allowed
                else:
                    assert np.array_equal(~masked, tile)


def test_window_tiles_grow_linearly_causal_tiles_quadratically():
    def count(T, window, b=16):
        return sum(1 for i0 in range(0, T, b)
                   for _ in key_tiles(i0, min(i0 + b, T), T, T, True, window, b))

    linear = [count(T, 64) for T in (1024, 2048, 4096)]  # a T + c: equal steps per doubling
    assert linear[2] - linear[1] == 2 * (linear[1] - linear[0])
    assert linear[1] <= (2048 // 16) * (-(-63 // 16) + 1)  # at most ceil((w-1)/b) + 1 per row
    assert count(2048, None) == (128 * 129) // 2


def test_cache_holds_no_square_array():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 300, 8)) for _ in range(3))
    out, cache = npf.flash_attention(q, k, v, causal=True)
    arrays = [x for x in cache if isinstance(x, np.ndarray)]
    assert all(x.size <= 2 * 3 * 300 * 8 for x in arrays)
    extra = sum(x.nbytes for x in arrays) - q.nbytes - k.nbytes - v.nbytes
    assert extra == 2 * 3 * 300 * (8 + 1) * 8  # out and lse: Tq (d_v + 1) per head


def test_float32_in_float32_out_and_close_to_float64():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 50, 16)) for _ in range(3))
    dout = rng.standard_normal((2, 50, 16))
    out64, cache64 = npf.flash_attention(q, k, v, causal=True, block_size=8)
    f32 = [x.astype(np.float32) for x in (q, k, v)]
    out32, cache32 = npf.flash_attention(*f32, causal=True, block_size=8)
    grads32 = npf.flash_attention_backward(dout.astype(np.float32), cache32)
    assert out32.dtype == np.float32 and cache32.lse.dtype == np.float32
    assert all(g.dtype == np.float32 for g in grads32)
    grads64 = npf.flash_attention_backward(dout, cache64)
    assert np.abs(out32 - out64).max() < 1e-5
    assert max(float(np.abs(a - b).max()) for a, b in zip(grads32, grads64)) < 1e-4


def test_window_at_least_T_is_the_causal_mask():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((20, 4)) for _ in range(3))
    a, _ = npf.flash_attention(q, k, v, causal=True, window=20, block_size=6)
    c, _ = npf.flash_attention(q, k, v, causal=True, block_size=6)
    assert np.array_equal(a, c)


def test_online_softmax_proved_for_two_blocks():
    from npformer.proofs.flash import prove_online_softmax

    assert prove_online_softmax(2, 3, d_v=2)


# Bad input: the error names the argument, what was expected and what came.

_rng = np.random.default_rng(9)
Q, K, V = (_rng.standard_normal((2, 8, 4)) for _ in range(3))


@pytest.mark.parametrize("kwargs, words", [
    (dict(block_size=0), "block_size: expected a positive integer, got 0"),
    (dict(block_size=2.0), "block_size: expected a positive integer, got 2.0"),
    (dict(causal=True, window=0), "window: expected None or a positive integer, got 0"),
    (dict(window=4), "window: expected None when causal=False"),
    (dict(causal="yes"), "causal: expected True or False, got 'yes'"),
])
def test_bad_arguments_are_named(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        npf.flash_attention(Q, K, V, **kwargs)


@pytest.mark.parametrize("q, k, v, words", [
    (Q, K[..., :3], V, "k: expected shape"),
    (Q, K, V[:, :6], "v: expected shape"),
    (Q[:1], K, V, "k: expected shape"),
    (Q, K.astype(np.float32), V, "k.dtype: expected float64 (that of q), got float32"),
    (Q.astype(np.int64), K, V, "q.dtype"),
    (Q[0, 0], K, V, "q: expected a non-empty array of shape"),
    (Q.tolist(), K, V, "q: expected a numpy array, got list"),
])
def test_mismatched_inputs_are_named(q, k, v, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        npf.flash_attention(q, k, v)


def test_a_cache_from_another_call_is_refused():
    out, cache = npf.flash_attention(Q, K, V)
    _, other = npf.flash_attention(Q[:, :5], K, V)
    with pytest.raises(ValueError, match="dout: expected shape"):
        npf.flash_attention_backward(out, other)
    with pytest.raises(ValueError, match="dout.dtype: expected float64"):
        npf.flash_attention_backward(out.astype(np.float32), cache)
    mixed = FlashCache(*((cache.q[:, :3],) + tuple(cache[1:])))
    with pytest.raises(ValueError, match="cache: expected arrays of one flash_attention call"):
        npf.flash_attention_backward(out, mixed)
    with pytest.raises(ValueError, match="cache: expected the FlashCache"):
        npf.flash_attention_backward(out, tuple(cache))


# Used: multi-head attention and a GPT on the tiled kernel.

def test_multi_head_attention_flag_gives_the_same_gradients():
    rng = np.random.default_rng(4)
    x, g = rng.standard_normal((2, 150, 16)), rng.standard_normal((2, 150, 16))
    layers = {kernel: MultiHeadAttention(16, 4, causal=True, seed=1, dtype="float64",
                                         kernel=kernel) for kernel in ("standard", "flash")}
    outs, grads = {}, {}
    for kernel, layer in layers.items():
        layer.zero_grad()
        outs[kernel] = layer(x)
        dx = layer.backward(g)
        grads[kernel] = [dx] + [grad.copy() for _, _, grad in layer.named_parameters()]
    assert np.abs(outs["standard"] - outs["flash"]).max() < EXACT
    for a, b in zip(grads["standard"], grads["flash"]):
        assert np.abs(a - b).max() < 1e-11


def test_multi_head_attention_flag_is_checked():
    with pytest.raises(ValueError, match="kernel: expected one of"):
        MultiHeadAttention(8, 2, kernel="fast")
    layer = MultiHeadAttention(8, 2, kernel="flash", dtype="float64")
    with pytest.raises(ValueError, match="attention_mask: expected None with kernel='flash'"):
        layer(np.zeros((1, 3, 8)), np.ones((1, 3)))


def test_default_kernel_is_standard():
    assert MultiHeadAttention(8, 2).kernel == "standard"
    cfg = npf.GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, d_model=8)
    assert cfg.attention_kernel == "standard"
    assert all(block.attn.kernel == "standard" for block in npf.GPT(cfg, seed=0).h)


def test_gpt_trained_with_the_flag_matches_the_standard_losses():
    rng = np.random.default_rng(5)
    starts = rng.integers(0, 23, (6, 3, 1))  # counting sequences mod 23: learnable
    batches = (starts + np.arange(97)) % 23  # (6, 3, 97): T = 96 > the block size 64

    def losses(kernel):
        cfg = npf.GPTConfig(vocab_size=23, block_size=96, n_layer=2, n_head=2, d_model=16,
                            dtype="float64", attention_kernel=kernel)
        model = npf.GPT(cfg, seed=0)
        opt = npf.AdamW(model.named_parameters(), lr=1e-2)
        out = []
        for ids in batches:
            model.zero_grad()
            loss, dlogits = next_token_loss(model.forward(ids[:, :-1]), ids[:, 1:])
            model.backward(dlogits)
            opt.step()
            out.append(float(loss))
        return np.array(out)

    standard, flash = losses("standard"), losses("flash")
    assert standard[-1] < standard[0]  # it learns
    np.testing.assert_allclose(flash, standard, rtol=1e-10, atol=0)


def test_gpt_config_rejects_an_unknown_kernel():
    with pytest.raises(ValueError, match="attention_kernel: expected one of"):
        npf.GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, d_model=8,
                      attention_kernel="sparse")


def test_shared_key_value_heads_broadcast_and_sum_their_gradients():
    """Grouped-query layout: q (B, h_kv, g, T, d), k and v (B, h_kv, 1, T, d)."""
    rng = np.random.default_rng(6)
    q, dout = rng.standard_normal((2, 3, 4, 21, 5)), rng.standard_normal((2, 3, 4, 21, 5))
    k, v = rng.standard_normal((2, 3, 1, 21, 5)), rng.standard_normal((2, 3, 1, 21, 5))
    kr, vr = np.repeat(k, 4, axis=2), np.repeat(v, 4, axis=2)  # each K/V head repeated g times
    out, cache = scaled_dot_product_attention(q, kr, vr, reference_mask(21, 21, True, 6))
    dq, dkr, dvr = attention_backward(dout, cache)
    out_f, cache_f = npf.flash_attention(q, k, v, causal=True, window=6, block_size=4)
    dq_f, dk_f, dv_f = npf.flash_attention_backward(dout, cache_f)
    assert dk_f.shape == k.shape and dv_f.shape == v.shape
    assert np.abs(out_f - out).max() < EXACT and np.abs(dq_f - dq).max() < EXACT
    assert np.abs(dk_f - dkr.sum(axis=2, keepdims=True)).max() < EXACT
    assert np.abs(dv_f - dvr.sum(axis=2, keepdims=True)).max() < EXACT
    k1, v1 = k[0, 0, 0], v[0, 0, 0]  # (21, 5): no leading axes, shared by every head
    out1, cache1 = npf.flash_attention(q, k1, v1, causal=True, block_size=8)
    dk1 = npf.flash_attention_backward(dout, cache1)[1]
    ref, ref_cache = scaled_dot_product_attention(q, np.broadcast_to(k1, q.shape),
                                                  np.broadcast_to(v1, q.shape),
                                                  reference_mask(21, 21, True, None))
    assert dk1.shape == k1.shape and np.abs(out1 - ref).max() < EXACT
    assert np.abs(dk1 - attention_backward(dout, ref_cache)[1].sum(axis=(0, 1, 2))).max() < 1e-11


def test_grouped_query_attention_flag_gives_the_same_gradients():
    from npformer.embedding import RoPE
    from npformer.models.llama import GroupedQueryAttention

    rng = np.random.default_rng(7)
    x, g = rng.standard_normal((2, 90, 16)), rng.standard_normal((2, 90, 16))
    grads = {}
    for kernel in ("standard", "flash"):
        layer = GroupedQueryAttention(16, 4, 2, rope=RoPE(4, 128, dtype="float64"), seed=1,
                                      dtype="float64", kernel=kernel)
        layer.zero_grad()
        grads[kernel] = [layer(x), layer.backward(g)] + [
            grad.copy() for _, _, grad in layer.named_parameters()]
    for a, b in zip(grads["standard"], grads["flash"]):
        assert np.abs(a - b).max() < 1e-11


def test_llama_trained_with_the_flag_matches_the_standard_losses():
    rng = np.random.default_rng(8)
    starts = rng.integers(0, 19, (5, 2, 1))
    batches = (starts + np.arange(81)) % 19  # (5, 2, 81): T = 80 > the block size 64

    def losses(kernel):
        cfg = npf.LlamaConfig(vocab_size=19, block_size=80, n_layer=2, n_head=4, n_kv_head=2,
                              d_model=16, dtype="float64", attention_kernel=kernel)
        model = npf.Llama(cfg, seed=0)
        opt = npf.AdamW(model.named_parameters(), lr=1e-2)
        out = []
        for ids in batches:
            model.zero_grad()
            loss, dlogits = next_token_loss(model.forward(ids[:, :-1]), ids[:, 1:])
            model.backward(dlogits)
            opt.step()
            out.append(float(loss))
        return np.array(out)

    standard, flash = losses("standard"), losses("flash")
    assert standard[-1] < standard[0]
    np.testing.assert_allclose(flash, standard, rtol=1e-10, atol=0)


# The benchmark: a smoke run of the script, and the committed results the chapter reads.

ROOT = Path(__file__).resolve().parents[1]


def test_bench_quick_run_writes_every_part(tmp_path):
    out = tmp_path / "flash.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "flash.py"), "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert {"memory", "time", "block", "window", "machine"} <= set(res)
    assert all(s > f > 0 for s, f in zip(res["memory"]["standard_MiB"],
                                         res["memory"]["flash_MiB"]))


def test_committed_results_cover_the_lengths_the_chapter_reports():
    res = json.loads((ROOT / "book" / "data" / "flash.json").read_text())
    assert res["memory"]["T"] == [512, 1024, 2048, 4096, 8192]
    assert 1024 in res["time"]["T"] and 4096 in res["time"]["T"]
    assert res["time"]["threads"] == 2 and res["machine"]["cpu"]
    for part in ("block", "window"):
        assert part in res
