"""`moe-train eval CKPT --tasks FILE...`: a checkpoint scored on downstream tasks, offline.

The checkpoint's own config builds the model on the launch's layout (one process, or
torchrun; `--parallel.key=value` sets the layout, as for `verify`), its global tensors fill
it whatever layout wrote them, and the tasks are scored by the same scorer as the training
loop's eval.tasks (see `moe_train.train.task_scoring`), so the figures equal the loop's at
that step.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from moe_checkpoint import CheckpointError, read_trainer_state, resolve_checkpoint
from moe_plan.config import Config, config_from_dict, parse_overrides
from moe_train.errors import ConfigError, MoeTrainError, on_every_rank
from moe_train.run_tokenizer import run_tokenizer
from moe_train.train.runtime import start_runtime
from moe_train.train.state_slices import load_model_state
from moe_train.train.step import StepRunner
from moe_train.train.task_scoring import TaskResult, open_task_scorer


def eval_config(checkpoint: Path, tasks: Sequence[str | Path], layout: Sequence[str]) -> Config:
    """The checkpoint's config with eval.tasks = `tasks` and the `layout` overrides
    (`--parallel.key=value` only)."""
    for override in layout:
        if not override.startswith("--parallel."):
            raise on_every_rank(
                ConfigError(
                    f"{override}: eval scores the checkpoint's model as it was trained and "
                    "takes only the layout (--parallel.key=value)"
                )
            )
    if not tasks:
        raise on_every_rank(ConfigError("give at least one task file: --tasks FILE..."))
    try:
        data = read_trainer_state(checkpoint)["config"]
    except CheckpointError as e:
        raise on_every_rank(MoeTrainError(str(e))) from e
    if layout:
        data["parallel"] = {**data.get("parallel", {}), **parse_overrides(list(layout))["parallel"]}
    data["eval"] = {**data.get("eval", {}), "tasks": [str(task) for task in tasks]}
    try:
        return config_from_dict(data)
    except MoeTrainError as e:
        raise on_every_rank(e) from None


def evaluate_checkpoint(
    checkpoint: str | Path,
    tasks: Sequence[str | Path],
    *,
    layout: Sequence[str] = (),
    device: torch.device | None = None,
) -> tuple[Path, list[TaskResult]]:
    """The resolved checkpoint and each task's figures (the same on every rank)."""
    try:
        ckpt = resolve_checkpoint(checkpoint)
    except CheckpointError as e:
        raise on_every_rank(MoeTrainError(str(e))) from e
    config = eval_config(ckpt, tasks, layout)
    runtime = start_runtime(config, device)
    clean = False
    try:
        torch.manual_seed(config.train.seed)
        runner = StepRunner(config, runtime, run_tokenizer(config)[1])
        runtime.raise_if_any(load_model_state(ckpt, runner.model, runner.optimizer, runtime.layout))
        results = open_task_scorer(config, runner).score()
        clean = True
    finally:
        runtime.close(clean=clean)
    return ckpt, results


def results_json(results: list[TaskResult]) -> list[dict]:
    """Per task its name, its figures and the seconds its scoring took."""
    return [
        {"name": result.name, **result.metrics, "seconds": round(result.seconds, 3)}
        for result in results
    ]


def results_table(ckpt: Path, results: list[TaskResult]) -> str:
    """One line per task."""
    lines = [f"{ckpt}:"]
    for result in results:
        figures = "  ".join(f"{name} {value:.4f}" for name, value in result.metrics.items())
        lines.append(f"  {result.name:<24} {figures}  ({result.seconds:.2f} s)")
    return "\n".join(lines)
