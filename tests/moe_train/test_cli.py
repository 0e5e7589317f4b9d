"""The moe-train command line: bad input gives one line on stderr and exit 2, no traceback."""

import pytest

from launch import run_cli
from moe_train.cli import main
from training import CONFIGS


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--model.moe.top_k=999"],
            "model.moe.top_k=999 must be between 1 and model.moe.num_experts=8",
        ),
        (["--model.n_heads=3"], "model.n_heads=3 must divide model.d_model=128"),
        (
            ["--data.micro_batch_size=5"],
            "data.micro_batch_size=5 must divide data.global_batch_size=16",
        ),
        (["--model.moe.top_kk=2"], "did you mean --model.moe.top_k?"),
        (["--parallel.dispatcher=magic"], "parallel.dispatcher='magic' must be one of"),
        (["--data.paths=/nonexistent/tokens"], "/nonexistent/tokens"),
        (["--model.d_model=abc"], "model.d_model='abc' must be an integer"),
    ],
)
def test_bad_train_input_is_one_line(args, expected, capsys, tmp_path):
    code = main(["train", str(CONFIGS / "tiny.yaml"), f"--train.run_dir={tmp_path / 'r'}", *args])
    assert code == 2
    assert expected in _error_line(capsys)


def test_a_mistyped_flag_names_the_flag_it_meant(capsys, tmp_path):
    tiny = str(CONFIGS / "tiny.yaml")
    for args, expected in [
        (["--max-steps", "10"], "--max-steps: unknown config key max-steps; did you mean "
                                "--train.max_steps?"),
        (["--lr=1e-3"], "--lr: unknown config key lr; did you mean --optim.lr?"),
        (["--trian.max_steps=3"], "did you mean --train.max_steps?"),
        (["--nonsense=1"], "config keys are written --section.key=value, with sections model,"),
    ]:  # fmt: skip
        assert main(["train", tiny, *args]) == 2
        assert expected in _error_line(capsys)
    # A command without config keys: its own usage line, and the close flag.
    with pytest.raises(SystemExit) as stopped:
        main(["prepare-data", "in.txt", "--out", str(tmp_path / "o"), "--wrokers", "2"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("usage: moe-train prepare-data [-h] --out DIR"), err
    assert err[-1] == (
        "moe-train prepare-data: error: unrecognized arguments: --wrokers 2; "
        "did you mean --workers?"
    )


def test_a_key_typo_in_a_yaml_file_names_the_file_the_key_and_the_valid_key(capsys, tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text((CONFIGS / "tiny.yaml").read_text().replace("warmup_steps:", "warmup_step:"))
    assert main(["train", str(mine)]) == 2
    assert _error_line(capsys) == (
        f"error: {mine}: unknown config key optim.warmup_step; did you mean optim.warmup_steps?"
    )
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text(
        "data:\n  mixture:\n    - {paths: [a], weight: 1}\n    - {paths: [b], wieght: 1}\n"
    )
    assert main(["train", str(mixed)]) == 2
    assert _error_line(capsys).startswith(
        f"error: {mixed}: unknown config key data.mixture[1].wieght; did you mean"
    )


def test_missing_config_file(capsys, tmp_path):
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml does not exist" in _error_line(capsys)


def test_prepare_data_errors(capsys, tmp_path):
    assert main(["prepare-data", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "nope.txt" in _error_line(capsys)


def test_prepare_then_train_through_the_cli(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    assert main(["prepare-data", str(corpus), "--out", str(tmp_path / "data")]) == 0
    code = main(
        [
            "train",
            str(CONFIGS / "tiny.yaml"),
            f"--data.paths=[{tmp_path / 'data'}]",
            "--train.max_steps=2",
            "--train.progress=false",
            "--train.peak_flops=1e11",
            "--model.n_layers=1",
            "--eval.interval=0",  # tiny.yaml's task is not what this checks
            f"--train.run_dir={tmp_path / 'run'}",
        ]
    )
    assert code == 0
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_entry_point_exit_code_in_a_real_process(tmp_path):
    result = run_cli("train", str(CONFIGS / "tiny.yaml"), "--model.moe.top_k=999", timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: model.moe.top_k=999 must be between 1 and model.moe.num_experts=8"
    )


def test_compile_without_a_cpp_compiler_is_one_line(capsys, tmp_path):
    from torch._inductor import config as inductor_config
    from torch._inductor.cpp_builder import cpp_compiler_search

    cpp_compiler_search.cache_clear()
    try:
        run_dir = tmp_path / "r"
        # inductor's own patching: a plain setattr on its config breaks the key afterwards
        with inductor_config.patch({"cpp.cxx": (None, "no-such-cxx")}):
            code = main(["train", str(CONFIGS / "tiny.yaml"), f"--train.run_dir={run_dir}",
                         "--train.compile=true"])  # fmt: skip
    finally:
        cpp_compiler_search.cache_clear()
    assert code == 2
    line = _error_line(capsys)
    assert "train.compile=true needs a C++ compiler" in line and "no-such-cxx" in line
    assert not run_dir.exists()


def test_commands_that_take_no_overrides_refuse_unknown_arguments(capsys, tmp_path):
    """Only train, eval, plan and verify hand `--section.key=value` on; the others stop with
    their own usage line and exit 2 before they touch anything."""
    from moe_train.cli import COMMANDS

    assert [c.name for c in COMMANDS if c.takes_overrides] == ["train", "eval", "plan", "verify"]
    with pytest.raises(SystemExit) as stop:
        main(["inspect", str(tmp_path / "ckpt"), "--model.d_model=64"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "usage: moe-train inspect [-h] [--json] [--no-verify] [--all] CKPT",
        "moe-train inspect: error: unrecognized arguments: --model.d_model=64",
    ]


def test_help_lists_every_command_with_its_line(capsys):
    from moe_train.cli import COMMANDS

    names = ["train", "prepare-data", "inspect", "export", "import-hf", "upcycle", "generate",
             "eval", "plot", "plan", "verify"]  # fmt: skip
    assert [c.name for c in COMMANDS] == names
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # help lines wrap with the terminal
    positions = [out.index(f" {c.name} {c.help}") for c in COMMANDS]
    assert positions == sorted(positions)


def test_an_error_every_rank_raises_alike_is_printed_by_rank_0_alone(capsys, monkeypatch):
    """What each rank of a 2-process launch does with a layout error (the launch itself is in
    test_distributed_training.py): rank 0 prints it, rank 1 waits for the launcher, both exit 2."""
    from moe_train.train import runtime

    monkeypatch.setattr(runtime, "RANK_0_GRACE_S", 0.1)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # as torchrun starts its ranks
    args = ["train", str(CONFIGS / "tiny.yaml"), "--parallel.ep=3"]
    for rank, printed in [("1", ""), ("0", "error: parallel.ep=3 must divide the data-parallel ")]:
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith(printed) and len(err.splitlines()) == (1 if printed else 0), err


@pytest.mark.parametrize(
    "args",
    [
        [str(CONFIGS / "tiny.yaml"), "--gpus", "2", "--tokens", "1e9", "--model.n_layers=4"],
        [str(CONFIGS / "tiny.yaml")],  # refused: --gpus is missing
        ["--help"],
    ],
)
def test_moe_train_plan_is_moe_plan(args, capsys):
    """`moe-train plan ARGS` runs the `moe-plan` command: the same exit code and output (the
    help but for the program's name)."""
    from moe_plan.cli import main as moe_plan

    answers = []
    for run, argv in ((main, ["plan", *args]), (moe_plan, args)):
        try:
            code = run(argv)
        except SystemExit as e:  # --help
            code = e.code
        out, err = capsys.readouterr()
        answers.append((code, " ".join(out.replace("moe-train plan", "moe-plan").split()), err))
    assert answers[0] == answers[1]
