"""Helpers for tests that train: the shared corpus, small configs, comparing runs' losses."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import yaml
from torch import nn

from moe_plan.config import Config, ModelConfig, MoEConfig, config_from_dict
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
training (1.6e-4 after 6 steps) would pass: a layout that dropped FP8 fails here. One rank of
ep2 or ep4 dropping FP8 experts moves the losses only about 3e-5, within it: the FP8 cases
also check each rank's GEMMs (`assert_fp8_ran`)."""
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


FP8_GEMMS = ("fp8_rowwise_grouped_mm", "Float8Linear")
"""What `recording_gemms` reports on a rank that trained with `FP8_PRECISION`: its experts ran
moe-kernels' rowwise FP8 grouped GEMM and nothing else, its attention and feed-forward linears
were torchao's Float8Linear and nothing else."""


@contextmanager
def recording_gemms() -> Iterator[dict[str, set]]:
    """While active, record what ran in this process: the grouped-GEMM functions the experts
    called (under "experts"; `grouped_mm` with its backend) and the linear modules that ran
    forward (under "modules"). `gemms_of` reduces the record to a trained model's."""
    from moe_train.model import moe

    record: dict[str, set] = {"experts": set(), "modules": set()}
    names = ("grouped_mm", "mxfp8_grouped_mm", "fp8_rowwise_grouped_mm")
    originals = {name: getattr(moe, name) for name in names}

    def recorded(name, function):
        def call(*args, **kwargs):
            backend = kwargs.get("backend")
            record["experts"].add(f"{name}/{backend}" if backend else name)
            return function(*args, **kwargs)

        return call

    def linear_ran(module, args, output) -> None:
        if isinstance(module, nn.Linear):
            record["modules"].add(module)

    for name, function in originals.items():
        setattr(moe, name, recorded(name, function))
    hook = nn.modules.module.register_module_forward_hook(linear_ran)
    try:
        yield record
    finally:
        hook.remove()
        for name, function in originals.items():
            setattr(moe, name, function)


def gemms_of(record: dict[str, set], model: nn.Module) -> tuple[str, str]:
    """The experts' GEMM functions and the classes of `model`'s attention and feed-forward
    linears that ran, each a sorted comma-separated string (compared with `FP8_GEMMS`)."""
    from moe_train.model.attention import Attention
    from moe_train.model.moe import SwiGLU

    linears = {
        id(linear)
        for module in model.modules()
        if isinstance(module, Attention | SwiGLU)
        for linear in module.children()
        if isinstance(linear, nn.Linear)
    }
    classes = {type(m).__name__ for m in record["modules"] if id(m) in linears}
    return ",".join(sorted(record["experts"])), ",".join(sorted(classes))


def train_cases_with_gemms(
    rank: int, world_size: int, cases: dict[str, dict]
) -> tuple[dict[str, list[float]], dict[str, tuple[str, str]]]:
    """Body for `run_distributed`: as `train_cases`, and each case's `gemms_of` on this rank."""
    losses, gemms = {}, {}
    for name, data in cases.items():
        with recording_gemms() as record:
            result = train(config_from_dict(data))
        losses[name], gemms[name] = result.losses, gemms_of(record, result.model)
    return losses, gemms


def train_fp8_single(data: dict) -> list[float]:
    """One process trained with `data` (FP8 precision); its losses, after checking that its
    experts and linears ran FP8 (`FP8_GEMMS`)."""
    with recording_gemms() as record:
        result = train(config_from_dict(data))
    assert gemms_of(record, result.model) == FP8_GEMMS, "the single FP8 process ran without FP8"
    return result.losses


def assert_fp8_ran(gemms_per_rank: Sequence[dict], names: Sequence[str]) -> None:
    """Every rank of each named case (`train_cases_with_gemms`' second result) ran `FP8_GEMMS`:
    a rank whose experts or linears silently ran bf16 fails here, whatever its losses."""
    for name in names:
        ran = [gemms[name] for gemms in gemms_per_rank]
        assert all(each == FP8_GEMMS for each in ran), f"{name}: GEMMs per rank {ran}"


def assert_losses_match(
    name: str, losses: Sequence[float], reference: Sequence[float], rtol: float = 1e-5
) -> None:
    """Same number of steps, each loss within `rtol` relative of the reference run's."""
    assert len(losses) == len(reference), f"{name}: {len(losses)} steps vs {len(reference)}"
    for step, (a, b) in enumerate(zip(losses, reference, strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"{name} step {step}: {a} vs single-process {b}"
