"""The two designs of `vs_fsdp.py` and what one rank measures of them.

- "ep": this trainer's step (`moe_train.train.step.StepRunner`, as `moe_train.train` builds
  it): data parallel with the experts resident on an expert-parallel group of `ep` ranks,
  tokens moved by a dispatcher (all_to_all or rowwise), dense gradients all-reduced (or
  reduce-scattered, with the distributed optimizer).
- "fsdp": torch's FSDP2 (`fully_shard` on every block and on the root) over the same model
  built with every expert local (the local dispatcher, the same grouped GEMM), each rank
  taking the same micro-batches: weights are all-gathered for each micro-batch's forward and
  again for its backward (the root module's stay gathered in between, FSDP2's rule for the
  root), and gradients reduce-scattered after each micro-batch's backward (FSDP2's default,
  which keeps them sharded). Gradients are summed, not averaged, over ranks (each
  micro-batch already weighs 1 / micro-batches in the loss), the optimizer is
  torch.optim.AdamW(fused=True) with weight decay on matrices only, as this trainer's, and the
  gradient norm is clipped globally (`torch.nn.utils.clip_grad_norm_`, same formula).

Both run fp32 parameters with the compute dtype under autocast, the same data, learning rate
schedule and MoE statistics (losses and expert loads summed over ranks, balancing biases
updated from them).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from moe_data import TokenDataset
from moe_parallel import decay_matrices
from moe_plan.config import Config, config_from_dict
from moe_train.model import Transformer, apply_expert_gemm
from moe_train.train.host_memory import allocated_host_bytes, keep_freed_host_memory
from moe_train.train.micro_batches import MicroBatches
from moe_train.train.runtime import Runtime, start_runtime
from moe_train.train.schedule import lr_at
from moe_train.train.step import (
    DTYPES,
    StepResult,
    StepRunner,
    accumulate_gradients,
    reduce_step_stats,
    update_balancing_biases,
)
from vs_fsdp_comm import CollectiveCounter, PeakHeap
from vs_fsdp_variants import EP, VARIANTS, Variant

CPU = torch.device("cpu")


@dataclass(frozen=True, kw_only=True)
class BenchSetup:
    """What every measured run shares (all but the expert count and the variant)."""

    model: dict[str, Any]
    """The config's `model` section; `moe.num_experts` is set per run."""
    data: dict[str, Any]
    """The config's `data` section (paths, seq_len, global and micro batch sizes)."""
    compute_dtype: str = "bfloat16"
    """Matmul dtype under autocast; parameters stay fp32 in both designs."""
    rowwise_capacity_factor: float = 2.0
    """model.moe.capacity_factor of the rowwise runs (its buffers are sized by it); the other
    runs are dropless."""
    random_routing: bool = True
    """model.moe.random_routing: each token to top_k experts drawn at random, an even load
    whatever the router has learnt (a system benchmark's routing). False: the router's own
    choice, deterministic, so that runs can be compared with one process."""
    optim: dict[str, Any] = field(default_factory=lambda: {"lr": 1e-3, "warmup_steps": 2})
    """The config's `optim` section."""
    warmup_steps: int = 2
    """Steps before the counted (or timed) ones."""
    counted_steps: int = 2
    """Steps run under the collective counter and the heap probe (not timed)."""
    timed_steps: int = 3
    """Steps timed, with the variants of one expert count interleaved step by step."""

    @property
    def schedule_steps(self) -> int:
        """train.max_steps of every run: the learning rate schedule is the same in the counted
        and the timed runs (each of which stops earlier or at its end)."""
        return self.warmup_steps + max(self.counted_steps, self.timed_steps)

    def config(self, variant: Variant, experts: int) -> Config:
        """The trainer config of `variant` with `experts` routed experts."""
        model = copy.deepcopy(self.model)
        moe = model.setdefault("moe", {})
        moe["num_experts"] = experts
        moe["random_routing"] = self.random_routing
        rowwise = variant.dispatcher == "rowwise"
        moe["capacity_factor"] = self.rowwise_capacity_factor if rowwise else None
        parallel: dict[str, Any] = {"ep": 1}
        if variant.design == "ep":
            parallel = {
                "ep": EP,
                "dispatcher": variant.dispatcher,
                "distributed_optimizer": variant.distributed_optimizer,
            }
            if rowwise:  # collectives the counters see (symmetric memory moves none)
                parallel["rowwise_transport"] = "all_to_all"
        return config_from_dict(
            {
                "model": model,
                "data": dict(self.data),
                "optim": dict(self.optim),
                "train": {
                    "max_steps": self.schedule_steps,
                    "progress": False,
                    "peak_flops": 1e12,
                },
                "precision": {"compute_dtype": self.compute_dtype},
                "parallel": parallel,
            }
        )


class Runner(Protocol):
    """What both designs offer a training loop."""

    runtime: Runtime
    model: torch.nn.Module

    def train_step(self, batch: torch.Tensor, lr: float) -> StepResult: ...


class _NoReducer:
    """FSDP2 reduces gradients from its own backward hooks: nothing to arm."""

    def arm(self) -> None:
        pass


class FsdpRunner:
    """The FSDP2 design's model, optimizer and training step on this rank."""

    def __init__(self, config: Config, runtime: Runtime) -> None:
        layout = runtime.layout
        if layout.ep != 1 or layout.pp != 1:
            raise ValueError(f"FsdpRunner needs ep=1, pp=1 (got {layout.describe()})")
        self.config, self.runtime = config, runtime
        self.compute_dtype = DTYPES[config.precision.compute_dtype]
        self.num_micro = runtime.shape.micro_batches
        self.my_micro = runtime.shape.micro_batches_per_rank  # cp = 1: batch ranks are dp
        self.first_micro = layout.dp_rank * self.my_micro
        # ep = 1: every layer's dispatcher is local, the single-process model's.
        model = Transformer(config.model, seed=config.train.seed).to(runtime.device)
        apply_expert_gemm(model, config.precision.expert_gemm)
        model.set_aux_loss_scale(1.0 / self.num_micro)
        mesh = init_device_mesh(runtime.device.type, (layout.dp,))
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for module in model.modules():
            if isinstance(module, FSDPModule):  # each setting is per fully_shard call
                # Each rank's loss already weighs its micro-batches by 1 / num_micro: sum, as
                # ours, not the default mean (a plain SUM: gloo has no pre-multiplied sum).
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        self.model = model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        optim = config.optim
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [p for n, p in named if decay_matrices(n, p)]},
                {"params": [p for n, p in named if not decay_matrices(n, p)], "weight_decay": 0.0},
            ],
            lr=optim.lr,
            betas=tuple(optim.betas),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            fused=True,
        )
        clip = optim.grad_clip
        self.grad_clip = clip if clip is not None else float("inf")

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.runtime.device.type, dtype=self.compute_dtype)

    def train_step(self, batch: torch.Tensor, lr: float) -> StepResult:
        """One step on a global batch (this rank's micro-batches of it), as `StepRunner`'s."""
        data = self.config.data
        rows_per_rank = self.my_micro * data.micro_batch_size
        rows = batch[self.first_micro * data.micro_batch_size :][:rows_per_rank]
        shape = (self.my_micro, data.micro_batch_size, data.seq_len + 1)
        mine = MicroBatches.of(rows, shape, self.runtime.device, None)
        lm_loss_sum = accumulate_gradients(
            self.model, mine, _NoReducer(), self.autocast, self.num_micro
        )
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip, foreach=True)
        grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        stats = reduce_step_stats(self.model, lm_loss_sum, self.num_micro, self.runtime)
        applied = stats.finite and math.isfinite(grad_norm)
        if applied:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            update_balancing_biases(self.model, stats.expert_copies_LE)
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(stats, grad_norm, applied)


def build_runner(variant: Variant, config: Config) -> Runner:
    """The runner of `variant`, built the way the trainer builds its step (every rank)."""
    runtime = start_runtime(config, CPU)
    torch.manual_seed(config.train.seed)
    if variant.design == "fsdp":
        return FsdpRunner(config, runtime)
    return StepRunner(config, runtime)


def _steps(total: int, config: Config, dataset: TokenDataset) -> Iterator:
    """(step, global batch, learning rate) of steps 0 .. total - 1, as the trainer's."""
    for step in range(total):
        batch = dataset.batch(step, config.data.global_batch_size, config.train.seed)
        yield step, batch, lr_at(step, config.optim, config.train.max_steps)


def count_run(
    setup: BenchSetup, variant: Variant, experts: int, dataset: TokenDataset
) -> dict[str, Any]:
    """Build `variant` alone, train the warmup steps, then the counted steps under the
    collective counter and the heap probe; this rank's figures (bytes summed over the
    counted steps; peak above the heap in use before the model was built)."""
    total = setup.warmup_steps + setup.counted_steps
    config = setup.config(variant, experts)
    gc.collect()
    baseline = allocated_host_bytes()
    runner = build_runner(variant, config)
    counter, heap = CollectiveCounter(), PeakHeap()
    losses, grad_norms, dropped = [], [], []
    for step, batch, lr in _steps(total, config, dataset):
        counted = step >= setup.warmup_steps
        with contextlib.ExitStack() as probes:
            if counted:
                probes.enter_context(counter)
                probes.enter_context(heap)
            result = runner.train_step(batch, lr)
        losses.append(result.stats.lm_loss)
        grad_norms.append(result.grad_norm)
        if counted:
            dropped.append(result.stats.dropped_fraction)
    out = {
        "losses": losses,
        "grad_norms": grad_norms,
        "collectives": counter.totals.as_dict(),
        "peak_mem_bytes": heap.peak - baseline,
        "dropped_fraction": sum(dropped) / len(dropped),
        "params": sum(_local(p).numel() for p in runner.model.parameters()),
    }
    del runner
    dist.barrier()
    return out


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (FSDP's are DTensors, whose numel is the global one)."""
    return param.to_local() if isinstance(param, DTensor) else param


def timed_runs(
    setup: BenchSetup, variants: list[Variant], experts: int, dataset: TokenDataset
) -> dict[str, dict[str, list[float]]]:
    """Train every variant from step 0, interleaved step by step (the order rotates), and time
    the steps after the warmup; per variant, its losses and step times (the slowest rank's)."""
    total = setup.warmup_steps + setup.timed_steps
    configs = {v: setup.config(v, experts) for v in variants}
    runners = {v: build_runner(v, configs[v]) for v in variants}
    first = configs[variants[0]]
    losses: dict[Variant, list[float]] = {v: [] for v in variants}
    times: dict[Variant, list[float]] = {v: [] for v in variants}
    for step, batch, lr in _steps(total, first, dataset):
        order = variants[step % len(variants) :] + variants[: step % len(variants)]
        for variant in order:
            dist.barrier()
            start = time.perf_counter()
            result = runners[variant].train_step(batch, lr)
            elapsed = time.perf_counter() - start
            losses[variant].append(result.stats.lm_loss)
            if step >= setup.warmup_steps:
                times[variant].append(elapsed)
    slowest = torch.tensor([times[v] for v in variants], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    del runners
    dist.barrier()
    return {
        v.name: {"losses": losses[v], "step_times_s": slowest[i].tolist()}
        for i, v in enumerate(variants)
    }


def measure_rank(
    rank: int,
    world_size: int,
    setup: BenchSetup,
    experts_list: list[int],
    variant_names: list[str],
) -> dict[int, dict[str, dict[str, Any]]]:
    """Body of each spawned rank: per expert count, per variant, the counted and timed runs."""
    if world_size != EP:
        raise ValueError(f"the benchmark runs on {EP} ranks, not {world_size}")
    keep_freed_host_memory()  # as the trainer does on a CPU
    variants = [v for v in VARIANTS if v.name in variant_names]
    data = setup.data
    dataset = TokenDataset(data["paths"], data["seq_len"], cache_dir=_cache_dir(data))
    results: dict[int, dict[str, dict[str, Any]]] = {}
    for experts in experts_list:
        # Timed first: its runs also make the lasting allocations of a new shape (kernel and
        # primitive caches), which would otherwise count in the first counted run's peak.
        timed = timed_runs(setup, variants, experts, dataset)
        results[experts] = {
            v.name: {**count_run(setup, v, experts, dataset), "timed": timed[v.name]}
            for v in variants
        }
    return results


def _cache_dir(data: dict[str, Any]) -> Path | None:
    return Path(data["cache_dir"]) if data.get("cache_dir") else None
