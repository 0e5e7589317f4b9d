"""`moe-train prepare-data INPUT... --out DIR`."""

import argparse
import sys
from pathlib import Path
from typing import Any

from moe_train.cli.command import Command
from moe_train.errors import DataError


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", type=Path, metavar="INPUT")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="'byte' (default), the path of a tokenizer.json, or a Hugging Face model or "
        "tokenizer directory (its tokenizer.json, tokenizer_config.json and chat template; "
        "needs the tokenizers package)",
    )
    parser.add_argument(
        "--format",
        default="text",
        choices=["text", "chat", "prompt-completion"],
        help="text: documents for pretraining (default). chat: rows with messages, a list of "
        "{role, content}, rendered with the tokenizer's chat template, with a label mask "
        "(train with data.label_mask). prompt-completion: rows with prompt and completion "
        "(texts, or lists of messages), the completion trained on",
    )
    parser.add_argument(
        "--train-on",
        default="assistant",
        choices=["assistant", "all"],
        help="with --format chat or prompt-completion: the tokens the label mask marks: the "
        "assistant's replies and end-of-turn tokens (default; the completion for "
        "prompt-completion), or all of them",
    )
    parser.add_argument(
        "--workers", type=int, default=None, metavar="N", help="processes (default: the cores)"
    )
    parser.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="the JSON field or column that holds the text (default: text)",
    )
    parser.add_argument(
        "--shard-size",
        default=None,
        metavar="SIZE",
        help="input bytes per output shard, e.g. 256M (default: about 64 shards, 1M to 256M each)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "uint16", "uint32"],
        help="token id dtype (default auto: uint16 when every id fits)",
    )


def _handle(args: argparse.Namespace) -> int:
    meta, contents = _prepare_text(args) if args.format == "text" else _prepare_conversations(args)
    print(
        f"wrote {meta['num_tokens']:,} tokens of {meta['num_documents']:,} {contents} to {args.out}"
    )
    return 0


def _prepare_text(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """--format text, documents for pretraining: the written meta and what it holds, in words."""
    from moe_data import prepare_data, usable_cores

    if args.train_on != "assistant":
        raise DataError("--train-on applies to --format chat and prompt-completion only")
    meta = prepare_data(
        args.inputs,
        args.out,
        tokenizer=args.tokenizer,
        workers=usable_cores() if args.workers is None else args.workers,
        text_field=args.text_field,
        shard_size=args.shard_size,
        dtype=args.dtype,
        progress=sys.stderr,
    )
    return meta, f"documents ({meta['dtype']}, {len(meta['shards'])} shards)"


def _prepare_conversations(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """--format chat or prompt-completion, conversations with a label mask: the written meta
    and what it holds, in words."""
    from moe_data import prepare_conversations

    for flag, value, default in (
        ("--text-field", args.text_field, "text"),
        ("--shard-size", args.shard_size, None),
        ("--workers", args.workers, None),
    ):
        if value != default:
            raise DataError(
                f"{flag} applies to --format text only; --format {args.format} reads its own "
                "fields and writes one shard per input file"
            )
    meta = prepare_conversations(
        args.inputs,
        args.out,
        args.tokenizer,
        data_format=args.format,
        train_on=args.train_on,
        dtype=args.dtype,
        progress=sys.stderr,
    )
    trained = f"{meta['trained_tokens']:,} trained on, {meta['dtype']}"
    return meta, f"conversations ({trained}) with a label mask"


PREPARE_DATA = Command(
    name="prepare-data",
    help="tokenize text, JSON Lines, parquet or Hugging Face datasets into token shards",
    description="Tokenize UTF-8 text files (one document each), JSON Lines (.jsonl, .json; "
    "also .gz or .zst), .parquet files, Hugging Face datasets saved with save_to_disk and "
    "pre-tokenized .npy arrays into DIR/meta.json and token shards DIR/tokens-*.bin. "
    "Stopped (Ctrl-C, SIGTERM, a crash), the same command continues where it stopped. "
    "--format chat and prompt-completion write conversations with a label mask beside the "
    "tokens (DIR/mask-*.bin) for fine-tuning with data.label_mask.",
    add_arguments=_add_arguments,
    handle=_handle,
)
