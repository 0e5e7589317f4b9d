"""The single-process training loop."""

from __future__ import annotations

import contextlib
import math
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moe_train.config import Config, dump_config
from moe_train.data import TokenDataset
from moe_train.errors import ConfigError, DataError, MoeTrainError
from moe_train.model import Transformer, count_params, flops_per_token, lm_loss
from moe_train.train.host_memory import keep_freed_host_memory
from moe_train.train.metrics import MetricsLog, Progress
from moe_train.train.peak import peak_flops
from moe_train.train.schedule import lr_at

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class TrainResult:
    run_dir: Path
    """Where metrics.jsonl and config.yaml were written."""
    losses: list[float]
    """LM loss of every step."""
    model: Transformer
    """The trained model."""


def check_supported(config: Config) -> None:
    """Reject settings whose features this version of the trainer does not have yet."""
    unsupported = {
        "parallel.ep": (config.parallel.ep, 1),
        "parallel.pp": (config.parallel.pp, 1),
        "parallel.dispatcher": (config.parallel.dispatcher, "local"),
        "parallel.distributed_optimizer": (config.parallel.distributed_optimizer, False),
        "parallel.recompute": (config.parallel.recompute, "none"),
        "precision.mxfp8": (config.precision.mxfp8, False),
        "checkpoint.interval": (config.checkpoint.interval, 0),
        "checkpoint.resume": (config.checkpoint.resume, "never"),
    }
    for key, (value, supported) in unsupported.items():
        if value != supported:
            raise ConfigError(
                f"{key}={value} is not available in this version of moe-train; "
                f"only {key}={supported} is"
            )


def choose_run_dir(requested: str) -> Path:
    """`requested`, or `requested.N` with the first free N when it already holds a run."""
    path = Path(requested)
    candidate, n = path, 1
    while candidate.exists() and any(candidate.iterdir()):
        candidate = path.with_name(f"{path.name}.{n}")
        n += 1
    try:
        candidate.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"train.run_dir={requested} cannot be created: {e.strerror}") from e
    return candidate


def build_optimizer(model: nn.Module, config: Config) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not norms, not biases)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optim = config.optim
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        fused=True,
    )


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a GPU; the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def train(config: Config, *, device: torch.device | None = None) -> TrainResult:
    """Train `config.model` on `config.data` for `config.train.max_steps` steps."""
    check_supported(config)
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    keep_freed_host_memory()
    compute_dtype = DTYPES[config.precision.compute_dtype]
    data, train_cfg, moe = config.data, config.train, config.model.moe

    dataset = TokenDataset(
        data.paths, data.seq_len, cache_dir=Path(data.cache_dir) if data.cache_dir else None
    )
    if dataset.vocab_size > config.model.vocab_size:
        raise DataError(
            f"data.paths hold token ids up to {dataset.vocab_size - 1} but "
            f"model.vocab_size={config.model.vocab_size}; set model.vocab_size >= "
            f"{dataset.vocab_size}"
        )

    run_dir = choose_run_dir(train_cfg.run_dir)
    dump_config(config, run_dir / "config.yaml")
    progress = Progress(train_cfg.max_steps, train_cfg.progress)
    # Measured before seeding: the measurement draws random numbers.
    peak, peak_source = peak_flops(compute_dtype, device, train_cfg.peak_flops)

    torch.manual_seed(train_cfg.seed)
    model = Transformer(config.model, data.seq_len).to(device)
    optimizer = build_optimizer(model, config)
    params = count_params(config.model)
    tokens_per_step = data.global_batch_size * data.seq_len
    step_flops = flops_per_token(config.model, data.seq_len) * tokens_per_step
    num_micro = data.global_batch_size // data.micro_batch_size
    progress.message(
        f"run_dir {run_dir} | {params.total / 1e6:.1f}M params ({params.active / 1e6:.1f}M "
        f"active) | {tokens_per_step} tokens/step | peak {peak / 1e12:.2f} TFLOP/s "
        f"({peak_source})"
    )

    def autocast() -> contextlib.AbstractContextManager:
        if compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=compute_dtype)

    metrics = MetricsLog(run_dir / "metrics.jsonl")
    losses: list[float] = []
    grad_clip = config.optim.grad_clip if config.optim.grad_clip is not None else float("inf")
    model.train()
    try:
        for step in range(train_cfg.max_steps):
            start = time.perf_counter()
            batch = dataset.batch(step, data.global_batch_size, train_cfg.seed).to(device)
            lm_sum = torch.zeros((), device=device)
            lb_sum = torch.zeros((), device=device)
            z_sum = torch.zeros((), device=device)
            for micro in batch.view(num_micro, data.micro_batch_size, data.seq_len + 1):
                with autocast():
                    logits = model(micro[:, :-1])
                loss = lm_loss(logits, micro[:, 1:])
                lb, z = model.aux_losses()
                total = loss + moe.lb_loss_weight * lb + moe.z_loss_weight * z
                (total / num_micro).backward()
                lm_sum += loss.detach()
                lb_sum += lb.detach()
                z_sum += z.detach()

            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            lr = lr_at(step, config.optim, train_cfg.max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            load_ratios, dropped, routed = [], 0.0, 0.0
            for layer in model.moe_layers():
                copies_per_expert, layer_dropped, layer_routed = layer.take_stats()
                layer.router.update_bias(copies_per_expert)
                load_ratios.append(copies_per_expert.max() / copies_per_expert.mean())
                dropped += float(layer_dropped)
                routed += float(layer_routed)

            loss_value = float(lm_sum) / num_micro
            losses.append(loss_value)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_time = time.perf_counter() - start
            record = {
                "step": step,
                "loss": loss_value,
                "lb_loss": float(lb_sum) / num_micro,
                "z_loss": float(z_sum) / num_micro,
                "lr": lr,
                "grad_norm": float(grad_norm),
                "tokens_per_s": tokens_per_step / step_time,
                "mfu": step_flops / step_time / peak,
                "expert_load_max_over_mean": (
                    float(torch.stack(load_ratios).max()) if load_ratios else 1.0
                ),
                "dropped_token_frac": dropped / routed if routed else 0.0,
                "peak_mem_bytes": peak_memory_bytes(device),
                "step_time_s": step_time,
            }
            if step % train_cfg.log_interval == 0 or step == train_cfg.max_steps - 1:
                metrics.write(record)
            progress.update(step, record)
            if not math.isfinite(loss_value):
                metrics.write(record)
                raise MoeTrainError(
                    f"the loss became {loss_value} at step {step}; lower optim.lr "
                    f"(now {config.optim.lr}) or set optim.grad_clip"
                )
    finally:
        metrics.close()
    return TrainResult(run_dir=run_dir, losses=losses, model=model)
