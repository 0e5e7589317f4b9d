"""`moe-train export CKPT --out DIR [--dtype float32|bfloat16]`."""

import argparse
from pathlib import Path

from moe_train.cli.command import Command


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, metavar="CKPT")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="dtype of the written weights (default float32)",
    )


def _handle(args: argparse.Namespace) -> int:
    from moe_train.hf import export_checkpoint

    result = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype)
    for note in result.notes:
        print(f"note: {note}")
    print(
        f"wrote {result.checkpoint} as {result.architecture} ({args.dtype}, "
        f"{len(result.files)} files) to {result.out}"
    )
    return 0


EXPORT = Command(
    name="export",
    help="write a checkpoint as a Hugging Face transformers model directory",
    description="Write CKPT (or the newest checkpoint under a checkpoints root) to DIR as "
    "a directory transformers.AutoModelForCausalLM.from_pretrained loads: config.json, "
    "generation_config.json, sharded safetensors with an index, and the tokenizer files "
    "when the data used a tokenizer.json. Refused (exit 2, nothing written) when no "
    "transformers architecture computes the same logits. Needs transformers.",
    add_arguments=_add_arguments,
    handle=_handle,
)
