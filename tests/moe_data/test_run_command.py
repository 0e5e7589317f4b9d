"""run_command ends every command alike: a user error as one line and its exit code, a pipe
closed early quietly with 0, Ctrl-C with `error: interrupted` and 130."""

from __future__ import annotations

import pytest

from moe_data import DataError, UserError, run_command


def _raise(error: BaseException):
    def run() -> int:
        raise error

    return run


def test_a_user_error_is_one_line_and_its_exit_code(capsys):
    assert run_command(lambda: 0) == 0
    assert run_command(_raise(DataError("data.paths[0]='x' does not exist"))) == 2
    assert capsys.readouterr().err == "error: data.paths[0]='x' does not exist\n"

    class Preempted(UserError):
        exit_code = 75

    seen = []
    assert run_command(_raise(Preempted("stopped")), report=seen.append) == 75
    assert [str(e) for e in seen] == ["stopped"] and capsys.readouterr().err == ""


def test_ctrl_c_and_a_closed_pipe(capfd):
    assert run_command(_raise(KeyboardInterrupt())) == 130
    assert capfd.readouterr().err == "error: interrupted\n"
    assert run_command(_raise(BrokenPipeError())) == 0
    print("after the pipe closed: discarded")
    assert capfd.readouterr().out == ""


def test_a_bug_is_not_hidden():
    with pytest.raises(ZeroDivisionError):
        run_command(lambda: 1 // 0)
