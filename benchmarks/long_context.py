"""Long sequences under context parallelism: activation memory per rank and tokens/s.

For each context-parallel size (`--cps`, default 1 2 4; one spawn of that many gloo ranks,
one thread each), each sequence length (`--seqs`, default 2K 4K 8K) and document masking off
and on (4 documents of uneven length per sequence), a small MoE model (2 layers, d_model
128, 4 heads, 4 experts, fp32) runs forward and backward of one sequence split over the
ranks (`moe_train.parallelize.apply_context_parallel`).

"act MiB/rank" is the activation memory of the rank that saves most: the bytes of the
distinct tensors autograd saves for backward (parameters left out), the gathered keys and
values included. "vs cp1" divides it by the cp1 figure of the same length and masking.
"peak RSS MiB" is the largest resident set of a rank's process over its runs (weights, the
interpreter and the allocator's slack included). "tok/s" is the sequence's tokens over the
slowest rank's median forward + backward time; on a machine with fewer cores than ranks it
measures contention too.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from harness.output import print_table, write_json
from harness.ranks import run_distributed
from moe_plan.config import ModelConfig, MoEConfig
from moe_train.model import Documents, Transformer
from moe_train.parallelize import ContextShard, apply_context_parallel

MODEL = ModelConfig(
    vocab_size=256,
    d_model=128,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    dense_layers=1,
    dense_hidden=256,
    moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=128),
)
DOCUMENT_ENDS = (0.3, 0.55, 0.8)
"""Where the documents of a masked sequence end, as fractions of its length (and its end)."""


def forward_saving(model: Transformer, **inputs) -> tuple[torch.Tensor, int]:
    """The loss of `model(**inputs)` and the bytes of the distinct tensors autograd saved for
    its backward, the model's parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(**inputs)
    return loss, sum(storages.values())


def measure(rank: int, world_size: int, cases: list[tuple[int, bool]], reps: int) -> list[dict]:
    """Per (seq, masking) case: this rank's saved activation bytes and median step time."""
    model = Transformer(MODEL, seed=0)
    shard = ContextShard(world_size, rank, dist.group.WORLD)
    if world_size > 1:
        apply_context_parallel(model, shard)
    results = []
    for seq, masking in cases:
        tokens = torch.randint(
            0, MODEL.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(seq)
        )
        documents = None
        if masking:
            ends = (*(int(seq * f) for f in DOCUMENT_ENDS), seq)
            documents = Documents((ends,))
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if world_size > 1:
            inputs, targets = shard.local(inputs), shard.local(targets)
        batch = {
            "tokens_BS": inputs,
            "targets_BS": targets,
            "documents": documents,
            "loss_normalizer": torch.tensor(float(seq)),
        }
        loss, activation_bytes = forward_saving(model, **batch)
        loss.backward()
        times = []
        for _ in range(reps):
            if world_size > 1:
                dist.barrier()
            start = time.perf_counter()
            model(**batch).backward()
            elapsed = torch.tensor([time.perf_counter() - start])
            if world_size > 1:
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(elapsed.item())
        model.zero_grad(set_to_none=True)
        results.append(
            {
                "seq": seq,
                "masking": masking,
                "activation_bytes": activation_bytes,
                "seconds": statistics.median(times),
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            }
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--reps", type=int, default=2, help="timed forward + backward passes")
    parser.add_argument("--out", type=Path, default=Path("bench_results/long_context.json"))
    args = parser.parse_args()
    cases = [(seq, masking) for seq in args.seqs for masking in (False, True)]
    rows = []
    for cp in args.cps:
        per_rank = run_distributed(measure, world_size=cp, args=(cases, args.reps), timeout=3600)
        for index, (seq, masking) in enumerate(cases):
            ranks = [results[index] for results in per_rank]
            rows.append(
                {
                    "cp": cp,
                    "seq": seq,
                    "masking": masking,
                    "activation_bytes_per_rank": max(r["activation_bytes"] for r in ranks),
                    "peak_rss_bytes_per_rank": max(r["peak_rss_bytes"] for r in ranks),
                    "tokens_per_s": seq / ranks[0]["seconds"],
                }
            )
    cp1 = {(r["seq"], r["masking"]): r["activation_bytes_per_rank"] for r in rows if r["cp"] == 1}
    for row in rows:
        base = cp1.get((row["seq"], row["masking"]))
        row["activation_vs_cp1"] = row["activation_bytes_per_rank"] / base if base else None
    print(f"one sequence, forward + backward, median of {args.reps}; {os.cpu_count()} cores")
    print_table(
        ("seq", "masking", "cp", "act MiB/rank", "vs cp1", "peak RSS MiB", "tok/s"),
        (
            [
                row["seq"],
                "on" if row["masking"] else "off",
                row["cp"],
                f"{row['activation_bytes_per_rank'] / 2**20:,.1f}",
                f"{row['activation_vs_cp1']:.2f}" if row["activation_vs_cp1"] else "-",
                f"{row['peak_rss_bytes_per_rank'] / 2**20:,.0f}",
                f"{row['tokens_per_s']:,.0f}",
            ]
            for row in sorted(rows, key=lambda r: (r["seq"], r["masking"], r["cp"]))
        ),
    )
    write_json(args.out, {"reps": args.reps, "model": dataclasses.asdict(MODEL), "rows": rows})


if __name__ == "__main__":
    main()
