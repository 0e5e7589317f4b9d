"""Start real `moe-train` processes as users do: one process, under torchrun, or one process
per rank with RANK / WORLD_SIZE / MASTER_ADDR set by hand (as SLURM's srun and other cluster
launchers do). Every test that runs the command line in another process starts it here.

    outcome = run_cli("inspect", str(checkpoint))        # (returncode, stdout, stderr, seconds)
    outcome = run_torchrun(2, "train", str(config_path), "--parallel.ep=2")
    procs = start_ranks(config_path, world_size=2)       # [rank 0, rank 1]
    wait_for_records(run_dir / "metrics.jsonl", 3, procs)
    procs[1].send_signal(signal.SIGKILL)
    outcome = finish(procs[0], timeout=60)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.ranks import free_port
from training import save_config, small_config_data

TESTS = Path(__file__).parent
CLI = ("-m", "moe_train.cli")
"""The command line's entry: `python -m moe_train.cli`, as the `moe-train` script runs it."""


def write_config(path: Path, run_dir: Path, token_file: Path, **sections: dict) -> Path:
    """The small test config (tests/training.py) as a YAML file."""
    return save_config(path, small_config_data(run_dir, token_file, **sections))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def start_ranks(
    config: Path, world_size: int, *overrides: str, script: Path | None = None
) -> list[subprocess.Popen]:
    """`moe-train train CONFIG` once per rank, each told its place through the environment
    (no torchrun); `script` replaces the moe_train.cli module (a test wrapper around it)."""
    port = str(free_port())
    entry = [str(script)] if script else CLI
    return [
        _popen(
            *entry,
            "train",
            str(config),
            *overrides,
            env={
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
        )
        for rank in range(world_size)
    ]


def start_torchrun(nproc: int, *args: str, entry: Sequence[str] = CLI) -> subprocess.Popen:
    """torchrun --standalone --nproc-per-node NPROC -m moe_train.cli ARGS...; `entry` replaces
    `-m moe_train.cli` (a test wrapper script around it, with its own arguments)."""
    return _popen(
        "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *entry, *args
    )


def run_torchrun(
    nproc: int, *args: str, entry: Sequence[str] = CLI, timeout: float = 300
) -> Outcome:
    """`start_torchrun`, waited for."""
    return finish(start_torchrun(nproc, *args, entry=entry), timeout)


def run_cli(*args: str, timeout: float = 300, **popen) -> Outcome:
    """`moe-train ARGS...` in one fresh process, waited for; `popen` goes to subprocess.Popen
    (cwd, env entries through `env=`)."""
    return finish(_popen(*CLI, *args, **popen), timeout)


def _popen(*args: str, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    """`python ARGS...` with pipes for its output, in the test environment (`_env`)."""
    return subprocess.Popen(
        [sys.executable, *args],
        env=_env(**(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def wait_for_records(
    metrics: Path, count: int, procs: list[subprocess.Popen], timeout: float = 120
) -> None:
    """Wait until `metrics` holds `count` records (fail early if a process ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= count:
            return
        ended = [p for p in procs if p.poll() is not None]
        if ended:
            _, err = ended[0].communicate()
            raise AssertionError(f"a process ended early ({ended[0].returncode}):\n{err[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"{metrics} did not reach {count} records within {timeout} s")


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    """From the call of `finish` to the process's exit."""

    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error: ")]


def finish(proc: subprocess.Popen, timeout: float) -> Outcome:
    """Wait for `proc` (killed and reported if it outlives `timeout`)."""
    start = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"process still running after {timeout} s:\n{err[-3000:]}") from None
    return Outcome(proc.returncode, out, err, time.monotonic() - start)


def children(pid: int) -> list[int]:
    """Process ids whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # The command name (in parentheses) may hold spaces: the parent pid follows it.
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found
