"""`moe-train verify CKPT_A CKPT_B`: replay a run from checkpoint A to B's step with A's
manifest (config, data, seeds) and compare the result with B, tensor by tensor.

On the layout that wrote B the replay must match bitwise (training is deterministic on a
given layout); on another layout within a float tolerance (the summation order of gradient
reductions differs). Data files whose sha256 no longer matches A's manifest, a config of B
that differs from A's, or checkpoints of different runs are refused with one line each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from moe_checkpoint import CheckpointError, read_trainer_state, resolve_checkpoint
from moe_plan.config import (
    LAYOUT,
    Config,
    check_start,
    config_changes,
    config_from_dict,
    parse_overrides,
    verify_allows,
    what_changes,
    why_numbers,
)
from moe_train.errors import ConfigError, DataError, MoeTrainError
from moe_train.train.manifest import check_data_files
from moe_train.train.runtime import launch_id, launched_rank, launched_world_size

OTHER_LAYOUT_RTOL = 1e-3
"""Relative tolerance (of each tensor's largest magnitude) when the replay runs on another
layout than B's: reductions sum in another order, and Adam amplifies those roundings in
elements with near-zero gradients over a few steps."""


@dataclass(frozen=True)
class TensorDiff:
    name: str
    max_abs: float
    """Largest absolute difference."""
    scale: float
    """Largest magnitude of the tensor in B."""
    differing: int
    """Elements that differ at all."""


@dataclass(frozen=True)
class Verdict:
    step_a: int
    step_b: int
    same_layout: bool
    """Whether the replay ran on the layout that wrote B (then it must match bitwise)."""
    tensors: int
    diffs: list[TensorDiff]
    """Every tensor that differs (bitwise), with how much."""
    failures: list[TensorDiff]
    """Those beyond what the comparison allows."""

    @property
    def ok(self) -> bool:
        return not self.failures


def read_pair(path_a: Path, path_b: Path) -> tuple[Path, Path, dict[str, Any], dict[str, Any]]:
    """Both checkpoints and their trainer states, checked to be of one run, A before B."""
    try:
        a, b = resolve_checkpoint(path_a), resolve_checkpoint(path_b)
        state_a, state_b = read_trainer_state(a), read_trainer_state(b)
    except CheckpointError as e:
        raise MoeTrainError(str(e)) from e
    for path, state in ((a, state_a), (b, state_b)):
        if "manifest" not in state:
            raise MoeTrainError(
                f"{path} carries no run manifest (written by a release before manifests); "
                "it cannot be verified"
            )
    if state_a["step"] >= state_b["step"]:
        raise MoeTrainError(
            f"{a} is at step {state_a['step']}, not before {b} (step {state_b['step']}); "
            "give the earlier checkpoint first"
        )
    config_a = config_from_dict(state_a["config"])
    changed = [
        c
        for c in config_changes(state_a["config"], state_b["config"])
        if not verify_allows(c.key, config_a)  # logging, where files go, the layout
    ]
    if changed:
        first = changed[0]
        why = why_numbers(first.key, config_a)
        raise MoeTrainError(
            f"{b} was trained with another config than {a}: "
            f"{first.key} is {first.now!r} in B, {first.saved!r} in A"
            + (f" ({why})" if why else "")
        )
    return a, b, state_a, state_b


def replay_config(
    state_a: dict[str, Any], a: Path, step_b: int, work_dir: Path, layout: list[str]
) -> Config:
    """A's config (with the `layout` overrides of keys that change only the layout: parallel.*,
    and data.micro_batch_size where A's model does not count by micro-batch), set to resume
    from A in `work_dir` and save at `step_b` only (no tracking, no evaluation)."""
    config = config_from_dict(state_a["config"])
    for override in layout:
        key = override.removeprefix("--").split("=", 1)[0]
        if what_changes(key, config) != LAYOUT:
            why = why_numbers(key, config)
            raise ConfigError(
                f"{override}: verify replays A's config and takes only the layout "
                "(--parallel.key=value, and --data.micro_batch_size where the numbers do not "
                "depend on it)" + (f": {why}" if why else "")
            )
    if layout:
        data = config.to_dict()
        for section, values in parse_overrides(layout).items():
            data[section].update(values)
        config = config_from_dict(data)
    return dataclasses.replace(
        config,
        train=dataclasses.replace(
            config.train,
            run_dir=str(work_dir / "run"),
            progress=False,
            tensorboard=False,
            wandb_project=None,
        ),
        checkpoint=dataclasses.replace(
            config.checkpoint,
            dir=str(work_dir / "checkpoints"),
            resume=str(a),
            interval=step_b,
            interval_minutes=0,
            async_save=False,
            keep_last=1,
        ),
        eval=dataclasses.replace(config.eval, interval=0),
    )


def verify(
    path_a: Path,
    path_b: Path,
    *,
    layout: list[str] | None = None,
    work_dir: Path | None = None,
    device: torch.device | None = None,
) -> tuple[Verdict | None, Path, Path]:
    """Replay from A to B's step in a scratch directory and compare with B (on rank 0; None
    on other ranks); also the two checkpoints as resolved. `work_dir`: the scratch directory
    (every rank must see the same one: by default one under the temporary directory named
    after the checkpoints and the launch, which suits ranks on one machine)."""
    from moe_train.train import train

    a, b, state_a, state_b = read_pair(path_a, path_b)
    problems = check_data_files(state_a["manifest"])
    if problems:
        raise DataError(f"the data no longer matches {a}'s manifest: {problems[0]}")
    scratch = work_dir or _default_scratch(a, b)
    step_b = int(state_b["step"])
    config = replay_config(state_a, a, step_b, scratch, layout or [])
    check_start(config, launched_world_size())  # before any scratch is made
    main = launched_rank() == 0
    if main:
        shutil.rmtree(scratch, ignore_errors=True)  # a crashed earlier replay's
        scratch.mkdir(parents=True)
    try:
        result = train(config, device=device, stop_at_step=step_b)
        if not result.is_main:  # rank 0 compares
            return None, a, b
        if result.checkpoint is None or result.end_step != step_b:
            raise MoeTrainError(f"the replay stopped at step {result.end_step}, not {step_b}")
        replayed_state = read_trainer_state(result.checkpoint)
        same_layout = replayed_state.get("topology") == state_b.get("topology") and (
            config.data.micro_batch_size == state_b["config"]["data"]["micro_batch_size"]
        )
        verdict = compare(result.checkpoint, b, int(state_a["step"]), step_b, same_layout)
        return verdict, a, b
    finally:
        if main:
            shutil.rmtree(scratch, ignore_errors=True)


def _default_scratch(a: Path, b: Path) -> Path:
    key = "|".join([str(a.resolve()), str(b.resolve()), launch_id()])
    return (
        Path(tempfile.gettempdir()) / f"moe-verify-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    )


def compare(replayed: Path, b: Path, step_a: int, step_b: int, same_layout: bool) -> Verdict:
    """Every tensor of `replayed` against B's: bitwise, or within OTHER_LAYOUT_RTOL."""
    with contextlib.ExitStack() as stack:
        ours, theirs = (_open_tensors(path, stack) for path in (replayed, b))
        if set(ours) != set(theirs):
            missing = sorted(set(ours) ^ set(theirs))
            raise MoeTrainError(f"{b} and the replay hold different tensors, e.g. {missing[0]}")
        diffs, failures = [], []
        for name in sorted(ours):
            x, y = ours[name].get_tensor(name), theirs[name].get_tensor(name)
            if x.shape != y.shape:
                raise MoeTrainError(
                    f"{name}: shape {tuple(y.shape)} in {b}, {tuple(x.shape)} replayed"
                )
            if torch.equal(x, y):
                continue
            delta = (x.double() - y.double()).abs()
            scale = float(y.double().abs().max()) if y.numel() else 0.0
            diff = TensorDiff(name, float(delta.max()), scale, int((delta != 0).sum()))
            diffs.append(diff)
            allowed = 0.0 if same_layout else OTHER_LAYOUT_RTOL * max(scale, 1e-30)
            if not diff.max_abs <= allowed or not math.isfinite(diff.max_abs):
                failures.append(diff)
    return Verdict(step_a, step_b, same_layout, len(ours), diffs, failures)


def format_verdict(verdict: Verdict, a: Path, b: Path) -> str:
    how = (
        "bitwise (same layout as B)"
        if verdict.same_layout
        else (
            f"within {OTHER_LAYOUT_RTOL:g} of each tensor's largest value (another layout than B)"
        )
    )
    lines = [
        f"replayed {a} (step {verdict.step_a}) to step {verdict.step_b} and compared "
        f"{verdict.tensors} tensors with {b}, {how}:"
    ]
    if not verdict.diffs:
        lines.append("  every tensor is identical")
    for diff in verdict.diffs[:20]:
        mark = "DIFFERS" if diff in verdict.failures else "ok"
        lines.append(
            f"  {mark:<7} {diff.name}: max |diff| {diff.max_abs:.3g} (largest value "
            f"{diff.scale:.3g}), {diff.differing} elements"
        )
    if len(verdict.diffs) > 20:
        lines.append(f"  ... and {len(verdict.diffs) - 20} more tensors that differ")
    lines.append(
        "verified: B follows from A"
        if verdict.ok
        else f"NOT verified: {len(verdict.failures)} tensors differ beyond what is allowed"
    )
    return "\n".join(lines)


def _open_tensors(path: Path, stack: contextlib.ExitStack) -> dict[str, Any]:
    """Each tensor name of the checkpoint's safetensors files, to its file opened once."""
    handles = {}
    for file in sorted(path.glob("*.safetensors")):
        handle = stack.enter_context(safe_open(file, framework="pt"))
        handles.update(dict.fromkeys(handle.keys(), handle))
    return handles
