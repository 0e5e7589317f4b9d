"""A run directory's figures as `moe-train plot` reads them: metrics, routing rows, thresholds."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from moe_train.errors import MoeTrainError

ROUTING_KEYS = ("step", "layers", "load", "rank_load", "lb_loss", "rank_imbalance")
"""Keys of an expert_load.jsonl row the plots use."""


@dataclass(frozen=True)
class Run:
    """What the plots of one run directory need."""

    name: str
    """The directory's name (legend labels, file suffixes)."""
    metrics: list[dict[str, Any]]
    """The rows of metrics.jsonl, by step."""
    routing: list[dict[str, Any]]
    """The rows of expert_load.jsonl, by step (empty for a run without one)."""
    balanced_lb_loss: float | None
    """train.routing_check.balanced_lb_loss of the run's config.yaml, if it has one."""
    max_rank_imbalance: float | None
    """train.routing_check.max_rank_imbalance of the run's config.yaml, if set."""
    resumes: tuple[int, ...] = ()
    """The steps later launches of the run resumed from (manifest.json's segments)."""

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """Steps and values of a metrics key, over the rows that hold a number for it."""
        rows = [r for r in self.metrics if isinstance(r.get(key), int | float)]
        return [r["step"] for r in rows], [float(r[key]) for r in rows]


def read_runs(paths: list[Path]) -> list[Run]:
    """`read_run` of each path; runs whose directories share a name are named by their paths."""
    runs = [read_run(path) for path in paths]
    names = [run.name for run in runs]
    if len(set(names)) < len(names):
        runs = [
            replace(run, name=str(path).strip("/").replace("/", "_"))
            for run, path in zip(runs, paths, strict=True)
        ]
    return runs


def read_run(path: Path) -> Run:
    """A run directory's metrics, routing rows and check thresholds; `MoeTrainError` with one
    line naming the path when it is not a run directory `moe-train train` wrote."""
    if not path.is_dir():
        raise MoeTrainError(
            f"{path} is not a directory; give a run directory written by moe-train train "
            f"(it holds metrics.jsonl)"
        )
    metrics_path = path / "metrics.jsonl"
    if not metrics_path.is_file():
        raise MoeTrainError(
            f"{path} holds no metrics.jsonl; give a run directory written by moe-train train"
        )
    metrics = read_rows(metrics_path, ("step", "loss"))
    if not metrics:
        raise MoeTrainError(f"{metrics_path} holds no rows yet; plot after the first logged step")
    routing_path = path / "expert_load.jsonl"
    routing = read_rows(routing_path, ROUTING_KEYS) if routing_path.is_file() else []
    check = _routing_check(path / "config.yaml")
    return Run(
        name=path.resolve().name,
        metrics=sorted(metrics, key=lambda r: r["step"]),
        routing=sorted(routing, key=lambda r: r["step"]),
        balanced_lb_loss=check.get("balanced_lb_loss"),
        max_rank_imbalance=check.get("max_rank_imbalance"),
        resumes=_resume_steps(path / "manifest.json"),
    )


def read_rows(path: Path, required: tuple[str, ...]) -> list[dict[str, Any]]:
    """The JSON rows of a .jsonl file. A last line cut short (a run still writing, or one
    killed mid-write) is left out; any other bad line is an error naming the file and line."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise MoeTrainError(f"{path} cannot be read: {e}") from e
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise MoeTrainError(f"{path}:{number} is not a JSON object") from None
        missing = [key for key in required if not isinstance(row, dict) or key not in row]
        if missing:
            raise MoeTrainError(f"{path}:{number} has no {', '.join(missing)}")
        rows.append(row)
    return rows


def _resume_steps(manifest_path: Path) -> tuple[int, ...]:
    """The start steps of the launches after the first in a run's manifest.json, in order
    (none when it is absent or unreadable: the markers only annotate the curves)."""
    try:
        segments = json.loads(manifest_path.read_text())["segments"]
        starts = [segment["start_step"] for segment in segments[1:]]
    except (OSError, ValueError, KeyError, TypeError):
        return ()
    return tuple(sorted({s for s in starts if isinstance(s, int) and s > 0}))


def _routing_check(config_path: Path) -> dict[str, Any]:
    """train.routing_check of a run's config.yaml ({} when absent or unreadable: the
    thresholds only add reference lines)."""
    try:
        config = yaml.safe_load(config_path.read_text())
        check = config["train"]["routing_check"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return {}
    return check if isinstance(check, dict) else {}
