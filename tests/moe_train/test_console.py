"""What a person reads: banner, progress lines every log_interval steps, summary."""

import io
import math
import re
import warnings
from pathlib import Path

from moe_train.train import train
from moe_train.train.console import Console, progress_line, wrap_words
from moe_train.train.step_record import StepRecord

PACKAGES = Path(__file__).parents[2] / "packages"


def _deprecation(caught: warnings.WarningMessage) -> bool:
    return issubclass(
        caught.category, (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
    )


def _record(step: int, **extra) -> StepRecord:
    """The record of step `step` (the state after `step` optimizer steps)."""
    figures = {
        "step": step,
        "loss": 2.5,
        "lb_loss": 1.0,
        "z_loss": 0.0,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "tokens_per_s": 4000.0,
        "mfu": 0.125,
        "expert_load_max_over_mean": 1.5,
        "hidden_imbalance_layers": 0,
        "collapsed_layers": 0,
        "dropped_token_frac": 0.0,
        "peak_mem_bytes": 3 * 2**29,
        "step_time_s": 0.5,
        "data_wait_s": 0.0,
        "skipped_steps": 0,
        "tokens_seen": step * 1000,
        "tokens_per_source": {},
        "trained_tokens": 2000,
        "time": 1.8e9,
        "tokens": 1000,
    }
    return StepRecord(**(figures | extra))


def test_progress_line_holds_every_figure():
    line = progress_line(_record(10, eval_loss=2.75, skipped_steps=2), 100, 2, eta=3725)
    assert line == (
        "step 10/100 | loss 2.5000 | eval 2.7500 | lr 1.00e-03 | gnorm 0.500 | "
        "2,000 tok/s/dev | MFU 12.5% | load 1.50 | mem 1.50 GiB | skipped 2 | ETA 1:02:05"
    )
    plain = progress_line(_record(10, loss=math.nan, grad_norm=math.inf), 100, 1, eta=0)
    assert "loss nan" in plain and "gnorm inf" in plain and "eval" not in plain
    assert "skipped" not in plain


def test_a_line_every_log_interval_and_at_the_end_when_not_a_terminal():
    stream = io.StringIO()
    console = Console(7, enabled=True, progress=True, world_size=1, stream=stream)
    for step in range(1, 8):
        evaluated = {"eval_loss": 2.0 - (step - 1) / 10} if step == 5 else {}
        console.step(_record(step, **evaluated), logged=step % 3 == 0 or step == 7)
    console.summary(12.0, "runs/x/checkpoints/step_00000007")
    lines = stream.getvalue().splitlines()
    steps = [re.match(r"step (\d+)/7", line).group(1) for line in lines[:-1]]
    assert steps == ["3", "5", "6", "7"]  # every 3 steps, a fresh eval loss, the last
    assert lines[-1] == (
        "summary: 7 steps, 7,000 tokens in 0:00:12 | 2,000 tok/s per device on average "
        "| eval loss best 1.6000, last 1.6000 | peak memory 1.50 GiB "
        "| checkpoint runs/x/checkpoints/step_00000007"
    )


def test_other_ranks_print_nothing_and_progress_false_keeps_run_facts():
    quiet = io.StringIO()
    other = Console(3, enabled=False, progress=True, world_size=2, stream=quiet)
    other.banner([("run", "x")])
    other.step(_record(1), logged=True)
    other.summary(1.0, None)
    assert quiet.getvalue() == ""
    facts = io.StringIO()
    console = Console(3, enabled=True, progress=False, world_size=1, stream=facts)
    console.step(_record(1), logged=True)
    console.message("resumed from somewhere")
    assert facts.getvalue() == "resumed from somewhere\n"


def test_a_real_run_prints_a_readable_banner_lines_and_a_summary(tmp_path, make_config, capsys):
    config = make_config(
        tmp_path,
        train={"max_steps": 6, "log_interval": 2, "progress": True},
        optim={"warmup_steps": 6},
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(config)
    ours = [w for w in caught if _deprecation(w) and PACKAGES in Path(w.filename).parents]
    assert not ours, [f"{w.filename}:{w.lineno}: {w.message}" for w in ours]
    err = capsys.readouterr().err.splitlines()
    # The ceiling of `load` (4 experts, top-2), and a run that is all warmup says so.
    assert "4 experts top-2 (load from 1.00 (even) to at most 2.00)" in err[1], err[1]
    assert err[5] == (
        "dispatch     local (one rank holds every expert: tokens are only permuted)"
    ), err[5]
    assert err[6].endswith(
        "float32 params, float32 compute; expert GEMMs torch (as configured); linears in the "
        "compute dtype"
    ), err[6]
    assert err[8].endswith(
        "(cosine schedule, peak lr 0.003; all 6 steps are warmup, optim.warmup_steps=6: "
        "the lr rises to 0.003 and never decays)"
    ), err[8]
    assert err[3] == (
        "masking      label mask off (every token is a target); document masking off "
        "(attention crosses document ends)"
    ), err[3]
    assert (
        err[7] == "optimizer    adamw (betas 0.9, 0.95, eps 1e-08); weight decay 0.1, grad clip 1"
    )
    banner = [line for line in err if not line.startswith(("step ", "summary: "))]
    assert [line.split()[0] for line in banner] == [
        "run",
        "model",
        "data",
        "masking",
        "layout",
        "dispatch",
        "precision",
        "optimizer",
        "steps",
        "checkpoints",
        "eval",
    ]
    assert not any(c in line for line in banner for c in "{}'")  # no raw dicts
    assert [line.split()[1] for line in err if line.startswith("step ")] == ["2/6", "4/6", "6/6"]
    assert err[-1].startswith("summary: 6 steps, 1,536 tokens in ") and "step_00000006" in err[-1]


def test_a_resumed_run_says_resumed_once_and_sums_up_launch_and_run_apart(
    tmp_path, make_config, capsys
):
    saves = {"interval": 2, "resume": "auto"}
    train(make_config(tmp_path, train={"max_steps": 4}, checkpoint=saves))
    capsys.readouterr()
    train(make_config(tmp_path, train={"max_steps": 6}, checkpoint=saves))
    err = capsys.readouterr().err.splitlines()
    resumed = [line for line in err if "resumed from" in line]
    assert len(resumed) == 1 and resumed[0].startswith("run ") and "at step 4" in resumed[0]
    assert "changed      train.max_steps 4 -> 6" in err, err
    # 8 sequences of 32 tokens per step: 2 steps of this launch, 6 of the run.
    assert err[-1].startswith("summary: this launch 2 steps, 512 tokens in "), err[-1]
    assert "| run total 6 steps, 1,536 tokens |" in err[-1], err[-1]


def test_eta_counts_only_the_steps_this_process_ran(monkeypatch):
    """A run resumed at step 50 of 100 at 10 s per step: 48 steps left after step 52."""
    from moe_train.train import console as console_module

    clock = {"now": 1000.0}
    monkeypatch.setattr(console_module.time, "perf_counter", lambda: clock["now"])
    stream = io.StringIO()
    console = Console(100, enabled=True, progress=True, world_size=1, stream=stream)
    for step in (51, 52):
        clock["now"] += 10.0
        console.step(_record(step, step_time_s=10.0), logged=True)
    assert stream.getvalue().splitlines()[-1].endswith("ETA 0:08:00")


BANNER = [
    ("run", "runs/tiny (a new run)"),
    (
        "model",
        "3.4M params, 1.0M active: 4 layers, d_model 128, 8 experts top-2 "
        "(load from 1.00 (even) to at most 4.00)",
    ),
    ("data", "builtin:stdlib: 16 x 128 = 2,048 tokens per step"),
    (
        "precision",
        "float32 params, bfloat16 compute; expert GEMMs torch (as configured); linears in the "
        "compute dtype",
    ),
    ("checkpoints", "every 500 steps or every 30 min into runs/tiny/checkpoints"),
]
BUSY = {
    "eval_loss": 3.8617,
    "task_metrics": {"eval/code_order/acc": 0.13, "eval/code_order/acc_norm": 0.13},
    "skipped_steps": 2,
    "hidden_imbalance_layers": 1,
    "collapsed_layers": 3,
    "tokens_per_s": 1.25e6,
}
"""A step line with every optional figure."""


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_every_line_fits_80_columns_and_no_figure_is_cut(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    stream = io.StringIO()
    console = Console(200, enabled=True, progress=True, world_size=1, stream=stream)
    console.banner(BANNER)
    record = _record(120, **BUSY)
    console.step(record, logged=True)
    console.message(
        "warning: MoE layer 2 routes nearly every token to one expert: its busiest expert "
        "received 97.0% of the step's tokens (load max/mean 3.88 of at most num_experts/top_k "
        "= 4.00; above train.routing_check.max_expert_share=0.9) for 5 logged steps in a row"
    )
    console.totals.first_step = 101  # a resumed run's summary is the longest
    console.summary(3725.0, "runs/tiny/checkpoints/step_00000120")
    lines = stream.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    assert all(line.startswith(" ") for line in lines if line.split()[0] not in _STARTS), lines
    # Every figure of the step stands whole on one line, and the step starts one line only.
    figures = progress_line(record, 200, 1, eta=0).split(" | ")[:-1]
    for figure in figures:
        assert any(figure in line for line in lines), (figure, lines)
    assert sum(line.startswith("step ") for line in lines) == 1
    assert any(line.startswith("             (load from 1.00") for line in lines), lines  # hanging

    # A live line leaves out the least needed figures (the task scores, MFU, memory first).
    for extra, want in [
        ({}, "step 120/200 | loss 2.5000 | 4,000 tok/s/dev | load 1.50 | ETA "),
        (
            BUSY | {"skipped_steps": 0, "hidden_imbalance_layers": 0},
            "step 120/200 | loss 2.5000 | eval 3.8617 | collapsed 3 layers | ETA ",
        ),
    ]:
        live = _Terminal()
        console = Console(200, enabled=True, progress=True, world_size=1, stream=live)
        console.step(_record(120, **extra), logged=False)
        (line,) = live.getvalue().split("\r\033[K")[1:]
        assert len(line) < 80 and line.startswith(want), line


_STARTS = {"run", "model", "data", "precision", "checkpoints", "step", "warning:", "summary:"}


def test_a_wide_terminal_gets_one_line_per_step_and_a_word_wider_than_a_line_stays_whole(
    monkeypatch,
):
    monkeypatch.setenv("COLUMNS", "250")
    stream = io.StringIO()
    console = Console(200, enabled=True, progress=True, world_size=1, stream=stream)
    record = _record(120, **BUSY)
    console.step(record, logged=True)
    (line,) = stream.getvalue().splitlines()
    assert line.rsplit(" | ETA ", 1)[0] == progress_line(record, 200, 1, eta=0).rsplit(" | ETA ")[0]
    path = "runs/" + "a-very-long-run-directory-name-" * 3 + "/checkpoints/step_00000120"
    assert wrap_words(f"done: 3 steps, metrics in {path}", 40) == [
        "done: 3 steps, metrics in",
        f"  {path}",
    ]
