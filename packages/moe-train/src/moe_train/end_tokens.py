"""Which token ids end generation: the one rule `generate`, `export` and `import-hf` follow.

A run's end tokens are its tokenizer's end-of-text id and, when the tokenizer's directory
holds a chat template, the template's end-of-turn token: the first special token it renders
after an assistant reply (the token that training on conversations ends each reply's trained
span with). `moe-train generate` stops at the end-of-text id, and with `--chat` at the
end-of-turn token too; an export names both in generation_config.json (`eos_token_id`, a list
when they differ), so that transformers' `generate` stops at either.

A transformers model directory names its own end tokens (`eos_token_id` of
generation_config.json, else of config.json: one id or a list). `import-hf` records them in
the trainer state of the checkpoint it writes (`END_IDS_KEY`); generating from, or exporting,
that checkpoint ends at those ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moe_data import ChatTemplate, HFTokenizer, RowError, end_of_turn_text
from moe_train.errors import DataError, MoeTrainError

END_IDS_KEY = "end_token_ids"
"""Trainer-state key of the end ids an imported model directory named."""
_REPLY = "\x00reply\x00"


def end_of_turn_id(tokenizer: HFTokenizer, template: ChatTemplate, user: str = "Hi") -> int | None:
    """The id of `template`'s end-of-turn token: the first of `tokenizer`'s special tokens it
    renders after an assistant reply to the user message `user`; None when that is not one
    token of `tokenizer`. A RowError when the template refuses the conversation."""
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": _REPLY}]
    turn = template.render(messages)
    after = turn.find(_REPLY) + len(_REPLY) if _REPLY in turn else len(turn)
    end = end_of_turn_text(turn, after, tokenizer.special_token_texts())
    end_ids = [int(i) for i in tokenizer.encode(end)] if end else []
    return end_ids[0] if len(end_ids) == 1 else None


def tokenizer_end_of_turn(tokenizer_file: Path) -> tuple[int | None, str | None]:
    """The end-of-turn id of the chat template beside `tokenizer_file` (None when it has no
    template), and why there is none although it has a template (else None)."""
    try:
        template = ChatTemplate(tokenizer_file.parent)
    except DataError:
        return None, None
    try:
        end_of_turn = end_of_turn_id(HFTokenizer(tokenizer_file), template)
    except RowError as e:
        return None, str(e)
    if end_of_turn is None:
        return None, f"the chat template of {template.origin} ends a reply with no special token"
    return end_of_turn, None


def end_ids(eos_id: int | None, end_of_turn: int | None = None) -> list[int]:
    """The ids that end generation: the end-of-text id, then the end-of-turn id, each when
    known and once."""
    return list(dict.fromkeys(i for i in (eos_id, end_of_turn) if i is not None))


def checkpoint_end_ids(
    trainer_state: dict[str, Any], eos_id: int | None, end_of_turn: int | None = None
) -> list[int]:
    """The ids that end generation from a checkpoint: those its model directory named, when
    it was imported (`END_IDS_KEY`), else `end_ids(eos_id, end_of_turn)`."""
    recorded = trainer_state.get(END_IDS_KEY)
    if recorded:
        return [int(i) for i in recorded]
    return end_ids(eos_id, end_of_turn)


def generation_eos(ids: list[int]) -> int | list[int] | None:
    """`ids` as generation_config.json's `eos_token_id`: one id alone, a list of several."""
    return (ids[0] if len(ids) == 1 else ids) if ids else None


def model_dir_end_ids(hf_dir: Path) -> list[int]:
    """The end ids a transformers model directory names: `eos_token_id` of its
    generation_config.json, else of its config.json (one id or a list; none: empty)."""
    for name in ("generation_config.json", "config.json"):
        path = hf_dir / name
        if not path.is_file():
            continue
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise MoeTrainError(f"{path} is not readable JSON: {e}") from e
        value = raw.get("eos_token_id") if isinstance(raw, dict) else None
        if value is None or value == []:
            continue
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise MoeTrainError(
                f"{path}: eos_token_id={value!r} must be a token id or a list of token ids"
            )
        return list(dict.fromkeys(ids))
    return []
