"""Data layer: tokenizers, `prepare_data` for token shards, and the `TokenDataset` the trainer
reads."""

from moe_train.data.builtin import builtin_dataset_dir
from moe_train.data.dataset import TokenDataset
from moe_train.data.mixture import MixedDataset, MixtureSource, open_training_data
from moe_train.data.prepare import PreparationStopped, prepare_data
from moe_train.data.token_files import HEADERLESS_DTYPES, split_dtype_suffix
from moe_train.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from moe_train.data.workers import usable_cores

__all__ = [
    "HEADERLESS_DTYPES",
    "ByteTokenizer",
    "HFTokenizer",
    "MixedDataset",
    "MixtureSource",
    "PreparationStopped",
    "TokenDataset",
    "Tokenizer",
    "builtin_dataset_dir",
    "load_tokenizer",
    "open_training_data",
    "prepare_data",
    "split_dtype_suffix",
    "usable_cores",
]
