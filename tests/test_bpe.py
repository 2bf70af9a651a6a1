"""BpeTokenizer against the ``tokenizers`` library: small BPE models trained here, saved as
``tokenizer.json`` the way Llama 3, GPT-2 and Llama 2 configure theirs, must give the library's
ids on held-out text, tricky strings and random text; bad files are refused with a clear error."""

from __future__ import annotations

import copy
import json
import random
import unicodedata
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ravnest_node.data.bpe import MAX_FILE_BYTES, BpeTokenizer
from ravnest_node.data.text import Tokenizer
from ravnest_node.errors import ConfigError

from .conftest import has_module, require_module

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def words(text: str) -> list[str]:
    return text.split()


WORDS = words(
    "the of and to in is was that for on with as by at from his her they we you it this be are "
    "have not but had one all were when there can an which their said if do will each about how "
    "up out them then she many some so these would other into has more two like him see time "
    "could no make than first been its who now people my made over did down only way find use "
    "may water long little very after words called just where most know get through back much "
    "before go good new write our used me man too any day same right look think also around "
    "another came come work three word must because does part even place well such here take "
    "why things help put years different away again off went old number great tell men say small "
    "every found still between name should home big give air line set own under read last never "
    "don't I'M we'll she'd THEY'RE you've it's Hello world tokenizer Llama peer-to-peer training"
)
UNICODE_WORDS = words(
    "café naïve Ærøskøbing crème brûlée façade jalapeño Zürich São_Paulo e\u0301 "
    "日本語のテキスト 中文字符 한국어 Привет мир مرحبا שלום ελληνικά हिन्दी ไทย "
    "😀 🎉👍🏽 🇫🇷 \u2115 ² ½ Ⅻ ٣ ༣ \uff5e … — “quoted” «guillemets» ¿qué? ¡sí!"
)
PUNCT = words("! ? . , ; : ... -- ( ) [ ] { } # @ $ % ^ & * + = / \\ | ` ~ < > ' \"")
SEPARATORS = [" "] * 12 + ["  ", "   ", "\t", "\n", " \n", "\n\n", "\r\n", " \t ", ""]

TRICKY = [
    "",
    " ",
    "   ",
    "\n",
    "\r\n\r\n",
    "\t\t x",
    "a",
    "Hello",
    " Hello",
    "Hello world",
    "Hello  world  ",
    "don't DON'T I'M i'm we'Ll she'D they'RE you'VE it'S 's 'x",
    "123456789 1234 12 1 0.5 3.14159 1,000,000 -42 ²³ ½ ٣٤٥",
    "café naïve e\u0301 Ærø ﬁ ß ẞ \u017ft",
    "日本語のテキスト、中文字符。한국어!",
    "😀😀😀 🎉👍🏽 🇫🇷 👨‍👩‍👧",
    "tabs\tand\nnewlines\r\nand   spaces    ",
    "trailing spaces   \n   leading",
    "punctuation!!! ??? ... --- (parens) [brackets] {braces} <angle>",
    "https://example.com/path?q=1&r=2#frag user@example.com",
    "def f(x):\n    return x ** 2  # comment\n\n\nclass A:\n\tpass\n",
    "\u00a0non-breaking\u2003em\u3000ideographic\u2028line\u2029para\x85next\x1c\x1f",
    "\x00\x01\x7f control \ufeff bom \u200b zero \u200d joiner",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "日本語" * 40,
    "▁ ▁▁ x▁y ▁▁▁",
    "<0x41> <unk> <s > </ s>",
]


def sentences(seed: int, count: int) -> list[str]:
    """English-like lines with unicode words, numbers, punctuation and odd whitespace."""
    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(2, 16)):
            draw = rng.random()
            if draw < 0.72:
                word = rng.choice(WORDS)
            elif draw < 0.84:
                word = rng.choice(UNICODE_WORDS)
            elif draw < 0.92:
                word = str(rng.randint(0, 10 ** rng.randint(1, 10)))
            else:
                word = rng.choice(PUNCT)
            if rng.random() < 0.08:
                word = word.upper() if rng.random() < 0.5 else word.capitalize()
            parts.append(word + rng.choice(SEPARATORS))
        lines.append("".join(parts))
    return lines


# -- tokenizer.json files made by the library --


def tokenizers_lib() -> Any:
    return require_module("tokenizers")


def train(tokenizer: Any, vocab_size: int, specials: list[str], alphabet: list[str]) -> None:
    tk = tokenizers_lib()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet,
        show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator(sentences(0, 3000), trainer)


def save(tokenizer: Any, path: Path, edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    tokenizer.save(str(path))
    if edit is not None:
        spec = json.loads(path.read_text(encoding="utf-8"))
        edit(spec)
        path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return path


def make_llama3(path: Path) -> Path:
    tk = tokenizers_lib()
    tokenizer = tk.Tokenizer(tk.models.BPE(ignore_merges=True))
    tokenizer.pre_tokenizer = tk.pre_tokenizers.Sequence([
        tk.pre_tokenizers.Split(tk.Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tokenizer.decoder = tk.decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    train(tokenizer, 1200, specials, tk.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.post_processor = tk.processors.Sequence([
        tk.processors.ByteLevel(trim_offsets=False),
        tk.processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", tokenizer.token_to_id("<|begin_of_text|>"))],
        ),
    ])  # fmt: skip
    return save(tokenizer, path)


def make_gpt2(path: Path, add_prefix_space: bool = False) -> Path:
    tk = tokenizers_lib()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tokenizer.decoder = tk.decoders.ByteLevel()
    tokenizer.post_processor = tk.processors.ByteLevel(trim_offsets=True)
    train(tokenizer, 800, ["<|endoftext|>"], tk.pre_tokenizers.ByteLevel.alphabet())
    return save(tokenizer, path)


def make_llama2(path: Path, variant: str) -> Path:
    """Llama 2's layout: <unk> <s> </s>, then the 256 byte tokens (in the vocabulary, not added
    tokens), merges learnt on words ("whitespace" split) or on whole lines ("lines"); text
    read through the Prepend/Replace normalizer or ("metaspace-first", "metaspace-always") the
    Metaspace pre-tokenizer of newer files."""
    tk = tokenizers_lib()
    model = tk.models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    tokenizer = tk.Tokenizer(model)
    sentencepiece = tk.normalizers.Sequence(
        [tk.normalizers.Prepend("▁"), tk.normalizers.Replace(" ", "▁")]
    )
    if variant == "lines":
        tokenizer.normalizer = sentencepiece
    else:
        tokenizer.pre_tokenizer = tk.pre_tokenizers.Metaspace(prepend_scheme="always")
    train(tokenizer, 900, ["<unk>", "<s>", "</s>", *BYTES], [])
    if variant in ("whitespace", "lines"):
        tokenizer.normalizer = sentencepiece
        tokenizer.pre_tokenizer = None
        tokenizer.decoder = tk.decoders.Sequence([
            tk.decoders.Replace("▁", " "), tk.decoders.ByteFallback(), tk.decoders.Fuse(),
            tk.decoders.Strip(content=" ", left=1, right=0),
        ])  # fmt: skip
    else:
        scheme = variant.removeprefix("metaspace-")
        split = scheme == "always"
        tokenizer.pre_tokenizer = tk.pre_tokenizers.Metaspace(prepend_scheme=scheme, split=split)
        tokenizer.decoder = tk.decoders.Metaspace(prepend_scheme=scheme, split=split)
    tokenizer.post_processor = tk.processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )

    def bytes_are_no_added_tokens(spec: dict[str, Any]) -> None:
        spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in BYTES]

    return save(tokenizer, path, bytes_are_no_added_tokens)


KINDS = ["llama3", "gpt2", "gpt2-prefix", "llama2", "llama2-lines", "metaspace-first",
         "metaspace-always"]  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("bpe")
    made = {
        "llama3": make_llama3(folder / "llama3.json"),
        "gpt2": make_gpt2(folder / "gpt2.json"),
        "gpt2-prefix": make_gpt2(folder / "gpt2-prefix.json", add_prefix_space=True),
        "llama2": make_llama2(folder / "llama2.json", "whitespace"),
        "llama2-lines": make_llama2(folder / "llama2-lines.json", "lines"),
    }
    for scheme in ("first", "always"):
        kind = f"metaspace-{scheme}"
        made[kind] = make_llama2(folder / f"{kind}.json", kind)
    return made


@pytest.fixture(scope="module")
def pairs(files: dict[str, Path]) -> dict[str, tuple[BpeTokenizer, Any]]:
    tk = tokenizers_lib()
    return {
        k: (BpeTokenizer.from_file(f), tk.Tokenizer.from_file(str(f))) for k, f in files.items()
    }


def assert_same_ids(ours: BpeTokenizer, theirs: Any, texts: Iterable[str]) -> None:
    for text in texts:
        expected = theirs.encode(text, add_special_tokens=False)
        got = ours.encode(text)
        assert got == expected.ids, (text, ours.tokens(text), expected.tokens)


def edited(path: Path, name: str, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of the tokenizer.json `path`, changed by `edit`, in a folder of its own."""
    spec = json.loads(path.read_text(encoding="utf-8"))
    edit(spec)
    out = path.parent / name / "tokenizer.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return out


# -- the same ids as the library --


@pytest.mark.parametrize("kind", KINDS)
def test_ids_match_the_library(kind: str, pairs: dict[str, tuple[BpeTokenizer, Any]]) -> None:
    ours, theirs = pairs[kind]
    held_out = sentences(1, 300)
    specials = [
        "<|begin_of_text|>Hello<|eot_id|>\n<|end_of_text|>",
        "a<|endoftext|>b <|endoftext|> <|endoftext|><|endoftext|>",
        "<s>Hello</s> <s> world</s><unk>",
        "<|begin_of_text|<|end_of_text|>>",
    ]
    assert_same_ids(ours, theirs, [*held_out, *TRICKY, *specials, "\n".join(held_out)])


def test_special_tokens_in_text_are_single_ids(pairs: dict[str, tuple[BpeTokenizer, Any]]) -> None:
    llama3, _ = pairs["llama3"]
    eot, begin = llama3.id_of("<|eot_id|>"), llama3.id_of("<|begin_of_text|>")
    ids = llama3.encode("Hello<|eot_id|><|begin_of_text|>")
    assert ids[-2:] == [eot, begin] and eot not in llama3.encode("Hello<|eot_id|")
    llama2, _ = pairs["llama2"]
    assert llama2.encode("<s>")[0] == llama2.id_of("<s>") == 1
    assert llama2.encode("x<0x41>") != llama2.encode("xA")  # byte tokens are no added tokens


@pytest.mark.parametrize("kind", ["llama3", "llama2", "metaspace-first", "gpt2"])
def test_template_adds_bos_as_the_library(
    kind: str, pairs: dict[str, tuple[BpeTokenizer, Any]]
) -> None:
    ours, theirs = pairs[kind]
    for text in ["Hello world", "", "<s>x", *sentences(2, 20)]:
        assert ours.encode(text, add_special_tokens=True) == theirs.encode(text).ids
    if kind == "gpt2":
        assert not ours.adds_bos and ours.bos_id is None
        assert ours.eos_id == ours.id_of("<|endoftext|>")
    else:
        assert ours.adds_bos and not ours.adds_eos
        assert ours.encode("x", add_special_tokens=True)[0] == ours.bos_id


def test_bos_eos_pad_and_sizes(pairs: dict[str, tuple[BpeTokenizer, Any]]) -> None:
    llama3, theirs3 = pairs["llama3"]
    assert llama3.bos_id == theirs3.token_to_id("<|begin_of_text|>")
    assert llama3.eos_id == theirs3.token_to_id("<|end_of_text|>")
    assert llama3.pad_id is None
    assert llama3.vocab_size == theirs3.get_vocab_size(with_added_tokens=True)
    assert llama3.special_ids == {llama3.id_of(t) for t in ("<|begin_of_text|>", "<|end_of_text|>",
                                                            "<|eot_id|>")}  # fmt: skip
    llama2, theirs2 = pairs["llama2"]
    assert (llama2.bos_id, llama2.eos_id, llama2.pad_id) == (1, 2, None)
    assert llama2.id_of("<0x0A>") == 3 + 0x0A and llama2.special_ids == {0, 1, 2}
    assert llama2.vocab_size == theirs2.get_vocab_size(with_added_tokens=True)
    with pytest.raises(KeyError):
        llama2.id_of("no such token")


def test_tokenizer_config_names_bos_eos_and_pad(files: dict[str, Path]) -> None:
    path = edited(files["llama3"], "config", lambda spec: None)
    config = path.with_name("tokenizer_config.json")
    config.write_text(json.dumps({
        "bos_token": {"content": "<|begin_of_text|>", "lstrip": False, "__type": "AddedToken"},
        "eos_token": "<|eot_id|>", "pad_token": "<|end_of_text|>", "chat_template": "{{ x }}",
    }))  # fmt: skip
    tokenizer = BpeTokenizer.from_file(path)
    assert tokenizer.bos_id == tokenizer.id_of("<|begin_of_text|>")
    assert tokenizer.eos_id == tokenizer.id_of("<|eot_id|>")
    assert tokenizer.pad_id == tokenizer.id_of("<|end_of_text|>")
    config.write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ConfigError, match=r"eos_token '<\|im_end\|>' is not a token"):
        BpeTokenizer.from_file(path)
    config.write_text("{bad")
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json: not a JSON file"):
        BpeTokenizer.from_file(path)


def test_merges_as_strings_or_pairs_give_the_same_ids(files: dict[str, Path]) -> None:
    tk = tokenizers_lib()
    pairs_spec = json.loads(files["llama3"].read_text(encoding="utf-8"))
    assert isinstance(pairs_spec["model"]["merges"][0], list)  # what the library saves

    def as_strings(spec: dict[str, Any]) -> None:
        spec["model"]["merges"] = [" ".join(m) for m in spec["model"]["merges"]]

    strings = edited(files["llama3"], "strings", as_strings)
    ours, by_pairs = BpeTokenizer.from_file(strings), BpeTokenizer.from_file(files["llama3"])
    texts = sentences(3, 100) + TRICKY
    assert [ours.encode(t) for t in texts] == [by_pairs.encode(t) for t in texts]
    assert_same_ids(ours, tk.Tokenizer.from_file(str(strings)), texts)
    assert ours.fingerprint != by_pairs.fingerprint  # other bytes
    assert by_pairs.fingerprint == BpeTokenizer.from_file(files["llama3"]).fingerprint
    assert len(by_pairs.fingerprint) == 16 and int(by_pairs.fingerprint, 16) >= 0


def test_is_a_tokenizer_of_the_datasets(pairs: dict[str, tuple[BpeTokenizer, Any]]) -> None:
    tokenizer: Tokenizer = pairs["llama3"][0]
    assert tokenizer.encode("Hello world") == pairs["llama3"][1].encode("Hello world").ids[1:]
    assert isinstance(tokenizer.fingerprint, str)


# -- decoding --


@pytest.mark.parametrize("kind", KINDS)
def test_decode_matches_the_library(kind: str, pairs: dict[str, tuple[BpeTokenizer, Any]]) -> None:
    ours, theirs = pairs[kind]
    for text in [*sentences(4, 50), *TRICKY, "<s>Hello<|eot_id|> x</s>"]:
        ids = ours.encode(text, add_special_tokens=True)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            ), (text, skip)
    assert ours.decode([]) == theirs.decode([])
    with pytest.raises(ValueError, match="no token"):
        ours.decode([ours.vocab_size])


@pytest.mark.parametrize("kind", ["llama3", "gpt2", "llama2-lines"])
def test_decode_round_trips(kind: str, pairs: dict[str, tuple[BpeTokenizer, Any]]) -> None:
    ours, _ = pairs[kind]
    texts = [*sentences(5, 100), *TRICKY[1:], "x<|eot_id|>y<s>"]
    if kind == "llama2-lines":
        # Not quite: the decoder reads ▁ as a space and strips the one the normalizer put
        # first, and the normalizer puts one after each special token.
        texts = [t.lstrip(" ") for t in sentences(5, 100)]
    for text in texts:
        assert ours.decode(ours.encode(text)) == text


# -- other settings of the same formats --


def test_split_behaviours_and_inversion(files: dict[str, Path]) -> None:
    tk = tokenizers_lib()
    texts = [*sentences(6, 40), *TRICKY, "-a--b-c---", "  x  "]
    behaviors = ["Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"]
    for behavior in behaviors:
        for invert in (False, True):
            for pattern in ({"Regex": r"\s+|\d|-"}, {"String": " "}):

                def split(spec: dict[str, Any], b: str = behavior, i: bool = invert,
                          p: dict[str, str] = pattern) -> None:  # fmt: skip
                    spec["pre_tokenizer"]["pretokenizers"][0] = {
                        "type": "Split", "pattern": p, "behavior": b, "invert": i,
                    }  # fmt: skip

                path = edited(files["llama3"], f"split-{behavior}-{invert}", split)
                assert_same_ids(BpeTokenizer.from_file(path), tk.Tokenizer.from_file(str(path)),
                                texts)  # fmt: skip


SPM_VARIANTS: dict[str, dict[str, Any]] = {
    "prepend": {"normalizer": {"type": "Prepend", "prepend": "▁"}},
    "replace": {"normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}},
    "regex-nfkc": {"normalizer": {"type": "Sequence", "normalizers": [
        {"type": "NFKC"}, {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"Regex": r"\s+"}, "content": "▁"}]}},
    "metaspace-legacy": {"normalizer": None, "pre_tokenizer": {
        "type": "Metaspace", "replacement": "▁", "add_prefix_space": True},
        "decoder": {"type": "Metaspace", "replacement": "▁", "add_prefix_space": True}},
    "metaspace-never": {"normalizer": None, "pre_tokenizer": {
        "type": "Metaspace", "replacement": "▁", "prepend_scheme": "never", "split": True},
        "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "never",
                    "split": True}},
}  # fmt: skip


@pytest.mark.parametrize("variant", SPM_VARIANTS)
def test_sentencepiece_variants(files: dict[str, Path], variant: str) -> None:
    """A single Prepend or Replace, a regex Replace after NFKC, and Metaspace as older files
    write it (add_prefix_space) or without a prefix."""
    tk = tokenizers_lib()
    path = edited(files["llama2"], variant, lambda spec: spec.update(SPM_VARIANTS[variant]))
    ours, theirs = BpeTokenizer.from_file(path), tk.Tokenizer.from_file(str(path))
    texts = [*sentences(10, 60), *TRICKY, "ﬁ ① \uff12 x\u3000y", "<s>a</s> b"]
    assert_same_ids(ours, theirs, texts)
    ids = ours.encode(texts[0])
    assert ours.decode(ids) == theirs.decode(ids)


def test_added_token_options(files: dict[str, Path]) -> None:
    """lstrip, rstrip, single_word and normalized tokens, and an NFC normalizer."""
    tk = tokenizers_lib()
    for kind, normalizer in (("llama2", None), ("llama3", tk.normalizers.NFC())):
        tokenizer = tk.Tokenizer.from_file(str(files[kind]))
        if normalizer is not None:
            tokenizer.normalizer = normalizer
        tokenizer.add_special_tokens([
            tk.AddedToken("<mask>", lstrip=True, special=True),
            tk.AddedToken("<sep>", rstrip=True, special=True),
        ])  # fmt: skip
        tokenizer.add_tokens([
            tk.AddedToken("word", single_word=True, normalized=False),
            tk.AddedToken("the", single_word=True, normalized=True),
            tk.AddedToken("quick", normalized=True),
            tk.AddedToken(" brown", normalized=False),
        ])  # fmt: skip
        path = save(tokenizer, files[kind].parent / f"added-{kind}.json")
        texts = [
            "a  <mask>  b <sep>  c \u3000<mask><sep>\t\n<sep>\x1cx", "<mask>", "  <mask>",
            "word words sword word_ word. a word² Ⅻword wordⅫ", "the theory bathe the",
            "Quick quick", "the brown fox, a  brown", "e\u0301 café cafe\u0301 Å A\u030a",
            *sentences(7, 30),
        ]  # fmt: skip
        assert_same_ids(BpeTokenizer.from_file(path), tk.Tokenizer.from_file(str(path)), texts)


def test_unknown_tokens_where_byte_fallback_fails(files: dict[str, Path]) -> None:
    """Unknown tokens (fused or not) where some bytes have no token, as the library writes them:
    an unknown token waits for the next character of the vocabulary, so the bytes of a character
    after it come first ("漢ß" is <0xC3> <0x9F> <unk>)."""
    tk = tokenizers_lib()
    for fuse in (True, False):

        def drop_bytes(spec: dict[str, Any], fuse: bool = fuse) -> None:
            model = spec["model"]
            model["fuse_unk"] = fuse
            for b in range(0xE0, 0x100):  # no lead byte of a character of 3 or 4 bytes
                del model["vocab"][f"<0x{b:02X}>"]

        path = edited(files["llama2"], f"unk-{fuse}", drop_bytes)
        texts = ["日本語 x 😀😀 a日b", "é日", "x 日 é 日é日", "漢ß 漢漢ßx x漢ß漢", *TRICKY]
        assert_same_ids(BpeTokenizer.from_file(path), tk.Tokenizer.from_file(str(path)), texts)


def test_long_text_in_one_piece(pairs: dict[str, tuple[BpeTokenizer, Any]]) -> None:
    """Llama 2's files have no pre-tokenizer: a whole line is one word to merge."""
    text = " ".join(sentences(8, 400))
    for kind in ("llama2", "llama2-lines", "llama3"):
        ours, theirs = pairs[kind]
        assert_same_ids(ours, theirs, [text, text.replace(" ", "")])


def test_merge_ranks_in_any_order(tmp_path: Path) -> None:
    """Hand-made vocabularies whose merge ranks need not follow the order tokens were made in,
    and words of up to 120 characters (no pre-tokenizer): the library's merge order."""
    tk = tokenizers_lib()
    for seed in range(24):
        rng = random.Random(seed)
        vocab, tokens = {"a": 0, "b": 1}, ["a", "b"]
        merges: list[list[str]] = []
        while len(merges) < 40:
            left, right = rng.choice(tokens), rng.choice(tokens)
            if left + right not in vocab and len(left + right) <= 7:
                vocab[left + right] = len(vocab)
                tokens.append(left + right)
                merges.append([left, right])
        if seed % 2:
            rng.shuffle(merges)
        model = {"type": "BPE", "vocab": vocab, "merges": merges}
        path = write(tmp_path / f"{seed}.json", minimal_spec(pre_tokenizer=None, model=model))
        texts = ["".join(rng.choices("ab", k=rng.randint(1, 120))) for _ in range(30)]
        assert_same_ids(BpeTokenizer.from_file(path), tk.Tokenizer.from_file(str(path)), texts)


# -- random text --

CHARACTERS = st.characters(exclude_categories=("Cs", "Cn"))  # known to this Python's Unicode
SNIPPETS = st.sampled_from([
    " ", "  ", "\n", "\r\n", "\t", "'s", "'LL", "'t", "▁", "123456", "٣", "é", "e\u0301", "日本",
    "😀", "<s>", "</s>", "<|begin_of_text|>", "<|eot_id|>", "<|endoftext|>", "Hello", " world",
    "the", "don't",
])  # fmt: skip
TEXTS = st.lists(st.one_of(st.text(CHARACTERS, max_size=10), SNIPPETS), max_size=10).map("".join)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TEXTS)
def test_random_text_gives_the_library_ids(
    pairs: dict[str, tuple[BpeTokenizer, Any]], text: str
) -> None:
    for ours, theirs in pairs.values():
        assert_same_ids(ours, theirs, [text])


def test_letter_and_number_classes_match_the_library() -> None:
    """The translated \\p{L}, \\p{N}, \\s and \\w hold the characters the library's regexes
    hold, over every character this Python's Unicode database knows."""
    tk = tokenizers_lib()
    known = "".join(
        chr(c) for c in range(0x110000) if unicodedata.category(chr(c)) not in ("Cs", "Cn")
    )
    for pattern in (r"\p{L}", r"\p{N}", r"[^\s\p{L}\p{N}]", r"\w"):
        split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Removed",
                 "invert": False}  # fmt: skip
        kept = "".join(p for p, _ in tk.pre_tokenizers.Split(
            tk.Regex(pattern), behavior="removed").pre_tokenize_str(known))  # fmt: skip
        ours = BpeTokenizer(minimal_spec(pre_tokenizer=split), {}, b"")
        assert "".join(ours._pre_tokenize(known, True)) == kept, pattern


# -- bad files --


def minimal_spec(**changes: Any) -> dict[str, Any]:
    """A small valid byte-level tokenizer.json, with `changes` to its top-level keys."""
    vocab = {"a": 0, "b": 1, "ab": 2, "Ġ": 3}
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    spec: dict[str, Any] = {
        "version": "1.0", "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None, "decoder": {"type": "ByteLevel", **byte_level},
        "model": {"type": "BPE", "vocab": vocab, "merges": [["a", "b"]]},
    }  # fmt: skip
    return spec | changes


def write(path: Path, spec: Any) -> Path:
    path.write_text(spec if isinstance(spec, str) else json.dumps(spec), encoding="utf-8")
    return path


def test_a_minimal_file_by_hand(tmp_path: Path) -> None:
    path = write(tmp_path / "tokenizer.json", minimal_spec())
    tokenizer = BpeTokenizer.from_file(path)
    assert tokenizer.encode("ab aab") == [2, 3, 0, 2]  # "ab", "Ġ", "a", "ab"
    if has_module("tokenizers"):
        assert_same_ids(tokenizer, tokenizers_lib().Tokenizer.from_file(str(path)), TRICKY)
    assert tokenizer.decode([2, 3, 0, 2]) == "ab aab"
    assert tokenizer.encode("abc") == [2]  # "c" has no token and there is no unknown token
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.adds_bos) == (4, None, False)


BAD_MODEL = {"type": "BPE", "vocab": {"a": 0, "b": 0}, "merges": []}
BAD_FILES = [
    ("{not json", "not a JSON file"),
    ("[1, 2]", "a JSON list, expected an object"),
    (minimal_spec(model={"type": "WordPiece", "vocab": {}}),
     "model type is 'WordPiece': only BPE models are supported"),
    (minimal_spec(model={"type": "Unigram", "vocab": []}), "'Unigram': only BPE"),
    (minimal_spec(normalizer={"type": "Lowercase"}), "normalizer type 'Lowercase'"),
    (minimal_spec(normalizer={"type": "Sequence", "normalizers": [{"type": "BertNormalizer"}]}),
     r"normalizer type 'BertNormalizer' \(normalizer.normalizers\[0\]\) is not supported"),
    (minimal_spec(pre_tokenizer={"type": "Whitespace"}), "pre-tokenizer type 'Whitespace'"),
    (minimal_spec(decoder={"type": "WordPiece"}), "decoder type 'WordPiece'"),
    (minimal_spec(post_processor={"type": "BertProcessing"}), "post-processor type 'Bert"),
    (minimal_spec(model={"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}),
     r"merges\[0\] 'a b' needs 'b', not in vocab"),
    (minimal_spec(model={"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": [["a", "b"]]}),
     "needs 'ab', not in vocab"),
    (minimal_spec(model={"type": "BPE", "vocab": {"a": 0}, "merges": ["a b c"]}),
     r'merges\[0\] must be "left right"'),
    (minimal_spec(model=BAD_MODEL), "gives the id 0 to both 'a' and 'b'"),
    (minimal_spec(model={"type": "BPE", "vocab": {"a": -1}, "merges": []}), "token id"),
    (minimal_spec(model={"type": "BPE", "vocab": {"a": 0}, "merges": [], "dropout": 0.1}),
     "dropout is not supported"),
    (minimal_spec(model={"type": "BPE", "vocab": {"a": 0}, "unk_token": "<unk>"}),
     "unk_token '<unk>' is not in the vocabulary"),
    (minimal_spec(added_tokens=[{"id": 0, "content": "<s>", "special": True}]),
     "the id 0 of '<s>' is 'a''s"),
    (minimal_spec(added_tokens=[{"id": 9, "content": "a"}]), "'a' has the id 9 but 0"),
    (minimal_spec(pre_tokenizer={"type": "Split", "pattern": {"Regex": "[[:alpha:]]"},
                                 "behavior": "Isolated"}), "POSIX brackets"),
    (minimal_spec(pre_tokenizer={"type": "Split", "pattern": {"Regex": "(a"},
                                 "behavior": "Isolated"}), r"regex '\(a' cannot be used"),
    (minimal_spec(pre_tokenizer={"type": "Split", "pattern": {"Regex": r"\p{Greek}"},
                                 "behavior": "Isolated"}), "not a Unicode general category"),
    (minimal_spec(pre_tokenizer={"type": "Split", "pattern": {"Regex": r"(a)\1"},
                                 "behavior": "Isolated"}), r"escape \\1 is not supported"),
    (minimal_spec(pre_tokenizer={"type": "Split", "pattern": {"Regex": "a"},
                                 "behavior": "Sideways"}), "behavior must be one of"),
    (minimal_spec(pre_tokenizer={"type": "Metaspace", "prepend_scheme": "sometimes"}),
     "prepend_scheme must be always, first or never"),
    (minimal_spec(post_processor={"type": "TemplateProcessing", "single": [
        {"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [7], "tokens": ["<s>"]}}}),
     "unknown ids"),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "message"), BAD_FILES)
def test_bad_files_are_refused_clearly(tmp_path: Path, spec: Any, message: str) -> None:
    path = write(tmp_path / "tokenizer.json", spec)
    with pytest.raises(ConfigError, match=message) as raised:
        BpeTokenizer.from_file(path)
    assert str(path) in str(raised.value)


JSON_VALUES = st.sampled_from([
    None, 0, -1, 1.5, True, "", "x", "BPE", "Sequence", [], {}, [1], ["a"], [["a", "b"]],
    {"type": "Sequence"}, {"Regex": "("}, {"String": 1}, {"a": 1},
])  # fmt: skip


def all_paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The key paths of every value nested in `value`."""
    out = [prefix]
    if isinstance(value, dict | list):
        for key, child in value.items() if isinstance(value, dict) else enumerate(value):
            out += all_paths(child, (*prefix, key))
    return out


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_mangled_files_load_or_are_refused_clearly(data: st.DataObject) -> None:
    """Any value anywhere in a valid file, changed: a `ConfigError`, or a tokenizer that works."""
    spec = minimal_spec(
        added_tokens=[{"id": 4, "content": "<s>", "special": True}],
        normalizer={"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        post_processor={"type": "TemplateProcessing", "single": [
            {"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [4], "tokens": ["<s>"]}}},
        decoder={"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"},
                                                  {"type": "Strip", "content": " ", "start": 1,
                                                   "stop": 0}]},
    )  # fmt: skip
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(all_paths(spec)[1:]))
        parent = spec
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = copy.deepcopy(data.draw(JSON_VALUES))  # never shared
    try:
        tokenizer = BpeTokenizer(spec, {}, b"")
    except ConfigError:
        return
    ids = tokenizer.encode("ab <s>x\n", add_special_tokens=True)
    assert isinstance(tokenizer.decode(ids), str)


def test_missing_and_oversized_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read the tokenizer file .*missing\.json"):
        BpeTokenizer.from_file(tmp_path / "missing.json")
    huge = tmp_path / "huge.json"
    with huge.open("wb") as file:
        file.truncate(MAX_FILE_BYTES + 1)  # sparse: nothing is written
    with pytest.raises(ConfigError, match=r"huge.json: larger than 64 MiB"):
        BpeTokenizer.from_file(huge)
    not_utf8 = tmp_path / "latin1.json"
    not_utf8.write_bytes(b'{"model": "\xe9"}')
    with pytest.raises(ConfigError, match=r"latin1\.json: not a JSON file"):
        BpeTokenizer.from_file(not_utf8)
