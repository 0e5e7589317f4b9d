"""Tokenize text, JSONL and pre-tokenized .npy files into one flat token memmap with metadata.

A prepared dataset is a directory holding `tokens.bin` (raw uint16 or uint32 ids, documents
each followed by `eos_id`) and `meta.json`. It appears under its final name only when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from moe_train.data.tokenizer import Tokenizer, load_tokenizer
from moe_train.errors import DataError

FORMAT = "moe-stack-tokens-v1"
TOKENS_FILE = "tokens.bin"
META_FILE = "meta.json"
VALID_INPUTS = "UTF-8 text files, .jsonl files with a 'text' field, .npy id arrays or directories"

_JSONL_BATCH_DOCUMENTS = 1024
_JSONL_BATCH_CHARS = 8 << 20
_NPY_COPY_CHUNK = 8 << 20


def prepare_data(
    inputs: Sequence[str | Path], out_dir: str | Path, tokenizer: str | None = None
) -> dict[str, Any]:
    """Tokenize `inputs` into `out_dir` (which must not exist or be empty); return its metadata.

    `tokenizer` is "byte" (default when None) or a path to a tokenizer.json. The data is
    written into a temporary directory next to `out_dir` and renamed into place when complete.
    """
    out_dir = Path(out_dir)
    _check_out_dir_free(out_dir)
    files = expand_inputs(inputs)
    tokenizer_impl = load_tokenizer(tokenizer)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    temp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        meta = write_dataset(files, temp_dir, tokenizer_impl)
        _check_out_dir_free(out_dir)
        try:
            os.rename(temp_dir, out_dir)
        except OSError as e:
            raise DataError(
                f"output directory {out_dir} already exists; choose another --out or delete it"
            ) from e
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    return meta


def _check_out_dir_free(out_dir: Path) -> None:
    if out_dir.is_dir():
        if any(out_dir.iterdir()):
            raise DataError(
                f"output directory {out_dir} already exists; choose another --out or delete it"
            )
    elif out_dir.exists():
        raise DataError(f"output path {out_dir} is a file, not a directory; choose another --out")


def expand_inputs(inputs: Iterable[str | Path]) -> list[Path]:
    """The files named by `inputs`: files as given, directories recursively in sorted order.

    Hidden files and directories (names starting with ".") inside a directory are skipped.
    """
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = []
            for root, dirs, names in os.walk(path):
                dirs[:] = [d for d in dirs if not d.startswith(".")]
                found += [Path(root) / name for name in names if not name.startswith(".")]
            found = sorted(p for p in found if p.is_file())
            if not found:
                raise DataError(f"input directory {path} holds no files; give {VALID_INPUTS}")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        elif path.exists():
            raise DataError(f"input {path} is not a regular file or directory; give {VALID_INPUTS}")
        else:
            raise DataError(f"input {path} not found; give {VALID_INPUTS}")
    if not files:
        raise DataError(f"no inputs given; give {VALID_INPUTS}")
    return files


def input_kind(path: Path) -> str:
    """ "npy", "jsonl" or "text", from the file name's suffix."""
    suffix = path.suffix.lower()
    if suffix == ".npy":
        return "npy"
    if suffix == ".jsonl":
        return "jsonl"
    return "text"


def open_token_array(path: Path) -> np.ndarray:
    """Memory-map a .npy file and check it is a 1-D integer array."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DataError(
            f"{path} is not a readable .npy file ({e}); give a 1-D integer array saved by np.save"
        ) from e
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise DataError(
            f"{path} holds a {array.ndim}-D {array.dtype} array; token files must be 1-D integer arrays"
        )
    return array


def token_array_max(path: Path, array: np.ndarray) -> int:
    """Largest id in `array` (-1 when empty); negative ids are an error naming `path`."""
    if array.size == 0:
        return -1
    if array.dtype.kind == "i" and int(array.min()) < 0:
        raise DataError(f"{path} holds negative token ids; ids must be >= 0")
    return int(array.max())


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise DataError(f"vocab_size={vocab_size} is too large; token ids must fit in uint32")


def write_dataset(files: Sequence[Path], dest_dir: Path, tokenizer: Tokenizer) -> dict[str, Any]:
    """Tokenize `files` into `dest_dir/tokens.bin` and `dest_dir/meta.json`; return the metadata.

    Holds one file's tokens at a time (one batch of lines for JSONL, chunks for .npy).
    """
    vocab_size = tokenizer.vocab_size
    for path in files:
        if input_kind(path) == "npy":
            vocab_size = max(vocab_size, token_array_max(path, open_token_array(path)) + 1)
    dtype = token_dtype(vocab_size)
    eos = np.array([tokenizer.eos_id], dtype=dtype)

    sources: list[dict[str, Any]] = []
    with open(dest_dir / TOKENS_FILE, "wb") as out:
        for path in files:
            kind = input_kind(path)
            if kind == "npy":
                source = _copy_npy(path, out, dtype)
            elif kind == "jsonl":
                source = _tokenize_jsonl(path, out, dtype, tokenizer, eos)
            else:
                source = _tokenize_text(path, out, dtype, tokenizer, eos)
            sources.append({"path": str(path), "kind": kind, **source})
        out.flush()
        os.fsync(out.fileno())

    meta = {
        "format": FORMAT,
        "dtype": dtype.name,
        "num_tokens": sum(s["num_tokens"] for s in sources),
        "vocab_size": vocab_size,
        "eos_id": tokenizer.eos_id,
        "tokenizer": tokenizer.name,
        "num_documents": sum(s["num_documents"] for s in sources),
        "sources": sources,
    }
    with open(dest_dir / META_FILE, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    return meta


def _copy_npy(path: Path, out: BinaryIO, dtype: np.dtype) -> dict[str, Any]:
    """Copy a pre-tokenized array verbatim (no eos added; it counts as no documents)."""
    array = open_token_array(path)
    for start in range(0, array.size, _NPY_COPY_CHUNK):
        np.asarray(array[start : start + _NPY_COPY_CHUNK]).astype(dtype).tofile(out)
    return {"sha256": _file_sha256(path), "num_tokens": int(array.size), "num_documents": 0}


def _tokenize_text(
    path: Path, out: BinaryIO, dtype: np.dtype, tokenizer: Tokenizer, eos: np.ndarray
) -> dict[str, Any]:
    """The whole file is one document."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path} is not UTF-8 text (bad byte at offset {e.start}); give {VALID_INPUTS}"
        ) from e
    ids = tokenizer.encode(text)
    np.concatenate([ids.astype(dtype), eos]).tofile(out)
    return {
        "sha256": hashlib.sha256(raw).hexdigest(),
        "num_tokens": int(ids.size) + 1,
        "num_documents": 1,
    }


def _tokenize_jsonl(
    path: Path, out: BinaryIO, dtype: np.dtype, tokenizer: Tokenizer, eos: np.ndarray
) -> dict[str, Any]:
    """Each non-blank line is a JSON object whose "text" string is one document."""
    digest = hashlib.sha256()
    num_tokens = 0
    num_documents = 0
    texts: list[str] = []
    pending_chars = 0

    def flush() -> None:
        nonlocal num_tokens, num_documents, pending_chars
        if not texts:
            return
        pieces: list[np.ndarray] = []
        for ids in tokenizer.encode_batch(texts):
            pieces += [ids.astype(dtype), eos]
        chunk = np.concatenate(pieces)
        chunk.tofile(out)
        num_tokens += int(chunk.size)
        num_documents += len(texts)
        texts.clear()
        pending_chars = 0

    with open(path, "rb") as f:
        for line_number, raw_line in enumerate(f, start=1):
            digest.update(raw_line)
            if not raw_line.strip():
                continue
            texts.append(_jsonl_text(path, line_number, raw_line))
            pending_chars += len(texts[-1])
            if len(texts) >= _JSONL_BATCH_DOCUMENTS or pending_chars >= _JSONL_BATCH_CHARS:
                flush()
    flush()
    return {"sha256": digest.hexdigest(), "num_tokens": num_tokens, "num_documents": num_documents}


def _jsonl_text(path: Path, line_number: int, raw_line: bytes) -> str:
    try:
        record = json.loads(raw_line)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:{line_number}: not UTF-8; each line must be a JSON object") from e
    except ValueError as e:
        reason = getattr(e, "msg", str(e))
        raise DataError(
            f'{path}:{line_number}: invalid JSON ({reason}); each line must be like {{"text": "..."}}'
        ) from e
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise DataError(
            f'{path}:{line_number}: no "text" string field; each line must be like {{"text": "..."}}'
        )
    return text


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
