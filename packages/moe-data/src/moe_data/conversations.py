"""`prepare_conversations`: chat and prompt-completion rows into token shards with a label mask.

`--format chat` reads rows holding `messages`, a list of {role, content} (the format of the
Hugging Face chat datasets), renders each with the tokenizer's chat template
(`moe_data.chat_template`) and trains on the assistant's content and end-of-turn
tokens. `--format prompt-completion` reads rows holding `prompt` and `completion`: texts
(tokenized one after the other, the completion and the end-of-document token trained on) or
lists of messages (rendered as one conversation, the completion's assistant turns trained
on). `train_on="all"` trains on every token instead.

Each conversation is followed by the end-of-document id (not trained on after a chat, so
each conversation's ids are exactly the template's), so `data.document_masking` keeps
attention inside it. The output is a prepared directory (`moe_data.token_files`) with
one token shard and one mask shard (`moe_data.labels`) per input file and
`label_mask: true` in its meta.json. Any bad row, or a file without rows, stops the
preparation with a DataError naming its file (and row), and nothing is written.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from moe_data.chat_template import (
    ChatTemplate,
    RowError,
    assistant_spans,
    check_messages,
    tokens_in_spans,
)
from moe_data.compressed import open_stream
from moe_data.errors import DataError
from moe_data.inputs import InputFile, expand_inputs
from moe_data.labels import LABEL_MASK_KEY, mask_file_name
from moe_data.plan import choose_dtype
from moe_data.prepare import LOCK_FILE, check_out_dir_free, locked_work_dir, partial_dir
from moe_data.readers import file_sha256
from moe_data.shards import ShardWriter, write_json
from moe_data.tables import pyarrow_module
from moe_data.token_files import FORMAT, META_FILE, shard_file_name
from moe_data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer

FORMATS = ("text", "chat", "prompt-completion")
"""prepare-data --format values: text goes through `prepare_data`, the others here."""
TRAIN_ON = ("assistant", "all")
_FIELDS = {"chat": ("messages",), "prompt-completion": ("prompt", "completion")}
_BATCH_ROWS = 1024


class Conversations:
    """Turns rows of one format into (ids, mask) with one tokenizer and template."""

    def __init__(self, data_format: str, tokenizer: Tokenizer, train_on: str) -> None:
        if data_format not in _FIELDS:
            raise DataError(f"--format={data_format!r} is not one of {', '.join(FORMATS)}")
        if train_on not in TRAIN_ON:
            raise DataError(f"--train-on={train_on!r} is not one of {', '.join(TRAIN_ON)}")
        self.format, self.tokenizer, self.train_on = data_format, tokenizer, train_on
        self._template: ChatTemplate | None = None
        if data_format == "chat":
            self._template = self.template()

    @property
    def loaded_template(self) -> ChatTemplate | None:
        """The chat template, if a row needed it."""
        return self._template

    def template(self) -> ChatTemplate:
        """The tokenizer's chat template (loaded on first use)."""
        if self._template is None:
            if not isinstance(self.tokenizer, HFTokenizer):
                raise DataError(
                    f"--format {self.format} with messages needs a chat model's tokenizer: give "
                    "--tokenizer a Hugging Face model or tokenizer directory"
                )
            self._template = ChatTemplate(Path(self.tokenizer.name).parent)
        return self._template

    def encode(self, row: Any) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64, mask uint8) of one row, the end-of-document id included."""
        if not isinstance(row, dict):
            raise RowError("it is not an object")
        if self.format == "chat":
            ids, mask = self._render(check_messages(row.get("messages")), skip_assistants=0)
            end_trained = self.train_on == "all"
        else:
            ids, mask = self._prompt_completion(row.get("prompt"), row.get("completion"))
            # After a text completion the end-of-document id is what ends it: trained on.
            end_trained = self.train_on == "all" or isinstance(row.get("prompt"), str)
        ids = np.append(ids.astype(np.int64), self.tokenizer.eos_id)
        return ids, np.append(mask, np.uint8(end_trained))

    def _prompt_completion(self, prompt: Any, completion: Any) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(prompt, str) and isinstance(completion, str):
            prompt_ids, completion_ids = self.tokenizer.encode_batch([prompt, completion])
            if not completion_ids.size:
                raise RowError("its completion is empty, so nothing in it would be trained on")
            ids = np.concatenate([prompt_ids.astype(np.int64), completion_ids.astype(np.int64)])
            mask = np.concatenate(
                [np.full(prompt_ids.size, self.train_on == "all"), np.ones(completion_ids.size)]
            )
            return ids, mask.astype(np.uint8)
        if isinstance(prompt, list) and isinstance(completion, list):
            check_messages(prompt, needs_assistant=False)
            messages = check_messages(prompt + completion)
            if not any(m["role"] == "assistant" for m in completion):
                raise RowError("its completion has no assistant message")
            prompt_replies = sum(m["role"] == "assistant" for m in prompt)
            return self._render(messages, skip_assistants=prompt_replies)
        raise RowError(
            "it needs prompt and completion, both texts or both lists of {role, content} messages"
        )

    def _render(
        self, messages: list[dict[str, Any]], skip_assistants: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Ids of the rendered conversation, and the mask of its assistant replies after the
        first `skip_assistants`."""
        template = self.template()
        tokenizer = self.tokenizer
        assert isinstance(tokenizer, HFTokenizer)
        text = template.render(messages)
        ids, offsets = tokenizer.encode_with_offsets(text)
        if self.train_on == "all":
            return ids, np.ones(ids.size, dtype=np.uint8)
        starts = template.reply_starts(messages, text)
        spans = assistant_spans(text, messages, tokenizer.special_token_texts(), starts)
        mask = tokens_in_spans(offsets, spans[skip_assistants:])
        if not mask.any():
            raise RowError("its assistant messages hold no tokens to train on")
        return ids, mask


def read_rows(source: InputFile, fields: Sequence[str]) -> Iterator[tuple[str, Any]]:
    """(where, row) of each row of a JSON Lines, parquet or saved-dataset file; `where`
    names the file and the line or row."""
    if source.kind == "jsonl":
        yield from _jsonl_rows(source)
    elif source.kind in ("parquet", "arrow"):
        yield from _table_rows(source, fields)
    else:
        raise DataError(
            f"{source.path} is a {source.kind} file; conversations are read from JSON Lines, "
            "parquet files or Hugging Face datasets saved with save_to_disk"
        )


def _jsonl_rows(source: InputFile) -> Iterator[tuple[str, Any]]:
    with open_stream(source) as (stream, _):
        for number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            where = f"{source.path} line {number}"
            try:
                yield where, json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise DataError(f"{where} is not a JSON object ({e})") from e


def _table_rows(source: InputFile, fields: Sequence[str]) -> Iterator[tuple[str, Any]]:
    pa = pyarrow_module()
    try:
        if source.kind == "parquet":
            parquet = pa.parquet.ParquetFile(source.path)
            _check_columns(source, parquet.schema_arrow.names, fields)
            batches = parquet.iter_batches(batch_size=_BATCH_ROWS, columns=list(fields))
            yield from _batch_rows(source, batches)
            return
        with pa.memory_map(str(source.path)) as mapped:
            reader = pa.ipc.open_stream(mapped)
            _check_columns(source, reader.schema.names, fields)
            yield from _batch_rows(source, (batch.select(list(fields)) for batch in reader))
    except pa.ArrowException as e:
        raise DataError(f"{source.path} is not a readable {source.kind} file ({e})") from e


def _check_columns(source: InputFile, names: Sequence[str], fields: Sequence[str]) -> None:
    missing = [field for field in fields if field not in names]
    if missing:
        raise DataError(
            f"{source.path} has no {missing[0]!r} column (it has {', '.join(names[:8])})"
        )


def _batch_rows(source: InputFile, batches: Any) -> Iterator[tuple[str, Any]]:
    row = 0
    for batch in batches:
        for values in batch.to_pylist():
            yield f"{source.path} row {row} (counting from 0)", values
            row += 1


def prepare_conversations(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    tokenizer: str | None,
    *,
    data_format: str = "chat",
    train_on: str = "assistant",
    dtype: str | None = None,
    progress: TextIO | None = None,
) -> dict[str, Any]:
    """Tokenize the rows of `inputs` (see the module docstring) into `out_dir` (which must
    not exist or be empty) with a label mask; return its meta.json. `tokenizer`: a Hugging
    Face model or tokenizer directory, or a tokenizer.json with the template files beside
    it. `progress`: where a line per input file goes (None: nowhere)."""
    out_dir = Path(out_dir)
    check_out_dir_free(out_dir)
    tokenizer_impl = load_tokenizer(tokenizer)
    conversations = Conversations(data_format, tokenizer_impl, train_on)
    dtype = choose_dtype(dtype, tokenizer_impl.vocab_size, tokenizer_impl)
    sources = expand_inputs(inputs)
    work_dir = partial_dir(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with locked_work_dir(work_dir):
        try:
            meta = _write_all(work_dir, sources, conversations, dtype, progress)
            check_out_dir_free(out_dir)
            os.rename(work_dir, out_dir)
        except BaseException:
            shutil.rmtree(work_dir, ignore_errors=True)
            raise
    return meta


def _write_all(
    work_dir: Path,
    sources: list[InputFile],
    conversations: Conversations,
    dtype: str,
    progress: TextIO | None,
) -> dict[str, Any]:
    """One token shard and one mask shard per source in `work_dir`, then meta.json."""
    for path in work_dir.iterdir():  # what a stopped text preparation left
        if path.name != LOCK_FILE:
            path.unlink()
    shards, described = [], []
    for index, source in enumerate(sources):
        shard = _write_source(work_dir, index, source, conversations, dtype)
        shards.append(shard)
        described.append(
            {
                "path": str(source.path),
                "kind": source.kind,
                "compression": source.compression,
                "sha256": file_sha256(source.path),
                "num_tokens": shard["num_tokens"],
                "num_documents": shard["num_documents"],
            }
        )
        if progress is not None:
            print(
                f"{source.path}: {shard['num_documents']:,} rows, {shard['num_tokens']:,} "
                f"tokens, {shard['trained_tokens']:,} trained on",
                file=progress,
            )
    tokenizer = conversations.tokenizer
    template = conversations.loaded_template
    meta = {
        "format": FORMAT,
        "dtype": dtype,
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "tokenizer": tokenizer.name,
        "num_documents": sum(s["num_documents"] for s in shards),
        LABEL_MASK_KEY: True,
        "data_format": conversations.format,
        "train_on": conversations.train_on,
        "chat_template": template.origin if template is not None else None,
        "trained_tokens": sum(s["trained_tokens"] for s in shards),
        "shards": shards,
        "sources": described,
    }
    (work_dir / LOCK_FILE).unlink(missing_ok=True)
    write_json(work_dir / META_FILE, meta)
    return meta


def _write_source(
    work_dir: Path, index: int, source: InputFile, conversations: Conversations, dtype: str
) -> dict[str, Any]:
    """Token and mask shard `index` from the rows of `source`; its meta.json entry."""
    tokens = ShardWriter(work_dir / shard_file_name(index), dtype)
    mask = ShardWriter(work_dir / mask_file_name(index), "uint8")
    documents = trained = 0
    fields = _FIELDS[conversations.format]
    for where, row in read_rows(source, fields):
        try:
            row_ids, row_mask = conversations.encode(row)
        except RowError as e:
            raise DataError(f"{where}: {e}") from None
        tokens.write(row_ids, source.path)
        mask.write(row_mask, source.path)
        documents += 1
        trained += int(row_mask.sum())
    if not documents:
        tokens.discard()
        mask.discard()
        raise DataError(
            f"{source.path} holds no rows, so nothing in it would be trained on; give rows "
            f"with {' and '.join(fields)}"
        )
    return {
        "file": tokens.path.name,
        "num_tokens": tokens.num_tokens,
        "num_documents": documents,
        "sha256": tokens.commit(),
        "mask_sha256": mask.commit(),
        "trained_tokens": trained,
    }
