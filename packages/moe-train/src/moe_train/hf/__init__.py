"""Hugging Face interop: export a checkpoint as a directory `transformers` loads.

Needs the optional `transformers` library (`moestack-train[hf]`) only when an export runs.
"""

from moe_train.hf.architectures import Architecture, ExportError, choose_architecture
from moe_train.hf.export import EXPORT_DTYPES, ExportResult, export_checkpoint
from moe_train.hf.tokenizer import byte_tokenizer

__all__ = [
    "EXPORT_DTYPES",
    "Architecture",
    "ExportError",
    "ExportResult",
    "byte_tokenizer",
    "choose_architecture",
    "export_checkpoint",
]
