"""One start check: every room that asks whether a config can start on N ranks (loading, the
trainer's start, `moe-train train --nproc-per-node`, the planner) gets the same one-line
answer; and the layout's arithmetic lives in the config package alone."""

from __future__ import annotations

import re
from pathlib import Path
from unittest import mock

import pytest

from moe_plan import DEVICES, evaluate
from moe_plan.config import Config, load_config
from moe_plan.config.key_rules import KEY_RULES, NUMBERS, resume_refuses, verify_allows
from moe_plan.config.layout_shape import layout_shape
from moe_plan.config.start_check import check_start, start_error
from moe_train.cli import launch, main
from moe_train.errors import ConfigError
from moe_train.train.runtime import start_runtime
from training import CONFIGS

TINY = CONFIGS / "tiny.yaml"  # 4 layers, 8 experts, seq_len 128, batch 16 of micro-batches of 8
ROOT = Path(__file__).resolve().parents[2]

BAD = {
    "pp does not divide the world": (8, ["--parallel.pp=3"]),
    "ep does not divide dp": (8, ["--parallel.ep=3"]),
    "ep larger than dp": (4, ["--parallel.ep=8"]),
    "ep does not divide the experts": (8, ["--parallel.ep=8", "--model.moe.num_experts=4"]),
    "ep does not divide dp with cp": (8, ["--parallel.pp=2", "--parallel.cp=2", "--parallel.ep=8"]),
    "pp below 1": (8, ["--parallel.pp=0"]),
    "ep below 1": (8, ["--parallel.ep=0"]),
    "cp does not cut the sequence": (8, ["--parallel.cp=3"]),
    "cp does not divide dp": (8, ["--parallel.cp=16"]),
    "micro-batches do not split over dp": (
        8,
        ["--data.global_batch_size=12", "--data.micro_batch_size=4"],
    ),
    "micro-batches do not split over dp / cp": (8, ["--parallel.cp=2"]),
    "micro batch does not divide the batch": (8, ["--data.micro_batch_size=5"]),
    "pp does not divide the layers": (8, ["--parallel.pp=2", "--model.n_layers=3"]),
    "pp larger than the layers": (8, ["--parallel.pp=8", "--data.global_batch_size=64"]),
    "interleaved without virtual stages": (
        8,
        ["--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b", "--data.micro_batch_size=2"],
    ),
    "virtual stages without interleaving": (
        8,
        ["--parallel.pp=2", "--parallel.virtual_stages=2", "--data.micro_batch_size=2"],
    ),
    "virtual stages do not divide the layers": (
        8,
        [
            "--parallel.pp=2",
            "--parallel.pp_schedule=interleaved_1f1b",
            "--parallel.virtual_stages=3",
            "--data.micro_batch_size=2",
        ],
    ),
    "too few micro-batches for 1f1b": (8, ["--parallel.pp=4"]),
    "interleaved micro-batches not a multiple of pp": (
        8,
        [
            "--parallel.pp=2",
            "--parallel.pp_schedule=interleaved_1f1b",
            "--parallel.virtual_stages=2",
            "--data.global_batch_size=24",
            "--data.micro_batch_size=2",
        ],
    ),
    "local dispatcher with ep": (
        8,
        ["--parallel.ep=2", "--parallel.dispatcher=local", "--data.micro_batch_size=2"],
    ),
    "rowwise without a capacity": (
        8,
        ["--parallel.dispatcher=rowwise", "--data.micro_batch_size=2"],
    ),
    "tied embeddings over stages": (
        8,
        ["--parallel.pp=2", "--model.tie_embeddings=true", "--data.micro_batch_size=2"],
    ),
    "mtp with document masking": (8, ["--model.mtp_depth=1", "--data.document_masking=true"]),
}


def _unchecked(overrides: list[str]) -> Config:
    """The tiny config with `overrides`, built without its own checks (as a program might)."""
    with mock.patch.object(Config, "validate"):
        return load_config(TINY, overrides)


def _loading(world: int, overrides: list[str]) -> str | None:
    try:
        check_start(load_config(TINY, overrides), world)
    except ConfigError as e:
        return str(e)
    return None


def _trainer(world: int, overrides: list[str], monkeypatch) -> str | None:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    try:
        start_runtime(_unchecked(overrides))  # refused before any process group is joined
    except ConfigError as e:
        return str(e)
    return None


def _launcher(world: int, overrides: list[str], monkeypatch, capsys) -> str | None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(launch, "launch_ranks", lambda *call: pytest.fail(f"launched {call}"))
    if main(["train", str(TINY), "--nproc-per-node", str(world), *overrides]) == 0:
        return None
    return capsys.readouterr().err.strip().removeprefix("error: ")


@pytest.mark.parametrize("case", sorted(BAD))
def test_every_room_refuses_a_bad_config_with_one_message(case, monkeypatch, capsys):
    world, overrides = BAD[case]
    expected = _loading(world, overrides)
    assert expected is not None and "\n" not in expected, case
    answers = {
        "planner": start_error(_unchecked(overrides), world),
        "planner page and CLI": evaluate(_unchecked(overrides), world, DEVICES["h100"]).error,
        "trainer": _trainer(world, overrides, monkeypatch),
        "--nproc-per-node": _launcher(world, overrides, monkeypatch, capsys),
    }
    assert answers == dict.fromkeys(answers, expected), case


def test_the_bad_configs_are_refused_for_different_reasons():
    messages = {_loading(world, overrides) for world, overrides in BAD.values()}
    assert len(BAD) >= 20 and len(messages) == len(BAD)


def test_the_shape_of_a_layout():
    sizes = ["--parallel.pp=2", "--parallel.cp=2", "--parallel.ep=2"]
    config = load_config(TINY, [*sizes, "--data.micro_batch_size=2"])
    shape = check_start(config, 8)
    assert (shape.dp, shape.batch_ranks, shape.edp) == (4, 2, 2)
    assert (shape.micro_batches, shape.micro_batches_per_rank) == (8, 4)
    assert [shape.pp_rank(rank) for rank in range(8)] == [0] * 4 + [1] * 4
    assert layout_shape(config.parallel, 8).micro_batches_per_rank == 1


def test_one_key_table_answers_resume_and_verify():
    assert resume_refuses("model.moe.top_k") and resume_refuses("data.seq_len")
    assert not resume_refuses("parallel.pp") and not resume_refuses("optim.lr")
    assert verify_allows("parallel.ep") and verify_allows("train.routing_check.logged_steps")
    assert not verify_allows("data.micro_batch_size") and not verify_allows("optim.lr")
    assert not verify_allows("train.seed") and not verify_allows("model.d_model")
    assert all(rule.changes != NUMBERS or rule.planned for rule in KEY_RULES)


ARITHMETIC = re.compile(r"world_size\s*//")
"""A world size divided: the layout's arithmetic, which only the config package does."""


def _dividers(roots: list[Path]) -> list[str]:
    """Files under `roots` outside a `config` folder that divide a world size."""
    return [
        str(path)
        for root in roots
        for path in sorted(root.rglob("*.py"))
        if "config" not in path.relative_to(root).parts[:-1]
        and ARITHMETIC.search(path.read_text(encoding="utf-8"))
    ]


def test_only_the_config_package_divides_world_sizes(tmp_path):
    roots = [ROOT / "packages/moe-train/src/moe_train", ROOT / "packages/moe-plan/src/moe_plan"]
    roots.append(ROOT / "benchmarks")
    assert _dividers(roots) == []
    planted = tmp_path / "moe_plan/sizes.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("dp = world_size // pp\n")
    (tmp_path / "moe_plan/config").mkdir()
    (tmp_path / "moe_plan/config/shape.py").write_text("dp = world_size // pp\n")
    assert _dividers([tmp_path / "moe_plan"]) == [str(planted)]
