"""`moe-train upcycle HF_DENSE_DIR --experts N --top-k K [--granularity G] [--noise S] --out DIR`."""

import argparse
from pathlib import Path

from moe_train.cli.command import Command


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", type=Path, metavar="HF_DENSE_DIR")
    parser.add_argument("--experts", required=True, type=int, metavar="N",
                        help="routed experts per MoE layer")  # fmt: skip
    parser.add_argument("--top-k", required=True, type=int, metavar="K",
                        help="experts per token (a multiple of G)")  # fmt: skip
    parser.add_argument(
        "--granularity", type=int, default=1, metavar="G",
        help="cut each copy of the MLP into G experts along its hidden width (default 1)",
    )  # fmt: skip
    parser.add_argument(
        "--noise", type=float, default=0.0, metavar="S",
        help="add Gaussian noise of S times each weight's RMS to the experts (default 0: exact)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the router and the noise")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR")


def _handle(args: argparse.Namespace) -> int:
    from moe_train.hf.upcycle import UpcycleOptions, upcycle

    options = UpcycleOptions(
        experts=args.experts,
        top_k=args.top_k,
        granularity=args.granularity,
        noise=args.noise,
        seed=args.seed,
    )
    result = upcycle(args.hf_dir, args.out, options)
    moe = result.config.model.moe
    print(
        f"wrote {args.hf_dir} ({result.architecture}) upcycled to {moe.num_experts} experts of "
        f"width {moe.expert_hidden}, top-{moe.top_k}, as {result.checkpoint} and "
        f"{result.out / 'config.yaml'}; train from it with --checkpoint.init_from={result.out}"
    )
    return 0


UPCYCLE = Command(
    name="upcycle",
    help="turn a dense Hugging Face model into an MoE checkpoint",
    description="Read HF_DENSE_DIR (a dense Qwen3, Llama or OLMo-2 model: config.json and "
    "safetensors) and write DIR/step_00000000 and DIR/config.yaml as import-hf does, each "
    "MLP replaced by N experts: copies of it, or with --granularity G, G slices of each copy "
    "(down projections scaled by G, the router row of a copy shared by its slices, K a "
    "multiple of G). Softmax routing with renormalised top-k makes the MoE compute the "
    "dense model exactly at step 0 unless --noise is given. Refused (exit 2, nothing "
    "written) for other models or options that do not fit. Needs transformers.",
    add_arguments=_add_arguments,
    handle=_handle,
)
