"""What test_generate.py and test_generate_chat.py share: a short run on text a BPE
tokenizer.json encoded, and the check that `moe-train generate` refuses in one line."""

from pathlib import Path

import pytest

from moe_data import prepare_data
from moe_plan.config import config_from_dict
from moe_train.cli import main
from moe_train.train import train
from tokenizer_files import bpe_tokenizer_file
from training import small_config_data


def bpe_text_checkpoint(directory: Path, text: str, max_steps: int) -> Path:
    """The checkpoint of `max_steps` steps on `text`, tokenized by a BPE `tokenizer.json`
    written into `directory` (no chat template beside it); the run lives there too."""
    bpe_tokenizer_file(directory, text)
    (directory / "train.txt").write_text(text)
    prepare_data([directory / "train.txt"], directory / "data", str(directory / "tokenizer.json"))
    data = small_config_data(
        directory / "run",
        directory / "unused.npy",
        model={"vocab_size": 320},
        data={"paths": [str(directory / "data")], "seq_len": 16},
        train={"max_steps": max_steps},
    )
    return train(config_from_dict(data)).checkpoint


def assert_refused_in_one_line(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`main(argv)` exits 2 with one `error: ...` line on stderr that contains `expected`."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
