"""The `moe-train` command line: train, prepare-data, inspect."""

import argparse
import json
import os
import sys
from pathlib import Path

from moe_train.errors import MoeTrainError

USAGE_EXIT = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-train", description="Train Mixture-of-Experts language models."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser(
        "train",
        help="train a model from a YAML config",
        description="Train from CONFIG.yaml; override any key with --section.key=value.",
    )
    train.add_argument("config", type=Path, help="YAML config file")

    prepare = commands.add_parser(
        "prepare-data",
        help="tokenize text / JSONL / .npy files into a token memmap",
        description="Tokenize UTF-8 text files, JSONL (a 'text' field per line) and "
        "pre-tokenized .npy arrays into DIR/tokens.bin and DIR/meta.json.",
    )
    prepare.add_argument("inputs", nargs="+", type=Path, metavar="INPUT")
    prepare.add_argument("--out", required=True, type=Path, metavar="DIR")
    prepare.add_argument(
        "--tokenizer",
        default=None,
        help="'byte' (default) or the path of a tokenizer.json (needs the tokenizers package)",
    )
    inspect = commands.add_parser(
        "inspect",
        help="show a checkpoint's step, topology and tensors, and verify its checksums",
        description="Print what a checkpoint directory holds and check every file's sha256; "
        "exit 2 when verification fails.",
    )
    inspect.add_argument("checkpoint", type=Path, metavar="CKPT")
    inspect.add_argument("--json", action="store_true", help="print the summary as JSON")
    return parser


def _inspect(checkpoint: Path, as_json: bool) -> int:
    from moe_checkpoint import CheckpointError, checkpoint_summary

    try:
        summary = checkpoint_summary(checkpoint)
    except CheckpointError as e:
        raise MoeTrainError(str(e)) from e
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        topology = summary["saved_topology"] or {"world_size": summary["saved_world_size"]}
        print(f"checkpoint {summary['path']}")
        print(f"step {summary['step']} | saved by {topology} | {summary['total_bytes']:,} bytes")
        width = max((len(name) for name in summary["tensors"]), default=4)
        print(f"{'tensor':<{width}}  {'shape':<20} {'dtype':<8} {'bytes':>14}  file")
        for name, tensor in summary["tensors"].items():
            shape = "x".join(str(d) for d in tensor["shape"]) or "scalar"
            print(
                f"{name:<{width}}  {shape:<20} {tensor['dtype']:<8} {tensor['bytes']:>14,}  "
                f"{tensor['file']}"
            )
        print(f"checksums: {summary['verification']}")
    if summary["verification"] != "ok":
        _error_line(summary["verification"])
        return USAGE_EXIT
    return 0


def run(argv: list[str]) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "train":
        from moe_train.config import load_config
        from moe_train.train import train

        config = load_config(args.config, extra)
        result = train(config)
        if result.is_main:
            print(
                f"done: {len(result.losses)} steps, final loss {result.losses[-1]:.4f}, "
                f"metrics in {result.run_dir / 'metrics.jsonl'}"
            )
        return 0
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "inspect":
        return _inspect(args.checkpoint, args.json)
    from moe_train.data import prepare_data

    meta = prepare_data(args.inputs, args.out, tokenizer=args.tokenizer)
    print(
        f"wrote {meta['num_tokens']:,} tokens of {meta['num_documents']:,} documents "
        f"({meta['dtype']}) to {args.out}"
    )
    return 0


def _error_line(message: str) -> None:
    # One write call: lines of several ranks sharing a pipe do not interleave.
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """Entry point: user errors print one line `error: ...` and exit 2."""
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except MoeTrainError as e:
        _error_line(str(e))
        return USAGE_EXIT
    except BrokenPipeError:  # output piped into a pager or head that closed early
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
