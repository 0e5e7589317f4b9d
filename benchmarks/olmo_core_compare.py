"""Training-step throughput of this trainer against OLMo-core on the same small MoE, in one run.

Both systems train the same 14.2M-parameter decoder-only MoE in one process on the same
random token batches: vocabulary 1024, d_model 256, 4 pre-norm blocks, 4 attention heads
(4 key/value heads, head size 64, RoPE theta 10000, per-head RMS QK-norm), a softmax router
choosing the top 2 of 8 SwiGLU experts of hidden width 512 in every block (dropless, no
dense or shared experts, top-k weights renormalised to sum to one), untied embeddings,
RMSNorm eps 1e-5, 4 sequences of 256 tokens per optimizer step (one micro-batch). A step
is forward, cross-entropy, backward, global gradient-norm clipping at 1.0 and AdamW (lr
1e-3, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices only), in fp32, or with fp32
parameters and bf16 autocast.

- This trainer: `moe_train.train.step.StepRunner`, the step the training loop runs.
- OLMo-core: its `MoETransformer` (`TransformerConfig.llama_like_moe(..., dropless=True)`,
  block type `moe`) in a plain step written here: `model(inputs, labels=labels)` (OLMo-core's
  own LM head computes the loss), backward, `model.post_batch()`,
  `torch.nn.utils.clip_grad_norm_` and `torch.optim.AdamW(fused=True)` with the same
  parameter groups, under `torch.autocast` for bf16 (OLMo-core's `autocast_precision`). Its
  trainer (`TransformerTrainModule`) needs a distributed setup, so it is not used.

Where the two differ:
- OLMo-core's MoE layers cannot run on a CPU as shipped: they permute tokens with Triton GPU
  kernels (`olmo_core.kernels.moe.gather`, `scatter`, `scatter_wgrad`). Those three are
  replaced here by torch index operations with the same semantics (checked at start-up
  against a per-token loop). The experts then run OLMo-core's own CPU fallback, one matmul
  per expert (its grouped GEMM package is CUDA-only); this trainer uses grouped GEMMs.
- Auxiliary losses have the same weights (load balancing 0.01, router z-loss 0.001) and
  both systems divide them over the layers, but the formulas differ in detail.
- Initialisation differs (each system's own); routing is therefore not identical.
- This trainer's step also gathers routing statistics (one `.item()` per step).
- The process keeps freed host memory for reuse, as this trainer's training loop does; being
  one process, OLMo-core gets the same allocator settings.

OLMo-core 3.0.0 pins torch<2.14 while this project runs a newer torch, so it is installed
without its torch, into an ignored folder laid over the project's environment
(`scripts/olmo_core_env.sh`; nothing in the project's environment changes):

    scripts/olmo_core_env.sh
    PYTHONPATH=.cache/olmo-core uv run --no-sync python benchmarks/olmo_core_compare.py
        [--steps 20] [--warmup 3] [--dtypes float32 bfloat16 bf16-params] [--compile]
        [--threads N]
        [--out bench_results/olmo_core_compare.json]

Steps are timed one by one and the rows give tokens per second at the median step time. The
two systems alternate in rounds of a few steps each (the first system of a round alternates
too), so noise on a shared machine falls on both; the "paired" column is the median over
rounds of the ratio within each round, which also cancels slow drifts in machine load.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from harness.output import print_table, write_json
from moe_plan.config import Config, config_from_dict
from moe_train.train.host_memory import keep_freed_host_memory
from moe_train.train.runtime import start_runtime
from moe_train.train.step import StepRunner

VOCAB, D_MODEL, N_LAYERS, N_HEADS = 1024, 256, 4, 4
NUM_EXPERTS, TOP_K, EXPERT_HIDDEN = 8, 2, 512
SEQ_LEN, BATCH = 256, 4
LR, BETAS, EPS, WEIGHT_DECAY, GRAD_CLIP = 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0
LB_LOSS_WEIGHT, Z_LOSS_WEIGHT, ROPE_THETA, NORM_EPS = 0.01, 0.001, 10000, 1e-5
PRECISIONS = {
    "float32": ("float32", "float32"),
    "bfloat16": ("float32", "bfloat16"),
    "bf16-params": ("bfloat16", "bfloat16"),
}
"""Row dtype: this trainer's (param_dtype, compute_dtype). OLMo-core runs fp32 parameters
under autocast to the compute dtype in every row (its CPU-runnable path has no FP32-master
optimizer)."""
PARAM_TOLERANCE = 0.03
"""Largest relative difference of the two parameter counts this comparison accepts."""


@dataclass
class System:
    """One trainer, built for one dtype: a full optimizer step on a [BATCH, SEQ_LEN + 1] batch."""

    name: str
    params: int
    step: Callable[[torch.Tensor], None]
    close: Callable[[], None] = lambda: None
    step_times: list[float] = field(default_factory=list)


def ours_config(dtype: str, compile_: bool = False) -> Config:
    """The benchmark model as this trainer's config (the data section is not read)."""
    return config_from_dict(
        {
            "model": {
                "vocab_size": VOCAB,
                "d_model": D_MODEL,
                "n_layers": N_LAYERS,
                "n_heads": N_HEADS,
                "n_kv_heads": N_HEADS,
                "qk_norm": True,
                "rope_theta": ROPE_THETA,
                "norm_eps": NORM_EPS,
                "dense_layers": 0,
                "moe": {
                    "num_experts": NUM_EXPERTS,
                    "top_k": TOP_K,
                    "expert_hidden": EXPERT_HIDDEN,
                    "shared_experts": 0,
                    "router": "softmax",
                    "lb_loss_weight": LB_LOSS_WEIGHT,
                    "z_loss_weight": Z_LOSS_WEIGHT,
                },
            },
            "data": {"seq_len": SEQ_LEN, "global_batch_size": BATCH, "micro_batch_size": BATCH},
            "optim": {
                "lr": LR,
                "betas": list(BETAS),
                "eps": EPS,
                "weight_decay": WEIGHT_DECAY,
                "grad_clip": GRAD_CLIP,
            },
            "precision": dict(
                zip(("param_dtype", "compute_dtype"), PRECISIONS[dtype], strict=True)
            ),
        }
    )


def build_ours(dtype: str, compile_: bool) -> System:
    config = ours_config(dtype, compile_)
    runtime = start_runtime(config, torch.device("cpu"))
    runner = StepRunner(config, runtime)
    params = sum(p.numel() for p in runner.model.parameters())

    def step(batch: torch.Tensor) -> None:
        runner.train_step(batch, LR)

    return System("moe-train", params, step, lambda: runtime.close(clean=True))


def import_olmo_core() -> ModuleType:
    try:
        import olmo_core.nn.transformer as transformer
    except ImportError as e:
        raise SystemExit(
            "olmo_core is not importable: run scripts/olmo_core_env.sh, then this script with "
            "PYTHONPATH=.cache/olmo-core (see the module docstring)"
        ) from e
    return transformer


def install_cpu_permutation() -> None:
    """Replace OLMo-core's Triton token-permutation kernels (GPU-only) with torch index ops.

    Row i of the expert-sorted layout holds copy `indices[i]` of token `indices[i] // top_k`;
    `weights` are indexed by copy, and scatter sums a token's copies.
    """
    from olmo_core.kernels import moe as kernels

    def gather(x, indices, bin_ids, weights, bins, top_k):
        rows = x.index_select(0, indices.long() // top_k)
        if weights is None:
            return rows
        return (rows.float() * weights[indices.long()].float().unsqueeze(1)).to(x.dtype)

    def scatter(x, indices, bin_ids, weights, bins, top_k):
        scaled = x if weights is None else x.float() * weights[indices.long()].float()[:, None]
        copies = torch.empty_like(x).index_copy_(0, indices.long(), scaled.to(x.dtype))
        return copies.view(-1, top_k, x.shape[1]).sum(dim=1)

    def scatter_wgrad(x, grad, indices, bin_ids, bins, top_k):
        grad_rows = grad.index_select(0, indices.long() // top_k).float()
        dots = (x.float() * grad_rows).sum(dim=1).to(x.dtype)
        return torch.empty_like(dots).index_copy_(0, indices.long(), dots)

    kernels.gather, kernels.scatter, kernels.scatter_wgrad = gather, scatter, scatter_wgrad


def olmo_core_model(transformer: ModuleType) -> torch.nn.Module:
    config = transformer.TransformerConfig.llama_like_moe(
        d_model=D_MODEL,
        vocab_size=VOCAB,
        n_layers=N_LAYERS,
        n_heads=N_HEADS,
        n_kv_heads=N_HEADS,
        num_experts=NUM_EXPERTS,
        top_k=TOP_K,
        expert_hidden_size=EXPERT_HIDDEN,
        dropless=True,
        lb_loss_weight=LB_LOSS_WEIGHT,
        z_loss_weight=Z_LOSS_WEIGHT,
        qk_norm=True,
        use_head_qk_norm=True,
        rope_theta=ROPE_THETA,
        layer_norm_eps=NORM_EPS,
    )
    config.block.feed_forward_moe.router.normalize_expert_weights = 1.0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Grouped GEMM not available")
        model = config.build(init_device="cpu")
    model.init_weights(max_seq_len=SEQ_LEN, device=torch.device("cpu"))
    return model.train()


def check_moe_layer(model: torch.nn.Module) -> None:
    """OLMo-core's first MoE layer (with the CPU permutation) against a per-token loop."""
    moe = model.blocks["0"].feed_forward_moe
    x = torch.randn(1, 16, D_MODEL, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = moe(x)[0]
        weights, experts, _, _ = moe.router(x)
        mlp = moe.experts.mlp
        w1, w2, w3 = (w.view(NUM_EXPERTS, EXPERT_HIDDEN, D_MODEL) for w in (mlp.w1, mlp.w2, mlp.w3))
        expected = torch.zeros_like(y)
        for t in range(x.shape[1]):
            for k in range(TOP_K):
                e = experts[0, t, k]
                h = torch.nn.functional.silu(w1[e] @ x[0, t]) * (w3[e] @ x[0, t])
                expected[t] += weights[0, t, k] * (w2[e].T @ h)
    moe.reset_metrics()
    if not torch.allclose(y, expected, rtol=1e-4, atol=1e-5):
        worst = (y - expected).abs().max().item()
        raise SystemExit(f"OLMo-core MoE layer with the CPU permutation is off by {worst:.3g}")


def build_olmo_core(dtype: str) -> System:
    transformer = import_olmo_core()
    install_cpu_permutation()
    model = olmo_core_model(transformer)
    check_moe_layer(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        fused=True,
    )
    compute_dtype = getattr(torch, PRECISIONS[dtype][1])
    autocast = torch.autocast("cpu", dtype=compute_dtype, enabled=dtype != "float32")

    def step(batch: torch.Tensor) -> None:
        with autocast:
            output = model(batch[:, :-1], labels=batch[:, 1:])
        output.loss.backward()
        model.post_batch()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.reset_auxiliary_metrics()

    return System("olmo-core", sum(p.numel() for p in model.parameters()), step)


def check_param_counts(ours: System, theirs: System) -> None:
    print(f"parameters: {ours.name} {ours.params:,}, {theirs.name} {theirs.params:,}")
    if abs(ours.params - theirs.params) > PARAM_TOLERANCE * theirs.params:
        raise SystemExit(
            f"the two models differ by more than {PARAM_TOLERANCE:.0%} in parameters: "
            f"{ours.params:,} vs {theirs.params:,}"
        )


def run_interleaved(
    systems: list[System], batches: list[torch.Tensor], steps: int, warmup: int, per_round: int
) -> None:
    """Warm each system up, then time `steps` steps of each, `per_round` at a time, alternating
    which system goes first."""
    for system in systems:
        for i in range(warmup):
            system.step(batches[i % len(batches)])
    rounds = -(-steps // per_round)
    for r in range(rounds):
        order = systems if r % 2 == 0 else systems[::-1]
        for system in order:
            for i in range(min(per_round, steps - r * per_round)):
                batch = batches[(r * per_round + i) % len(batches)]
                start = time.perf_counter()
                system.step(batch)
                system.step_times.append(time.perf_counter() - start)


def measure(dtype: str, args: argparse.Namespace) -> list[dict]:
    """Rows (ours, OLMo-core) for one dtype."""
    steps, warmup, per_round = args.steps, args.warmup, args.per_round
    ours, theirs = build_ours(dtype, args.compile), build_olmo_core(dtype)
    try:
        check_param_counts(ours, theirs)
        generator = torch.Generator().manual_seed(0)
        batches = [
            torch.randint(0, VOCAB, (BATCH, SEQ_LEN + 1), generator=generator) for _ in range(4)
        ]
        run_interleaved([ours, theirs], batches, steps, warmup, per_round)
    finally:
        ours.close()
    rows = []
    for system in (ours, theirs):
        median = statistics.median(system.step_times)
        rows.append(
            {
                "system": system.name,
                "dtype": dtype,
                "params": system.params,
                "tokens_per_step": BATCH * SEQ_LEN,
                "steps_timed": len(system.step_times),
                "step_time_s": median,
                "tokens_per_s": BATCH * SEQ_LEN / median,
                "step_times_s": system.step_times,
            }
        )
    rows[0]["ratio_vs_olmo_core"] = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    rows[0]["paired_ratio_vs_olmo_core"] = paired_ratio(ours, theirs, per_round)
    return rows


def paired_ratio(ours: System, theirs: System, per_round: int) -> float:
    """Median over rounds of OLMo-core's over our mean step time in the same round: each
    round's two systems ran back to back, so slow drifts in machine load cancel."""
    ratios = []
    for start in range(0, len(ours.step_times), per_round):
        mine = statistics.fmean(ours.step_times[start : start + per_round])
        other = statistics.fmean(theirs.step_times[start : start + per_round])
        ratios.append(other / mine)
    return statistics.median(ratios)


def print_summary(rows: list[dict]) -> None:
    header = ("system", "dtype", "params", "step ms", "tokens/s", "ours/olmo-core", "paired")
    cells = []
    for row in rows:
        ratio, paired = row.get("ratio_vs_olmo_core"), row.get("paired_ratio_vs_olmo_core")
        cells.append(
            [
                row["system"],
                row["dtype"],
                f"{row['params'] / 1e6:.2f}M",
                f"{1000 * row['step_time_s']:.1f}",
                f"{row['tokens_per_s']:,.0f}",
                f"{ratio:.2f}x" if ratio else "",
                f"{paired:.2f}x" if paired else "",
            ]
        )
    print_table(header, cells)
    print(
        "ours/olmo-core: ratio of the median tokens/s; paired: median over rounds of the "
        "ratio within a round"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per system and dtype")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--per-round", type=int, default=2, help="steps per system per round")
    parser.add_argument("--dtypes", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--compile", action="store_true", help="this trainer with train.compile=true"
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results/olmo_core_compare.json"))
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    keep_freed_host_memory()
    rows = []
    for dtype in args.dtypes:
        rows += measure(dtype, args)
    print(f"\ntorch {torch.__version__}, {args.threads} threads, {BATCH}x{SEQ_LEN} tokens/step")
    print_summary(rows)
    meta = {
        "torch": torch.__version__,
        "threads": args.threads,
        "olmo_core": olmo_core_version(),
        "compile": args.compile,
    }
    print()
    write_json(args.out, {**meta, "runs": rows})


def olmo_core_version() -> str:
    from importlib.metadata import version

    return version("ai2-olmo-core")


if __name__ == "__main__":
    main()
