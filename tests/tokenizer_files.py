"""Tokenizer files for tests that need a real tokenizer.json."""

from pathlib import Path

import pytest


def bpe_tokenizer_file(directory: Path, text: str) -> Path:
    """A small byte-level BPE tokenizer.json trained on `text`, with <|endoftext|>."""
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([text], trainer=trainer)
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return path
