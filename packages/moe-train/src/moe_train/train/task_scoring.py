"""Downstream tasks scored on the training layout: log-likelihoods of task requests.

Every request of a task is one row, right-padded to the task's longest row, so all its
micro-batches have one shape; rows go, in order, into global batches of
data.global_batch_size rows (the last one filled with padding rows), each cut into
micro-batches and shared out over the dp ranks exactly as a training batch is. So the
choices of many questions share a micro-batch, every layout runs the same micro-batches,
and expert-parallel ranks run the same number of them. Forward only, in the compute dtype;
the rank holding the head sums each row's scored log-probabilities (fp32 per token, fp64
sums), and one sum over the world gathers them. The model is in eval mode and the RNG is
restored, so scoring leaves training untouched (as `Evaluator` does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from moe_data import Tokenizer
from moe_plan.config import Config
from moe_train.errors import ConfigError, DataError, on_every_rank
from moe_train.model import head_token_logprobs
from moe_train.run_tokenizer import run_tokenizer
from moe_train.tasks import (
    MultipleChoiceTask,
    Request,
    Task,
    choice_metrics,
    choice_requests,
    open_task,
    text_bytes,
    text_metrics,
    text_requests,
)
from moe_train.train.evaluate import eval_mode_keeping_rng, pipeline_forward
from moe_train.train.micro_batches import model_inputs
from moe_train.train.step import StepRunner


@dataclass(frozen=True)
class TaskResult:
    name: str
    metrics: dict[str, float]
    """`acc` and `acc_norm`, or `bits_per_byte`."""
    loglikelihoods: list[float]
    """Per request (choice, or text window), in the task's order."""
    seconds: float
    """Wall time of the scoring on this rank."""


def open_task_scorer(config: Config, runner: StepRunner) -> TaskScorer:
    """The scorer of eval.tasks, with the tokenizer of data.paths (every rank reads the same
    files, so a bad one stops every rank alike)."""
    tokenizer, _ = run_tokenizer(config)
    if tokenizer is None:
        raise on_every_rank(
            ConfigError(
                "eval.tasks needs the tokenizer the training data was prepared with, and that "
                "of data.paths is not known here (a .npy token array, or files not on this "
                "machine); use directories written by moe-train prepare-data or builtin:stdlib"
            )
        )
    try:
        cache_dir = Path(config.data.cache_dir) if config.data.cache_dir else None
        tasks = [open_task(spec, cache_dir) for spec in config.eval.tasks]
        return TaskScorer(runner, tokenizer, tasks)
    except DataError as e:
        raise on_every_rank(e) from None


class TaskScorer:
    """Scores tasks with this rank's part of the model (collective: every rank calls it)."""

    def __init__(self, runner: StepRunner, tokenizer: Tokenizer, tasks: list[Task]) -> None:
        self.runner, self.tokenizer, self.tasks = runner, tokenizer, tasks
        seq_len = runner.config.data.seq_len
        self.requests = [
            choice_requests(task, tokenizer, seq_len)
            if isinstance(task, MultipleChoiceTask)
            else text_requests(task, tokenizer, seq_len)
            for task in tasks
        ]
        vocab = runner.config.model.vocab_size
        for task, requests in zip(tasks, self.requests, strict=True):
            if any(max(r.tokens) >= vocab for r in requests):
                raise DataError(
                    f"{task.path}: its text encodes to token ids beyond model.vocab_size={vocab}"
                )

    def describe(self) -> str:
        """The tasks, their rows and requests, for the banner."""
        return ", ".join(
            f"{task.name} ({_size(task)}, {len(requests)} rows of forward)"
            for task, requests in zip(self.tasks, self.requests, strict=True)
        )

    def score(self) -> list[TaskResult]:
        """Every task's figures (the same on every rank)."""
        results = []
        for task, requests in zip(self.tasks, self.requests, strict=True):
            start = time.perf_counter()
            lls = self.loglikelihoods(requests)
            metrics = (
                choice_metrics(task, lls)
                if isinstance(task, MultipleChoiceTask)
                else text_metrics(task, lls)
            )
            results.append(TaskResult(task.name, metrics, lls, time.perf_counter() - start))
        return results

    @torch.no_grad()
    def loglikelihoods(self, requests: list[Request]) -> list[float]:
        """The sum of the scored targets' log-probabilities of each request."""
        runner, model = self.runner, self.runner.model
        device = runner.runtime.device
        context = runner.context  # under context parallelism each rank scores its positions
        chunks = 2 * context.cp if context is not None else 1
        rows_BW, scored_BW = _rows(requests, self.tokenizer.eos_id, chunks)
        size = runner.config.data.global_batch_size
        batches = -(-len(requests) // size)
        rows_BW, scored_BW = _pad_rows(rows_BW, scored_BW, batches * size)
        totals = torch.zeros(batches * size, dtype=torch.float64, device=device)
        first, stop = runner.my_rows
        mbs = runner.config.data.micro_batch_size
        with eval_mode_keeping_rng(model):
            for batch in range(batches):
                for start in range(batch * size + first, batch * size + stop, mbs):
                    rows = slice(start, start + mbs)
                    inputs, targets = model_inputs(rows_BW[rows].to(device), False, context)
                    logprobs = self._target_logprobs(inputs, targets)
                    if logprobs is not None:
                        scored = scored_BW[rows].to(device)
                        scored = scored if context is None else context.local(scored)
                        totals[rows] = torch.where(scored, logprobs.double(), 0.0).sum(dim=1)
        return runner.runtime.sum_over_world(totals)[: len(requests)].tolist()

    def _target_logprobs(self, inputs: Tensor, targets: Tensor) -> Tensor | None:
        """[mbs, W - 1] log-probabilities of the targets (None on ranks without the head)."""
        runner = self.runner
        if runner.pipeline is None:
            model = runner.model
            with runner.autocast():
                hidden = model.run_layers(inputs, list(model.blocks), embed=True)
                return head_token_logprobs(model.norm(hidden), model.head.weight, targets)
        normed = pipeline_forward(runner, inputs, None)
        if normed is None:
            return None
        with runner.autocast():
            return head_token_logprobs(normed, runner.model.head.weight, targets)


def _size(task: Task) -> str:
    if isinstance(task, MultipleChoiceTask):
        return f"{len(task.rows)} questions"
    return f"{text_bytes(task):,} bytes of text"


def _rows(requests: list[Request], pad_id: int, chunks: int = 1) -> tuple[Tensor, Tensor]:
    """[R, W] token rows right-padded with `pad_id` to the longest (and further, so that the
    W - 1 inputs split into `chunks` equal chunks), and [R, W - 1] which of their targets are
    scored."""
    width = 1 + -(-max(len(r.tokens) - 1 for r in requests) // chunks) * chunks
    rows = torch.full((len(requests), width), pad_id, dtype=torch.long)
    scored = torch.zeros((len(requests), width - 1), dtype=torch.bool)
    for index, request in enumerate(requests):
        length = len(request.tokens)
        rows[index, :length] = torch.tensor(request.tokens)
        scored[index, length - 1 - request.scored : length - 1] = True
    return rows, scored


def _pad_rows(rows: Tensor, scored: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """`count` rows: padding rows (their first row, nothing scored) added at the end."""
    extra = count - rows.shape[0]
    if not extra:
        return rows, scored
    return (
        torch.cat([rows, rows[:1].expand(extra, -1)]),
        torch.cat([scored, torch.zeros(extra, scored.shape[1], dtype=torch.bool)]),
    )
