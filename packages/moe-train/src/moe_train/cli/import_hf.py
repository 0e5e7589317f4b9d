"""`moe-train import-hf HF_DIR --out DIR`."""

import argparse
from pathlib import Path

from moe_train.cli.command import Command


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", type=Path, metavar="HF_DIR")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR")


def _handle(args: argparse.Namespace) -> int:
    from moe_train.hf.import_hf import import_hf

    result = import_hf(args.hf_dir, args.out)
    if result.ignored:
        print(f"note: ignored {len(result.ignored)} tensors of layers past the last one "
              f"(multi-token prediction), e.g. {result.ignored[0]}")  # fmt: skip
    print(
        f"wrote {args.hf_dir} ({result.architecture}) as {result.checkpoint} and "
        f"{result.out / 'config.yaml'}; train from it with --checkpoint.init_from={result.out}"
    )
    return 0


IMPORT_HF = Command(
    name="import-hf",
    help="turn a Hugging Face transformers model directory into a checkpoint",
    description="Read HF_DIR (Qwen3-MoE, GLM-4-MoE, OLMoE, Mixtral or Qwen2-MoE: config.json "
    "and safetensors) and write DIR/step_00000000, a weights-only checkpoint, and DIR/config.yaml, a trainer "
    "config of the same model with checkpoint.init_from=DIR; the checkpoint keeps the end "
    "tokens HF_DIR names (eos_token_id of generation_config.json, else config.json), where "
    "generate stops. Refused (exit 2, nothing "
    "written) when our model cannot compute exactly what the transformers model does. "
    "Needs transformers.",
    add_arguments=_add_arguments,
    handle=_handle,
)
