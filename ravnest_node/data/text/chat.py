"""Chat and instruction data (`ChatData`): a JSON Lines file of conversations
(``{"messages": [{"role": ..., "content": ...}, ...]}``) or of prompt/completion pairs
(``{"prompt": ..., "completion": ...}``), rendered with the model's own chat template
(chat_template.py), the loss counting only the assistant's tokens.

Each line becomes one sample (or one per assistant turn, for a template that rewrites earlier
turns: see `assistant_samples`) of at most seq_len + 1 tokens: inputs the first seq_len,
targets the next token of each, -100 (`IGNORE_INDEX`) wherever that token is not an assistant
turn's (content and end-of-turn token(s)) and in the padding. Longer samples are cut at the
end; a sample left with no token to learn (no assistant turn, or every one cut away) is
skipped, never trained on as nothing. The counts are logged.

The tokenizer needs ``encode(text) -> list[int]`` adding no special tokens and matching the
special tokens written in the text (``<|im_start|>``) as their ids, and ``token_to_id``.
Each span is encoded on its own, as a prompt and the reply generated after it are.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from ravnest_node.data.text.chat_template import (
    ChatTemplate,
    Sample,
    assistant_samples,
    read_tokenizer_config,
    special_token,
)
from ravnest_node.data.text.corpus import json_lines, json_object
from ravnest_node.data.text.masked_lm import IGNORE_INDEX
from ravnest_node.data.text.sampling import Epochs, check_batch, check_sharding, derive_seed
from ravnest_node.errors import ConfigError

__all__ = ["ROLES", "ChatData", "ChatTokenizer", "chat_dataset", "encode_sample", "hold_out",
           "read_chat_lines"]  # fmt: skip

log = logging.getLogger(__name__)

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
"""The roles a message may have."""


class ChatTokenizer(Protocol):
    """What chat data needs of a tokenizer."""

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, no special token added, special tokens in the text matched."""
        ...

    def token_to_id(self, token: str) -> int | None:
        """The id of `token`, or None."""
        ...

    @property
    def eos_id(self) -> int | None:
        """The tokenizer's own end-of-sequence id (data/tokenizer.py), or None."""
        ...

    @property
    def pad_id(self) -> int | None:
        """The tokenizer's own padding id, or None."""
        ...


Line = tuple[int, list[dict[str, Any]] | None, str, str]
"""A line of a chat file: its number, its messages (None for a prompt/completion line), its
prompt and completion ("" for a messages line)."""


def read_chat_lines(path: Path) -> list[Line] | None:
    """The conversations of JSON Lines file `path`, or None if it is not chat data (its first
    non-blank line is not a JSON object with ``messages``, or ``prompt`` and ``completion``):
    such a file stays text. Blank lines are skipped. ConfigError naming the file and line for
    a line that is not JSON, lacks messages or roles, or has a role outside `ROLES`."""
    numbered = json_lines(path)
    if not numbered or not _is_chat(numbered[0][1]):
        return None
    return [_line(f"{path}:{n}", n, text) for n, text in numbered]


def _is_chat(line: str) -> bool:
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        return False
    return isinstance(row, dict) and ("messages" in row or "prompt" in row)


def _line(where: str, number: int, text: str) -> Line:
    row: dict[str, Any] = json_object(where, text)
    if "messages" in row:
        return number, _messages(where, row["messages"]), "", ""
    prompt, completion = row.get("prompt"), row.get("completion")
    if isinstance(prompt, list) and isinstance(completion, list):  # conversational
        return number, _messages(where, prompt + completion), "", ""
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise ConfigError(f"{where}: needs 'messages', or 'prompt' and 'completion' strings")
    return number, None, prompt, completion


def _messages(where: str, messages: Any) -> list[dict[str, Any]]:
    """`messages` checked: a list of objects with a known role and string (or parts) content."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: 'messages' must be a non-empty list")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ConfigError(f"{where}: message {k} has no role")
        if m["role"] not in ROLES:
            raise ConfigError(f"{where}: message {k} has an unknown role {m['role']!r}; roles "
                              f"are {', '.join(sorted(ROLES))}")  # fmt: skip
        content = m.get("content")
        if not (isinstance(content, str | list) or (content is None and m.get("tool_calls"))):
            raise ConfigError(f"{where}: message {k} has no content")
    return messages


def hold_out(
    lines: Sequence[Line], fraction: float, *, where: str
) -> tuple[list[Line], list[Line]]:
    """(the lines to train on, the held-out ones): round(fraction x lines) of them, at least
    one, drawn by a seed of the line count alone, so every node holds out the same lines
    whatever the run's seed; both keep file order. ConfigError if no line is left to train."""
    held = max(1, round(fraction * len(lines)))
    if held >= len(lines):
        raise ConfigError(f"{where}: eval={fraction} of {len(lines)} lines leaves none to train")
    generator = torch.Generator().manual_seed(derive_seed("chat-eval", len(lines)))
    chosen = set(torch.randperm(len(lines), generator=generator)[:held].tolist())
    return ([x for k, x in enumerate(lines) if k not in chosen],
            [x for k, x in enumerate(lines) if k in chosen])  # fmt: skip


def encode_sample(tokenizer: ChatTokenizer, sample: Sample) -> tuple[list[int], list[bool]]:
    """The token ids of a sample and, per id, whether it lies in one of its spans: the text
    encoded piece by piece, cut at the spans' ends."""
    text, spans = sample
    ids: list[int] = []
    counted: list[bool] = []
    at = 0
    for start, end in sorted(spans):
        for piece, counts in ((text[at:start], False), (text[start:end], True)):
            if piece:
                piece_ids = tokenizer.encode(piece)
                ids += piece_ids
                counted += [counts] * len(piece_ids)
        at = end
    tail = tokenizer.encode(text[at:]) if text[at:] else []
    return ids + tail, counted + [False] * len(tail)


class ChatData:
    """Chat samples as rows, a fixed dataset dealt out to the shards one sample at a time
    (sample i to shard i mod num_shards), visited once per epoch in a fresh order.

    Row inputs are the first seq_len ids of a sample, targets the next id of each where it
    counts and `IGNORE_INDEX` elsewhere, both padded at the end (`pad_id`, IGNORE_INDEX)."""

    kind = "chat"
    cut = 0
    """Samples cut to fit seq_len + 1 tokens (by `from_samples`)."""
    skipped = 0
    """Samples skipped, no assistant token left to learn (by `from_samples`)."""

    def __init__(self, rows: torch.Tensor, targets: torch.Tensor, *, seed: int, shard: int = 0,
                 num_shards: int = 1) -> None:  # fmt: skip
        """ConfigError if this shard has no sample."""
        check_sharding(shard, num_shards, 0)
        self.seq_len = int(rows.shape[1])
        self.seed, self.shard, self.num_shards = seed, shard, num_shards
        self._rows, self._targets = rows, targets
        self.num_samples = len(range(shard, len(rows), num_shards))
        if not self.num_samples:
            raise ConfigError(
                f"shard {shard} of {num_shards} has no chat sample: there are only {len(rows)}"
            )
        self._epochs = Epochs(self.num_samples, self._seed_of)
        digest = hashlib.sha256(f"{self.kind}:seq_len={self.seq_len}\n".encode())
        digest.update(rows.numpy().tobytes())
        digest.update(targets.numpy().tobytes())
        self._fingerprint = digest.hexdigest()[:16]

    @classmethod
    def from_samples(cls, samples: Sequence[tuple[Sequence[int], Sequence[bool]]], *,
                     seq_len: int, pad_id: int, seed: int, shard: int = 0, num_shards: int = 1,
                     where: str = "the chat data") -> ChatData:  # fmt: skip
        """Rows from (ids, counted) samples: each cut to seq_len + 1 ids; a sample left with
        no counted target skipped. The counts are logged; ConfigError if none is left."""
        rows, targets, cut, skipped = [], [], 0, 0
        for ids, counted in samples:
            cut += len(ids) > seq_len + 1
            ids_t = torch.tensor(list(ids[: seq_len + 1]), dtype=torch.int64)
            mask = torch.tensor(list(counted[1 : seq_len + 1]), dtype=torch.bool)
            if not bool(mask.any()):
                skipped += 1
                continue
            row = torch.full((seq_len,), pad_id, dtype=torch.int64)
            target = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.int64)
            row[: len(ids_t) - 1] = ids_t[:-1]
            target[: len(mask)] = torch.where(mask, ids_t[1:], IGNORE_INDEX)
            rows.append(row)
            targets.append(target)
        log.info("%s: %d samples of seq %d; %d cut to fit; %d skipped (no assistant token "
                 "left to learn)", where, len(rows), seq_len, cut, skipped)  # fmt: skip
        if not rows:
            raise ConfigError(f"{where}: no sample has an assistant token to learn within "
                              f"seq {seq_len} ({skipped} skipped)")  # fmt: skip
        data = cls(torch.stack(rows), torch.stack(targets), seed=seed, shard=shard,
                   num_shards=num_shards)  # fmt: skip
        data.cut, data.skipped = cut, skipped
        return data

    @property
    def fingerprint(self) -> str:
        """First 16 hex digits of the SHA-256 of every row and its targets (equal on every
        shard, whatever the seed)."""
        return self._fingerprint

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (int64 ``[batch_size, seq_len]``) of `step`: the samples of
        `sample_ids`. A pure function of (seed, shard, num_shards, step, batch_size) and the
        data. ValueError for a negative step or a batch size below 1."""
        rows = self.shard + torch.tensor(self.sample_ids(step, batch_size)) * self.num_shards
        return self._rows[rows], self._targets[rows]

    def sample_ids(self, step: int, batch_size: int) -> list[int]:
        """This shard's sample ids of the rows of `step`'s batch; sample s is row
        ``shard + s * num_shards`` of all of them."""
        check_batch(step, batch_size)
        return self._epochs.sample_ids(step, batch_size)

    def _seed_of(self, what: str) -> int:
        return derive_seed(self.kind, self.seed, self.shard, self.num_shards, what)

    def __repr__(self) -> str:
        return (
            f"ChatData(seq_len={self.seq_len}, seed={self.seed}, shard={self.shard}, "
            f"num_shards={self.num_shards}, num_samples={self.num_samples}, "
            f"fingerprint={self.fingerprint!r})"
        )


def chat_dataset(lines: Sequence[Line], *, path: Path, directory: Path,
                 config: Mapping[str, Any], tokenizer: ChatTokenizer, seq_len: int, seed: int,
                 shard: int = 0, num_shards: int = 1) -> ChatData:  # fmt: skip
    """`ChatData` of the lines of chat file `path` for the model in `directory` (its
    ``config.json`` as `config`): conversations rendered with its chat template, prompt and
    completion lines as a user and an assistant turn (without a template: the prompt, then the
    completion and the EOS token, the loss on the latter two). Padding is the config's
    ``pad_token_id`` (what the embeddings zero), else the tokenizer config's pad token, else
    its EOS. ConfigError naming the file and line for a line the template cannot render, or
    for a conversation when the model has no chat template."""
    template = ChatTemplate.from_directory(directory)
    settings = read_tokenizer_config(directory)
    eos = special_token(settings, "eos_token")
    samples: list[tuple[list[int], list[bool]]] = []
    split = 0
    for number, messages, prompt, completion in lines:
        where = f"{path}:{number}"
        if messages is None and template is None:
            text = prompt + completion + (eos or "")
            ids, counted = encode_sample(tokenizer, (text, [(len(prompt), len(text))]))
            if eos is None and tokenizer.eos_id is not None:  # the tokenizer's own
                ids, counted = [*ids, tokenizer.eos_id], [*counted, True]
            samples.append(_without_pad(ids, counted, config, where))
            continue
        if template is None:
            raise ConfigError(f"{where}: a conversation, and the model in {directory} has no "
                              "chat template (chat_template.jinja or tokenizer_config.json's "
                              "chat_template)")  # fmt: skip
        if messages is None:
            messages = [{"role": "user", "content": prompt},
                        {"role": "assistant", "content": completion}]  # fmt: skip
        try:
            found, apart = assistant_samples(template, messages)
        except Exception as exc:  # whatever a template raises: it fails on this line
            raise ConfigError(f"{where}: the chat template ({template.where}) fails to render "
                              f"it: {type(exc).__name__}: {exc}") from None  # fmt: skip
        split += apart
        if not found:
            samples.append(([], []))  # no assistant turn: counted as skipped
        samples += [_without_pad(*encode_sample(tokenizer, s), config, where) for s in found]
    if split:
        log.info("%s: the chat template writes earlier turns otherwise; %d conversations train "
                 "each assistant turn as a sample of its own", path, split)  # fmt: skip
    return ChatData.from_samples(samples, seq_len=seq_len, pad_id=_pad_id(config, settings,
                                 tokenizer, directory), seed=seed, shard=shard,
                                 num_shards=num_shards, where=str(path))  # fmt: skip


def _without_pad(ids: list[int], counted: list[bool], config: Mapping[str, Any], where: str
                 ) -> tuple[list[int], list[bool]]:  # fmt: skip
    """(ids, counted) unchanged; ConfigError if the ids hold config.json's pad token, which the
    model's blocks take for padding (an all-zero row nobody attends to: models/pretrained/
    padding.py), so a conversation holding it would not compute what transformers computes."""
    pad = config.get("pad_token_id")
    if pad is not None and int(pad) in ids:
        raise ConfigError(f"{where}: the rendered sample holds the pad token (config.json's "
                          f"pad_token_id {pad}), which this model's blocks take for padding; "
                          "set pad_token_id to a token the data never holds")  # fmt: skip
    return ids, counted


def _pad_id(config: Mapping[str, Any], settings: Mapping[str, Any], tokenizer: ChatTokenizer,
            directory: Path) -> int:  # fmt: skip
    """The id padding rows hold (see `chat_dataset`); ConfigError if the model names none."""
    if config.get("pad_token_id") is not None:
        return int(config["pad_token_id"])
    for key in ("pad_token", "eos_token"):
        token = special_token(settings, key)
        if token is not None and (found := tokenizer.token_to_id(token)) is not None:
            return found
    for found in (tokenizer.pad_id, tokenizer.eos_id):  # its own guesses (data/tokenizer.py)
        if found is not None:
            return int(found)
    raise ConfigError(f"{directory}: chat samples are padded, and neither config.json's "
                      "pad_token_id nor tokenizer_config.json's pad_token or eos_token names a "
                      "token")  # fmt: skip
