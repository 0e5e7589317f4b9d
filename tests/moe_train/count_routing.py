"""`moe-train` with the routers watched: each rank also counts, per training step and MoE layer,
the experts its routers chose (a bincount of their top-k indices), the copies the capacity
keeps (min(count, ceil(capacity_factor * T * K / E)) per forward) and the sum of the routers'
balancing losses, and writes them to OUT_DIR/rank{R}.json after every step. The reference a
test compares RUN_DIR/expert_load.jsonl with; run as

    torchrun --nproc-per-node N count_routing.py OUT_DIR train CONFIG.yaml [overrides]
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch

from moe_train.cli import main
from moe_train.train.step import StepRunner


def _watch(out_dir: Path) -> None:
    rank = int(os.environ.get("RANK", "0"))
    counts: dict[int, dict[int, dict]] = {}
    step = {"now": 1}  # the step being run: the state after it is step N
    original_init, original_step = StepRunner.__init__, StepRunner.train_on

    def init(self: StepRunner, config, runtime, *args) -> None:
        original_init(self, config, runtime, *args)
        moe = config.model.moe
        for index, layer in self.model.moe_layers().items():

            def hook(module, args, output, index=index) -> None:
                if not module.training:
                    return
                num_tokens = args[0].shape[0]
                chosen = torch.bincount(output.topk_idx_TK.flatten(), minlength=moe.num_experts)
                kept = chosen.tolist()
                if moe.capacity_factor is not None:
                    cap = math.ceil(moe.capacity_factor * num_tokens * moe.top_k / moe.num_experts)
                    kept = [min(c, cap) for c in kept]
                entry = counts.setdefault(step["now"], {}).setdefault(
                    index, {"load": [0] * moe.num_experts, "kept": [0] * moe.num_experts,
                            "lb_sum": 0.0, "forwards": 0},
                )  # fmt: skip
                entry["load"] = [a + b for a, b in zip(entry["load"], chosen.tolist(), strict=True)]
                entry["kept"] = [a + b for a, b in zip(entry["kept"], kept, strict=True)]
                entry["lb_sum"] += float(output.lb_loss)
                entry["forwards"] += 1

            layer.router.register_forward_hook(hook)

    def train_on(self: StepRunner, micro_batches, lr):
        result = original_step(self, micro_batches, lr)
        (out_dir / f"rank{rank}.json").write_text(json.dumps(counts))
        step["now"] += 1
        return result

    StepRunner.__init__ = init
    StepRunner.train_on = train_on


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    _watch(out)
    sys.exit(main(sys.argv[2:]))
