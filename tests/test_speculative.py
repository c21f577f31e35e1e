"""Speculative decoding: the output law is the target's, exactly; greedy is the target's
greedy text; the sampled algorithm's acceptance matches its exact expectation."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

import npformer as npf
from npformer.speculative import (
    NGramCache,
    NGramConfig,
    NGramDraft,
    acceptance_probability,
    expected_tokens_per_call,
    probabilities,
    residual,
    speculative_generate,
    truncate_cache,
    verify,
    verify_distribution,
)

DATA = Path(__file__).resolve().parents[1] / "book" / "data"


def table_model(seed, V=3, zero_share=0.0):
    """An arbitrary conditional distribution: a Dirichlet draw per context, with zeros."""
    memo = {}

    def dist(ctx):
        if ctx not in memo:
            rng = np.random.default_rng([seed, len(ctx), *ctx])
            d = rng.dirichlet(np.ones(V))
            d[rng.random(V) < zero_share] = 0.0
            d[rng.integers(V)] += d.sum() == 0
            memo[ctx] = d / d.sum()
        return memo[ctx]
    return dist


def speculative_law(target, draft, gamma, n_out, V):
    law, frontier = {}, {(): 1.0}
    while frontier:
        ctx = min(frontier, key=len)
        mass = frontier.pop(ctx)
        for drafted in itertools.product(range(V), repeat=gamma):
            rows = np.array([draft(ctx + drafted[:i]) for i in range(gamma)])
            p_drafts = np.prod(rows[np.arange(gamma), drafted])
            if p_drafts == 0:
                continue
            p = np.array([target(ctx + drafted[:i]) for i in range(gamma + 1)])
            for emitted, pe in verify_distribution(p, rows, drafted).items():
                out = ctx + emitted
                into = law if len(out) >= n_out else frontier
                into[out[:n_out]] = into.get(out[:n_out], 0.0) + mass * p_drafts * pe
    return law


def target_law(target, n_out, V):
    return {s: np.prod([target(s[:t])[s[t]] for t in range(n_out)])
            for s in itertools.product(range(V), repeat=n_out)}


@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("zeros", [(0.0, 0.0), (0.0, 0.4), (0.3, 0.4)])
def test_speculative_law_equals_target_law_to_1e12(gamma, zeros):
    V, n_out = 3, 4
    target, draft = table_model(10 + gamma, V, zeros[0]), table_model(20 + gamma, V, zeros[1])
    law, ref = speculative_law(target, draft, gamma, n_out, V), target_law(target, n_out, V)
    assert set(law) <= set(ref)
    assert max(abs(law.get(s, 0.0) - ref[s]) for s in ref) < 1e-12


def test_the_check_catches_a_naive_rule_that_resamples_from_the_target():
    """Keep a draft when p >= p_draft, else draw from p itself: its law is not p."""
    rng = np.random.default_rng(3)
    worst = 0.0
    for _ in range(20):
        p, q = rng.dirichlet(np.ones(3), size=2)
        keep = p >= q
        naive = q * keep + q[~keep].sum() * p
        worst = max(worst, np.abs(naive - p).max())
        exact = np.zeros(3)
        for v in range(3):
            for out, prob in verify_distribution(np.stack([p, p]), q[None], [v]).items():
                exact[out[0]] += q[v] * prob
        np.testing.assert_allclose(exact, p, rtol=0, atol=1e-15)
    assert worst > 0.05


def test_the_one_token_lemma_holds_for_any_pair_of_distributions():
    rng = np.random.default_rng(0)
    for _ in range(200):
        p, q = rng.dirichlet(np.ones(6), size=2)
        p[rng.random(6) < 0.3] = 0
        q[rng.random(6) < 0.3] = 0
        if p.sum() == 0 or q.sum() == 0:
            continue
        p, q = p / p.sum(), q / q.sum()
        beta = acceptance_probability(p, q)
        out = np.minimum(p, q) + (1 - beta) * residual(p, q)  # kept draft, or residual
        np.testing.assert_allclose(out, p, rtol=0, atol=1e-15)
        assert beta == pytest.approx(1 - 0.5 * np.abs(p - q).sum(), abs=1e-15)


def test_greedy_tables_give_the_target_greedy_sequence_with_probability_one():
    V, n_out = 3, 5
    t, d = table_model(1, V), table_model(2, V)
    target = lambda c: probabilities(np.log(t(c)), 0.0)  # noqa: E731
    draft = lambda c: probabilities(np.log(d(c)), 0.0)  # noqa: E731
    law = speculative_law(target, draft, 2, n_out, V)
    greedy = ()
    for _ in range(n_out):
        greedy += (int(np.argmax(t(greedy))),)
    assert law == {greedy: 1.0}


def test_sampled_verify_follows_verify_distribution():
    rng = np.random.default_rng(1)
    V, g, N = 4, 2, 15_000
    p, q = rng.dirichlet(np.ones(V), size=g + 1), rng.dirichlet(np.ones(V), size=g)
    drafted = np.array([1, 3])
    law = verify_distribution(p, q, drafted)
    assert sum(law.values()) == pytest.approx(1, abs=1e-15)
    counts: dict = {}
    for _ in range(N):
        out, n = verify(p, q, drafted, rng)
        assert len(out) == n + 1
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    assert set(counts) <= set(law)
    for key, prob in law.items():  # each frequency within 5 binomial standard deviations
        assert abs(counts.get(key, 0) / N - prob) <= 5 * np.sqrt(prob * (1 - prob) / N)


class ContextFree:
    """A 'model' whose next-token distribution is the same after every context."""

    def __init__(self, p, block_size=64):
        self.config = NGramConfig(len(p), block_size, 1)
        with np.errstate(divide="ignore"):
            self.logp = np.log(p)

    def new_cache(self):
        return [NGramCache(self.config.block_size)]  # only its length is used

    def forward_cached(self, ids, cache):
        cache[0].length += np.asarray(ids).shape[1]
        return np.broadcast_to(self.logp, (1, np.asarray(ids).shape[1], len(self.logp)))


def test_sampled_acceptance_matches_its_exact_expectation():
    """With context-free models every test succeeds independently with probability beta:
    kept drafts per full step have the cut-off geometric law; the mean is checked within
    5 standard deviations of that law, and each token's frequency against p."""
    rng = np.random.default_rng(2)
    p, q = rng.dirichlet(np.ones(5)), rng.dirichlet(np.ones(5))
    q[0] = 0.0  # the draft never proposes a token the target likes
    q /= q.sum()
    gamma, beta = 4, acceptance_probability(p, q)
    kept, tokens = [], []
    for seed in range(60):
        out, st = speculative_generate(ContextFree(p), ContextFree(q), [[0]], 63,
                                       gamma=gamma, seed=seed)
        kept += [n for n, g in zip(st.accepted, st.drafted) if g == gamma]
        tokens += out[0, 1:].tolist()
        assert sum(st.accepted) + len(st.accepted) == 63
        assert st.target_calls == len(st.accepted)  # a 1-token prompt needs no prefill
    law = np.array([beta**n * (1 - beta) for n in range(gamma)] + [beta**gamma])
    n = np.arange(gamma + 1)
    mean, var = (n * law).sum(), (n**2 * law).sum() - (n * law).sum() ** 2
    assert mean == pytest.approx(expected_tokens_per_call(beta, gamma) - 1, abs=1e-12)
    assert abs(np.mean(kept) - mean) <= 5 * np.sqrt(var / len(kept))
    freq = np.bincount(tokens, minlength=5) / len(tokens)
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / len(tokens)))


def test_expected_tokens_per_call_equals_the_direct_sum():
    a = np.linspace(0, 1, 201)
    for g in range(0, 10):
        direct = sum((n + 1) * a**n * (1 - a) for n in range(g)) + (g + 1) * a**g
        np.testing.assert_allclose(expected_tokens_per_call(a, g), direct, rtol=0,
                                   atol=1e-12)
    assert expected_tokens_per_call(1.0, 4) == 5.0


@pytest.fixture(scope="module")
def baby():
    from pydoc_data.topics import topics

    ckpt = npf.load_checkpoint(DATA / "gpt_baby.safetensors")
    tok = npf.CharTokenizer(ckpt.extra["chars"])
    data = np.array(tok.encode("\n".join(topics[k] for k in sorted(topics))))
    n = int(0.9 * len(data))
    return ckpt.model.eval(), tok, data[:n], data[n:]


def test_greedy_speculative_equals_plain_greedy_decoding_on_the_book_gpt(baby):
    target, tok, train_ids, val_ids = baby
    drafts = [NGramDraft(train_ids, tok.vocab_size, order=5),
              npf.load(DATA / "speculative_draft.safetensors").eval()]
    for s in (500, 23000, 41000):
        prompt = val_ids[None, s:s + 8]
        ref = npf.generate(target, prompt, 48, temperature=0)
        for draft, gamma in itertools.product(drafts, (1, 4, 8)):
            out, st = speculative_generate(target, draft, prompt, 48, gamma=gamma,
                                           temperature=0)
            np.testing.assert_array_equal(out, ref)
            assert st.target_calls == len(st.accepted) + 1 <= 48 + 1


def test_a_truncated_cache_gives_the_logits_of_one_that_never_saw_the_rejected(baby):
    target, tok, _, val_ids = baby
    seq = val_ids[None, 100:130]
    a, b = target.new_cache(), target.new_cache()
    target.forward_cached(seq[:, :20], a)
    target.forward_cached((seq[:, 20:26] + 5) % tok.vocab_size, a)
    truncate_cache(a, 20)
    target.forward_cached(seq[:, :20], b)
    np.testing.assert_array_equal(target.forward_cached(seq[:, 20:24], a),
                                  target.forward_cached(seq[:, 20:24], b))


def test_bad_inputs_raise_errors_that_name_the_argument(baby):
    target, tok, train_ids, _ = baby
    ngram = NGramDraft(train_ids[:1000], tok.vocab_size, order=3)
    small = NGramDraft(np.arange(10), 10, order=2)
    ok = np.zeros((1, 4), dtype=np.int64)
    cases = [
        (dict(gamma=0), "gamma"),
        (dict(gamma=2.5), "gamma"),
        (dict(temperature=-1.0), "temperature"),
        (dict(max_new_tokens=61), "max_new_tokens"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(draft=small), "draft"),
        (dict(draft="a string"), "draft"),
        (dict(ids=np.zeros((2, 4), dtype=np.int64)), "ids"),
        (dict(ids=np.zeros((1, 4))), "ids"),
        (dict(ids=np.full((1, 4), 103)), "ids"),
    ]
    for kw, name in cases:
        args = dict(draft=ngram, ids=ok, max_new_tokens=8) | kw
        with pytest.raises(ValueError, match=name):
            speculative_generate(target, args.pop("draft"), args.pop("ids"),
                                 args.pop("max_new_tokens"), **args)
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_call(1.5, 3)
    with pytest.raises(ValueError, match="length"):
        truncate_cache(target.new_cache(), 1)
    with pytest.raises(ValueError, match="ids"):
        NGramDraft(np.array([0, 1, 200]), 103)
    with pytest.raises(ValueError, match="order"):
        NGramDraft(np.arange(10), 10, order=0)


def test_a_llama_target_rolls_back_its_rotary_cache_too():
    """The Llama's cache positions its rotary embeddings by the cache length: greedy
    speculation with any draft still writes its greedy text."""
    llama = npf.load(DATA / "part4_llama_pydoc.safetensors").eval()
    V = llama.config.vocab_size
    draft = NGramDraft(np.arange(3000) % (V - 2), V, order=3)  # a poor draft: many rejections
    prompt = np.arange(5, 13)[None]
    ref = npf.generate(llama, prompt, 40, temperature=0)
    for gamma in (1, 3, 6):
        out, st = speculative_generate(llama, draft, prompt, 40, gamma=gamma, temperature=0)
        np.testing.assert_array_equal(out, ref)
        assert sum(n < g for n, g in zip(st.accepted, st.drafted)) > 0  # rollbacks happened
