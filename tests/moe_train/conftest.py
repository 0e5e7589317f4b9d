"""Small configs and token files for trainer tests."""

from pathlib import Path

import numpy as np
import pytest

from moe_train.config import Config, config_from_dict


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    """A .npy file of 20k tokens of repetitive, learnable byte text."""
    text = ("def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 800).encode()
    path = tmp_path / "tokens.npy"
    np.save(path, np.frombuffer(text, dtype=np.uint8).astype(np.uint16)[:20000])
    return path


@pytest.fixture
def make_config(token_file: Path):
    """Builds a small config: make_config(run_root, **sections) updates defaults per section."""
    return lambda tmp_path, **sections: small_config(tmp_path, token_file, **sections)


def small_config(tmp_path: Path, token_file: Path, **sections) -> Config:
    """A 2-layer model that trains in seconds; `sections` update the defaults per section."""
    data = {
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
            "run_dir": str(tmp_path / "run"),
            "progress": False,
            "peak_flops": 1e11,
        },
        "precision": {"compute_dtype": "float32"},
    }
    for section, values in sections.items():
        for key, value in values.items():
            if isinstance(value, dict):
                data[section].setdefault(key, {}).update(value)
            else:
                data.setdefault(section, {})[key] = value
    return config_from_dict(data)
