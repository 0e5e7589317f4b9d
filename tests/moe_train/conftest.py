"""Small configs and token files for trainer tests."""

from pathlib import Path

import pytest

from moe_plan.config import Config, config_from_dict
from training import CODE_TEXT, save_byte_tokens, small_config_data


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    """A .npy file of 20k tokens of repetitive, learnable byte text."""
    return save_byte_tokens(tmp_path / "tokens.npy", CODE_TEXT * 800, limit=20000)


@pytest.fixture(scope="session")
def shared_token_file(tmp_path_factory) -> Path:
    """The tokens of `token_file` in one file for the whole session, for fixtures that outlive
    a test (a module's reference run); never to be changed."""
    return save_byte_tokens(
        tmp_path_factory.mktemp("corpus") / "tokens.npy", CODE_TEXT * 800, 20000
    )


@pytest.fixture
def make_config(token_file: Path):
    """Builds a small config: make_config(run_root, **sections) updates defaults per section."""
    return lambda tmp_path, **sections: small_config(tmp_path, token_file, **sections)


def small_config(tmp_path: Path, token_file: Path, **sections) -> Config:
    """A 2-layer model that trains in seconds; `sections` update the defaults per section."""
    return config_from_dict(small_config_data(tmp_path / "run", token_file, **sections))
