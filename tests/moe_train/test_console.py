"""What a person reads: banner, progress lines every log_interval steps, summary."""

import io
import math
import re

from moe_train.train import train
from moe_train.train.console import Console, progress_line
from moe_train.train.step_record import StepRecord


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
    train(config)
    err = capsys.readouterr().err.splitlines()
    # The ceiling of `load` (4 experts, top-2), and a run that is all warmup says so.
    assert "4 experts top-2 (load from 1.00 (even) to at most 2.00)" in err[1], err[1]
    assert err[4].endswith(
        "float32 params, float32 compute; expert GEMMs torch (as configured); linears in the "
        "compute dtype"
    ), err[4]
    assert err[5].endswith(
        "(cosine schedule, peak lr 0.003; all 6 steps are warmup, optim.warmup_steps=6: "
        "the lr rises to 0.003 and never decays)"
    ), err[5]
    banner = [line for line in err if not line.startswith(("step ", "summary: "))]
    assert [line.split()[0] for line in banner] == [
        "run",
        "model",
        "data",
        "layout",
        "precision",
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
