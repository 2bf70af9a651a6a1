"""Tokenization speed of an ``hf:`` model's data: MB of text per second on one core.

Generates a multilingual corpus (seeded: the same bytes every run), trains a Llama-3-style
byte-level BPE of ``--vocab`` tokens on it with the ``tokenizers`` library, saves its
``tokenizer.json``, and times encoding the whole corpus in one call with a fresh tokenizer, best
of ``--repeats``. It reports MB/s and a digest of the ids, so two implementations can be
compared on equal output:

    # the library behind ravnest_node.data.tokenizer.TextTokenizer (this tree)
    RAYON_NUM_THREADS=1 taskset -c 0 env PYTHONPATH=$PWD python docs/bench/tokenize_speed.py
    # the tree before issue #32 (ravnest_node.data.bpe.BpeTokenizer, our own BPE)
    RAYON_NUM_THREADS=1 taskset -c 0 env PYTHONPATH=/path/to/old/tree \\
        python docs/bench/tokenize_speed.py

The implementation is the one the imported ``ravnest_node`` has.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tokenizers as tk

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def pieces(text: str) -> list[str]:
    return text.split()


SYLLABLES = {
    "en": pieces("th he in er an re on at en nd ti es or te of ed is it al ar st to nt ng se ha"),
    "de": pieces("ein ich der die und sch ung den ver cht gen ber ste auf eit hen"),
    "fr": pieces("les ent que des ait eur ion tion ous our ais par pas une con"),
    "ru": pieces("ст ен ов но ни на ра ко то ро ан ос по ре ть ал ер ли ве ка"),  # noqa: RUF001
    "zh": list("的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年"),
    "ja": list("のにはをたがでてとしれさあいうかきくけこなるもすった"),
    "ar": pieces("ال ان من في ين ات لا ها ما عل ون ير"),  # noqa: RUF001
    "hi": pieces("के में की है और से का को एक पर ने यह"),
}
"""Frequent letter groups of each language: the pieces pseudo-words are made of."""


def corpus(megabytes: float, seed: int = 0) -> str:
    """Lines of Zipf-distributed pseudo-words of eight languages, with numbers, punctuation and
    code-like lines: `megabytes` MB of UTF-8 (about)."""
    rng = random.Random(seed)
    lexicons = {}
    for lang, syllables in SYLLABLES.items():
        lexicons[lang] = [
            "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)
        ]
    weights = [1 / (k + 1) for k in range(3000)]
    langs = list(lexicons)
    lines: list[str] = []
    size = 0
    while size < megabytes * 1e6:
        lang = rng.choice(langs)
        if rng.random() < 0.05:
            line = f"    def f_{rng.randint(0, 999)}(x, y={rng.random():.3f}):  # {lang}"
        else:
            words = rng.choices(lexicons[lang], weights, k=rng.randint(4, 20))
            sep = "" if lang in ("zh", "ja") else " "
            line = sep.join(w.capitalize() if rng.random() < 0.1 else w for w in words)
            line += rng.choice([".", ",", "!", "?", "。", ";", ""]) + rng.choice(
                ["", f" {rng.randint(0, 100000)}", " (2024)", " —"]
            )
        lines.append(line)
        size += len(line.encode("utf-8")) + 1
    return "\n".join(lines)


def train(text: str, vocab: int, path: Path) -> None:
    """A Llama-3-style byte-level BPE of `vocab` tokens trained on `text`, saved at `path`."""
    tokenizer = tk.Tokenizer(tk.models.BPE(ignore_merges=True))
    tokenizer.pre_tokenizer = tk.pre_tokenizers.Sequence([
        tk.pre_tokenizers.Split(tk.Regex(LLAMA3_PATTERN), behavior="isolated"),
        tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator(text.split("\n"), trainer)
    tokenizer.save(str(path))


def load(path: Path) -> tuple[str, Any]:
    """The tokenizer of the imported ravnest_node: (its name, a fresh instance)."""
    try:
        from ravnest_node.data.tokenizer import TextTokenizer

        return "TextTokenizer (tokenizers library)", TextTokenizer.from_file(path)
    except ImportError:
        from ravnest_node.data.bpe import BpeTokenizer  # the tree before issue #32

        return "BpeTokenizer (our own BPE)", BpeTokenizer.from_file(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=3.0)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    text = corpus(args.megabytes)
    size_mb = len(text.encode("utf-8")) / 1e6
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "tokenizer.json"
        train(text, args.vocab, path)
        best = float("inf")
        for _ in range(args.repeats):
            name, tokenizer = load(path)  # a fresh one: no cache from the run before
            start = time.process_time()
            ids = tokenizer.encode(text)
            best = min(best, time.process_time() - start)
    digest = hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]
    print(f"{name}: {size_mb:.2f} MB, {len(ids)} ids (sha256 {digest}), vocab {args.vocab}: "
          f"best of {args.repeats} {best:.2f} s CPU = {size_mb / best:.2f} MB/s")  # fmt: skip


if __name__ == "__main__":
    main()
