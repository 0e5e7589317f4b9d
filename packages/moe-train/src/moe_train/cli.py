"""The `moe-train` command line: train, prepare-data, inspect, export, import-hf, generate,
plot, plan, verify."""

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
        help="tokenize text, JSON Lines, parquet or Hugging Face datasets into token shards",
        description="Tokenize UTF-8 text files (one document each), JSON Lines (.jsonl, .json; "
        "also .gz or .zst), .parquet files, Hugging Face datasets saved with save_to_disk and "
        "pre-tokenized .npy arrays into DIR/meta.json and token shards DIR/tokens-*.bin. "
        "Stopped (Ctrl-C, SIGTERM, a crash), the same command continues where it stopped.",
    )
    prepare.add_argument("inputs", nargs="+", type=Path, metavar="INPUT")
    prepare.add_argument("--out", required=True, type=Path, metavar="DIR")
    prepare.add_argument(
        "--tokenizer",
        default=None,
        help="'byte' (default) or the path of a tokenizer.json (needs the tokenizers package)",
    )
    prepare.add_argument(
        "--workers", type=int, default=None, metavar="N", help="processes (default: the cores)"
    )
    prepare.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="the JSON field or column that holds the text (default: text)",
    )
    prepare.add_argument(
        "--shard-size",
        default=None,
        metavar="SIZE",
        help="input bytes per output shard, e.g. 256M (default: about 64 shards, 1M to 256M each)",
    )
    prepare.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "uint16", "uint32"],
        help="token id dtype (default auto: uint16 when every id fits)",
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
    import_hf = commands.add_parser(
        "import-hf",
        help="turn a Hugging Face transformers model directory into a checkpoint",
        description="Read HF_DIR (Qwen3-MoE or GLM-4-MoE: config.json and safetensors) and "
        "write DIR/step_00000000, a weights-only checkpoint, and DIR/config.yaml, a trainer "
        "config of the same model with checkpoint.init_from=DIR. Refused (exit 2, nothing "
        "written) when our model cannot compute exactly what the transformers model does. "
        "Needs transformers.",
    )
    import_hf.add_argument("hf_dir", type=Path, metavar="HF_DIR")
    import_hf.add_argument("--out", required=True, type=Path, metavar="DIR")
    generate = commands.add_parser(
        "generate",
        help="continue a prompt with a checkpoint's model",
        description="Load CKPT (or the newest checkpoint under a checkpoints root) in one "
        "process (CUDA when available, else CPU; fp32, dropless routing) and print the "
        "continuation of the prompt. Stops at the tokenizer's end-of-text token or after "
        "--max-new-tokens. --prompt needs the tokenizer the run's data was prepared with.",
    )
    generate.add_argument("checkpoint", type=Path, metavar="CKPT")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the prompt as text")
    prompt.add_argument("--prompt-ids", metavar="IDS", help="the prompt as token ids: 1,2,3")
    generate.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    generate.add_argument(
        "--temperature", type=float, default=0.0, help="0 (default): greedy; else sampling"
    )
    generate.add_argument(
        "--top-k", type=int, default=0, help="sample among the K likeliest tokens (0: all)"
    )
    generate.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    generate.add_argument("--json", action="store_true", help="print prompt_ids, ids and text")
    plot = commands.add_parser(
        "plot",
        help="draw PNG figures of runs: loss, learning rate, throughput, routing",
        description="Write PNG figures of RUN_DIR (metrics.jsonl, expert_load.jsonl): loss "
        "and eval loss by step and by tokens, learning rate, tokens/s and MFU, expert load, "
        "EP-rank load, and the balancing loss against the real imbalance with the routing "
        "check's warnings. Several RUN_DIRs overlay their curves. Needs matplotlib "
        "(moestack-train[plot]).",
    )
    plot.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    plot.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the PNG files go (default RUN_DIR/plots for one run, ./plots for several)",
    )
    _add_plan(commands)
    verify = commands.add_parser(
        "verify",
        help="replay a run from checkpoint A to checkpoint B's step and compare with B",
        description="Replay training from CKPT_A to CKPT_B's step with A's config, data and "
        "seeds (refused when a data file's sha256 no longer matches A's manifest) and compare "
        "every tensor with CKPT_B: bitwise on the layout that wrote B, within a stated "
        "tolerance on another. Run it as training runs (torchrun for several ranks); "
        "--parallel.key=value sets the replay's layout.",
    )
    verify.add_argument("checkpoint_a", type=Path, metavar="CKPT_A")
    verify.add_argument("checkpoint_b", type=Path, metavar="CKPT_B")
    return parser


def _add_plan(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser(
        "plan",
        help="predict memory, traffic and throughput of a config's layouts on N devices",
        description="Check CONFIG's layout at --gpus N with the trainer's own start checks, "
        "then rank every layout that fits by predicted tokens/s per device: memory per "
        "device by category, bytes per step by collective kind, pipeline bubble, a roofline "
        "step time and MFU. Override config keys with --section.key=value.",
    )
    plan.add_argument("config", type=Path, help="YAML config file")
    plan.add_argument("--gpus", type=int, required=True, metavar="N", help="devices in all")
    plan.add_argument(
        "--gpu", default=None, help="h100, h200, b200 or b300 (default h100, or the figures below)"
    )
    plan.add_argument("--gpus-per-node", type=int, default=None, metavar="G")
    plan.add_argument("--gpu-memory-gib", type=float, default=None, metavar="M")
    plan.add_argument("--gpu-tflops", type=float, default=None, metavar="F", help="dense bf16")
    plan.add_argument("--intra-node-gbps", type=float, default=None, metavar="B", help="GB/s")
    plan.add_argument("--inter-node-gbps", type=float, default=None, metavar="B", help="GB/s")
    plan.add_argument("--top", type=int, default=15, help="rows of the ranked table")
    plan.add_argument("--json", action="store_true", help="print the whole plan as JSON")


def _plan(args: argparse.Namespace, overrides: list[str]) -> int:
    from moe_train.config import load_config
    from moe_train.errors import ConfigError
    from moe_train.plan import device_with, format_plan, make_plan, plan_json

    if args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus} must be at least 1")
    custom = [args.gpu_memory_gib, args.gpu_tflops, args.intra_node_gbps, args.inter_node_gbps]
    name = args.gpu or (None if all(v is not None for v in custom) else "h100")
    try:
        device = device_with(
            name,
            memory_gib=args.gpu_memory_gib,
            tflops=args.gpu_tflops,
            intra_node_gbps=args.intra_node_gbps,
            inter_node_gbps=args.inter_node_gbps,
            gpus_per_node=args.gpus_per_node,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from e
    plan = make_plan(load_config(args.config, overrides), args.gpus, device)
    print(json.dumps(plan_json(plan), indent=1) if args.json else format_plan(plan, args.top))
    return 0 if plan.own.error is None and plan.own.fits else 1


def _verify(args: argparse.Namespace, layout: list[str]) -> int:
    from moe_train.verify import format_verdict, verify

    verdict, a, b = verify(args.checkpoint_a, args.checkpoint_b, layout=layout)
    if verdict is None:  # not rank 0
        return 0
    print(format_verdict(verdict, a, b))
    return 0 if verdict.ok else 1


def _plot(args: argparse.Namespace) -> int:
    from moe_train.plot import plot_runs

    result = plot_runs(args.run_dirs, args.out)
    for note in result.notes:
        print(f"note: {note}")
    print(
        f"wrote {len(result.files)} figures to {result.out}: "
        f"{', '.join(path.name for path in result.files)}"
    )
    return 0


def _generate(args: argparse.Namespace) -> int:
    from moe_train.generate import generate

    result = generate(
        args.checkpoint,
        prompt=args.prompt,
        prompt_ids=args.prompt_ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    if args.json:
        fields = ("prompt_ids", "ids", "text", "stop_reason")
        print(json.dumps({name: getattr(result, name) for name in fields}))
    elif result.text is not None:
        print(result.text)
    else:
        print(",".join(str(i) for i in result.ids))
    return 0


def _import_hf(args: argparse.Namespace) -> int:
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
    if args.command == "plan":
        return _plan(args, extra)
    if args.command == "verify":
        return _verify(args, extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "inspect":
        return _inspect(args)
    if args.command == "export":
        return _export(args)
    if args.command == "import-hf":
        return _import_hf(args)
    if args.command == "generate":
        return _generate(args)
    if args.command == "plot":
        return _plot(args)
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
