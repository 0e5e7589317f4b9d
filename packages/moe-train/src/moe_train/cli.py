"""The `moe-train` command line: train, prepare-data, inspect, export."""

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
        help="show what a checkpoint holds and verify its checksums",
        description="Show a checkpoint's step, save time, saving layout, data position, "
        "sizes by category, model config and tensors, and check every chunk checksum and "
        "file sha256; exit 2 when that fails. CKPT may be a checkpoints root: its newest "
        "committed checkpoint is shown.",
    )
    inspect.add_argument("checkpoint", type=Path, metavar="CKPT")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.add_argument(
        "--no-verify",
        action="store_true",
        help="a quick listing: read no tensor data, check no data checksums",
    )
    inspect.add_argument(
        "--all", action="store_true", help="also list the optimizer tensors (optim.*)"
    )
    export = commands.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face transformers model directory",
        description="Write CKPT (or the newest checkpoint under a checkpoints root) to DIR as "
        "a directory transformers.AutoModelForCausalLM.from_pretrained loads: config.json, "
        "generation_config.json, sharded safetensors with an index, and the tokenizer files "
        "when the data used a tokenizer.json. Refused (exit 2, nothing written) when no "
        "transformers architecture computes the same logits. Needs transformers.",
    )
    export.add_argument("checkpoint", type=Path, metavar="CKPT")
    export.add_argument("--out", required=True, type=Path, metavar="DIR")
    export.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="dtype of the written weights (default float32)",
    )
    return parser


def _export(args: argparse.Namespace) -> int:
    from moe_train.hf import export_checkpoint

    result = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype)
    for note in result.notes:
        print(f"note: {note}")
    print(
        f"wrote {result.checkpoint} as {result.architecture} ({args.dtype}, "
        f"{len(result.files)} files) to {result.out}"
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    """Print the report; a failed verification then stops with its one-line error."""
    from moe_train.inspect_report import build_report, format_report

    report = build_report(args.checkpoint, verify=not args.no_verify, all_tensors=args.all)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    if report["verification"] not in ("ok", None):
        sys.stdout.flush()
        raise MoeTrainError(report["verification"])
    return 0


def _train(config_path: Path, overrides: list[str]) -> int:
    """Train; exit 0 when the run reached train.max_steps (now or before), PREEMPTED_EXIT
    when a signal stopped it early."""
    from moe_train.config import load_config
    from moe_train.signals import PREEMPTED_EXIT, StopRequests

    # Listening first: a launcher's SIGTERM during start-up (torchrun sends one to every rank
    # when another exits) then lets this rank finish what it is doing and report its own error.
    with StopRequests(announce=False) as stops:
        config = load_config(config_path, overrides)
        from moe_train.train import train

        result = train(config, stops=stops)
    if not result.is_main:
        return PREEMPTED_EXIT if result.stopped_by else 0
    steps = config.train.max_steps
    if result.already_finished:
        print(
            f"{result.run_dir} already finished: {result.checkpoint} is at step "
            f"{result.start_step} (train.max_steps={steps}); nothing to do"
        )
        return 0
    if result.stopped_by:
        saved = (
            f"saved {result.checkpoint}"
            if result.checkpoint
            else "nothing saved (checkpointing is off)"
        )
        print(
            f"stopped by {result.stopped_by} after step {result.end_step} of {steps}; {saved}; "
            f"relaunch with --checkpoint.resume=auto to continue"
        )
        return PREEMPTED_EXIT
    final = f", final loss {result.losses[-1]:.4f}" if result.losses else ""
    print(
        f"done: {result.end_step - result.start_step} steps{final}, "
        f"metrics in {result.run_dir / 'metrics.jsonl'}"
    )
    return 0


def run(argv: list[str]) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "train":
        return _train(args.config, extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "inspect":
        return _inspect(args)
    if args.command == "export":
        return _export(args)
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
    """Entry point: user errors print one line `error: ...` and exit with the error's code
    (2 for bad input; see moe_train.errors)."""
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except MoeTrainError as e:
        _error_line(str(e))
        return e.exit_code
    except BrokenPipeError:  # output piped into a pager or head that closed early
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
