"""The rows of the start banner: what the run resumes from, the model, data, masking, layout,
precision, optimizer, schedule, checkpoints and evaluation, one row each (the console prints
them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moe_data import MixedDataset, TokenDataset
from moe_plan.config import Config, DispatchChoice
from moe_train.model import count_params
from moe_train.train.console import load_scale
from moe_train.train.data_feed import describe_sources
from moe_train.train.resume import StartPoint, start_rows
from moe_train.train.runtime import Runtime
from moe_train.train.schedule import describe_schedule
from moe_train.train.task_scoring import TaskScorer


@dataclass(frozen=True)
class RunFacts:
    """What the banner reports beyond the config: found or measured during setup."""

    start: StartPoint
    checkpoint_dir: Path
    peak_flops: float
    """Peak FLOP/s per device, the mean over the ranks."""
    peak_source: str
    """Where the peak came from (measured, the config, a known device)."""
    expert_gemm: str
    """The expert GEMM applied, the kernel that runs it, and why."""
    linear: str
    """How the linear layers run (precision.linear), and why."""
    dispatch: DispatchChoice
    """The token dispatcher and transport that run, and why."""
    dataset: TokenDataset | MixedDataset
    task_scorer: TaskScorer | None


def banner_rows(config: Config, runtime: Runtime, facts: RunFacts) -> list[tuple[str, str]]:
    """The banner's rows, (name, text) each."""
    layout = runtime.layout
    model, moe, data, ckpt = config.model, config.model.moe, config.data, config.checkpoint
    params = count_params(model)
    saves = []
    if ckpt.interval:
        saves.append(f"every {ckpt.interval} steps")
    if ckpt.interval_minutes:
        saves.append(f"every {ckpt.interval_minutes:g} min")
    saving = f"{' or '.join(saves)} into {facts.checkpoint_dir}" if saves else "off"
    tokens_per_step = data.global_batch_size * data.seq_len
    return [
        *start_rows(facts.start, config, layout.describe()),
        (
            "model",
            f"{params.total / 1e6:.1f}M params, {params.active / 1e6:.1f}M active: "
            f"{model.n_layers} layers, d_model {model.d_model}, {moe.num_experts} experts "
            f"top-{moe.top_k} ({load_scale(moe.num_experts, moe.top_k)})",
        ),
        (
            "data",
            f"{describe_sources(data)}: {data.global_batch_size} x {data.seq_len} = "
            f"{tokens_per_step:,} tokens per step" + packing_note(config, facts.dataset),
        ),
        ("masking", masking_banner(config)),
        (
            "layout",
            f"{layout.world_size} process{'es' if layout.world_size > 1 else ''}: pp "
            f"{layout.pp}, dp {layout.batch_ranks}"
            f"{f', cp {layout.cp}' if layout.cp > 1 else ''}, ep "
            f"{layout.ep} on {runtime.device.type}; peak {facts.peak_flops / 1e12:.2f} TFLOP/s "
            f"per device ({facts.peak_source})",
        ),
        ("dispatch", facts.dispatch.describe()),
        (
            "precision",
            f"{config.precision.param_dtype} params, {config.precision.compute_dtype} "
            f"compute; expert GEMMs {facts.expert_gemm}; linears {facts.linear}",
        ),
        ("optimizer", optimizer_banner(config)),
        (
            "steps",
            f"{config.train.max_steps} ({describe_schedule(config.optim, config.train.max_steps)})",
        ),
        ("checkpoints", saving),
        ("eval", eval_banner(config, facts.task_scorer)),
    ]


def masking_banner(config: Config) -> str:
    """Whether the loss is masked to labels and attention to documents."""
    data = config.data
    labels = (
        "on (the loss counts the marked target tokens only)"
        if data.label_mask
        else "off (every token is a target)"
    )
    documents = (
        "on (a token attends only to its own document)"
        if data.document_masking
        else "off (attention crosses document ends)"
    )
    return f"label mask {labels}; document masking {documents}"


def optimizer_banner(config: Config) -> str:
    """The optimizer and its settings."""
    optim, parallel = config.optim, config.parallel
    adamw = f"betas {optim.betas[0]:g}, {optim.betas[1]:g}, eps {optim.eps:g}"
    if optim.name == "muon":
        text = (
            f"muon (momentum {optim.muon_momentum:g}, Newton-Schulz in {optim.muon_ns_dtype}) "
            f"on the hidden matrices, adamw ({adamw}, lr x {optim.adamw_lr_ratio:g}) on "
            "embedding, head, norms and router"
        )
    else:
        text = f"adamw ({adamw})"
    clip = f"grad clip {optim.grad_clip:g}" if optim.grad_clip is not None else "no grad clip"
    text += f"; weight decay {optim.weight_decay:g}, {clip}"
    if parallel.distributed_optimizer:
        text += "; state sharded over each reduction group"
    return text


def eval_banner(config: Config, task_scorer: TaskScorer | None) -> str:
    """What an evaluation holds and how often it runs."""
    evaluation, size = config.eval, config.data.global_batch_size
    if not evaluation.enabled:
        return "off"
    parts = []
    if evaluation.paths:
        parts.append(f"{evaluation.batches} x {size} sequences of {', '.join(evaluation.paths)}")
    if task_scorer is not None:
        parts.append(f"tasks {task_scorer.describe()}")
    return f"{'; '.join(parts)} every {evaluation.interval} steps"


def packing_note(config: Config, dataset: TokenDataset | MixedDataset) -> str:
    """With data.label_mask: how documents longer than a sequence were handled."""
    if not config.data.label_mask:
        return ""
    note = "; whole documents packed, trained on the label mask"
    if dataset.skipped_long:
        note += (
            f"; {dataset.skipped_long:,} documents longer than data.seq_len+1 "
            "skipped (data.split_long_examples=true cuts them instead)"
        )
    if dataset.split_long:
        note += f"; {dataset.split_long:,} documents longer than a sequence cut"
    return note
