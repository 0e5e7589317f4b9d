"""The single-process training loop."""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_checkpoint import CheckpointError, read_trainer_state
from moe_train.config import Config, dump_config
from moe_train.data import TokenDataset
from moe_train.errors import DataError, MoeTrainError
from moe_train.model import (
    Transformer,
    count_params,
    flops_per_token,
)
from moe_train.train.checkpointing import (
    load_training_state,
    restore_rng_state,
)
from moe_train.train.host_memory import keep_freed_host_memory
from moe_train.train.metrics import MetricsLog, Progress
from moe_train.train.peak import peak_flops
from moe_train.train.run_files import (
    PeriodicSaver,
    check_no_newer_checkpoints,
    checkpoint_root,
    find_resume_checkpoint,
    prepare_run_dir,
    truncate_metrics,
)
from moe_train.train.runtime import Runtime, start_runtime
from moe_train.train.schedule import lr_at
from moe_train.train.step import DTYPES, StepRunner


@dataclass
class TrainResult:
    run_dir: Path
    """Where metrics.jsonl and config.yaml were written."""
    losses: list[float]
    """LM loss of every step."""
    model: Transformer
    """The trained model (this rank's part of it)."""
    is_main: bool = True
    """True on the rank that wrote the files (rank 0)."""


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a GPU; the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def train(config: Config, *, device: torch.device | None = None) -> TrainResult:
    """Train `config.model` on `config.data` for `config.train.max_steps` steps.

    Runs in one process, or as one rank of a torchrun launch (each rank calls this).
    """
    runtime = start_runtime(config, device)
    try:
        return _train(config, runtime)
    finally:
        runtime.close()


def _train(config: Config, runtime: Runtime) -> TrainResult:
    device, layout = runtime.device, runtime.layout
    if device.type == "cpu":
        keep_freed_host_memory()
    compute_dtype = DTYPES[config.precision.compute_dtype]
    data, train_cfg = config.data, config.train

    dataset = TokenDataset(
        data.paths, data.seq_len, cache_dir=Path(data.cache_dir) if data.cache_dir else None
    )
    if dataset.vocab_size > config.model.vocab_size:
        raise DataError(
            f"data.paths hold token ids up to {dataset.vocab_size - 1} but "
            f"model.vocab_size={config.model.vocab_size}; set model.vocab_size >= "
            f"{dataset.vocab_size}"
        )

    # Measured before seeding: the measurement draws random numbers.
    peak, peak_source = peak_flops(compute_dtype, device, train_cfg.peak_flops)
    peak = runtime.mean_over_world(peak)
    torch.manual_seed(train_cfg.seed)
    # Built before anything is written, so a backend that cannot run leaves no run directory.
    runner = StepRunner(config, runtime)
    model, optimizer = runner.model, runner.optimizer

    resume_from = runtime.on_main(lambda: find_resume_checkpoint(config))
    run_dir = runtime.on_main(
        lambda: prepare_run_dir(train_cfg.run_dir, resuming=resume_from is not None)
    )
    if runtime.is_main:
        dump_config(config, run_dir / "config.yaml")
    progress = Progress(train_cfg.max_steps, train_cfg.progress and runtime.is_main)
    params = count_params(config.model)
    tokens_per_step = data.global_batch_size * data.seq_len
    step_flops = flops_per_token(config.model, data.seq_len) * tokens_per_step
    progress.message(
        f"run_dir {run_dir} | {params.total / 1e6:.1f}M params ({params.active / 1e6:.1f}M "
        f"active) | {tokens_per_step} tokens/step | world {layout.describe()} | peak "
        f"{peak / 1e12:.2f} TFLOP/s per rank ({peak_source})"
    )

    start_step = 0
    if resume_from is not None:
        error = None
        try:
            load_training_state(resume_from, model, optimizer, layout)
            trainer_state = read_trainer_state(resume_from)
        except CheckpointError as e:
            error = str(e)
        runtime.raise_if_any(error)
        start_step = trainer_state["step"]
        restore_rng_state(trainer_state["rng"])
        progress.message(f"resumed from {resume_from} at step {start_step}")
    runtime.on_main(
        lambda: check_no_newer_checkpoints(
            checkpoint_root(config, run_dir), start_step, config.checkpoint.interval
        )
    )
    if runtime.is_main:
        truncate_metrics(run_dir / "metrics.jsonl", start_step)
    metrics = MetricsLog(run_dir / "metrics.jsonl") if runtime.is_main else None
    saver = PeriodicSaver(
        config, checkpoint_root(config, run_dir), model, optimizer, dataset, runtime
    )
    losses: list[float] = []
    model.train()
    try:
        for step in range(start_step, train_cfg.max_steps):
            start = time.perf_counter()
            batch = dataset.batch(step, data.global_batch_size, train_cfg.seed)
            lm_loss_sum = runner.forward_backward(runner.my_micro_batches(batch))
            lr = lr_at(step, config.optim, train_cfg.max_steps)
            grad_norm = runner.update(lr)
            step_stats = runner.step_stats(lm_loss_sum)
            loss_lm = step_stats.lm_loss
            losses.append(loss_lm)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_time, peak_mem = runtime.max_over_world(
                [time.perf_counter() - start, float(peak_memory_bytes(device))]
            )
            record = {
                "step": step,
                "loss": loss_lm,
                "lb_loss": step_stats.lb_loss,
                "z_loss": step_stats.z_loss,
                "lr": lr,
                "grad_norm": float(grad_norm),
                "tokens_per_s": tokens_per_step / step_time,
                "mfu": step_flops / step_time / (peak * layout.world_size),
                "expert_load_max_over_mean": step_stats.load_max_over_mean,
                "dropped_token_frac": step_stats.dropped_fraction,
                "peak_mem_bytes": int(peak_mem),
                "step_time_s": step_time,
            }
            logged = step % train_cfg.log_interval == 0 or step == train_cfg.max_steps - 1
            if metrics is not None and (logged or not math.isfinite(loss_lm)):
                metrics.write(record)
            progress.update(step, record)
            if math.isfinite(loss_lm):
                saver.after_step(step)
            else:
                raise MoeTrainError(
                    f"the loss became {loss_lm} at step {step}; lower optim.lr "
                    f"(now {config.optim.lr}) or set optim.grad_clip"
                )
        saver.finish()
    finally:
        if metrics is not None:
            metrics.close()
    return TrainResult(run_dir=run_dir, losses=losses, model=model, is_main=runtime.is_main)
