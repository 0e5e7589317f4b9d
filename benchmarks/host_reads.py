"""Host reads of the MoE layer per dispatcher, and of one whole training step, on ep2.

A host read is anything that, on a GPU, makes the host wait for the device's tensor data
(``harness/host_reads.py`` counts them with a torch dispatch mode: ``item()``, ``tolist()``,
copies to the host, and operations whose output shape depends on values such as
``nonzero``). Two gloo processes, one expert-parallel group of 2; for each dispatcher the
trainer's own model and step (``StepRunner``) are built, warmed up by one step, then:

- ``forward_host_reads`` / ``backward_host_reads``: one MoE layer's forward and backward
  (router, dispatch, experts, combine, auxiliary losses) on a micro-batch;
- ``step_host_reads``: one whole training step (every layer and micro-batch, the gradient
  reduction, clipping, the step's statistics and the optimizer), each read listed by site.

The experts' grouped GEMMs run ``torch._grouped_mm``, the backend GPUs use (it takes its
offsets on the device). Its wrapper has two branches taken on CPU tensors only, which read
the offsets on the host on purpose, and so does gradient clipping (it skips the scaling when
the norm is within the bound): those reads (``CPU_ONLY_SITES``) are listed apart and not
counted. Rank 0's counts are reported (the ranks run the same code).

    uv run python benchmarks/host_reads.py --json bench_results/host_reads.json
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from harness.arguments import names_among
from harness.host_reads import HostReadCounter
from harness.output import print_table, write_json
from harness.ranks import run_distributed
from moe_plan.config import Config, config_from_dict
from moe_train.train.runtime import start_runtime
from moe_train.train.step import StepRunner

DISPATCHERS = (
    "all_to_all",
    "all_to_all_dedup",
    "rowwise/symmetric_memory",
    "rowwise/all_to_all",
)
"""``dispatcher`` or ``rowwise/transport``."""

CPU_ONLY_SITES = (
    "moe_kernels/grouped_mm.py:_zero_padding_rows_",
    "moe_kernels/grouped_mm.py:_zero_empty_groups_",
    "moe_parallel/grad_norm.py:scale_to_norm_",
)
"""Functions whose host reads are in a branch taken on CPU tensors only."""

EP = 2
MICRO, SEQ, MICRO_BATCHES = 2, 32, 2


def layer_config(dispatcher: str) -> Config:
    name, _, transport = dispatcher.partition("/")
    return config_from_dict(
        {
            "model": {
                "vocab_size": 128,
                "d_model": 32,
                "n_layers": 2,
                "n_heads": 4,
                "n_kv_heads": 2,
                "dense_layers": 0,
                "moe": {
                    "num_experts": 8,
                    "top_k": 2,
                    "expert_hidden": 32,
                    "capacity_factor": 2.0 if name == "rowwise" else None,
                },
            },
            "data": {
                "seq_len": SEQ,
                "global_batch_size": MICRO * MICRO_BATCHES * EP,
                "micro_batch_size": MICRO,
            },
            "parallel": {
                "ep": EP,
                "dispatcher": name,
                "rowwise_transport": transport or "all_to_all",
            },
            "precision": {"compute_dtype": "float32"},
        }
    )


def _split(counter: HostReadCounter) -> tuple[dict[str, int], dict[str, int]]:
    """(reads by site, CPU-only reads by site)."""
    kept: Counter[str] = Counter()
    cpu_only: Counter[str] = Counter()
    for read in counter.reads:
        where = cpu_only if read.site in CPU_ONLY_SITES else kept
        where[f"{read.site} ({read.what})"] += 1
    return dict(kept), dict(cpu_only)


def _count_one(dispatcher: str) -> dict[str, Any]:
    config = layer_config(dispatcher)
    runtime = start_runtime(config)
    try:
        torch.manual_seed(0)
        runner = StepRunner(config, runtime)
        batch = torch.randint(0, 128, (config.data.global_batch_size, SEQ + 1))
        runner.train_step(batch, lr=1e-3)  # warm-up: buffers, first-call setup
        layer = next(iter(runner.model.moe_layers().values()))
        x_BSD = torch.randn(MICRO, SEQ, config.model.d_model, requires_grad=True)
        layer(x_BSD).sum().backward()  # warm-up of the layer alone
        with HostReadCounter() as forward:
            y_BSD = layer(x_BSD)
        loss = y_BSD.square().mean()
        with HostReadCounter() as backward:
            loss.backward()
        with HostReadCounter() as step:
            runner.train_step(batch, lr=1e-3)
    finally:
        runtime.close(clean=True)
    counts = {}
    for phase, counter in (("forward", forward), ("backward", backward), ("step", step)):
        kept, cpu_only = _split(counter)
        counts[phase] = {"reads": sum(kept.values()), "sites": kept, "cpu_only_sites": cpu_only}
    return counts


def count_on_rank(rank: int, world_size: int, dispatchers: list[str]) -> list[dict[str, Any]]:
    """This rank's counts for each dispatcher, one after another in this process."""
    return [_count_one(dispatcher) for dispatcher in dispatchers]


def measure(dispatchers: list[str]) -> list[dict[str, Any]]:
    """One object per dispatcher (rank 0's counts)."""
    per_dispatcher = run_distributed(count_on_rank, world_size=EP, args=(dispatchers,))[0]
    results = []
    for dispatcher, counts in zip(dispatchers, per_dispatcher, strict=True):
        name, _, transport = dispatcher.partition("/")
        results.append(
            {
                "dispatcher": name,
                "transport": transport or None,
                "forward_host_reads": counts["forward"]["reads"],
                "backward_host_reads": counts["backward"]["reads"],
                "step_host_reads": counts["step"]["reads"],
                "sites": {phase: counts[phase]["sites"] for phase in counts},
                "cpu_only_sites": {phase: counts[phase]["cpu_only_sites"] for phase in counts},
            }
        )
    return results


def _print(results: list[dict[str, Any]]) -> None:
    print_table(
        ["dispatcher", "transport", "forward", "backward", "step"],
        [
            [
                r["dispatcher"],
                r["transport"] or "-",
                r["forward_host_reads"],
                r["backward_host_reads"],
                r["step_host_reads"],
            ]
            for r in results
        ],
    )
    for r in results:
        label = r["dispatcher"] + (f"/{r['transport']}" if r["transport"] else "")
        print(f"\n{label}: host reads by site")
        for phase, sites in r["sites"].items():
            for site, count in sorted(sites.items()):
                print(f"  {phase:8s} {count:3d}  {site}")
        for phase, sites in r["cpu_only_sites"].items():
            for site, count in sorted(sites.items()):
                print(f"  {phase:8s} {count:3d}  {site}  [CPU only, not counted]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dispatchers",
        type=names_among(DISPATCHERS),
        default=list(DISPATCHERS),
        help=f"comma-separated, of {', '.join(DISPATCHERS)}",
    )
    parser.add_argument("--json", type=Path, help="write one object per dispatcher")
    args = parser.parse_args(argv)
    results = measure(args.dispatchers)
    _print(results)
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
