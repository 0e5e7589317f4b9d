"""moe-data: tokenize, pack and mix corpora into token shards, and read them back as batches.

Knows nothing of models: `prepare_data` writes token shards, `TokenDataset` and
`MixedDataset` read fixed-length windows of them in an order fixed by the seed and the step.
torch is needed only to hand batches over as tensors (the `torch` extra).
"""

from moe_data.builtin import BUILTIN_STDLIB, builtin_dataset_dir, default_cache_dir
from moe_data.chat_template import ChatTemplate, RowError, end_of_turn_text
from moe_data.conversations import prepare_conversations
from moe_data.dataset import TokenDataset
from moe_data.errors import PREEMPTED_EXIT, DataError, UserError, run_command
from moe_data.file_modes import current_umask, give_umask_mode, new_scratch_dir
from moe_data.labels import (
    IGNORE_INDEX,
    encode_masked,
    inputs_and_targets,
    mask_file_of,
    token_ids,
    trained_targets,
)
from moe_data.mixture import MixedDataset, MixtureSource, open_training_data
from moe_data.prepare import PreparationStopped, prepare_data
from moe_data.readers import file_sha256
from moe_data.token_files import HEADERLESS_DTYPES, split_dtype_suffix
from moe_data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from moe_data.workers import usable_cores

__all__ = [
    "BUILTIN_STDLIB",
    "HEADERLESS_DTYPES",
    "IGNORE_INDEX",
    "PREEMPTED_EXIT",
    "ByteTokenizer",
    "ChatTemplate",
    "DataError",
    "HFTokenizer",
    "MixedDataset",
    "MixtureSource",
    "PreparationStopped",
    "RowError",
    "TokenDataset",
    "Tokenizer",
    "UserError",
    "builtin_dataset_dir",
    "current_umask",
    "default_cache_dir",
    "encode_masked",
    "end_of_turn_text",
    "file_sha256",
    "give_umask_mode",
    "inputs_and_targets",
    "load_tokenizer",
    "mask_file_of",
    "new_scratch_dir",
    "open_training_data",
    "prepare_conversations",
    "prepare_data",
    "run_command",
    "split_dtype_suffix",
    "token_ids",
    "trained_targets",
    "usable_cores",
]

__version__ = "0.1.0"
