"""`moe-train plot`: figures of real runs, several runs overlaid, and one-line errors."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from launch import run_cli
from moe_plan.config import config_from_dict
from moe_train.cli import main
from moe_train.train import train
from training import CODE_TEXT, save_byte_tokens, small_config_data

if TYPE_CHECKING:
    from moe_train.plot import Run

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
    names = ["loss", "lr", "throughput", "expert_load", "balance"]  # ep=1: no rank_load
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.png" for n in names)
    assert "note: run: one EP rank (parallel.ep = 1) holds every expert, so no rank_load.png: " \
        "there are no ranks to compare" in result.stdout  # fmt: skip
    assert f"wrote 5 figures to {out}" in result.stdout
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
    expected = [name for name in expected if not name.startswith("rank_load")]  # ep=1
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


# ---- what the figures say: whole steps, layer choices, one EP rank, resumes ----------------


def _step_axes(figure: Any) -> list[Any]:
    """The visible axes of a figure whose x axis is steps, drawn so their tick labels exist."""
    figure.draw_without_rendering()
    return [a for a in figure.axes if a.get_visible() and a.get_xlabel() == "step"]


def _assert_whole_step_ticks(name: str, figure: Any, count: int) -> None:
    step_axes = _step_axes(figure)
    assert len(step_axes) == count, f"{name}: {len(step_axes)} step axes, expected {count}"
    for axes in step_axes:
        low, high = sorted(axes.get_xlim())
        texts = [t.get_text().replace("\N{MINUS SIGN}", "-") for t in axes.get_xticklabels()
                 if low <= t.get_position()[0] <= high]  # fmt: skip
        assert texts, f"{name}: a step axis without tick labels"
        assert all(t.lstrip("-").isdigit() for t in texts), f"{name}: step ticks {texts}"


def _synthetic_run(load_LE: list[list[float]], rank_load_LR: list[list[float]],
                   layers: list[int] | None = None, resumes: tuple[int, ...] = ()) -> Run:  # fmt: skip
    """A run of 4 logged steps whose routing repeats the given loads every step."""
    from moe_train.plot import Run

    def over_mean(values: list[float]) -> float:
        return max(values) / (sum(values) / len(values))

    row = {
        "layers": layers or list(range(1, len(load_LE) + 1)),
        "load": load_LE,
        "rank_load": rank_load_LR,
        "lb_loss": [1.0] * len(load_LE),
        "expert_imbalance": [over_mean(v) for v in load_LE],
        "rank_imbalance": [over_mean(v) for v in rank_load_LR],
    }
    return Run(
        name="synthetic",
        metrics=[{"step": step, "loss": 1.0} for step in range(1, 5)],
        routing=[{"step": step, **row} for step in range(1, 5)],
        balanced_lb_loss=None,
        max_rank_imbalance=None,
        resumes=resumes,
    )


def test_step_axes_are_ticked_at_whole_steps(two_runs):
    """4 logged steps would get ticks 1.0, 1.5, ..., 4.0 from matplotlib's default locator."""
    from moe_train.plot import read_runs
    from moe_train.plot.routing import balance_figure, expert_load_figure, rank_load_figure
    from moe_train.plot.training import loss_figure, lr_figure, throughput_figure

    runs = read_runs(two_runs)
    layers = len(runs[0].routing[0]["layers"])
    two_ranks = _synthetic_run([[3, 1, 1, 1], [1, 1, 1, 1]], [[4, 2], [3, 3]])
    for name, figure, count in [
        ("loss", loss_figure(runs), 1),
        ("lr", lr_figure(runs), 1),
        ("throughput", throughput_figure(runs), 2),
        ("expert_load", expert_load_figure(runs[0]), 1),
        ("balance", balance_figure(runs[0]), layers),
        ("rank_load", rank_load_figure(two_ranks), 2),
    ]:
        _assert_whole_step_ticks(name, figure, count)


def _titles(figure: Any) -> list[str]:
    titles = [axes.get_title() for axes in figure.axes]
    return [*titles, figure.get_suptitle()]


def test_one_ep_rank_draws_no_rank_comparison(two_runs):
    """With parallel.ep = 1 every rank line would be flat at 1: no rank_load figure, no rank
    line in the balance figure, and the expert heatmap's layer is the one its title names."""
    from moe_train.plot import read_run
    from moe_train.plot.routing import balance_figure, expert_load_figure, rank_load_figure

    run = read_run(two_runs[0])
    assert len(run.routing[0]["rank_load"][0]) == 1, "the fixture's runs have one EP rank"
    assert rank_load_figure(run) is None
    balance = balance_figure(run)
    labels = {line.get_label() for axes in balance.axes for line in axes.get_lines()}
    assert "busiest EP rank / mean" not in labels
    assert "busiest expert / mean" in labels
    legend = [t.get_text() for t in balance.legends[0].get_texts()]
    assert "check: rank imbalance limit" not in legend
    assert balance.get_suptitle().endswith("(one EP rank)")
    # The expert heatmap's title names the layer drawn and why, from the data itself.
    mean_L = np.nanmean(np.array([r["expert_imbalance"] for r in run.routing], float), axis=0)
    title = expert_load_figure(run).axes[1].get_title()
    worst = run.routing[0]["layers"][int(np.argmax(mean_L))]
    assert title == (f"MoE layer {worst} (most uneven of {len(mean_L)} on average: busiest "
                     f"expert {mean_L.max():.2f}x the mean): expert load by step")  # fmt: skip


def test_layer_titles_say_what_is_drawn():
    """ "most uneven" only where there is a choice among layers; alike layers are said to be."""
    from moe_train.plot.routing import balance_figure, expert_load_figure, rank_load_figure

    uneven = _synthetic_run([[1, 1, 1, 1], [5, 1, 1, 1]], [[1, 1], [3, 1]], layers=[2, 5])
    assert expert_load_figure(uneven).axes[1].get_title() == (
        "MoE layer 5 (most uneven of 2 on average: busiest expert 2.50x the mean): "
        "expert load by step"
    )
    assert rank_load_figure(uneven).axes[0].get_title() == (
        "MoE layer 5 (most uneven of 2 on average: busiest EP rank 1.50x the mean): "
        "load per EP rank"
    )
    alike = _synthetic_run([[3, 1, 1, 3]] * 3, [[4, 4]] * 3)
    assert expert_load_figure(alike).axes[1].get_title() == (
        "MoE layer 1 (all 3 layers alike on average: busiest expert 1.50x the mean): "
        "expert load by step"
    )
    assert rank_load_figure(alike).axes[0].get_title() == (
        "MoE layer 1 (all 3 layers alike on average: even): load per EP rank"
    )
    single = _synthetic_run([[3, 1, 1, 3]], [[5, 3]], layers=[7])
    assert expert_load_figure(single).axes[1].get_title() == "MoE layer 7: expert load by step"
    assert rank_load_figure(single).axes[0].get_title() == "MoE layer 7: load per EP rank"
    many_alike = _synthetic_run([[2, 1, 1, 1]] * 20, [[3, 2]] * 20)
    assert "(the first 16 of 20 layers: all alike)" in balance_figure(many_alike).get_suptitle()
    many = _synthetic_run([[2, 1, 1, 1]] * 19 + [[1, 1, 1, 1]], [[3, 2]] * 19 + [[1, 1]])
    assert "(16 of 20 layers: the most uneven)" in balance_figure(many).get_suptitle()
    for figure in (expert_load_figure(alike), rank_load_figure(alike), balance_figure(many_alike),
                   expert_load_figure(single), rank_load_figure(single)):  # fmt: skip
        assert not any("most uneven" in title for title in _titles(figure)), _titles(figure)


def _resume_marks(axes: Any) -> tuple[list[float], list[str]]:
    lines = [line.get_xdata()[0] for line in axes.get_lines() if line.get_gid() == "resume"]
    return lines, [text.get_text().strip() for text in axes.texts if text.get_gid() == "resume"]


def test_a_resumed_run_marks_where_it_resumed(tmp_path, make_config):
    """4 steps saved at step 4, then resumed to 7: every step axis marks step 4."""
    from moe_train.plot import read_run
    from moe_train.plot.routing import balance_figure, expert_load_figure, rank_load_figure
    from moe_train.plot.training import loss_figure, lr_figure, throughput_figure

    no_timer = {"interval_minutes": 0}
    train(make_config(tmp_path, train={"max_steps": 4}, checkpoint={"interval": 4, **no_timer}))
    resumed = {"resume": "auto", "interval": 0, **no_timer}
    result = train(make_config(tmp_path, train={"max_steps": 7}, checkpoint=resumed))
    assert result.start_step == 4
    run = read_run(result.run_dir)
    assert run.resumes == (4,)
    assert [r["step"] for r in run.metrics] == list(range(1, 8))
    figures = {
        name: build(arg)
        for name, build, arg in [
            ("loss", loss_figure, [run]),
            ("lr", lr_figure, [run]),
            ("throughput", throughput_figure, [run]),
            ("expert_load", expert_load_figure, run),
            ("balance", balance_figure, run),
        ]
    }
    marked = 0
    for name, figure in figures.items():
        for axes in _step_axes(figure):
            assert _resume_marks(axes) == ([4], ["resumed at step 4"]), (
                f"{name}: {axes.get_title()}"
            )
            marked += 1
    assert marked == 5 + len(run.routing[0]["layers"])
    two_ranks = _synthetic_run([[3, 1, 1, 1]], [[4, 2]], resumes=(2,))
    for axes in _step_axes(rank_load_figure(two_ranks)):
        assert _resume_marks(axes) == ([2], ["resumed at step 2"]), axes.get_title()
    by_tokens = figures["loss"].axes[1]
    tokens = next(r["tokens_seen"] for r in run.metrics if r["step"] == 4)
    assert _resume_marks(by_tokens) == ([tokens], ["resumed at step 4"])
    # A run that was never resumed has no marker; overlaid runs name theirs.
    fresh = read_run(train(make_config(tmp_path / "fresh", train={"max_steps": 4})).run_dir)
    assert fresh.resumes == ()
    overlaid = loss_figure([run, fresh]).axes[0]
    assert _resume_marks(overlaid) == ([4], [f"{run.name}: resumed at step 4"])
