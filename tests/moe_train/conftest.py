"""Small configs and token files for trainer tests."""

from pathlib import Path

import numpy as np
import pytest

from moe_train.config import Config, config_from_dict
from training import small_config_data


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
    return config_from_dict(small_config_data(tmp_path / "run", token_file, **sections))
