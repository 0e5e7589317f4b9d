"""Helpers for tests that train: the shared corpus, small configs, comparing runs' losses."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import yaml

from moe_train.config import Config, ModelConfig, MoEConfig, config_from_dict
from moe_train.train import train

ROOT = Path(__file__).resolve().parents[1]
"""The repository."""
CONFIGS = ROOT / "configs"
"""The shipped configs."""

FP8_PRECISION = {"compute_dtype": "bfloat16", "expert_gemm": "fp8_rowwise", "linear": "fp8_rowwise"}
"""The precision section of rowwise FP8 training: expert GEMMs and linear layers (emulated on
a CPU)."""
FP8_LAYOUT_RTOL = 7e-5
"""Layouts against one process, both with `FP8_PRECISION`. A layout that keeps micro-batches
whole sees the same scales (dp2, pp2: equal); one that splits an expert's or a linear's rows
over ranks (ep, cp) scales the weight-gradient operands over other rows, a few 1e-5 apart.
Tighter than the bf16 layout tolerance (2e-3), which the gap between FP8 and plain bf16
training (1.6e-4 after 6 steps) would pass: a layout that dropped FP8 fails here."""
FP8_CONTEXT_RTOL = 2e-3
"""Context-parallel layouts of four ranks against one process, both with `FP8_PRECISION`: the
bf16 layout tolerance. Each context rank quantizes the weight-gradient operands over its part
of the tokens and sums attention in bf16 in another order (measured after 6 steps: cp2 x ep2
4.7e-5, cp2 x pp2 7.5e-5; 5e-4 after 20). Too loose to tell FP8 from bf16 there (2.5e-4
apart after 6 steps): the two-rank cp2 case under `FP8_LAYOUT_RTOL` is the one that does."""

CODE_TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n"
"""A few lines of code; repeated, the tests' training text: short, repetitive, learnable."""


def save_byte_tokens(path: Path, text: str, limit: int | None = None) -> Path:
    """`text` as a .npy file of byte token ids (uint16), its first `limit` bytes if given."""
    np.save(path, np.frombuffer(text.encode(), dtype=np.uint8).astype(np.uint16)[:limit])
    return path


def save_config(path: Path, config: dict | Config) -> Path:
    """A config (plain data or a Config) as the YAML file `moe-train` reads."""
    data = config.to_dict() if isinstance(config, Config) else config
    path.write_text(yaml.safe_dump(data))
    return path


def small_model_config(n_layers: int = 2, **moe_kwargs) -> ModelConfig:
    """A tiny model with QK-norm, one dense first layer and one shared expert per MoE layer;
    `moe_kwargs` update its MoE settings."""
    return ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
        qk_norm=True,
        dense_layers=1,
        dense_hidden=48,
        moe=MoEConfig(
            **{"num_experts": 4, "top_k": 2, "expert_hidden": 16, "shared_experts": 1, **moe_kwargs}
        ),
    )


def small_config_data(run_dir: Path, token_file: Path, **sections: dict) -> dict:
    """Plain config data of a 2-layer model that trains in seconds (fp32, 6 steps).

    Each keyword names a section whose keys replace the defaults; a dict value (such as
    ``model={"moe": {...}}``) updates that sub-section instead of replacing it.
    """
    data: dict = {
        "model": {
            "vocab_size": 256,
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "qk_norm": True,
            "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32},
        },
        "data": {
            "paths": [str(token_file)],
            "seq_len": 32,
            "global_batch_size": 8,
            "micro_batch_size": 4,
        },
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "train": {
            "max_steps": 6,
            "run_dir": str(run_dir),
            "progress": False,
            "peak_flops": 1e11,
        },
        "precision": {"compute_dtype": "float32"},
    }
    for section, values in sections.items():
        for key, value in values.items():
            if isinstance(value, dict):
                data.setdefault(section, {}).setdefault(key, {}).update(value)
            else:
                data.setdefault(section, {})[key] = value
    return data


def train_cases(rank: int, world_size: int, cases: dict[str, dict]) -> dict[str, list[float]]:
    """Body for `run_distributed`: train each config (plain data) in turn; losses by name."""
    return {name: train(config_from_dict(data)).losses for name, data in cases.items()}


def assert_losses_match(
    name: str, losses: Sequence[float], reference: Sequence[float], rtol: float = 1e-5
) -> None:
    """Same number of steps, each loss within `rtol` relative of the reference run's."""
    assert len(losses) == len(reference), f"{name}: {len(losses)} steps vs {len(reference)}"
    for step, (a, b) in enumerate(zip(losses, reference, strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"{name} step {step}: {a} vs single-process {b}"
