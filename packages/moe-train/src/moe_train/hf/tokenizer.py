"""Tokenizer files of an export: the run's tokenizer.json, or the byte tokenizer rebuilt as one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BYTE_EOS_TOKEN = "<|endoftext|>"
"""Name of the byte tokenizer's end-of-document token (id 256) in the exported files."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: a printable character for each byte value."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = dict(zip(printable, printable, strict=True))
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = 256 + extra
            extra += 1
    return {byte: chr(code) for byte, code in chars.items()}


def byte_tokenizer() -> Any:
    """`moe_data.ByteTokenizer` as a `tokenizers.Tokenizer`: a byte-level BPE with no
    merges whose vocabulary gives byte b the id b, plus `BYTE_EOS_TOKEN` as id 256, so text
    encodes to its UTF-8 bytes exactly as in training."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BYTE_EOS_TOKEN])
    return tokenizer


def write_tokenizer(transformers: Any, source: Path | None, eos_id: int | None, out: Path) -> None:
    """tokenizer.json and tokenizer_config.json in `out`: from the tokenizer.json `source`
    (with the chat template of its directory, when it has one), or the byte tokenizer when
    `source` is None."""
    if source is None:
        # Training never turned text into id 256: the token's name in a text stays bytes.
        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_object=byte_tokenizer(), eos_token=BYTE_EOS_TOKEN, split_special_tokens=True
        )
    else:
        fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(source))
        if eos_id is not None:
            fast.eos_token = fast.convert_ids_to_tokens(eos_id)
        template = _chat_template_beside(source)
        if template is not None:
            fast.chat_template = template
    fast.save_pretrained(out)


def _chat_template_beside(tokenizer_file: Path) -> str | None:
    """The chat template of the directory holding `tokenizer_file` (None if it has none)."""
    from moe_data import ChatTemplate
    from moe_train.errors import DataError

    try:
        return ChatTemplate(tokenizer_file.parent).source
    except DataError:
        return None
