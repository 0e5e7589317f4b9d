"""RUN_DIR/expert_load.jsonl in one process: the measures, the balance check's streaks and its
one warning per layer, continuation on resume, and the check's config keys."""

from __future__ import annotations

import shutil

import pytest
import torch

from moe_plan.config import RoutingCheckConfig
from moe_train.cli import main
from moe_train.train import read_metrics, train
from moe_train.train.expert_load import ExpertLoadLog
from moe_train.train.routing import StepRouting
from moe_train.train.routing_check import BalanceCheck, CollapseCheck, busiest_share

CHECK = RoutingCheckConfig(max_rank_imbalance=1.3, balanced_lb_loss=1.1, logged_steps=3)


def _routing(kept: list[list[int]], lb: list[float], ep: int = 2) -> StepRouting:
    counts = torch.tensor(kept)
    return StepRouting(
        layers=tuple(range(3, 3 + len(kept))),
        load_LE=counts + 1,
        kept_LE=counts,
        lb_loss_L=torch.tensor(lb, dtype=torch.float64),
        ep=ep,
    )


def test_measures_of_a_step():
    routing = _routing([[6, 2, 0, 0], [3, 1, 4, 0]], [1.0, 1.2])
    assert routing.rank_load_LR.tolist() == [[8, 0], [4, 4]]
    assert routing.rank_imbalance_L.tolist() == [2.0, 1.0]
    # load is kept + 1: [7, 3, 1, 1] and [4, 2, 5, 1], means 3 and 3
    assert routing.expert_imbalance_L.tolist() == [7 / 3, 5 / 3]


def test_check_needs_a_streak_of_logged_steps_and_reports_each_layer_once():
    check = BalanceCheck(CHECK)
    # layer 3: hidden on steps 0-2 (flagged at 2), interrupted at 3, hidden again 4-6.
    # layer 4: rank imbalance high but the loss sees it (lb 1.2): never flagged.
    # layer 5: balanced ranks: never flagged; lb null (non-finite) on step 1.
    steps = [
        ([1.0, 1.2, 1.0], [1.5, 2.0, 1.0]),
        ([1.05, 1.2, None], [1.4, 2.0, 1.0]),
        ([1.1, 1.2, 1.0], [1.31, 2.0, 1.0]),
        ([1.0, 1.2, 1.0], [1.3, 2.0, 1.0]),
        ([1.0, 1.2, 1.0], [2.0, 2.0, 1.0]),
        ([1.0, 1.2, 1.0], [2.0, 2.0, 1.0]),
        ([1.0, 1.2, 1.0], [2.0, 2.0, 1.0]),
    ]
    flags, reported = [], []
    for step, (lb, ranks) in enumerate(steps):
        now, first = check.observe(step, [3, 4, 5], lb, ranks)
        flags.append(now)
        reported += [(e.layer, e.step, e.logged_steps) for e in first]
    assert [f[0] for f in flags] == [False, False, True, False, False, False, True]
    assert not any(f[1] or f[2] for f in flags)
    assert reported == [(3, 2, 3)]
    off = BalanceCheck(RoutingCheckConfig(max_rank_imbalance=None, logged_steps=1))
    assert off.observe(0, [3], [1.0], [4.0]) == ([False], [])


def test_rows_resume_without_duplicates_and_keep_the_check_state(tmp_path):
    warnings: list[str] = []
    hidden = _routing([[8, 0, 0, 0], [2, 2, 2, 2]], [1.0, 1.0])  # layer 3 all on rank 0
    log = ExpertLoadLog(tmp_path, 0, CHECK, warnings.append, top_k=1)
    for step in range(1, 7):
        log.write(step, hidden)
    log.close()
    assert len(warnings) == 1 and warnings[0].startswith("warning: MoE layer 3 ")
    assert "up to step 3" in warnings[0]
    # A relaunch resuming from step 4: the rows of steps 5 and 6 are written again.
    resumed = ExpertLoadLog(tmp_path, 4, CHECK, warnings.append, top_k=1)
    assert resumed.flagged_layers == 1  # the streak of steps 1-4 goes on
    resumed.write(5, hidden)
    resumed.write(6, _routing([[2, 2, 2, 2], [2, 2, 2, 2]], [1.0, 1.0]))
    resumed.close()
    rows = read_metrics(tmp_path / "expert_load.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["hidden_imbalance"] for r in rows] == [[0, 0]] * 2 + [[1, 0]] * 3 + [[0, 0]]
    assert len(warnings) == 1, "layer 3 was reported again after the resume"
    assert rows[0]["kept"] == [[8, 0, 0, 0], [2, 2, 2, 2]]
    assert rows[0]["load"] == [[9, 1, 1, 1], [3, 3, 3, 3]]
    assert rows[0]["rank_load"] == [[8, 0], [4, 4]]
    assert rows[0]["layers"] == [3, 4]


@pytest.mark.slow
def test_a_resumed_run_rewrites_the_rows_after_its_checkpoint(tmp_path, make_config):
    """A job that logged steps 4-6 but whose step-6 save never committed resumes from step 3:
    the file then holds each step once, the rewritten rows equal to the first job's."""
    config = make_config(tmp_path, checkpoint={"interval": 3}, model={"moe": {"top_k": 1}})
    first = train(config)
    path = first.run_dir / "expert_load.jsonl"
    before = read_metrics(path)
    assert [r["step"] for r in before] == list(range(1, 7))
    shutil.rmtree(first.run_dir / "checkpoints" / "step_00000006")
    resumed = train(make_config(tmp_path, checkpoint={"interval": 3, "resume": "auto"},
                                model={"moe": {"top_k": 1}}))  # fmt: skip
    assert resumed.start_step == 3 and resumed.run_dir == first.run_dir
    after = read_metrics(path)
    assert [r["step"] for r in after] == list(range(1, 7))
    for old, new in zip(before, after, strict=True):
        assert (new["load"], new["kept"], new["lb_loss"]) == (
            old["load"],
            old["kept"],
            old["lb_loss"],
        )
    tokens = config.data.global_batch_size * config.data.seq_len
    assert all(sum(r["load"][0]) == tokens for r in after)  # top-1: one copy per token


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "--train.routing_check.max_rank_imbalance=0.9",
            "train.routing_check.max_rank_imbalance=0.9 must be above 1",
        ),
        (
            "--train.routing_check.balanced_lb_loss=0.5",
            "train.routing_check.balanced_lb_loss=0.5 must be at least 1",
        ),
        (
            "--train.routing_check.logged_steps=0",
            "train.routing_check.logged_steps=0 must be positive",
        ),
        (
            "--train.routing_check.max_expert_share=1.0",
            "train.routing_check.max_expert_share=1.0 must be above 0 and below 1",
        ),
        ("--train.routing_check.steps=3", "unknown config key train.routing_check.steps"),
    ],
)
def test_bad_check_settings_are_one_line(override, message, tmp_path, capsys):
    from pathlib import Path

    tiny = Path(__file__).parents[2] / "configs" / "tiny.yaml"
    assert main(["train", str(tiny), f"--train.run_dir={tmp_path / 'r'}", override]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not (tmp_path / "r").exists()


def test_a_collapsed_layer_is_reported_once_after_its_streak_and_a_recovering_one_never(
    tmp_path,
):
    """Top-2 of 4 experts, 16 tokens (32 copies): all tokens at one expert is a share of 1.0
    (load max/mean 2.0, its maximum num_experts / top_k)."""
    collapsed, even, nearly = [16, 8, 4, 4], [8, 8, 8, 8], [14, 6, 6, 6]  # shares 1.0, 0.5, 0.875
    # layer 3 collapsed throughout; layer 4 even; layer 5 collapsed but recovers every 3rd step.
    steps = [[collapsed, even, collapsed if s % 3 else nearly] for s in range(1, 9)]
    warnings: list[str] = []
    log = ExpertLoadLog(tmp_path, 0, CHECK, warnings.append, top_k=2)
    for step, load in enumerate(steps, start=1):
        counts = torch.tensor(load)
        routing = StepRouting(
            layers=(3, 4, 5),
            load_LE=counts,
            kept_LE=counts,
            lb_loss_L=torch.ones(3, dtype=torch.float64),
            ep=1,
        )
        log.write(step, routing)
        assert log.collapsed_layers == (step >= 3), step
    log.close()
    assert len(warnings) == 1 and warnings[0].startswith("warning: MoE layer 3 "), warnings
    assert "received 100.0% of the step's tokens (load max/mean 2.00 of at most" in warnings[0]
    assert "max_expert_share=0.9) for 3 logged steps in a row, up to step 3" in warnings[0]
    rows = read_metrics(tmp_path / "expert_load.jsonl")
    assert [r["collapsed"] for r in rows] == [[0, 0, 0]] * 2 + [[1, 0, 0]] * 6
    # The check needs room to collapse: top-4 of 4 experts always has a share of 1.0.
    check = CollapseCheck(CHECK, top_k=4)
    assert [check.observe(s, [3], [[8, 8, 8, 8]])[0] for s in range(5)] == [[False]] * 5
    off = CollapseCheck(RoutingCheckConfig(max_expert_share=None, logged_steps=1), top_k=2)
    assert off.observe(1, [3], [collapsed]) == ([False], [])


def test_a_collapse_lands_in_the_metrics_rows(tmp_path, make_config):
    """A real run with a low threshold: each row counts the layers whose busiest expert was
    above it for the last 2 logged steps in a row, from the loads of expert_load.jsonl."""
    check = {"max_expert_share": 0.51, "logged_steps": 2}
    config = make_config(tmp_path, train={"max_steps": 4, "routing_check": check})
    result = train(config)
    metrics = read_metrics(result.run_dir / "metrics.jsonl")
    routing = read_metrics(result.run_dir / "expert_load.jsonl")
    above = [[busiest_share(load, 2) > 0.51 for load in row["load"]] for row in routing]
    want = [
        sum(now and (i > 0 and above[i - 1][layer]) for layer, now in enumerate(above[i]))
        for i in range(len(above))
    ]
    assert [r["collapsed_layers"] for r in metrics] == want and want[-1] > 0, (want, above)
    assert [sum(r["collapsed"]) for r in routing] == want
