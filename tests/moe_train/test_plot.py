"""`moe-train plot`: figures of real runs, several runs overlaid, and one-line errors."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from launch import run_cli
from moe_train.cli import main
from moe_train.config import config_from_dict
from moe_train.train import train
from training import CODE_TEXT, save_byte_tokens, small_config_data

ROUTING_FIGURES = ("expert_load", "rank_load", "balance")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> list[Path]:
    """Two short real runs (with evaluation), each in a directory called `run`."""
    root = tmp_path_factory.mktemp("runs")
    tokens = save_byte_tokens(root / "tokens.npy", CODE_TEXT * 400)
    runs = []
    for name, lr in (("a", 3e-3), ("b", 1e-3)):
        data = small_config_data(
            root / name / "run",
            tokens,
            optim={"lr": lr, "warmup_steps": 2},
            train={"max_steps": 4},
            eval={"paths": [str(tokens)], "interval": 2},
            checkpoint={"interval": 0, "interval_minutes": 0},
        )
        runs.append(train(config_from_dict(data)).run_dir)
    return runs


def _image(path: Path) -> np.ndarray:
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return matplotlib.image.imread(path)


@pytest.mark.slow
def test_plot_writes_every_figure_of_a_run(two_runs, tmp_path):
    out = tmp_path / "plots"
    result = run_cli("plot", str(two_runs[0]), "--out", str(out), timeout=120)
    assert result.returncode == 0, result.stderr
    names = ["loss", "lr", "throughput", *ROUTING_FIGURES]
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.png" for n in names)
    assert f"wrote 6 figures to {out}" in result.stdout
    for name in names:
        pixels = _image(out / f"{name}.png")
        height, width = pixels.shape[:2]
        assert width >= 800 and height >= 400, f"{name}.png is {width}x{height}"
        assert pixels[..., :3].std() > 0.05, f"{name}.png is blank"


def test_several_runs_overlay_their_curves(two_runs, tmp_path):
    from moe_train.plot import plot_runs, read_runs
    from moe_train.plot.training import loss_figure

    result = plot_runs(two_runs, tmp_path / "both")
    names = sorted(p.name for p in result.files)
    labels = [str(path).strip("/").replace("/", "_") for path in two_runs]  # both are "run"
    expected = ["loss.png", "lr.png", "throughput.png"]
    expected += [f"{figure}-{label}.png" for figure in ROUTING_FIGURES for label in labels]
    assert names == sorted(expected)
    runs = read_runs(two_runs)
    figure = loss_figure(runs)
    by_step, by_tokens = figure.axes[:2]
    for axes in (by_step, by_tokens):
        lines = {line.get_label(): line for line in axes.get_lines()}
        assert sorted(lines) == sorted(f"{r.name}: {k}" for r in runs
                                       for k in ("loss", "eval loss"))  # fmt: skip
    losses = [
        line.get_ydata() for line in by_step.get_lines() if line.get_label().endswith(": loss")
    ]
    assert [len(y) for y in losses] == [4, 4]
    assert not np.array_equal(losses[0], losses[1]), "both runs drew the same curve"


def _error(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_bad_run_directories_are_one_line(two_runs, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["plot", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert _error(capsys) == [f"error: {tmp_path / 'missing'} is not a directory; give a run "
                              "directory written by moe-train train (it holds metrics.jsonl)"]  # fmt: skip
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["plot", str(two_runs[0]), str(empty), "--out", str(out)]) == 2
    assert _error(capsys) == [f"error: {empty} holds no metrics.jsonl; give a run directory "
                              "written by moe-train train"]  # fmt: skip
    broken = tmp_path / "broken"
    broken.mkdir()
    lines = (two_runs[0] / "metrics.jsonl").read_text().splitlines()
    (broken / "metrics.jsonl").write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    assert main(["plot", str(broken), "--out", str(out)]) == 2
    assert _error(capsys) == [f"error: {broken / 'metrics.jsonl'}:2 is not a JSON object"]
    assert not out.exists(), "a bad run directory must stop the command before it writes"
    # A last line cut short (a run still writing) is left out, not an error.
    (broken / "metrics.jsonl").write_text("\n".join([*lines, '{"step": 9, "lo']) + "\n")
    assert main(["plot", str(broken), "--out", str(out)]) == 0
    assert "no expert_load.jsonl" in capsys.readouterr().out


def test_without_matplotlib_the_error_names_the_extra(two_runs, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["plot", str(two_runs[0]), "--out", str(tmp_path / "out")]) == 2
    assert _error(capsys) == [
        "error: moe-train plot needs matplotlib: pip install 'moestack-train[plot]'"
    ]
    assert not (tmp_path / "out").exists()
