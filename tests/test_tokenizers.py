"""Character, byte-level BPE and WordPiece tokenizers (book/tokenizers.md)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npformer.tokenizer import (
    _PRETOKENIZE,
    ByteBPE,
    CharTokenizer,
    WordPiece,
    _merge_word,
    _train_merges,
)

CORPUS = "\n".join(topics[k] for k in sorted(topics))
SMALL = CORPUS[:20_000]
UNICODE_SAMPLE = ("caf\u00e9 cafe\u0301 na\u00efve \u4e2d\u6587\u5b57\u7b26 \u65e5\u672c\u8a9e "
                  "\U0001f600\U0001f44d\U0001f3fd \u0645\u0631\u062d\u0628\u0627 ")


@pytest.fixture(scope="module")
def bpe() -> ByteBPE:
    """Merges that cut through multi-byte characters as well as English words."""
    return ByteBPE.train(SMALL + UNICODE_SAMPLE * 20, 600)


def naive_merges(text: str, n_merges: int) -> list[tuple[int, int]]:
    """Direct BPE: recount every pair after each merge; ties go to the smaller pair."""
    chunks = Counter(_PRETOKENIZE.findall(text))
    words, freqs = [list(c.encode("utf-8")) for c in chunks], list(chunks.values())
    merges = []
    while len(merges) < n_merges:
        counts = Counter()
        for word, f in zip(words, freqs):
            for p in zip(word, word[1:]):
                counts[p] += f
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        if counts[best] < 2:
            break
        merges.append(best)
        words = [_merge_word(w, *best, 255 + len(merges))[0] for w in words]
    return merges


def hand_vocab(*tokens: str) -> list[str]:
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *tokens]


# --------------------------------------------------------------------------- characters


def test_char_vocabulary_is_the_sorted_distinct_characters():
    tok = CharTokenizer("hello world")
    assert tok.chars == [" ", "d", "e", "h", "l", "o", "r", "w"]
    assert tok.vocab_size == 8
    assert tok.encode("hello") == [3, 2, 4, 4, 5]


@given(st.text(alphabet=st.sampled_from(list("ab\u00e9\u4e2d\U0001f600 \n")), max_size=50))
def test_char_round_trip_is_exact(s):
    tok = CharTokenizer("ab\u00e9\u4e2d\U0001f600 \n")
    assert tok.decode(tok.encode(s)) == s


def test_char_unknown_character_raises_naming_it_and_its_position():
    tok = CharTokenizer("abc")
    with pytest.raises(ValueError, match=r"text: .*'d' \(U\+0064\) at position 2"):
        tok.encode("abd")


def test_char_validation_errors():
    with pytest.raises(ValueError, match="text: expected a non-empty str"):
        CharTokenizer("")
    with pytest.raises(ValueError, match="text: expected a str, got bytes"):
        CharTokenizer(b"abc")
    tok = CharTokenizer("abc")
    with pytest.raises(ValueError, match=r"ids\[1\]: expected an integer id in \[0, 3\), got 3"):
        tok.decode([0, 3])
    with pytest.raises(ValueError, match=r"ids\[0\]: expected an integer id .* got True"):
        tok.decode([True])
    with pytest.raises(ValueError, match=r"ids: expected a 1-D sequence .* shape \(1, 2\)"):
        tok.decode(np.zeros((1, 2), dtype=np.int64))


def test_char_decode_accepts_numpy_ids():
    tok = CharTokenizer("abc")
    assert tok.decode(np.array([2, 1, 0])) == "cba"


# --------------------------------------------------------------------------- BPE training


@given(st.text())
def test_pretokenization_chunks_concatenate_to_the_text(s):
    assert "".join(_PRETOKENIZE.findall(s)) == s


def test_pretokenization_attaches_one_leading_space_to_words():
    assert _PRETOKENIZE.findall("Hello  world's 42x_y!?\n\n") == [
        "Hello", " ", " world", "'s", " 42", "x", "_", "y", "!?", "\n\n"]


def test_merge_word_replaces_left_to_right_without_overlap():
    assert _merge_word([1, 1, 1, 2, 1, 1], 1, 1, 9) == ([9, 1, 2, 9], 2)


def test_incremental_training_reproduces_the_direct_algorithm():
    chunks = Counter(_PRETOKENIZE.findall(SMALL[:6000]))
    fast, _ = _train_merges([list(c.encode()) for c in chunks], list(chunks.values()),
                            120, 2, 256)
    assert fast == naive_merges(SMALL[:6000], 120)


def test_training_is_deterministic():
    a = ByteBPE.train(SMALL, 500)
    b = ByteBPE.train(SMALL, 500)
    assert a.merges == b.merges and a.counts == b.counts


def test_token_count_equals_bytes_minus_replacements(bpe):
    text = SMALL + UNICODE_SAMPLE * 20
    assert len(bpe.encode(text)) == len(text.encode("utf-8")) - sum(bpe.counts)


def test_vocab_is_bytes_plus_merges_and_each_token_joins_its_parents(bpe):
    assert bpe.vocab_size == 256 + len(bpe.merges) == 600
    for k, (a, b) in enumerate(bpe.merges):
        assert bpe.vocab[256 + k] == bpe.vocab[a] + bpe.vocab[b]


def test_a_prefix_of_the_merges_is_the_smaller_training_run():
    assert ByteBPE.train(SMALL, 400).merges == ByteBPE.train(SMALL, 600).merges[:144]


def test_training_stops_when_no_pair_reaches_min_frequency():
    tok = ByteBPE.train("abcd abcd xyz", 1000)  # every pair but a-b-c-d occurs once
    assert tok.vocab[256:] == [b"ab", b"cd", b"abcd"]  # ties go to the smaller pair
    assert tok.counts == [2, 2, 2]
    assert len(ByteBPE.train("abcd abcd xyz", 1000, min_frequency=1).merges) > len(tok.merges)


def test_bpe_train_validation_errors():
    with pytest.raises(ValueError, match="vocab_size: expected at least 256 .* got 255"):
        ByteBPE.train("abc", 255)
    with pytest.raises(ValueError, match="vocab_size: expected a positive integer, got 3.5"):
        ByteBPE.train("abc", 3.5)
    with pytest.raises(ValueError, match="min_frequency: expected a positive integer, got 0"):
        ByteBPE.train("abc", 300, min_frequency=0)
    with pytest.raises(ValueError, match="text: expected a str, got list"):
        ByteBPE.train(["abc"], 300)


# --------------------------------------------------------------------------- BPE encode/decode


@settings(max_examples=300)
@given(st.text())
def test_bpe_round_trip_is_exact_for_any_string(bpe, s):
    assert bpe.decode(bpe.encode(s)) == s


@pytest.mark.parametrize("s", [
    "", " ", "\n\n\t", "caf\u00e9 vs cafe\u0301", "\u4e2d\u6587\u5b57\u7b26",
    "\U0001f468\u200d\U0001f469\u200d\U0001f467", "a\u0300\u0301\u0302\u0303",
    "\x00\ufffd\U0010ffff", "x" * 500, UNICODE_SAMPLE * 3,
])
def test_bpe_round_trip_on_awkward_strings(bpe, s):
    assert bpe.decode(bpe.encode(s)) == s


def test_encoding_uses_merges_for_multibyte_characters(bpe):
    text = UNICODE_SAMPLE
    assert len(bpe.encode(text)) < len(text.encode("utf-8")) / 2


def test_decoding_a_prefix_that_ends_mid_character_gives_replacement_char():
    tok = ByteBPE.train("\U0001f600 " * 10, 258)
    ids = tok.encode("\U0001f600")
    assert len(ids) == 2
    assert tok.decode(ids[:1]) == "\ufffd"
    assert tok.decode(ids) == "\U0001f600"


def test_bpe_without_merges_is_the_utf8_bytes():
    assert ByteBPE().encode("a\u00e9") == [97, 195, 169]
    assert ByteBPE().vocab_size == 256


def test_bpe_encode_and_decode_validation_errors(bpe):
    with pytest.raises(ValueError, match=r"text: expected a str .* lone surrogate U\+D800 at "
                                         r"position 1"):
        bpe.encode("a\ud800")
    with pytest.raises(ValueError, match="text: expected a str, got bytes"):
        bpe.encode(b"abc")
    with pytest.raises(ValueError, match=r"ids\[0\]: expected an integer id in \[0, 600\), "
                                         r"got 600"):
        bpe.decode([600])
    with pytest.raises(ValueError, match=r"ids\[0\]: expected an integer id .* got -1"):
        bpe.decode([-1])


@pytest.mark.parametrize("merges, k", [
    ([(97, 98), (256, 99), (258, 1)], 2),  # id 258 does not exist before merge 2
    ([(97, 98), (97, 98)], 1),  # merged twice
    ([(97, 98, 99)], 0),  # not a pair
    ([(97, "b")], 0),
    ([(True, 98)], 0),
    ([(-1, 98)], 0),
])
def test_invalid_merges_are_rejected_naming_the_index(merges, k):
    with pytest.raises(ValueError, match=rf"merges\[{k}\]: expected a pair of token ids below "
                                         rf"{256 + k}"):
        ByteBPE(merges)


# --------------------------------------------------------------------------- BPE files


def test_save_load_round_trip(bpe, tmp_path):
    path = tmp_path / "bpe.json"
    bpe.save(path)
    again = ByteBPE.load(path)
    assert again.merges == bpe.merges
    assert again.encode(UNICODE_SAMPLE + SMALL[:2000]) == bpe.encode(UNICODE_SAMPLE + SMALL[:2000])
    assert [p.name for p in tmp_path.iterdir()] == ["bpe.json"]  # no temporary file left


def test_save_replaces_an_existing_file_atomically(bpe, tmp_path):
    path = tmp_path / "bpe.json"
    path.write_text("old")
    ByteBPE().save(path)
    bpe.save(path)
    assert ByteBPE.load(path).merges == bpe.merges
    assert len(list(tmp_path.iterdir())) == 1


def test_a_failed_save_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "bpe.json"
    ByteBPE([(97, 98)]).save(path)
    before = path.read_text()

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr("npformer.tokenizer.os.replace", fail)
    with pytest.raises(OSError, match="disk full"):
        ByteBPE([(99, 100)]).save(path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["bpe.json"]


def _tampered(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "bpe.json"
    ByteBPE([(97, 98), (256, 99)]).save(path)
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("changes, message", [
    ({"format": "gpt2"}, r"expected 'format' = 'npformer.ByteBPE', got 'gpt2'"),
    ({"version": 2}, r"expected 'version' = 1, got 2"),
    ({"pattern": r"\w+"}, r"expected 'pattern' = "),
    ({"merges": {"a": 1}}, r"expected 'merges' to be a list of pairs, got dict"),
    ({"merges": [[97, 98], [300, 1]]}, r"merges\[1\]: expected a pair of token ids below 257"),
])
def test_load_validates_the_file(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        ByteBPE.load(_tampered(tmp_path, **changes))


def test_load_rejects_a_file_that_is_not_json(tmp_path):
    path = tmp_path / "bpe.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="path: expected a ByteBPE JSON file"):
        ByteBPE.load(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected 'format' = 'npformer.ByteBPE', got None"):
        ByteBPE.load(path)


# --------------------------------------------------------------------------- WordPiece


def test_greedy_longest_match_first():
    tok = WordPiece(hand_vocab("un", "##aff", "##able", "##a", "##ff", "able"))
    assert tok.wordpiece("unaffable") == ["un", "##aff", "##able"]
    assert tok.wordpiece("able") == ["able"]


def test_a_word_that_cannot_be_split_is_one_unk_even_if_a_prefix_matched():
    tok = WordPiece(hand_vocab("a", "ab", "##bc"))
    assert tok.wordpiece("abc") == ["[UNK]"]  # greedy takes ab, then finds no ##c
    assert tok.wordpiece("xyz") == ["[UNK]"]
    assert WordPiece(hand_vocab("a", "ab", "##bc", "##c")).wordpiece("abc") == ["ab", "##c"]


def test_words_longer_than_max_chars_per_word_are_unk():
    tok = WordPiece(hand_vocab("a", "##a"), max_chars_per_word=5)
    assert tok.wordpiece("aaaaa") == ["a", "##a", "##a", "##a", "##a"]
    assert tok.wordpiece("aaaaaa") == ["[UNK]"]
    assert WordPiece(hand_vocab("a", "##a")).tokenize("a" * 100 + " " + "a" * 101) == [
        "a", *["##a"] * 99, "[UNK]"]


def test_basic_tokenizer_cleans_lowercases_strips_accents_and_splits():
    tok = WordPiece(hand_vocab())
    text = "Caf\u00e9\u00a0NA\u00cfVE\tx\x07y\ufffd\x00z \u00bfQu\u00e9?!  a.b\u3000$5^2"
    assert tok.basic_tokenize(text) == ["cafe", "naive", "xyz", "\u00bf", "que", "?", "!",
                                        "a", ".", "b", "$", "5", "^", "2"]


def test_basic_tokenizer_isolates_cjk_ideographs_but_not_kana():
    tok = WordPiece(hand_vocab())
    assert tok.basic_tokenize("ab\u4e2d\u6587cd \u3072\u3089\u304b\u306a") == [
        "ab", "\u4e2d", "\u6587", "cd", "\u3072\u3089\u304b\u306a"]
    # NFD writes ga as ka + U+3099 (category Mn): uncased BERT strips the voicing mark too
    assert tok.basic_tokenize("\u304c") == ["\u304b"]
    assert WordPiece(hand_vocab(), tokenize_chinese_chars=False).basic_tokenize(
        "ab\u4e2d\u6587") == ["ab\u4e2d\u6587"]


def test_lowercasing_is_per_character_without_the_final_sigma_rule():
    tok = WordPiece(hand_vocab())
    assert tok.basic_tokenize("\u039f\u0394\u039f\u03a3") == ["\u03bf\u03b4\u03bf\u03c3"]


def test_cased_tokenizer_keeps_case_and_accents_unless_asked():
    assert WordPiece(hand_vocab(), lowercase=False).basic_tokenize("Caf\u00e9") == ["Caf\u00e9"]
    assert WordPiece(hand_vocab(), lowercase=False, strip_accents=True).basic_tokenize(
        "Caf\u00e9") == ["Cafe"]
    assert WordPiece(hand_vocab(), strip_accents=False).basic_tokenize("Caf\u00e9") == [
        "caf\u00e9"]


def test_special_tokens_in_the_text_are_kept_verbatim():
    tok = WordPiece(hand_vocab("paris", "is", "[", "]", "mask"))
    assert tok.tokenize("Paris is [MASK][SEP] [mask]") == [
        "paris", "is", "[MASK]", "[SEP]", "[", "mask", "]"]


def test_encode_wraps_the_ids_in_cls_and_sep():
    tok = WordPiece(hand_vocab("the", "cat"))
    assert tok.encode("The cat") == [2, 5, 6, 3]
    assert tok.encode("") == [2, 3]
    assert tok.encode("dog") == [2, 1, 3]


def test_batch_encode_pads_to_the_longest_row_with_mask():
    tok = WordPiece(hand_vocab("a", "b", "c"))
    ids, mask = tok.batch_encode(["a b c", "a", ""])
    assert ids.dtype == np.int64 and mask.dtype == np.int64
    np.testing.assert_array_equal(ids, [[2, 5, 6, 7, 3], [2, 5, 3, 0, 0], [2, 3, 0, 0, 0]])
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])


def test_batch_encode_truncates_to_max_length_keeping_sep():
    tok = WordPiece(hand_vocab("a", "b", "c"))
    ids, mask = tok.batch_encode(["a b c", "a"], max_length=4)
    np.testing.assert_array_equal(ids, [[2, 5, 6, 3], [2, 5, 3, 0]])
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1], [1, 1, 1, 0]])
    ids, mask = tok.batch_encode(["a b c"], max_length=2)
    np.testing.assert_array_equal(ids, [[2, 3]])
    ids, _ = tok.batch_encode(["a"], max_length=10)  # no padding beyond the longest row
    assert ids.shape == (1, 3)


def test_batch_encode_validation_errors():
    tok = WordPiece(hand_vocab("a"))
    with pytest.raises(ValueError, match="texts: expected a non-empty list of str, got a str"):
        tok.batch_encode("a")
    with pytest.raises(ValueError, match=r"texts: expected a non-empty list of str, got \[\]"):
        tok.batch_encode([])
    with pytest.raises(ValueError, match=r"texts\[1\]: expected a str, got int"):
        tok.batch_encode(["a", 3])
    with pytest.raises(ValueError, match=r"max_length: expected at least 2 .* got 1"):
        tok.batch_encode(["a"], max_length=1)
    with pytest.raises(ValueError, match="max_length: expected a positive integer, got 0"):
        tok.batch_encode(["a"], max_length=0)


def test_constructor_validation_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unk: expected a token of the vocabulary, got "
                                         r"'\[UNK\]'"):
        WordPiece(["[PAD]", "[CLS]", "[SEP]"])
    with pytest.raises(ValueError, match=r"pad: expected a token of the vocabulary, got '<pad>'"):
        WordPiece(hand_vocab(), pad="<pad>")
    with pytest.raises(ValueError, match=r"vocab: expected unique tokens, got 'a' at ids 5 and 6"):
        WordPiece(hand_vocab("a", "a"))
    with pytest.raises(ValueError, match="vocab: expected a path to vocab.txt or a sequence"):
        WordPiece(42)
    with pytest.raises(ValueError, match="lowercase: expected True or False, got 1"):
        WordPiece(hand_vocab(), lowercase=1)
    with pytest.raises(ValueError, match="strip_accents: expected True or False, got 'yes'"):
        WordPiece(hand_vocab(), strip_accents="yes")
    with pytest.raises(ValueError, match="max_chars_per_word: expected a positive integer"):
        WordPiece(hand_vocab(), max_chars_per_word=0)


def test_vocab_file_is_read_line_by_line_with_ids_from_zero(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n \nhello\n##\u00e9\n", encoding="utf-8")
    tok = WordPiece(path)
    assert tok.vocab == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", " ", "hello", "##\u00e9"]
    assert tok.mask_id is None and (tok.unk_id, tok.cls_id, tok.sep_id, tok.pad_id) == (1, 2, 3, 0)
    tok.save_vocab(tmp_path / "again.txt")
    assert (tmp_path / "again.txt").read_bytes() == path.read_bytes()


def test_decode_glues_continuation_pieces_and_skips_specials():
    tok = WordPiece(hand_vocab("un", "##aff", "##able", "cat"))
    ids = tok.encode("unaffable cat dog")
    assert tok.decode(ids) == "unaffable cat [UNK]"
    assert tok.decode(ids, skip_special_tokens=False) == "[CLS] unaffable cat [UNK] [SEP]"


def test_trained_vocabulary_encodes_its_own_corpus_without_unk():
    tok = WordPiece.train(SMALL, 800)
    assert tok.vocab_size == 800
    assert tok.vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert "[UNK]" not in tok.tokenize(SMALL)
    assert WordPiece.train(SMALL, 800).vocab == tok.vocab  # deterministic
    assert len(tok.tokenize(SMALL)) < len(SMALL.split()) * 2


def test_trained_vocabulary_has_every_character_in_both_positions():
    tok = WordPiece.train("abc abd", 100)
    for c in "abcd":
        assert c in tok.token_to_id and "##" + c in tok.token_to_id


def test_wordpiece_train_validation_errors():
    with pytest.raises(ValueError, match=r"vocab_size: expected at least 5 \(the special "
                                         r"tokens\), got 4"):
        WordPiece.train("abc", 4)
    with pytest.raises(ValueError, match="min_frequency: expected a positive integer"):
        WordPiece.train("abc", 100, min_frequency=0)
    with pytest.raises(ValueError, match=r"vocab_size: expected at least 11 \(the special "
                                         r"tokens and each of the text's 3 characters"):
        WordPiece.train("abc", 10)
