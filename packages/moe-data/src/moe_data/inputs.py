"""What prepare-data reads: input files found from the command line, and their kinds."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from moe_data.errors import DataError

VALID_INPUTS = (
    "UTF-8 text files, JSON Lines (.jsonl, .json; also .gz or .zst compressed), .parquet, "
    "Hugging Face datasets saved with save_to_disk, .npy id arrays, or directories of them"
)

KINDS = ("text", "jsonl", "parquet", "arrow", "npy")
"""text: the whole file is one document. jsonl: one JSON object per line, its text field one
document. parquet, arrow (a file of a saved Hugging Face dataset): one document per row.
npy: token ids copied as they are."""

_COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_HF_STATE = "state.json"
_HF_INFO = "dataset_info.json"
_HF_DICT = "dataset_dict.json"


@dataclass(frozen=True)
class InputFile:
    """One input file and how to read it."""

    path: Path
    kind: str
    """One of KINDS."""
    compression: str | None
    """"gzip", "zstd" or None (text and jsonl only)."""
    size: int
    """Bytes on disk."""
    mtime_ns: int
    """Modification time, so a changed file is prepared again on resume."""


def input_file(path: Path) -> InputFile:
    """`path`'s kind and compression from its name, with its size and modification time."""
    name = path.name.lower()
    stem, suffix = os.path.splitext(name)
    compression = _COMPRESSIONS.get(suffix)
    if compression is not None:
        suffix = os.path.splitext(stem)[1]
    if suffix in _JSONL_SUFFIXES:
        kind = "jsonl"
    elif suffix in (".parquet", ".npy"):
        kind = suffix[1:]
        if compression is not None:
            raise DataError(f"{path}: a compressed {suffix} file cannot be read; decompress it")
    elif suffix == ".arrow":
        raise DataError(
            f"{path} is a lone .arrow file; give the Hugging Face dataset directory that holds "
            "it (saved by save_to_disk)"
        )
    else:
        kind = "text"
    try:
        stat = path.stat()
    except OSError as e:
        raise DataError(f"cannot read input {path} ({e.strerror})") from e
    return InputFile(path, kind, compression, stat.st_size, stat.st_mtime_ns)


def expand_inputs(inputs: Iterable[str | Path]) -> list[InputFile]:
    """The files named by `inputs`: files as given, Hugging Face dataset directories as their
    data files, other directories recursively in sorted order (skipping hidden names)."""
    files: list[InputFile] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = _walk(path)
            if not found:
                raise DataError(f"input directory {path} holds no files; give {VALID_INPUTS}")
            files.extend(found)
        elif path.is_file():
            files.append(input_file(path))
        elif path.exists():
            raise DataError(f"input {path} is not a regular file or directory; give {VALID_INPUTS}")
        else:
            raise DataError(f"input {path} not found; give {VALID_INPUTS}")
    if not files:
        raise DataError(f"no inputs given; give {VALID_INPUTS}")
    return files


def _walk(directory: Path) -> list[InputFile]:
    if _is_hf_dataset(directory):
        return hf_dataset_files(directory)
    _refuse_dataset_dict(directory)
    units: list[tuple[Path, list[InputFile] | None]] = []
    for root, dirs, names in os.walk(directory):
        root_path = Path(root)
        kept = []
        for name in dirs:
            if name.startswith("."):
                continue
            if _is_hf_dataset(root_path / name):
                units.append((root_path / name, hf_dataset_files(root_path / name)))
            else:
                _refuse_dataset_dict(root_path / name)
                kept.append(name)
        dirs[:] = kept
        units += [(root_path / n, None) for n in names if not n.startswith(".")]
    files: list[InputFile] = []
    for path, dataset in sorted(units, key=lambda unit: unit[0]):
        if dataset is not None:
            files.extend(dataset)
        elif path.is_file():
            files.append(input_file(path))
    return files


def _is_hf_dataset(directory: Path) -> bool:
    return (directory / _HF_STATE).is_file() and (directory / _HF_INFO).is_file()


def _refuse_dataset_dict(directory: Path) -> None:
    dict_file = directory / _HF_DICT
    if not dict_file.is_file():
        return
    try:
        splits = json.loads(dict_file.read_text(encoding="utf-8"))["splits"]
        listing = ", ".join(str(split) for split in splits)
        example = directory / str(splits[0])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        listing, example = "see its dataset_dict.json", directory / "train"
    raise DataError(
        f"{directory} is a Hugging Face DatasetDict (splits: {listing}); give the directory of "
        f"the split to prepare, e.g. {example}"
    )


def hf_dataset_files(directory: Path) -> list[InputFile]:
    """The arrow data files of a dataset saved by `datasets`' save_to_disk, in its order."""
    state_path = directory / _HF_STATE
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(
            f"{state_path} is not the state file of a dataset saved by save_to_disk ({e!r}); "
            "save the dataset again"
        ) from e
    files = []
    for name in names:
        path = directory / str(name)
        if not path.is_file():
            raise DataError(f"{state_path} lists {name}, which is missing; save the dataset again")
        stat = path.stat()
        files.append(InputFile(path, "arrow", None, stat.st_size, stat.st_mtime_ns))
    if not files:
        raise DataError(f"{state_path} lists no data files; save the dataset again")
    return files
