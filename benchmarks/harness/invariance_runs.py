"""The invariance matrix's training runs: the data they share, and one run of `moe-train
train` in fresh processes (a single process, or N ranks that the trainer's
`--nproc-per-node` starts after its start check), with how it ended.

A run ends in one of three ways: ok (exit 0), refused (the start check's exit 2 with one
line `error: ...`: the trainer cannot run that config on that layout) or failed (any other
end, with the first exception a rank printed, else its last error line).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CONFIG_ERROR_EXIT = 2
"""The trainer's exit code for a config it refuses (one line on stderr)."""

_RAISED = re.compile(r"^(\[rank\d+\]:\s*)?(\w+(?:Error|Exception): .*)$")
"""A traceback's last line, `XError: message`, as a rank prints it (torchrun prefixes
`[rankN]:`); the first one printed is the cause, the others mostly ranks that lost it."""
_WORDS = [
    "the",
    "of",
    "model",
    "data",
    "expert",
    "router",
    "token",
    "layer",
    "loss",
    "train",
    "a",
    "to",
    "is",
]


def write_data(root: Path) -> Path:
    """A prepared directory (byte tokens, end-of-document id 256, a label mask on each
    completion) of short prompt-completion documents, under `root`; its path. Every feature
    trains on it: the end-of-document ids serve document masking, the mask label masks, and
    features without either train on every token."""
    from moe_data import prepare_conversations

    rng = random.Random(0)

    def words() -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3)))

    rows = [json.dumps({"prompt": f"{words()}?", "completion": f" {words()}."}) for _ in range(400)]
    root.mkdir(parents=True, exist_ok=True)
    source = root / "documents.jsonl"
    source.write_text("\n".join(rows) + "\n")
    prepare_conversations([source], root / "data", None, data_format="prompt-completion")
    return root / "data"


@dataclass
class RunEnd:
    """How one training run ended."""

    status: str
    """ok, refused or fail."""
    reason: str = ""
    """The refusal's line, or the failure's last error line."""
    wall_s: float = 0.0
    """Seconds from launch to exit."""
    reports: int = 0
    """How many `done:` lines the ranks printed on standard output (one: the first rank
    reports for all)."""


def train_run(
    folder: Path, config: dict[str, Any], ranks: int, env: dict[str, str] | None = None
) -> RunEnd:
    """Train `config` in a new `folder` (its config.yaml, stdout.txt, stderr.txt and the run
    directory `run/`) on `ranks` processes (1: one process, no launcher), with `env` added to
    this process's environment; how it ended."""
    folder.mkdir(parents=True)
    config = {**config, "train": {**config["train"], "run_dir": str(folder / "run")}}
    config_file = folder / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "moe_train.cli", "train", str(config_file)]
    if ranks > 1:
        command += ["--nproc-per-node", str(ranks)]
    start = time.perf_counter()
    with (folder / "stdout.txt").open("wb") as out, (folder / "stderr.txt").open("wb") as err:
        code = subprocess.run(command, stdout=out, stderr=err, env={**os.environ, **(env or {})})
    wall_s = time.perf_counter() - start
    end = run_end(code.returncode, (folder / "stderr.txt").read_text(errors="replace"), wall_s)
    stdout = (folder / "stdout.txt").read_text(errors="replace")
    end.reports = len(re.findall(r"^done: ", stdout, flags=re.MULTILINE))
    return end


def run_end(returncode: int, stderr: str, wall_s: float = 0.0) -> RunEnd:
    """How a run ended from its exit code and standard error: ok, refused (exit 2 whose last
    line is `error: ...`) or fail (the first exception a rank printed, else its last line
    that names an error, else its last line)."""
    if returncode == 0:
        return RunEnd("ok", wall_s=wall_s)
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else f"exit {returncode} with nothing on stderr"
    if returncode == CONFIG_ERROR_EXIT and last.startswith("error: "):
        return RunEnd("refused", last.removeprefix("error: "), wall_s)
    raised = [m.group(2) for line in lines if (m := _RAISED.match(line))]
    errors = [line for line in lines if "error" in line.lower()]
    reason = raised[0] if raised else errors[-1] if errors else last
    return RunEnd("fail", f"exit {returncode}: {reason}", wall_s)


def run_env(backend: str) -> dict[str, str]:
    """What every run's environment adds: one torch thread per process, and with backend
    gloo no visible GPU (the trainer takes NCCL and the GPUs wherever CUDA is available)."""
    env = {"OMP_NUM_THREADS": "1"}
    if backend == "gloo":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env
