"""How long a rank waits on the token exchange, with and without parallel.ep_overlap, per
dispatcher, on 4 gloo ranks (expert parallelism over all four).

Each dispatcher's MoE layer (the trainer's own block, its experts split over the group) runs
forward and backward on the same tokens in three ways, interleaved rep by rep:

- ``plain``: one dispatch, the experts, one combine (parallel.ep_overlap off);
- ``exposed``: the overlap's machinery with one chunk, so every exchange is waited for whole
  (``wait_ms``: the exchange time a rank spends waiting when nothing overlaps it);
- ``overlapped``: two chunks, one chunk's exchange running while the experts compute the
  other (``wait_ms``: what is left to wait for).

``wait_ratio`` is overlapped over exposed, ``layer_ratio`` the overlapped layer's time over
plain. On a 2-core CPU four ranks share two cores, so an exchange and the experts' products
compete for them: the ratios show the mechanism, not what a GPU's copy engines and NVLink
would give. Rank 0's medians are reported.

    uv run python benchmarks/ep_overlap.py --json bench_results/ep_overlap.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from harness.arguments import names_among
from harness.output import print_table, write_json
from harness.ranks import run_distributed
from moe_plan.config import Config, config_from_dict

DISPATCHERS = ("all_to_all", "all_to_all_dedup", "rowwise/symmetric_memory", "rowwise/all_to_all")
"""``dispatcher`` or ``rowwise/transport``."""
EP = 4
MODES = ("plain", "exposed", "overlapped")


def layer_config(dispatcher: str, tokens: int, d_model: int) -> Config:
    """A MoE layer of 8 experts top-2 (expert width 2 x d_model) at ep 4; `tokens` per rank."""
    name, _, transport = dispatcher.partition("/")
    return config_from_dict(
        {
            "model": {
                "vocab_size": 128,
                "d_model": d_model,
                "n_layers": 1,
                "n_heads": 4,
                "n_kv_heads": 4,
                "dense_layers": 0,
                "moe": {
                    "num_experts": 8,
                    "top_k": 2,
                    "expert_hidden": 2 * d_model,
                    "capacity_factor": 1.25 if name == "rowwise" else None,
                },
            },
            "data": {"seq_len": tokens, "global_batch_size": EP, "micro_batch_size": 1},
            "parallel": {
                "ep": EP,
                "dispatcher": name,
                "rowwise_transport": transport or "all_to_all",
            },
            "precision": {"compute_dtype": "float32"},
        }
    )


def _measure_one(dispatcher: str, tokens: int, d_model: int, reps: int) -> dict[str, Any]:
    """Medians of rank 0's layer and wait times per mode, for one dispatcher."""
    from moe_train.model import Transformer
    from moe_train.model.exchange_worker import ExchangeWorker
    from moe_train.parallelize import apply_expert_parallel, layer_dispatchers, materialize
    from moe_train.train.runtime import start_runtime

    config = layer_config(dispatcher, tokens, d_model)
    runtime = start_runtime(config)
    try:
        with torch.device("meta"):
            model = Transformer(config.model)
        apply_expert_parallel(
            model, layer_dispatchers(config, runtime.layout.ep_group, runtime.device)
        )
        materialize(model, runtime.device, seed=0)
        (layer,) = model.moe_layers().values()
        worker = ExchangeWorker(runtime.device)
        x_BSD = torch.randn(1, tokens, d_model, generator=torch.Generator().manual_seed(1))
        x_BSD.requires_grad_()
        grad_BSD = torch.randn(1, tokens, d_model, generator=torch.Generator().manual_seed(2))
        chunks = {"plain": None, "exposed": 1, "overlapped": 2}
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        waits: dict[str, list[float]] = {mode: [] for mode in MODES}
        for rep in range(reps + 1):  # the first round warms up
            for mode in MODES:
                layer.exchange_worker = None if chunks[mode] is None else worker
                layer.exchange_chunks = chunks[mode] or 1
                worker.take_wait_s()
                start = time.perf_counter()
                layer(x_BSD).backward(grad_BSD)
                seconds = time.perf_counter() - start
                if rep:
                    times[mode].append(seconds)
                    waits[mode].append(worker.take_wait_s())
                x_BSD.grad = None
                layer.zero_grad(set_to_none=True)
        worker.close()
    finally:
        runtime.close(clean=True)
    return {
        "layer_ms": {mode: 1e3 * statistics.median(times[mode]) for mode in MODES},
        "wait_ms": {mode: 1e3 * statistics.median(waits[mode]) for mode in MODES},
    }


def measure_on_rank(
    rank: int, world_size: int, dispatchers: list[str], tokens: int, d_model: int, reps: int
) -> list[dict[str, Any]]:
    """This rank's medians for each dispatcher, one after another."""
    return [_measure_one(d, tokens, d_model, reps) for d in dispatchers]


def measure(dispatchers: list[str], tokens: int, d_model: int, reps: int) -> list[dict[str, Any]]:
    """One object per dispatcher (rank 0's medians)."""
    per_dispatcher = run_distributed(
        measure_on_rank, world_size=EP, args=(dispatchers, tokens, d_model, reps), timeout=900
    )[0]
    results = []
    for dispatcher, medians in zip(dispatchers, per_dispatcher, strict=True):
        name, _, transport = dispatcher.partition("/")
        layer_ms, wait_ms = medians["layer_ms"], medians["wait_ms"]
        results.append(
            {
                "dispatcher": name,
                "transport": transport or None,
                "tokens_per_rank": tokens,
                "d_model": d_model,
                "layer_ms": layer_ms,
                "wait_ms": wait_ms,
                "wait_ratio": wait_ms["overlapped"] / wait_ms["exposed"],
                "layer_ratio": layer_ms["overlapped"] / layer_ms["plain"],
            }
        )
    return results


def _print(results: list[dict[str, Any]]) -> None:
    print_table(
        [
            "dispatcher",
            "transport",
            "plain ms",
            "exposed ms",
            "overlapped ms",
            "exposed wait ms",
            "overlapped wait ms",
            "wait ratio",
            "layer ratio",
        ],
        [
            [
                r["dispatcher"],
                r["transport"] or "-",
                f"{r['layer_ms']['plain']:.1f}",
                f"{r['layer_ms']['exposed']:.1f}",
                f"{r['layer_ms']['overlapped']:.1f}",
                f"{r['wait_ms']['exposed']:.1f}",
                f"{r['wait_ms']['overlapped']:.1f}",
                f"{r['wait_ratio']:.2f}",
                f"{r['layer_ratio']:.2f}",
            ]
            for r in results
        ],
    )
    print(
        "(fwd+bwd of one MoE layer on rank 0 of 4, medians; wait: time blocked on the "
        "exchange thread; wait ratio: overlapped over exposed; layer ratio: overlapped "
        "over plain)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dispatchers",
        type=names_among(DISPATCHERS),
        default=list(DISPATCHERS),
        help=f"comma-separated, of {', '.join(DISPATCHERS)}",
    )
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank (4096)")
    parser.add_argument("--d-model", type=int, default=256, help="model width (256)")
    parser.add_argument("--reps", type=int, default=7, help="timed rounds (7)")
    parser.add_argument("--json", type=Path, help="write one object per dispatcher")
    args = parser.parse_args(argv)
    results = measure(args.dispatchers, args.tokens, args.d_model, args.reps)
    _print(results)
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
