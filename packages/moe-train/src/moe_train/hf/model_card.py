"""The model card (README.md) `moe-train export` writes, generated from the checkpoint alone.

Everything in it comes from the checkpoint's trainer state and the run manifest it carries:
architecture and size, how long it trained and on what (each data source by name with its
document and token counts, the tokens seen from it and one digest over its token files), the
last evaluation loss, the settings and the code. It names no path of the training machine and
lists no single file: the manifest keeps those. Only the licence is left for the user to fill
in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moe_data import split_dtype_suffix
from moe_plan.config import Config, count_params
from moe_train.files_digest import files_digest


def model_card(trainer_state: dict[str, Any], config: Config, architecture: str, name: str) -> str:
    """Markdown with a Hugging Face metadata header."""
    step = int(trainer_state["step"])
    tokens = step * config.data.global_batch_size * config.data.seq_len
    params = count_params(config.model)
    manifest = trainer_state.get("manifest") or {}
    lines = [
        "---",
        "license: # fill in: the licence under which you release these weights",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [mixture-of-experts, moe-stack]",
        "---",
        "",
        f"# {name}",
        "",
        f"A {_count(params.total)}-parameter mixture-of-experts language model "
        f"({_count(params.active)} active per token), trained with moe-stack for {step:,} "
        f"steps on {tokens:,} tokens and exported as `{architecture}`.",
        "",
    ]
    lines += _architecture_lines(config, params.total, params.active)
    lines += _training_lines(trainer_state, config, step, tokens)
    lines += ["", "## Data", ""]
    lines += _data_lines(manifest.get("data"), _tokens_seen(trainer_state, tokens))
    lines += ["", "## Code", ""]
    lines += _code_lines(manifest)
    lines += [
        "",
        "## Reproduce and verify",
        "",
        "The checkpoint this model was exported from carries the run manifest (config, data "
        "hashes, code versions). `moe-train verify CKPT_A CKPT_B` replays training from an "
        "earlier checkpoint of the run to this one's step and compares the result with it.",
        "",
    ]
    return "\n".join(lines)


def _architecture_lines(config: Config, total: int, active: int) -> list[str]:
    """The "Architecture" section: the model's shape and its `total` and `active` parameters."""
    model, data = config.model, config.data
    moe = model.moe
    return [
        "## Architecture",
        "",
        "| | |",
        "| --- | --- |",
        f"| layers | {model.n_layers} ({model.dense_layers} dense first) |",
        f"| model width | {model.d_model} |",
        f"| attention heads (key/value) | {model.n_heads} ({model.n_kv_heads}) |",
        f"| experts per layer | {moe.num_experts} routed, top-{moe.top_k} "
        f"({moe.router}), {moe.shared_experts} shared, width {moe.expert_hidden} |",
        f"| vocabulary | {model.vocab_size} |",
        f"| context | {data.seq_len} tokens |",
        f"| parameters | {total:,} ({active:,} active matmul) |",
        "",
    ]


def _training_lines(
    trainer_state: dict[str, Any], config: Config, step: int, tokens: int
) -> list[str]:
    """The "Training" section: how far, on what, with which optimizer, precision and layout."""
    data, optim = config.data, config.optim
    return [
        "## Training",
        "",
        "| | |",
        "| --- | --- |",
        f"| steps | {step:,} of {config.train.max_steps:,} |",
        f"| tokens | {tokens:,} ({data.global_batch_size} x {data.seq_len} per step) |",
        f"| optimizer | AdamW, lr {optim.lr:g}, betas {optim.betas}, weight decay "
        f"{optim.weight_decay:g}, {optim.schedule} schedule, {optim.warmup_steps} warmup steps |",
        f"| precision | compute {config.precision.compute_dtype}, parameters "
        f"{config.precision.param_dtype}, expert GEMMs {config.precision.expert_gemm} |",
        f"| seed | {config.train.seed} |",
        f"| layout | {_layout(trainer_state.get('topology'))} |",
        f"| last evaluation loss | {_eval_loss(trainer_state)} |",
    ]


def _tokens_seen(trainer_state: dict[str, Any], tokens: int) -> dict[str, int]:
    """Tokens trained on from each data source: recorded per source, or all of them when
    there is one source."""
    if "tokens_per_source" in trainer_state:
        return trainer_state["tokens_per_source"]
    sources = (trainer_state.get("manifest") or {}).get("data") or []
    return {sources[0]["path"]: tokens} if len(sources) == 1 else {}


def _count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def _layout(topology: dict[str, Any] | None) -> str:
    if not topology:
        return "not recorded"
    return ", ".join(f"{key} {value}" for key, value in topology.items())


def _eval_loss(trainer_state: dict[str, Any]) -> str:
    value = trainer_state.get("last_eval_loss")
    if value is None:
        return "none (no evaluation ran)"
    return f"{value:.4f} (at step {trainer_state.get('last_eval_step', '?')})"


def _data_lines(sources: list[dict[str, Any]] | None, seen: dict[str, int] | None) -> list[str]:
    """One row per data source: its name (never a path of the training machine), counts, and
    one digest over its token files."""
    if not sources:
        return ["Not recorded (the checkpoint predates run manifests)."]
    seen = seen or {}
    lines = [
        "| source | documents | tokens | tokens seen | input files | tokenizer | token files "
        "(digest) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for source in sources:
        inputs = source.get("sources")
        lines.append(
            f"| {_cell(source_name(source['path']))} | {_number(source.get('num_documents'))} | "
            f"{_number(source.get('num_tokens'))} | {seen.get(source['path'], 0):,} | "
            f"{'' if inputs is None else len(inputs)} | {_cell(_tokenizer_name(source))} | "
            f"{len(source['files'])} (`{files_digest(source['files'])}`) |"
        )
    lines += [
        "",
        "A source's digest is the sha256 of the `sha256sum` listing of its token files, sorted "
        "by name (for a prepared directory: `sha256sum tokens-*.bin | sha256sum` in it). The "
        "run's `manifest.json`, in its run directory and in each checkpoint's trainer state, "
        "lists every token file and every input file with its sha256 and counts.",
    ]
    return lines


def source_name(entry: str) -> str:
    """What the card calls the `data.paths` entry `entry`: the last component of its path
    (without a dtype suffix), or a builtin dataset's name."""
    try:
        path = split_dtype_suffix(entry)[0]
    except ValueError:
        path = entry
    return Path(path).name or "data"


def _tokenizer_name(source: dict[str, Any]) -> str:
    tokenizer = source.get("tokenizer")
    if tokenizer in (None, "byte"):
        return "bytes" if source.get("kind") == "prepared" else "not recorded"
    return Path(tokenizer).name


def _cell(text: str) -> str:
    """`text` as one Markdown table cell."""
    return text.replace("|", "\\|")


def _number(value: int | None) -> str:
    return "" if value is None else f"{value:,}"


def _code_lines(manifest: dict[str, Any]) -> list[str]:
    segments = manifest.get("segments") or []
    if not segments:
        return ["Not recorded."]
    lines = ["| steps | commit | versions | device |", "| --- | --- | --- | --- |"]
    for segment in segments:
        source = segment.get("source")
        commit = "not a git checkout"
        if source:
            commit = source["commit"] + (" (with local changes)" if source.get("dirty") else "")
        environment = segment.get("environment") or {}
        versions = ", ".join(
            f"{name} {version}" for name, version in (environment.get("packages") or {}).items()
        )
        device = environment.get("device_name") or environment.get("device", "?")
        steps = f"{segment['start_step']}-{segment['end_step']}"
        lines.append(f"| {steps} | {commit} | {versions} | {device} |")
    return lines
