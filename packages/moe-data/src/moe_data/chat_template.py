"""A tokenizer's chat template, rendered as transformers renders it, and label masks from it.

The template comes from a Hugging Face model or tokenizer directory: `chat_template.jinja`
(what transformers 5 writes) or the `chat_template` field of `tokenizer_config.json` (what
earlier releases wrote). It is rendered with jinja2 in the environment transformers gives
templates (a sandbox with trim_blocks, lstrip_blocks, loop controls; `raise_exception`,
`strftime_now` and a `tojson` that does not escape HTML) and the tokenizer's special tokens
(`bos_token`, `eos_token`, ...) as variables, so no transformers install is needed.

Which tokens are trained on is decided on the rendered text: each assistant message's
content is found, in order, in the text; its span starts where the template's generation
prompt for it ends (when the conversation before it renders as a prefix of the text: then
reasoning rendered before the content is part of the reply), else at the content, and runs
through the end-of-turn token that follows (the first special token after the content).
Tokens whose character offsets overlap a span are trained on. Messages' reasoning is also
given under `reasoning_content` and `thinking`, the names templates read, as transformers
gives it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from moe_data.errors import DataError

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
ROLES = ("system", "user", "assistant", "tool", "developer")
"""Roles a message may have."""
_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


class RowError(DataError):
    """One input row cannot be rendered; the caller adds its file and row."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """The chat template of a model or tokenizer directory."""

    def __init__(
        self,
        directory: Path,
        missing: str = "give the directory of a chat model's tokenizer, or use --format text",
    ) -> None:
        """The template of `directory`; a DataError ending with `missing` when it has none."""
        config_path = directory / CONFIG_FILE
        config: dict[str, Any] = {}
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise DataError(f"{config_path} is not readable JSON ({e})") from e
        template_path = directory / TEMPLATE_FILE
        if template_path.is_file():
            source, self.origin = template_path.read_text(encoding="utf-8"), str(template_path)
        elif isinstance(config.get("chat_template"), str):
            source, self.origin = config["chat_template"], f"{config_path} chat_template"
        else:
            raise DataError(
                f"{directory} has no chat template (neither {TEMPLATE_FILE} nor a chat_template "
                f"in {CONFIG_FILE}); {missing}"
            )
        self.special_tokens = {
            key: text for key in _SPECIAL_TOKEN_KEYS if (text := _token_text(config.get(key)))
        }
        """The tokenizer's special tokens by name, as templates see them."""
        self.source = source
        self._template = _compile(source, self.origin)

    def render(self, messages: Sequence[dict[str, Any]], generation_prompt: bool = False) -> str:
        """The conversation's text, as `apply_chat_template(messages, tokenize=False,
        add_generation_prompt=generation_prompt)`."""
        import jinja2

        try:
            return self._template.render(
                messages=[_alias_reasoning(message) for message in messages],
                tools=None,
                documents=None,
                add_generation_prompt=generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as e:
            raise RowError(f"the chat template ({self.origin}) refused it: {e}") from e

    def reply_starts(self, messages: Sequence[dict[str, Any]], text: str) -> dict[int, int]:
        """Where in `text` (the whole conversation rendered) each assistant reply begins,
        when the template renders the conversation before it, with the generation prompt,
        as a prefix of `text` (then a reply's reasoning, rendered before its content, is
        part of it); replies it does not are left out."""
        starts = {}
        for index, message in enumerate(messages):
            if message["role"] != "assistant" or index == 0:
                continue
            try:
                prefix = self.render(messages[:index], generation_prompt=True)
            except RowError:
                continue
            if text.startswith(prefix):
                starts[index] = len(prefix)
        return starts


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """A message with its reasoning (under any of its usual names) also under
    `reasoning_content` and `thinking`, the names templates read, as transformers does."""
    reasoning = next(
        (message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None
    )
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _compile(source: str, origin: str) -> Any:
    """The template, compiled in a sandbox configured as transformers configures its own."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return environment.from_string(source)
    except jinja2.TemplateError as e:
        raise DataError(f"the chat template in {origin} is not valid jinja ({e})") from e


def check_messages(messages: Any, needs_assistant: bool = True) -> list[dict[str, Any]]:
    """`messages` as a list of {role, content} dicts (null values dropped); RowError naming
    what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise RowError("its messages are not a non-empty list of {role, content} objects")
    if not all(isinstance(message, dict) for message in messages):
        index = next(i for i, m in enumerate(messages) if not isinstance(m, dict))
        raise RowError(f"message {index} is not an object with role and content")
    # Keys whose value is null are dropped, as transformers drops them (tables fill every
    # message with every key any message has).
    messages = [{k: v for k, v in message.items() if v is not None} for message in messages]
    for index, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            raise RowError(f"message {index} has role {role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise RowError(f"message {index} ({role}) has no text content")
    if needs_assistant and not any(m["role"] == "assistant" for m in messages):
        raise RowError("it has no assistant message, so nothing in it would be trained on")
    return messages


def assistant_spans(
    text: str,
    messages: Sequence[dict[str, Any]],
    special_tokens: Sequence[str],
    reply_starts: dict[int, int] | None = None,
) -> list[tuple[int, int]]:
    """Character spans (start, end) of each assistant message's content in `text` and the
    end-of-turn token after it (the first of `special_tokens` that follows). A span starts
    earlier, at `reply_starts[index]` (see `ChatTemplate.reply_starts`), when that lies
    between the end of the message before and the content."""
    reply_starts = reply_starts or {}
    spans, cursor = [], 0
    for index, message in enumerate(messages):
        found = _find_content(text, message["content"], cursor)
        if message["role"] != "assistant":
            cursor = found[1] if found is not None else cursor
            continue
        if found is None:
            raise RowError(
                f"the content of message {index} (assistant) does not appear in the text the "
                "chat template renders, so its tokens cannot be found"
            )
        turn_end = _end_of_turn(text, found[1], special_tokens)
        start = reply_starts.get(index, found[0])
        spans.append((start if cursor <= start <= found[0] else found[0], turn_end))
        cursor = turn_end
    return spans


def _find_content(text: str, content: str, cursor: int) -> tuple[int, int] | None:
    """Where `content` is rendered in `text` from `cursor` on: as it is, else trimmed (as
    templates that trim messages render it); None if neither is there."""
    for wanted in (content, content.strip()):
        start = text.find(wanted, cursor) if wanted else -1
        if start >= 0:
            return start, start + len(wanted)
    return None


def _end_of_turn(text: str, position: int, special_tokens: Sequence[str]) -> int:
    """The end of the first special token at or after `position` (`position` if none)."""
    token = end_of_turn_text(text, position, special_tokens)
    return text.find(token, position) + len(token) if token is not None else position


def end_of_turn_text(text: str, position: int, special_tokens: Sequence[str]) -> str | None:
    """The first of `special_tokens` in `text` at or after `position` (None if none): after
    an assistant reply, its end-of-turn token."""
    first: tuple[int, str] | None = None
    for token in special_tokens:
        found = text.find(token, position) if token else -1
        if found >= 0 and (first is None or found < first[0]):
            first = (found, token)
    return first[1] if first is not None else None


def tokens_in_spans(offsets_T2: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """uint8 [T]: 1 for each token whose characters (offsets_T2: start, end) overlap one of
    `spans`."""
    starts, ends = offsets_T2[:, 0], offsets_T2[:, 1]
    trained = np.zeros(len(offsets_T2), dtype=bool)
    for span_start, span_end in spans:
        trained |= (starts < span_end) & (ends > span_start) & (ends > starts)
    return trained.astype(np.uint8)
