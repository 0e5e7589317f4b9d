"""The training loop, in phases: setup, resume, step, log and save.

`train` runs it in one process or as one rank of a distributed launch (every rank calls it).
Each step ends with one small collective that the loop needs anyway (step time and peak
memory over the ranks); it also carries the stop requests (signals) and rank 0's clock for
time-based saves, so every rank stops and saves after the same step.
"""

from __future__ import annotations

import contextlib
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_plan.config import Config, dump_config
from moe_train.errors import TrainingDiverged
from moe_train.model import Transformer, flops_per_token
from moe_train.run_paths import checkpoint_root
from moe_train.signals import StopRequests
from moe_train.train.banner import RunFacts, banner_rows
from moe_train.train.cadence import Cadence
from moe_train.train.checkpointing import Checkpoints
from moe_train.train.console import Console
from moe_train.train.data_feed import BatchFeed, TokenCounts, open_dataset
from moe_train.train.evaluate import Evaluator
from moe_train.train.expert_load import ExpertLoadLog
from moe_train.train.host_memory import keep_freed_host_memory
from moe_train.train.manifest import manifest_at, start_manifest, write_manifest
from moe_train.train.metrics import MetricsLog
from moe_train.train.peak import peak_flops
from moe_train.train.resume import ResumePoint, StartPoint, find_start, load_start
from moe_train.train.run_dir import truncate_metrics
from moe_train.train.run_lock import release_held_locks
from moe_train.train.runtime import Runtime, launched_by_torchrun, lost_rank_error, start_runtime
from moe_train.train.schedule import lr_at
from moe_train.train.step import DTYPES, StepResult, StepRunner
from moe_train.train.step_record import StepRecord
from moe_train.train.task_scoring import open_task_scorer
from moe_train.train.tracing import traced_step
from moe_train.train.tracking import Trackers, check_tracking_available


@dataclass
class TrainResult:
    run_dir: Path
    """Where metrics.jsonl, config.yaml and (by default) the checkpoints are."""
    losses: list[float]
    """LM loss of every step this call ran (NaN or inf for a skipped step)."""
    model: Transformer
    """The trained model (this rank's part of it)."""
    is_main: bool = True
    """True on the rank that wrote the files (rank 0)."""
    start_step: int = 0
    """The step this call started at (the resumed checkpoint's, or 0)."""
    end_step: int = 0
    """Steps done when it ended: train.max_steps, or fewer when a signal stopped it."""
    stopped_by: str | None = None
    """What stopped the run before train.max_steps (a signal's name, e.g. 'SIGTERM', or the
    exit of the launcher), or None."""
    checkpoint: Path | None = None
    """The newest committed checkpoint of the run when it ended, if any."""
    already_finished: bool = False
    """The resumed checkpoint was already at train.max_steps: nothing ran."""


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a GPU; the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def train(
    config: Config,
    *,
    device: torch.device | None = None,
    stops: StopRequests | None = None,
    stop_at_step: int | None = None,
) -> TrainResult:
    """Train `config.model` on `config.data` up to `config.train.max_steps` steps (or only
    up to `stop_at_step`, saving a checkpoint there: how `moe-train verify` replays a run).

    Runs in one process, or as one rank of a torchrun (or cluster launcher) launch: each
    rank calls this. A stop signal ends it early after a checkpoint (`stopped_by`). `stops`:
    stop requests the caller already listens for (the CLI does, from its start, so that a
    signal during start-up is not fatal); by default train listens while it runs.
    """
    runtime = start_runtime(config, device)
    clean = False
    trainer: Trainer | None = None
    try:
        with contextlib.nullcontext(stops) if stops else StopRequests() as active:
            active.announce_on(runtime.is_main)
            active.watch_launcher(launched_by_torchrun())
            trainer = Trainer(config, runtime, active, stop_at_step)
            result = trainer.run()
        clean = True
        return result
    except RuntimeError as e:
        lost = lost_rank_error(e, config.parallel.timeout_s) if runtime.distributed else None
        if lost is None:
            raise
        last = trainer.checkpoints.last_committed if trainer and trainer.checkpoints else None
        where = f"; the newest checkpoint is {last}" if last else ""
        raise type(lost)(f"{lost}{where}") from e
    finally:
        try:
            runtime.close(clean=clean)
        finally:
            release_held_locks()  # the run directory's lock, taken with it (rank 0)


class Trainer:
    """One rank's training run. Construction is the setup and resume phases; `run` the rest."""

    def __init__(
        self,
        config: Config,
        runtime: Runtime,
        stops: StopRequests,
        stop_at_step: int | None = None,
    ) -> None:
        self.config, self.runtime, self.stops = config, runtime, stops
        self.end_step = min(config.train.max_steps, stop_at_step or config.train.max_steps)
        """The step the loop stops before: train.max_steps, or an earlier one asked for."""
        self.checkpoints: Checkpoints | None = None
        self.trackers: Trackers | None = None
        self._setup()
        self.start_step = self.start.step
        self.skipped_steps = int(self.start.saved("skipped_steps", 0))
        self.bad_streak = 0
        self.stop_code = 0
        """The ranks' agreed stop code of the last step (`StopRequests.code`'s maximum)."""
        self.losses: list[float] = []
        saved_counts = self.start.saved("tokens_per_source")
        self.tokens_seen = TokenCounts.before(self.dataset, config, self.start_step, saved_counts)
        """Target tokens trained on from each data source so far (rank 0's count is saved)."""
        if self.already_finished:
            return
        # Loaded before anything is written: a bad checkpoint leaves no file behind.
        self._load_start()
        self._open_files()
        # Last, so that a setup that fails leaves no tracker run open.
        runtime.on_main(self._open_trackers)

    # ---- setup -------------------------------------------------------------------------

    def _setup(self) -> None:
        config, runtime = self.config, self.runtime
        train_cfg = config.train
        runtime.on_main(
            lambda: check_tracking_available(train_cfg.tensorboard, train_cfg.wandb_project)
        )
        if runtime.device.type == "cpu":
            keep_freed_host_memory()
        self.dataset = open_dataset(config)
        self.cadence = Cadence.of(config)
        # Measured before seeding: the measurement draws random numbers.
        compute_dtype = DTYPES[config.precision.compute_dtype]
        peak, self.peak_source = peak_flops(compute_dtype, runtime.device, config.train.peak_flops)
        self.peak = runtime.mean_over_world(peak)
        torch.manual_seed(config.train.seed)
        # Built before anything is written, so a backend that cannot run leaves no run directory.
        self.runner = StepRunner(config, runtime, self.dataset.eos_id)
        evaluation = config.eval
        self.evaluator = (
            Evaluator(config, self.runner, runtime)
            if evaluation.enabled and evaluation.paths
            else None
        )
        self.task_scorer = (
            open_task_scorer(config, self.runner)
            if evaluation.enabled and evaluation.tasks
            else None
        )
        self.feed = BatchFeed(
            self.dataset,
            self.runner.my_rows,
            config.data.global_batch_size,
            config.train.seed,
            self.end_step,
            prefetch=config.data.prefetch,
            pin_memory=runtime.device.type == "cuda",
        )
        self.start: StartPoint = runtime.on_main(lambda: find_start(config))
        self.resume: ResumePoint | None = self.start.resume
        self.init_from: Path | None = self.start.init_from
        self.run_dir: Path = self.start.run_dir
        self.already_finished = self.start.already_finished

    def _open_files(self) -> None:
        config, runtime = self.config, self.runtime
        self.manifest = None
        if runtime.is_main:
            dump_config(config, self.run_dir / "config.yaml")
            truncate_metrics(self.run_dir / "metrics.jsonl", self.start_step)
            previous = self.start.saved("manifest")
            topology = runtime.layout.describe()
            self.manifest = start_manifest(
                config,
                topology,
                runtime.device,
                self.start_step,
                previous,
                self.runner.kernels,
                self.runner.dispatch,
            )
            write_manifest(self.run_dir, self.manifest)
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl") if runtime.is_main else None
        self.console = Console(
            config.train.max_steps,
            enabled=runtime.is_main,
            progress=config.train.progress,
            world_size=runtime.layout.world_size,
        )
        self.expert_load = (
            ExpertLoadLog(
                self.run_dir,
                self.start_step,
                config.train.routing_check,
                self.console.message,
                top_k=config.model.moe.top_k,
            )
            if runtime.is_main and config.model.dense_layers < config.model.n_layers
            else None
        )
        data = config.data
        self.tokens_per_step = data.global_batch_size * data.seq_len
        self.step_flops = flops_per_token(config.model, data.seq_len) * self.tokens_per_step
        facts = RunFacts(
            start=self.start,
            checkpoint_dir=self.checkpoints.root,
            peak_flops=self.peak,
            peak_source=self.peak_source,
            expert_gemm=self.runner.kernels["expert_gemm"],
            linear=self.runner.kernels["linear"],
            dispatch=self.runner.dispatch,
            dataset=self.dataset,
            task_scorer=self.task_scorer,
        )
        self.console.banner(banner_rows(config, runtime, facts))

    def _open_trackers(self) -> None:
        """TensorBoard and W&B, as asked (rank 0; its errors reach every rank via on_main)."""
        train_cfg = self.config.train
        self.trackers = Trackers.open(
            self.run_dir,
            self.config.to_dict(),
            tensorboard=train_cfg.tensorboard,
            wandb_project=train_cfg.wandb_project,
            resumed_from_step=self.start_step,
        )

    # ---- resume ------------------------------------------------------------------------

    def _load_start(self) -> None:
        """Load what the run starts from (every rank); the banner reports it."""
        config = self.config
        root = checkpoint_root(config, self.run_dir)
        self.checkpoints = Checkpoints(
            config, root, self.runner.model, self.runner.optimizer, self.dataset, self.runtime
        )
        load_start(self.start, self.checkpoints)

    # ---- the loop ----------------------------------------------------------------------

    def run(self) -> TrainResult:
        """The step, log and save phases, step after step, until train.max_steps or a stop."""
        stopped_by = None
        done = self.start_step
        if not self.already_finished:
            self.runner.model.train()
            started = time.perf_counter()
            failed = True
            try:
                for step in range(self.start_step + 1, self.end_step + 1):
                    result, stop, time_due = self._step(step)
                    done = step
                    self._check_bad_streak(step, result)
                    if stop:
                        stopped_by = self.stops.describe(self.stop_code)
                    self._save(step, final=stop or step == self.end_step, time_due=time_due)
                    if stop:
                        break
                self.checkpoints.finish()
                if self.manifest is not None:
                    finished = manifest_at(self.manifest, done, completed=True)
                    write_manifest(self.run_dir, finished)
                last = self.checkpoints.last_committed
                self.console.summary(time.perf_counter() - started, str(last) if last else None)
                failed = False
            finally:
                self.feed.close()
                for log in (self.metrics, self.expert_load):
                    if log is not None:
                        log.close()
                if self.trackers is not None:
                    self.trackers.close(failed=failed)
        return TrainResult(
            run_dir=self.run_dir,
            losses=self.losses,
            model=self.runner.model,
            is_main=self.runtime.is_main,
            start_step=self.start_step,
            end_step=done,
            stopped_by=stopped_by,
            checkpoint=self.checkpoints.last_committed if self.checkpoints else self.resume.path,
            already_finished=self.already_finished,
        )

    def _step(self, step: int) -> tuple[StepResult, bool, bool]:
        """Step `step` (from state step - 1 to state step), its evaluation when due, and its
        record. Returns the step and the ranks' agreed flags: whether a stop was requested
        before the run's end, and whether a time-based save is due."""
        config, runtime = self.config, self.runtime
        index = step - 1  # the batch, learning rate and data position of the step
        start = time.perf_counter()
        if runtime.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(runtime.device)
        rows = self.feed.get(index)
        self.tokens_seen.add(
            self.dataset.tokens_per_source(index, config.data.global_batch_size, config.train.seed)
        )
        lr = lr_at(index, config.optim, config.train.max_steps)
        rank = runtime.layout.rank
        with traced_step(config.train.profile, step, self.run_dir, rank, runtime.device):
            result = self.runner.train_on(self.runner.as_micro_batches(rows), lr)
        self.losses.append(result.stats.lm_loss)
        if not result.applied:
            self.skipped_steps += 1
        if runtime.device.type == "cuda":
            torch.cuda.synchronize(runtime.device)
        step_time = time.perf_counter() - start
        peak_mem = peak_memory_bytes(runtime.device)
        evaluates = self.cadence.evaluates(step)
        eval_loss = self.evaluator.evaluate() if evaluates and self.evaluator else None
        task_metrics = self._score_tasks() if evaluates and self.task_scorer else {}
        time_due = runtime.is_main and self.checkpoints.due_by_time()
        step_time, data_wait, peak_mem, stop, time_due = runtime.max_over_world(
            [
                step_time,
                self.feed.wait_s,
                float(peak_mem),
                float(self.stops.code),
                float(time_due),
            ]
        )
        self.stop_code = int(stop)
        stop = stop > 0 and step < self.end_step
        logged = self.cadence.logs(step, final=stop or step == self.end_step)
        if self.expert_load is not None and logged and result.stats.routing is not None:
            self.expert_load.write(step, result.stats.routing)
        record = self._record(
            step, lr, result, (step_time, data_wait), int(peak_mem), eval_loss, task_metrics
        )
        self._report(record, logged=logged)
        return result, stop, time_due > 0

    def _score_tasks(self) -> dict[str, float]:
        """The eval.tasks figures of the current state, keyed as in metrics.jsonl."""
        start = time.perf_counter()
        figures = {
            f"eval/{result.name}/{metric}": value
            for result in self.task_scorer.score()
            for metric, value in result.metrics.items()
        }
        (seconds,) = self.runtime.max_over_world([time.perf_counter() - start])
        figures["eval/tasks_s"] = seconds
        return figures

    def _record(
        self,
        step: int,
        lr: float,
        result: StepResult,
        times: tuple[float, float],
        peak: int,
        eval_loss: float | None,
        task_metrics: dict[str, float],
    ) -> StepRecord:
        """The record of step `step` (`times`: step time and data wait, in seconds), with the
        balance check's verdict so far (after the step's routing row is written)."""
        stats = result.stats
        step_time, data_wait = times
        return StepRecord(
            step=step,
            loss=stats.lm_loss,
            lb_loss=stats.lb_loss,
            z_loss=stats.z_loss,
            lr=lr,
            grad_norm=result.grad_norm,
            tokens_per_s=self.tokens_per_step / step_time,
            mfu=self.step_flops / step_time / (self.peak * self.runtime.layout.world_size),
            expert_load_max_over_mean=stats.load_max_over_mean,
            hidden_imbalance_layers=(
                self.expert_load.flagged_layers if self.expert_load is not None else 0
            ),
            collapsed_layers=(
                self.expert_load.collapsed_layers if self.expert_load is not None else 0
            ),
            dropped_token_frac=stats.dropped_fraction,
            dispatch_bytes=stats.dispatch_bytes,
            exchange_bytes=stats.exchange_bytes,
            peak_mem_bytes=peak,
            step_time_s=step_time,
            data_wait_s=data_wait,
            skipped_steps=self.skipped_steps,
            tokens_seen=step * self.tokens_per_step,
            tokens_per_source=self.tokens_seen.for_metrics(),
            trained_tokens=stats.trained_tokens or 0,
            time=time.time(),
            eval_loss=eval_loss,
            mtp_loss=stats.mtp_loss,
            task_metrics=task_metrics,
            tokens=self.tokens_per_step,
            applied=result.applied,
        )

    def _report(self, record: StepRecord, *, logged: bool) -> None:
        """The log phase: the metrics row of a logged step (and of a skipped or evaluated
        one), the trackers, and the console."""
        evaluated = record.evaluated
        if self.metrics is not None and (logged or not record.applied or evaluated):
            row = record.row()
            self.metrics.write(row)
            if self.trackers is not None:
                self.trackers.log(row)
        if not record.applied:
            self.console.message(
                f"step {record.step} skipped: loss {record.loss}, grad_norm {record.grad_norm} "
                f"({self.bad_streak + 1} in a row, train.max_skipped_steps="
                f"{self.config.train.max_skipped_steps})"
            )
        self.console.step(record, logged=logged)

    def _check_bad_streak(self, step: int, result: StepResult) -> None:
        """Stop when more than train.max_skipped_steps steps in a row were skipped."""
        self.bad_streak = 0 if result.applied else self.bad_streak + 1
        limit = self.config.train.max_skipped_steps
        if self.bad_streak <= limit:
            return
        last = self.checkpoints.last_committed
        kept = f"the newest checkpoint is {last}" if last else "no checkpoint was saved"
        raise TrainingDiverged(
            f"the loss or gradient norm was not finite in {self.bad_streak} steps in a row "
            f"(the last: step {step}, loss {result.stats.lm_loss}, grad_norm "
            f"{result.grad_norm}), more than train.max_skipped_steps={limit}; stopped, and "
            f"{kept}: lower optim.lr (now {self.config.optim.lr}) or set optim.grad_clip"
        )

    # ---- save --------------------------------------------------------------------------

    def _save(self, step: int, *, final: bool, time_due: bool) -> None:
        """The save phase: by steps, by time, after the last step, and before a stop."""
        checkpoints = self.checkpoints
        if not checkpoints.enabled:
            return
        if self.cadence.saves(step, final=final) or time_due:
            loop_state = {
                "skipped_steps": self.skipped_steps,
                "tokens_per_source": self.tokens_seen.for_checkpoint(),
            }
            if self.manifest is not None:
                loop_state["manifest"] = manifest_at(self.manifest, step)
            checkpoints.save(step, loop_state)
