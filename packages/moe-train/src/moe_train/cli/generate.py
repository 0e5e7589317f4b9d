"""`moe-train generate CKPT (--prompt TEXT | --prompt-ids 1,2,3) [...]`."""

import argparse
import json
from pathlib import Path

from moe_train.cli.command import Command


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, metavar="CKPT")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the prompt as text")
    prompt.add_argument("--prompt-ids", metavar="IDS", help="the prompt as token ids: 1,2,3")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 (default): greedy; else sampling"
    )
    parser.add_argument(
        "--top-k", type=int, default=0, help="sample among the K likeliest tokens (0: all)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    parser.add_argument("--json", action="store_true", help="print prompt_ids, ids and text")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user message: put it through the chat template of the run's "
        "tokenizer (with the generation prompt) and stop at its end-of-turn token",
    )


def _handle(args: argparse.Namespace) -> int:
    from moe_train.generate import generate

    result = generate(
        args.checkpoint,
        prompt=args.prompt,
        prompt_ids=args.prompt_ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        chat=args.chat,
    )
    if args.json:
        fields = ("prompt_ids", "ids", "text", "stop_reason")
        print(json.dumps({name: getattr(result, name) for name in fields}))
    elif result.text is not None:
        print(result.text)
    else:
        print(",".join(str(i) for i in result.ids))
    return 0


GENERATE = Command(
    name="generate",
    help="continue a prompt with a checkpoint's model",
    description="Load CKPT (or the newest checkpoint under a checkpoints root) in one "
    "process (CUDA when available, else CPU; fp32, dropless routing) and print the "
    "continuation of the prompt. Stops at the tokenizer's end-of-text token (from a "
    "checkpoint import-hf wrote: at the end tokens its model directory names) or after "
    "--max-new-tokens. --prompt needs the tokenizer the run's data was prepared with; --chat "
    "also its chat template (a chat model's tokenizer directory given to prepare-data).",
    add_arguments=_add_arguments,
    handle=_handle,
)
