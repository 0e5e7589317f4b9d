"""The model card (README.md) `moe-train export` writes, generated from the checkpoint alone.

Everything in it comes from the checkpoint's trainer state and the run manifest it carries:
architecture and size, how long it trained and on what (each data source with its hashes and
the tokens seen from it), the last evaluation loss, the settings and the code. Only the
licence is left for the user to fill in.
"""

from __future__ import annotations

from typing import Any

from moe_train.config import Config
from moe_train.model.accounting import count_params


def model_card(trainer_state: dict[str, Any], config: Config, architecture: str, name: str) -> str:
    """Markdown with a Hugging Face metadata header."""
    model, data, optim = config.model, config.data, config.optim
    moe = model.moe
    step = int(trainer_state["step"])
    tokens = step * data.global_batch_size * data.seq_len
    params = count_params(model)
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
        f"| parameters | {params.total:,} ({params.active:,} active matmul) |",
        "",
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
        "",
        "## Data",
        "",
    ]
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


def _tokens_seen(trainer_state: dict[str, Any], tokens: int) -> dict[str, int]:
    """Tokens trained on from each data source: recorded per source, or all of them when
    there is one source."""
    if "tokens_per_source" in trainer_state:
        return trainer_state["tokens_per_source"]
    sources = (trainer_state.get("manifest") or {}).get("data") or []
    return {sources[0]["path"]: tokens} if len(sources) == 1 else {}


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


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
    if not sources:
        return ["Not recorded (the checkpoint predates run manifests)."]
    seen = seen or {}
    lines = ["| source | token files (sha256) | tokens | tokens seen | tokenizer |"]
    lines.append("| --- | --- | --- | --- | --- |")
    for source in sources:
        files = "<br>".join(f"`{f['file']}` {f['sha256'][:16]}…" for f in source["files"])
        tokens = source.get("num_tokens")
        tokenizer = source.get("tokenizer") or "bytes"
        if source.get("tokenizer_sha256"):
            tokenizer = f"{tokenizer} ({source['tokenizer_sha256'][:16]}…)"
        lines.append(
            f"| `{source['path']}` | {files} | {'' if tokens is None else f'{tokens:,}'} | "
            f"{seen.get(source['path'], 0):,} | {tokenizer} |"
        )
    inputs = [(s["path"], origin) for s in sources for origin in s.get("sources", [])]
    if inputs:
        lines += ["", f"<details><summary>The {len(inputs)} input files</summary>", ""]
        lines += [
            f"- `{origin.get('path')}` ({path}): sha256 {origin.get('sha256')}, "
            f"{origin.get('num_tokens', '?')} tokens"
            for path, origin in inputs
        ]
        lines += ["", "</details>"]
    return lines


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
