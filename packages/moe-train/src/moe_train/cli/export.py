"""`moe-train export CKPT --out DIR [--dtype float32|bfloat16] [--name NAME]`."""

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
    parser.add_argument(
        "--name",
        metavar="NAME",
        help="the model's name, the title of its model card (default: the run's name, the "
        "last component of its train.run_dir)",
    )


def _handle(args: argparse.Namespace) -> int:
    from moe_train.hf import export_checkpoint

    result = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype, name=args.name)
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
    "generation_config.json (its eos_token_id: the end-of-text id and, when the tokenizer "
    "has a chat template, its end-of-turn id), sharded safetensors with an index, and the tokenizer files "
    "when the data used a tokenizer.json; also README.md, a model card: the model, how it was "
    "trained, each data source with its counts and one digest (no paths of the training "
    "machine), and the code. The architecture is the one of Qwen3-MoE, OLMoE, Mixtral, "
    "Qwen2-MoE and GLM-4-MoE that the model's options match; refused (exit 2, nothing "
    "written) when none computes the same logits. Needs transformers.",
    add_arguments=_add_arguments,
    handle=_handle,
)
