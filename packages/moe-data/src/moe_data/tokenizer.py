"""Tokenizers: a dependency-free byte tokenizer and a wrapper for local `tokenizer.json` files."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from moe_data.errors import DataError

EOS_NAMES = ("</s>", "<|endoftext|>", "<eos>")
"""Special-token names recognised as end-of-document, in order of preference."""


class Tokenizer(Protocol):
    """What the data layer needs from a tokenizer."""

    name: str
    """How `load_tokenizer` finds it again ("byte" or a path); recorded in meta.json."""
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text`, without an end-of-document token."""
        ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` for several documents at once."""
        ...

    def decode(self, ids: Any) -> str:
        """Text of `ids`, skipping the end-of-document token."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 and `eos_id = 256`; needs no files and no download."""

    name = "byte"
    eos_id = 256
    vocab_size = 257

    def encode(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of `text` as a read-only uint8 array."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` applied to each text."""
        return [self.encode(text) for text in texts]

    def decode(self, ids: Any) -> str:
        """Text of `ids`; ids outside 0..255 (eos included) are skipped, bad UTF-8 replaced."""
        ids_array = np.asarray(ids).reshape(-1)
        byte_ids = ids_array[(ids_array >= 0) & (ids_array < 256)].astype(np.uint8)
        return byte_ids.tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _tokenizers_library() -> Any:
    try:
        import tokenizers
    except ImportError as e:
        raise DataError(
            "a tokenizer.json needs the 'tokenizers' library: pip install tokenizers "
            "(or moestack-train[tokenizers], moestack-data[tokenizers]), or use the built-in 'byte' tokenizer"
        ) from e
    return tokenizers


class HFTokenizer:
    """A local Hugging Face `tokenizer.json`, used through the `tokenizers` library."""

    def __init__(self, path: str | Path) -> None:
        """Load `path` (a tokenizer.json, or a directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(
                f"tokenizer file {path} not found; give a path to a tokenizer.json or 'byte'"
            )
        tokenizers = _tokenizers_library()
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:
            first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(
                f"tokenizer file {path} could not be read ({first_line}); "
                "give a tokenizer.json saved by the 'tokenizers' library"
            ) from e
        self.name = str(path)
        self.vocab_size: int = self._tokenizer.get_vocab_size()
        eos_id = None
        for token in EOS_NAMES:
            eos_id = self._tokenizer.token_to_id(token)
            if eos_id is not None:
                break
        if eos_id is None:
            eos_id = _configured_eos_id(self._tokenizer, path.parent)
        if eos_id is None:
            raise DataError(
                f"tokenizer file {path} has no end-of-document token; "
                f"it needs one of {', '.join(EOS_NAMES)} (or an eos_token in the "
                "tokenizer_config.json beside it)"
            )
        self.eos_id: int = eos_id
        self.vocab_size = max(self.vocab_size, eos_id + 1)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` as uint32, without special tokens added by the tokenizer."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` for several documents at once (the library parallelises the batch)."""
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(encoding.ids, dtype=np.uint32) for encoding in encodings]

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of `text` (uint32, no special tokens added, those in the text matched) and
        each token's character span in it (int64 [tokens, 2]: start, end)."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        return np.asarray(encoding.ids, dtype=np.uint32), offsets

    def special_token_texts(self) -> list[str]:
        """The text of each special added token (such as an end-of-turn token)."""
        added = self._tokenizer.get_added_tokens_decoder().values()
        return [token.content for token in added if token.special]

    def decode(self, ids: Any) -> str:
        """Text of `ids`, skipping special tokens (eos included)."""
        ids_list = [int(i) for i in np.asarray(ids).reshape(-1)]
        return self._tokenizer.decode(ids_list, skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r})"


def _configured_eos_id(tokenizer: Any, directory: Path) -> int | None:
    """The id of the eos_token that `directory`'s tokenizer_config.json names, if any."""
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    token = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(token, dict):
        token = token.get("content")
    return tokenizer.token_to_id(token) if isinstance(token, str) else None


def load_tokenizer(spec: str | Path | None) -> ByteTokenizer | HFTokenizer:
    """`None` or "byte" gives the byte tokenizer; a path to a tokenizer.json gives `HFTokenizer`."""
    if spec is None or str(spec) == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if not path.exists():
        raise DataError(
            f"tokenizer {str(spec)!r} not found; use 'byte' or a path to a tokenizer.json"
        )
    return HFTokenizer(path)
