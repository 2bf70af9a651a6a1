"""A model's own chat template (`ChatTemplate`), rendered as the Hugging Face ecosystem renders
it, and where each assistant turn lies in the text it renders (`assistant_samples`).

The template is Jinja source from the model directory: ``chat_template.jinja`` (newer
transformers saves it there) or ``tokenizer_config.json``'s ``chat_template``. It runs in
Jinja's immutable sandbox with what transformers gives a template (``apply_chat_template``):
trim_blocks and lstrip_blocks, the loopcontrols extension, ``raise_exception``, ``tojson``,
``strftime_now`` (of a fixed day: the data must not change with the day a node starts), the
variables ``messages``, ``add_generation_prompt``, ``tools``, ``documents`` and the
tokenizer's special tokens (``bos_token``, ``eos_token``...). A ``{% generation %}`` block
renders its body unchanged. Nothing in a template reaches Python
beyond what the sandbox allows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from ravnest_node.errors import ConfigError

__all__ = ["ChatTemplate", "Sample", "assistant_samples", "read_tokenizer_config"]

Sample = tuple[str, list[tuple[int, int]]]
"""A text to train on and the character spans ``[start, end)`` in it whose tokens the loss
counts."""

_FIXED_NOW = datetime(2024, 7, 26)
"""What ``strftime_now`` tells a template (Llama 3.1's writes today's date): one fixed day, the
default of Llama 3.1's own template, so that every node renders the same data on any day."""

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                 "mask_token")  # fmt: skip


def read_tokenizer_config(directory: Path) -> dict[str, Any]:
    """The directory's ``tokenizer_config.json``, or {} if it has none; ConfigError naming the
    file if it cannot be read or is not a JSON object."""
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read it: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return config


def special_token(config: Mapping[str, Any], key: str) -> str | None:
    """The text of special token `key` (``eos_token``...) of a tokenizer config: a string, or
    the ``content`` of an added-token object, as older files write it."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A model's chat template, compiled once; `render` gives the text of a conversation."""

    def __init__(self, source: str, *, where: str, special: Mapping[str, str]) -> None:
        """ConfigError naming `where` (the template's file) if `source` is not a template."""
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.where = where
        self._special = dict(special)
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _generation_extension()],
        )  # fmt: skip
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _FIXED_NOW.strftime
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"{where}: the chat template is not valid Jinja: {exc}") from None

    @classmethod
    def from_directory(cls, directory: Path) -> ChatTemplate | None:
        """The template of the model in `directory` (``chat_template.jinja`` first, then
        ``tokenizer_config.json``'s ``chat_template``), or None if it has none."""
        config = read_tokenizer_config(directory)
        special = {k: v for k in _SPECIAL_KEYS if (v := special_token(config, k)) is not None}
        jinja = directory / "chat_template.jinja"
        if jinja.is_file():
            try:
                text = jinja.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{jinja}: cannot read it: {exc}") from None
            return cls(text, where=str(jinja), special=special)
        where = f"{directory / 'tokenizer_config.json'} (chat_template)"
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates, as some older files hold them
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if source is None:
            return None
        if not isinstance(source, str):
            raise ConfigError(f"{where}: not a string (nor a list naming a 'default' one)")
        return cls(source, where=where, special=special)

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool
               ) -> str:  # fmt: skip
        """The text of `messages` as the template writes it (with the prompt that opens an
        assistant turn when `add_generation_prompt`). Raises `jinja2.TemplateError` (and
        others a broken template may raise) for the caller to name the line at fault."""
        return self._template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            tools=None, documents=None, **self._special,
        )  # fmt: skip


def assistant_samples(template: ChatTemplate, messages: Sequence[Mapping[str, Any]]
                      ) -> tuple[list[Sample], bool]:  # fmt: skip
    """The samples that train on the assistant turns of `messages`, and whether the
    template made them more than one.

    Assistant turn i spans the text that rendering the conversation up to and including it
    adds to rendering the conversation before it with the generation prompt (where the two
    differ, from the first character they differ at): the turn's content and its end-of-turn
    token(s) as the template writes them, without the whitespace that follows the last of
    them (a separator the model never generates). This needs no ``{% generation %}``
    markers. Normally the whole conversation is one sample holding every turn's span. A
    template that writes earlier turns otherwise than it wrote them when they were the last
    (Qwen3 drops their reasoning) makes each turn a sample of its own, with the context the
    model sees when it writes that turn. Messages after the last assistant turn are left
    out; no assistant turn (or only empty ones): no sample."""
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not turns:
        return [], False
    full = template.render(messages[: turns[-1] + 1], add_generation_prompt=False)
    joint: list[tuple[int, int]] = []
    alone: list[Sample] = []
    for i in turns:
        before = _prompt(template, messages[:i])
        upto = (
            full
            if i == turns[-1]
            else template.render(messages[: i + 1], add_generation_prompt=False)
        )
        start = _common_prefix(before, upto)
        end = max(start, len(upto.rstrip()))
        if end == start:
            continue  # an empty turn: nothing to learn
        if full.startswith(upto[:end]):
            joint.append((start, end))
        else:
            alone.append((upto[:end], [(start, end)]))
    samples = ([(full, joint)] if joint else []) + alone
    return samples, len(samples) > 1


def _prompt(template: ChatTemplate, messages: Sequence[Mapping[str, Any]]) -> str:
    """What the template writes before the assistant's turn that follows `messages`; "" when
    the conversation opens with that turn and the template cannot render no message at all
    (many read ``messages[0]`` unguarded)."""
    if messages:
        return template.render(messages, add_generation_prompt=True)
    try:
        return template.render(messages, add_generation_prompt=True)
    except Exception:  # the template's own failure: nothing comes before the turn
        return ""


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of `a` and `b`."""
    if b.startswith(a):
        return len(a)
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:  # fmt: skip
    """Jinja's ``tojson`` as transformers defines it for templates (no HTML escaping)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


def _raise(message: str) -> None:
    """The template's own refusal (``raise_exception('...')``)."""
    import jinja2

    raise jinja2.TemplateError(message)


def _generation_extension() -> Any:
    """A Jinja extension for ``{% generation %}...{% endgeneration %}`` (transformers marks
    assistant text with it): the body renders unchanged."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> list[nodes.Node]:
            next(parser.stream)
            body: list[nodes.Node] = parser.parse_statements(
                ("name:endgeneration",), drop_needle=True
            )
            return body

    return Generation
