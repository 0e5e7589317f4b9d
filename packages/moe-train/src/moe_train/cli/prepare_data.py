"""`moe-train prepare-data INPUT... --out DIR`."""

import argparse
import sys
from pathlib import Path

from moe_train.cli.command import Command


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", type=Path, metavar="INPUT")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="'byte' (default) or the path of a tokenizer.json (needs the tokenizers package)",
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
    from moe_train.data import prepare_data, usable_cores

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
    print(
        f"wrote {meta['num_tokens']:,} tokens of {meta['num_documents']:,} documents "
        f"({meta['dtype']}, {len(meta['shards'])} shards) to {args.out}"
    )
    return 0


PREPARE_DATA = Command(
    name="prepare-data",
    help="tokenize text, JSON Lines, parquet or Hugging Face datasets into token shards",
    description="Tokenize UTF-8 text files (one document each), JSON Lines (.jsonl, .json; "
    "also .gz or .zst), .parquet files, Hugging Face datasets saved with save_to_disk and "
    "pre-tokenized .npy arrays into DIR/meta.json and token shards DIR/tokens-*.bin. "
    "Stopped (Ctrl-C, SIGTERM, a crash), the same command continues where it stopped.",
    add_arguments=_add_arguments,
    handle=_handle,
)
