"""The evaluation API (book/evaluation.md): intervals against their defining equations,
pass@k against exhaustive enumeration, McNemar exactly, the bootstrap by its seed,
completions with and without the KV cache, exact match on a stub model, the task's
train/test disjointness, and the committed run book/data/addition_eval.json."""

from __future__ import annotations

import json
import math
import sys
from fractions import Fraction
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import beta, binom

import npformer as npf
from npformer.evaluate import (
    Addition,
    Problem,
    bootstrap_interval,
    choice_logprob,
    clopper_pearson,
    complete,
    exact_match,
    mcnemar,
    multiple_choice,
    paired_difference,
    pass_at_k,
    token_nats,
    wilson,
)

Z = 1.959963984540054
DATA = Path(__file__).resolve().parents[1] / "book" / "data"


def tiny_gpt(seed=0, dtype="float64"):
    cfg = npf.GPTConfig(vocab_size=13, block_size=16, n_layer=2, n_head=2, d_model=16,
                        dtype=dtype)
    return npf.GPT(cfg, seed=seed)


TOK = npf.CharTokenizer(Addition.alphabet)


# --- intervals ---------------------------------------------------------------------------

@pytest.mark.parametrize("k,n", [(0, 1), (0, 50), (3, 20), (50, 50), (612, 1000), (1, 7)])
def test_wilson_ends_are_the_roots_of_the_score_test_quadratic(k, n):
    q_hat = k / n
    a, b, c = 1 + Z**2 / n, -(2 * q_hat + Z**2 / n), q_hat**2
    disc = math.sqrt(b * b - 4 * a * c)
    roots = ((-b - disc) / (2 * a), (-b + disc) / (2 * a))
    assert np.allclose(wilson(k, n), roots, rtol=0, atol=1e-12)


def test_wilson_known_values_and_the_zero_count_end():
    assert str(npf.accuracy(np.arange(1000) < 612)) == "61.2% [58.1, 64.2] (612/1000)"
    lo, hi = wilson(0, 50)
    assert lo == 0.0 and abs(hi - Z**2 / (50 + Z**2)) < 1e-15


@pytest.mark.parametrize("k,n", [(0, 10), (1, 10), (7, 10), (10, 10), (113, 1000), (2, 3000)])
def test_clopper_pearson_solves_the_binomial_tail_equations(k, n):
    lo, hi = clopper_pearson(k, n)
    if k:
        assert abs(binom.sf(k - 1, n, lo) - 0.025) < 1e-10  # P(X >= k | lo)
        assert abs(lo - beta.ppf(0.025, k, n - k + 1)) < 1e-10
    else:
        assert lo == 0.0
    if k < n:
        assert abs(binom.cdf(k, n, hi) - 0.025) < 1e-10  # P(X <= k | hi)
        assert abs(hi - beta.ppf(0.975, k + 1, n - k)) < 1e-10
    else:
        assert hi == 1.0


def test_clopper_pearson_covers_at_least_95_percent_exactly():
    n = 30
    ends = np.array([clopper_pearson(j, n) for j in range(n + 1)])
    for q in np.linspace(0.01, 0.99, 37):
        holds = (ends[:, 0] <= q) & (q <= ends[:, 1])
        assert binom.pmf(np.arange(n + 1), n, q)[holds].sum() >= 0.95 - 1e-12


# --- pass@k ------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 4, 7])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            subsets = list(combinations(range(n), k))  # samples 0..c-1 are correct
            share = Fraction(sum(min(s) < c for s in subsets), len(subsets))
            assert abs(pass_at_k(n, c, k) - float(share)) < 1e-14


def test_pass_at_k_is_unbiased_exactly_and_the_naive_estimate_is_not():
    n, q = 8, Fraction(1, 3)
    for k in range(1, n + 1):
        weights = [math.comb(n, c) * q**c * (1 - q) ** (n - c) for c in range(n + 1)]
        unbiased = sum(w * (1 - Fraction(math.comb(n - c, k), math.comb(n, k)))
                       for c, w in enumerate(weights))
        naive = sum(w * (1 - (1 - Fraction(c, n)) ** k) for c, w in enumerate(weights))
        assert unbiased == 1 - (1 - q) ** k
        assert (naive == unbiased) == (k == 1)
        assert abs(sum(float(w) * pass_at_k(n, c, k) for c, w in enumerate(weights))
                   - float(unbiased)) < 1e-14


def test_pass_at_1_is_the_sample_accuracy_and_arrays_match_scalars():
    counts = np.arange(21)
    assert np.allclose(pass_at_k(20, counts, 1), counts / 20, rtol=0, atol=1e-15)
    for k in (1, 5, 20):
        assert np.array_equal(pass_at_k(20, counts, k),
                              [pass_at_k(20, int(c), k) for c in counts])


# --- comparisons -------------------------------------------------------------------------

@pytest.mark.parametrize("a_only,b_only", [(0, 0), (10, 2), (2, 10), (7, 7), (30, 61)])
def test_mcnemar_is_the_exact_two_sided_binomial_test(a_only, b_only):
    m = a_only + b_only
    tail = sum(Fraction(math.comb(m, j), 2**m) for j in range(min(a_only, b_only) + 1))
    assert mcnemar(a_only, b_only) == float(min(Fraction(1), 2 * tail))
    if m:
        assert abs(mcnemar(a_only, b_only)
                   - min(1.0, 2 * binom.cdf(min(a_only, b_only), m, 0.5))) < 1e-12


def test_paired_bootstrap_is_reproducible_with_its_seed():
    rng = np.random.default_rng(0)
    a = rng.random(500) < 0.6
    b = np.where(rng.random(500) < 0.8, a, ~a)
    r1, r2 = paired_difference(a, b, seed=3), paired_difference(a, b, seed=3)
    assert r1 == r2 and paired_difference(a, b, seed=4) != r1
    assert r1.diff == (a.astype(int) - b).mean()
    assert r1.a_only == (a & ~b).sum() and r1.b_only == (~a & b).sum()
    assert r1.lo <= r1.diff <= r1.hi


def test_bootstrap_interval_columns_share_one_resampling():
    x = np.random.default_rng(1).random((300, 3))
    lo, hi = bootstrap_interval(x, seed=5, n_boot=2500)
    for j in range(3):
        assert np.allclose((lo[j], hi[j]), bootstrap_interval(x[:, j], seed=5, n_boot=2500),
                           rtol=0, atol=1e-15)


# --- completions -------------------------------------------------------------------------

def test_complete_with_kv_cache_equals_without_on_greedy():
    model = tiny_gpt(seed=2)
    prompts = ["12+5=", "3+4=", "999+999=", "7+60=", "1+1="]
    cached = complete(model, TOK, prompts, max_new_tokens=6, stop=None)
    plain = complete(model, TOK, prompts, max_new_tokens=6, stop=None, use_cache=False)
    assert cached == plain and all(len(c) == 6 for c in cached)


def test_complete_is_prompt_major_and_cuts_after_the_stop():
    model = tiny_gpt(seed=3)
    prompts = ["10+2=", "40+4="]  # one length: one batch, so one stream of draws
    out = complete(model, TOK, prompts, max_new_tokens=8, temperature=1.0, n=3, seed=0)
    assert len(out) == 6 and out == complete(model, TOK, prompts, max_new_tokens=8,
                                              temperature=1.0, n=3, seed=0)
    full = complete(model, TOK, prompts, max_new_tokens=8, temperature=1.0, n=3, seed=0,
                    stop=None)
    for cut, whole in zip(out, full):
        assert "\n" not in cut[:-1] and whole.startswith(cut)
        assert cut == whole[:whole.index("\n") + 1] if "\n" in whole else cut == whole


class Oracle:
    """A stub model whose next token continues the right sum of its prompt (or a wrong one)."""

    class config:
        block_size, vocab_size = 16, 13

    def __init__(self, offset=0):
        self.offset, self.training, self.device = offset, False, "cpu"

    def eval(self):
        return self

    def train(self, mode=True):
        return self

    def new_cache(self):
        return None

    def forward(self, ids):
        logits = np.zeros((ids.shape[0], ids.shape[1], 13))
        for b, row in enumerate(ids):
            text = TOK.decode(row.tolist()).split("\n")[-1]
            prompt, done = text.split("=")
            a, c = prompt.split("+")
            target = str(int(a) + int(c) + self.offset) + "\n"
            logits[b, -1, TOK.encode(target[len(done)])[0]] = 10.0
        return logits


def test_exact_match_grades_a_stub_model():
    task = Addition()
    items = task.test_set()[:25]
    right, got = exact_match(Oracle(), TOK, items, task.grade, use_cache=False)
    assert right.all() and got == [p.answer + "\n" for p in items]
    wrong, _ = exact_match(Oracle(offset=1), TOK, items, task.grade, use_cache=False)
    assert not wrong.any()
    assert task.grade(Problem("1+2", "3"), "3") and not task.grade(Problem("1+2", "3"), "33\n")


def test_bits_per_char_is_the_cross_entropy_in_bits():
    model = tiny_gpt(seed=4)
    ids = np.random.default_rng(0).integers(0, 13, size=(3, 9))
    loss, _ = npf.cross_entropy(model.forward(ids[:, :-1]), ids[:, 1:])
    assert abs(npf.bits_per_char(model, ids) * math.log(2) - loss) < 1e-12
    assert abs(npf.perplexity(model, ids) - math.exp(loss)) < 1e-10
    mask = np.zeros((3, 8), bool)
    mask[1, 2] = True
    assert abs(npf.bits_per_char(model, ids, mask) * math.log(2)
               - token_nats(model, ids)[1, 2]) < 1e-12


def test_choice_logprob_sums_the_options_tokens_and_normalise_divides_by_length():
    model = tiny_gpt(seed=5)
    prompts, options = ["12+3=", "7+8="], [["15\n", "1\n", "150\n"], ["15\n", "16\n", "1\n"]]
    logp, length = choice_logprob(model, TOK, prompts, options)
    for i, p in enumerate(prompts):
        for j, o in enumerate(options[i]):
            ids = np.array([TOK.encode(p + o)])
            assert abs(logp[i, j] + token_nats(model, ids)[0, len(p) - 1:].sum()) < 1e-12
            assert length[i, j] == len(o)
    assert np.array_equal(multiple_choice(model, TOK, prompts, options), logp.argmax(1))
    assert np.array_equal(multiple_choice(model, TOK, prompts, options, normalise=True),
                          (logp / length).argmax(1))
    assert multiple_choice(model, TOK, prompts[1], options[1], True) == \
        (logp / length).argmax(1)[1]


# --- bad inputs --------------------------------------------------------------------------

@pytest.mark.parametrize("call,name", [
    (lambda: wilson(5, 3), "k"), (lambda: wilson(1, 0), "n"), (lambda: wilson(1, 2, z=0), "z"),
    (lambda: clopper_pearson(1, 2, alpha=0), "alpha"), (lambda: pass_at_k(5, 6, 1), "c"),
    (lambda: pass_at_k(5, 1, 6), "k"), (lambda: pass_at_k(0, 0, 1), "n"),
    (lambda: npf.accuracy([]), "correct"), (lambda: npf.accuracy([0, 2]), "correct"),
    (lambda: paired_difference([1, 0], [1, 0, 1]), "b"), (lambda: mcnemar(-1, 2), "a_only"),
    (lambda: paired_difference([1, 0], [0, 1], n_boot=0), "n_boot"),
    (lambda: bootstrap_interval([]), "values"),
    (lambda: complete(tiny_gpt(), TOK, ["1+1="], max_new_tokens=0), "max_new_tokens"),
    (lambda: complete(tiny_gpt(), TOK, ["1+1="], max_new_tokens=2, stop="12"), "stop"),
    (lambda: complete(tiny_gpt(), TOK, "1+1=", max_new_tokens=2), "prompts"),
    (lambda: complete(tiny_gpt(), TOK, ["1"], max_new_tokens=2, temperature=-1),
     "temperature"),
    (lambda: choice_logprob(tiny_gpt(), TOK, ["1="], [["1"], ["2"]]), "options"),
    (lambda: choice_logprob(tiny_gpt(), TOK, ["1="], [["1", ""]]), "options"),
    (lambda: multiple_choice(tiny_gpt(), TOK, ["1="], [["1"]], normalise=1), "normalise"),
])
def test_bad_input_raises_value_error_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}: expected"):
        call()


# --- the task and the committed run ------------------------------------------------------

def test_addition_never_trains_on_a_test_pair_or_its_reverse():
    task = Addition()
    test = set(task.test_pairs)
    assert len(test) == 1000
    items = task.sample(100_000, seed=7)
    pairs = [tuple(int(v) for v in p.prompt.split("+")) for p in items]
    assert not any((a, b) in test or (b, a) in test for a, b in pairs)
    assert all(int(p.answer) == a + b for p, (a, b) in zip(items, pairs))


@pytest.fixture(scope="module")
def committed():
    if not (DATA / "addition_eval.json").exists():
        pytest.skip("book/data/addition_eval.json is not there")
    sys.path.insert(0, str(DATA))
    import addition_eval

    return addition_eval, json.loads((DATA / "addition_eval.json").read_text()), \
        npf.load(DATA / "addition_base.safetensors")


def test_committed_run_regrades_and_redraws_its_first_items(committed):
    script, log, model = committed
    task = Addition()
    items = task.test_set()
    greedy, _ = exact_match(model, TOK, items[:100], task.grade)
    assert "".join("1" if g else "0" for g in greedy) == log["greedy"][:100]
    counts, first = script.sample_counts(model, TOK, task, items, chunk=0)
    assert counts.tolist() == log["correct_samples"][:100]
    assert "".join("1" if f else "0" for f in first) == log["first_sample"][:100]
    assert log["disjoint"]["overlap"] == 0


def test_committed_choice_scores_match_choice_logprob(committed):
    script, log, model = committed
    items = [p for p in Addition().test_set() if int(p.answer) >= 10][:20]
    for name, end in (("newline", "\n"), ("bare", "")):
        logp, _ = choice_logprob(model, TOK, [p.prompt + "=" for p in items],
                                 [script.candidates(p, end) for p in items])
        # float32 forward passes: BLAS kernels differ between CPUs, so within 1e-4 nats
        assert np.allclose(logp, log["choice_logp"][name][:20], rtol=0, atol=1e-4)


# --- on the strict CuPy stand-in ---------------------------------------------------------

def test_evaluation_on_the_strict_device_equals_the_host():
    from npformer.strict import register

    register()
    host, dev = tiny_gpt(seed=6), tiny_gpt(seed=6).to("strict")
    prompts = ["12+5=", "3+4=", "99+9="]
    for kw in (dict(), dict(temperature=1.0, n=2, seed=1)):
        assert complete(dev, TOK, prompts, max_new_tokens=5, **kw) == \
            complete(host, TOK, prompts, max_new_tokens=5, **kw)
    ids = np.random.default_rng(0).integers(0, 13, size=(2, 7))
    assert np.allclose(token_nats(dev, ids), token_nats(host, ids), rtol=1e-12, atol=0)
    options = [["17\n", "1\n"], ["7\n", "8\n"], ["108\n", "10\n"]]
    assert np.allclose(choice_logprob(dev, TOK, prompts, options)[0],
                       choice_logprob(host, TOK, prompts, options)[0], rtol=1e-12, atol=0)
