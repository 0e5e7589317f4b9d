"""What `moe-train inspect` reports about a checkpoint: step, save time, saving layout, data
position, sizes by category, model config and tensors, with or without checking checksums.

`build_report` gathers it as a JSON-able dict (``--json`` prints exactly that);
`format_report` lays it out for a terminal. trainer_state.json is whatever the trainer saved:
every key read from it may be missing (then None).
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from moe_checkpoint import (
    CheckpointError,
    checkpoint_summary,
    read_trainer_state,
    resolve_checkpoint,
)
from moe_plan.config import flatten_config
from moe_train.errors import MoeTrainError

OPTIMIZER_PREFIX = "optim."
"""Optimizer state tensors are named ``optim.<...>``; listed only on request."""


def build_report(path: Path, *, verify: bool, all_tensors: bool) -> dict[str, Any]:
    """The report on `path`: a committed checkpoint, or a root holding some (then its newest).

    With `verify`, every chunk checksum and file sha256 is checked (``verification`` is
    ``"ok"`` or the one-line error); without, no tensor data is read (``verification`` is
    None). Optimizer tensors are left out of ``tensors`` unless `all_tensors`.
    """
    try:
        checkpoint = resolve_checkpoint(path)
        summary = checkpoint_summary(checkpoint, verify=verify)
    except CheckpointError as e:
        raise MoeTrainError(str(e)) from e
    try:
        state = read_trainer_state(checkpoint)
        state_error = None
    except CheckpointError as e:  # with `verify`, also the verification's outcome
        state, state_error = {}, str(e)
    tensors = summary["tensors"]
    listed = {
        name: tensor
        for name, tensor in tensors.items()
        if all_tensors or not name.startswith(OPTIMIZER_PREFIX)
    }
    config = state.get("config")
    model = config.get("model") if isinstance(config, dict) else None
    return {
        "path": str(checkpoint),
        "chosen_from": None if checkpoint == path else str(path),
        "step": summary["step"],
        "saved_at": _number(state.get("saved_at")),
        "saved_at_utc": _utc(state.get("saved_at")),
        "saved_topology": state.get("topology"),
        "saved_world_size": summary["saved_world_size"],
        "data": state.get("data"),
        "manifest": state.get("manifest"),
        "tokens_per_source": state.get("tokens_per_source"),
        "model_config": model if isinstance(model, dict) else None,
        "trainer_state_error": state_error,
        "total_bytes": summary["total_bytes"],
        "bytes_by_category": summary["bytes_by_category"],
        "tensors_by_category": _count_by_category(tensors),
        "files": summary["files"],
        "checksum_chunk_bytes": summary["checksum_chunk_bytes"],
        "verification": summary["verification"],
        "tensors": listed,
        "tensors_left_out": len(tensors) - len(listed),
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as aligned text lines (no trailing newline)."""
    lines = [f"{'checkpoint':<12} {report['path']}"]
    if report["chosen_from"] is not None:
        lines.append(f"{'':<12} (the newest committed checkpoint in {report['chosen_from']})")
    lines += [
        f"{'step':<12} {report['step']}",
        f"{'saved at':<12} {report['saved_at_utc'] or 'unknown'}",
        f"{'saved by':<12} {_pairs(report['saved_topology'])}",
        f"{'data':<12} {_pairs(report['data'])}",
        f"{'sizes':<12} {_sizes(report)}",
        f"{'checksums':<12} {_checks(report)}",
    ]
    if report["trainer_state_error"] is not None:
        lines.append(f"{'warning':<12} trainer state unreadable: {report['trainer_state_error']}")
    lines += _manifest_lines(report["manifest"], report["tokens_per_source"])
    lines.append("model config" if report["model_config"] else "model config unknown")
    for key, value in flatten_config(report["model_config"] or {}).items():
        lines.append(f"  {key:<28} {value}")
    lines += _tensor_table(report["tensors"])
    if report["tensors_left_out"]:
        lines.append(
            f"({report['tensors_left_out']} optimizer tensors not listed; --all lists them)"
        )
    return "\n".join(lines)


def _manifest_lines(manifest: dict[str, Any] | None, seen: dict[str, int] | None) -> list[str]:
    """The run manifest the checkpoint carries: data sources and the run's launches."""
    if not manifest:
        return [f"{'manifest':<12} none (saved by a release before run manifests)"]
    lines = ["data sources (token files, sha256)"]
    for source in manifest.get("data", []):
        tokens = (seen or {}).get(source["path"])
        extra = f", {tokens:,} tokens seen" if tokens is not None else ""
        lines.append(f"  {source['path']} ({len(source['files'])} files{extra})")
        lines += [f"    {f['file']} {f['sha256']}" for f in source["files"][:8]]
        if len(source["files"]) > 8:
            lines.append(f"    ... and {len(source['files']) - 8} more (--json lists all)")
    lines.append("launches of the run")
    for segment in manifest.get("segments", []):
        source = segment.get("source") or {}
        commit = source.get("commit", "not a git checkout")[:12]
        dirty = " (with local changes)" if source.get("dirty") else ""
        packages = (segment.get("environment") or {}).get("packages", {})
        lines.append(
            f"  steps {segment['start_step']}-{segment['end_step']}: commit {commit}{dirty}, "
            f"torch {packages.get('torch', '?')}, moestack-train "
            f"{packages.get('moestack-train', '?')}, {_pairs(segment.get('topology'))}"
        )
    return lines


def _tensor_table(tensors: dict[str, dict[str, Any]]) -> list[str]:
    width = max((len(name) for name in tensors), default=6)
    lines = [f"{'tensor':<{width}}  {'shape':<20} {'dtype':<6} {'bytes':>14}  file"]
    for name, tensor in tensors.items():
        shape = "x".join(str(d) for d in tensor["shape"]) or "scalar"
        lines.append(
            f"{name:<{width}}  {shape:<20} {tensor['dtype']:<6} {tensor['bytes']:>14,}  "
            f"{tensor['file']}"
        )
    return lines


def _sizes(report: dict[str, Any]) -> str:
    counts = report["tensors_by_category"]
    parts = [
        f"{category} {_human(nbytes)} ({counts.get(category, 0)} tensors)"
        for category, nbytes in report["bytes_by_category"].items()
    ]
    files = len(report["files"])
    return f"{', '.join(parts)}; {_human(report['total_bytes'])} in {files} files"


def _checks(report: dict[str, Any]) -> str:
    verification = report["verification"]
    if verification is None:
        return "not verified (--no-verify)"
    if verification != "ok":
        return f"FAILED: {verification}"
    chunk = _human(report["checksum_chunk_bytes"])
    return f"ok (crc32 of every {chunk} chunk, sha256 of every file)"


def _count_by_category(tensors: dict[str, dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for tensor in tensors.values():
        counts[tensor["category"]] = counts.get(tensor["category"], 0) + 1
    return dict(sorted(counts.items()))


def _pairs(value: Any) -> str:
    """``a=1 b=2`` for a flat dict; the value itself otherwise; ``unknown`` when missing."""
    if value is None:
        return "unknown"
    if isinstance(value, dict):
        return " ".join(f"{key}={item}" for key, item in flatten_config(value).items()) or "{}"
    return str(value)


def _number(value: Any) -> float | None:
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if is_number else None


def _utc(value: Any) -> str | None:
    """A unix time as ``2026-01-31 12:34:56 UTC``; None when it is not one."""
    seconds = _number(value)
    if seconds is None:
        return None
    try:
        return datetime.fromtimestamp(seconds, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return None


def _human(nbytes: int) -> str:
    """``812 B``, ``1.5 KiB``, ``3.2 MiB``, ``1.1 GiB``, ..."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    size, unit = float(nbytes), 0
    while size >= 1024 and unit < len(units) - 1:
        size /= 1024
        unit += 1
    return f"{nbytes} B" if unit == 0 else f"{size:.1f} {units[unit]}"
