"""Data layer: tokenizers, `prepare_data` for token memmaps, and the `TokenDataset` the trainer reads."""

from moe_train.data.builtin import builtin_dataset_dir
from moe_train.data.dataset import TokenDataset
from moe_train.data.prepare import prepare_data
from moe_train.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "TokenDataset",
    "Tokenizer",
    "builtin_dataset_dir",
    "load_tokenizer",
    "prepare_data",
]
