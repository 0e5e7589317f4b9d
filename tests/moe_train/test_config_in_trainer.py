"""The config as the trainer reads it: a key refused on `moe-train train`'s command line, and
what the banner and the cadence make of the eval keys."""

import pytest

from moe_plan.config import load_config
from moe_plan.errors import ConfigError
from moe_train.cli import main
from moe_train.train.banner import eval_banner
from moe_train.train.cadence import Cadence
from training import CONFIGS


def test_a_muon_key_under_adamw_is_one_line_from_the_cli(capsys, tmp_path):
    args = ["train", str(CONFIGS / "tiny.yaml"), f"--train.run_dir={tmp_path / 'r'}"]
    args += ["--train.max_steps=1", "--eval.interval=0"]  # short, were it to start
    assert main([*args, "--optim.muon_momentum=0.95"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: optim.muon_momentum is set on the command line but optim.name=adamw; it is "
        "used only with optim.name=muon\n"
    )
    assert not (tmp_path / "r").exists()


def test_an_empty_task_list_turns_evaluation_off():
    """tiny.yaml evaluates a task every 50 steps; --eval.tasks=[] leaves nothing to evaluate:
    accepted, no step evaluates and the banner says off. An interval given with neither
    eval.paths nor eval.tasks at all is still a mistake."""
    config = load_config(CONFIGS / "tiny.yaml", ["--eval.tasks=[]"])
    assert config.eval.interval == 50 and not config.eval.enabled
    cadence = Cadence.of(config)
    assert not any(cadence.evaluates(step) for step in range(1, config.train.max_steps + 1))
    assert eval_banner(config, None) == "off"
    assert Cadence.of(load_config(CONFIGS / "tiny.yaml")).evaluates(50)
    with pytest.raises(ConfigError, match=r"^eval\.interval=5 needs eval\.paths .* or eval\.tasks"):
        load_config(None, ["--eval.interval=5"])
