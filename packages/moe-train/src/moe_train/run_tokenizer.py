"""The tokenizer a run's data was prepared with, read from its data sources' meta.json.

`generate`, `export`, the loop's eval.tasks and `moe-train eval` all take the run's tokenizer
from here.
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_data import ByteTokenizer, HFTokenizer, load_tokenizer
from moe_plan.config import Config

BUILTIN_DATA_PREFIX = "builtin:"
BYTE_EOS_ID = 256
"""The byte tokenizer's end-of-document id (moe_data.ByteTokenizer)."""


def run_tokenizer(config: Config) -> tuple[ByteTokenizer | HFTokenizer | None, int | None]:
    """The tokenizer the run's data was prepared with (None when unknown or not on this
    machine) and its end-of-text id (None when unknown)."""
    with_tokenizer, tokenizer_file, eos_id, _ = tokenizer_of_run(config)
    if not with_tokenizer:
        return None, eos_id
    return load_tokenizer(tokenizer_file), eos_id


def tokenizer_of_run(config: Config) -> tuple[bool, Path | None, int | None, list[str]]:
    """Whether to write tokenizer files, the run's tokenizer.json (None: the byte tokenizer),
    its end-of-document id, and notes on what will not be written."""
    specs: set[tuple[str | None, int | None]] = set()
    for path in config.data.paths:
        if path.startswith(BUILTIN_DATA_PREFIX):
            specs.add(("byte", BYTE_EOS_ID))
            continue
        meta_path = Path(path) / "meta.json"
        if not meta_path.is_file():
            specs.add((None, None))  # a .npy token array, or data not on this machine
            continue
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            specs.add((None, None))
            continue
        specs.add((meta.get("tokenizer"), meta.get("eos_id")))
    known = {s for s in specs if s[0] is not None}
    if len(known) != 1 or len(specs) != 1:
        reason = (
            "were prepared with different tokenizers"
            if len(known) > 1
            else ("include pre-tokenized arrays or directories not on this machine")
        )
        eos_id = next(iter(known))[1] if len(known) == 1 else None
        return False, None, eos_id, [f"wrote no tokenizer files: the run's data.paths {reason}"]
    ((spec, eos_id),) = known
    if spec == "byte":
        return True, None, eos_id, []
    tokenizer_file = Path(spec)
    if not tokenizer_file.is_file():
        return (
            False,
            None,
            eos_id,
            [f"wrote no tokenizer files: {tokenizer_file} is not on this machine"],
        )
    return True, tokenizer_file, eos_id, []
