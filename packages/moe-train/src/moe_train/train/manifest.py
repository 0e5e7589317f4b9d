"""The run manifest: what a run was made of, for anyone who has to say how a model was made.

`RUN_DIR/manifest.json` is written when a run starts and completed when it ends; every
checkpoint carries the manifest as of its step. It records the resolved config, the seeds,
every data source with the facts its meta.json holds and the sha256 of each token file
training reads, and one segment per launch of the run (a resume adds one): the steps it ran,
the versions of the code and of the libraries that affect the numbers, the source tree's
commit (when run from a git checkout), the command, the layout, the device and the kernels that ran.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_data import file_sha256, mask_file_of
from moe_plan.config import Config, DispatchChoice

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "moe-stack-manifest-v1"

PACKAGES = (
    "moestack-train",
    "moestack-devices",
    "moestack-kernels",
    "moestack-dispatch",
    "moestack-parallel",
    "moestack-checkpoint",
    "moestack-data",
    "moestack-plan",
    "torch",
    "triton",
    "numpy",
    "safetensors",
    "tokenizers",
    "torchao",
)
"""Distributions whose versions a manifest records: ours, and those that change the numbers."""


def environment(device: torch.device) -> dict[str, Any]:
    """Interpreter, platform, library versions and the devices in use."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    versions["torch"] = torch.__version__  # with its build tag (e.g. +cu128), which the
    # distribution's metadata leaves out
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": versions,
        "torch_cuda": torch.version.cuda,
        "device": str(device),
    }
    if device.type == "cuda":
        facts["device_name"] = torch.cuda.get_device_name(device)
        facts["cudnn"] = torch.backends.cudnn.version()
    return facts


def source_tree() -> dict[str, Any] | None:
    """The git commit of the checkout this package is imported from, and whether it has local
    changes; None when it is not in a git checkout (an installed wheel)."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=here, capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status), "root": git("rev-parse", "--show-toplevel")}


def known_sha256(path: Path, cache_dir: Path) -> str:
    """sha256 of a token file, remembered in `cache_dir` by path, size and modification time
    so that a run's start does not read terabytes again (`moe-train verify` always reads)."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    record = cache_dir / "sha256" / hashlib.sha256(key.encode()).hexdigest()
    if record.is_file():
        return record.read_text().strip()
    digest = file_sha256(path)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        partial = record.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(digest + "\n")
        partial.replace(record)
    except OSError:  # a read-only cache: hash again next time
        pass
    return digest


def data_facts(entry: str, directory: Path, cache_dir: Path) -> dict[str, Any]:
    """One `data.paths` entry: its token files with their sha256 and, for a prepared
    directory, what its meta.json says (sources with their sha256 and tokens, tokenizer).
    `directory` is where the entry's files are (for builtin:stdlib, its prepared cache);
    `cache_dir` remembers the sha256 of files that no meta.json records."""
    meta_path = directory / "meta.json"
    if directory.is_dir() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if "shards" in meta:
            files = [{"file": s["file"], "sha256": s["sha256"]} for s in meta["shards"]]
            files += [  # label masks (prepare-data --format chat) beside the tokens
                {"file": mask_file_of(s["file"]), "sha256": s["mask_sha256"]}
                for s in meta["shards"]
                if "mask_sha256" in s
            ]
        else:  # a single-file directory of an earlier release
            digest = known_sha256(directory / "tokens.bin", cache_dir)
            files = [{"file": "tokens.bin", "sha256": digest}]
        facts = {key: meta[key] for key in meta if key not in ("shards",)}
        return {"path": entry, "kind": "prepared", "dir": str(directory), "files": files, **facts}
    return {
        "path": entry,
        "kind": "token file",
        "files": [{"file": str(directory), "sha256": known_sha256(directory, cache_dir)}],
    }


def check_data_files(manifest: dict[str, Any]) -> list[str]:
    """Token files named by `manifest` that are missing or whose sha256 differs, one line each."""
    problems = []
    for source in manifest["data"]:
        base = Path(source["dir"]) if source["kind"] == "prepared" else None
        for entry in source["files"]:
            path = base / entry["file"] if base is not None else Path(entry["file"])
            if not path.is_file():
                problems.append(f"{path} is missing (data source {source['path']})")
                continue
            digest = file_sha256(path)
            if digest != entry["sha256"]:
                problems.append(
                    f"{path} has changed since the run (sha256 {digest[:16]}..., the "
                    f"manifest says {entry['sha256'][:16]}...; data source {source['path']})"
                )
    return problems


def data_sources(config: Config) -> list[dict[str, Any]]:
    """`data_facts` of every `data.paths` entry of `config`."""
    from moe_data import BUILTIN_STDLIB, builtin_dataset_dir, default_cache_dir, split_dtype_suffix

    data = config.data
    cache = Path(data.cache_dir) if data.cache_dir else default_cache_dir()
    facts = []
    for entry in data.paths:
        if entry == BUILTIN_STDLIB:
            facts.append(data_facts(entry, builtin_dataset_dir(cache), cache))
        else:
            facts.append(data_facts(entry, Path(split_dtype_suffix(entry)[0]), cache))
    return facts


def start_manifest(
    config: Config,
    topology: dict[str, Any],
    device: torch.device,
    start_step: int,
    previous: dict[str, Any] | None,
    kernels: dict[str, str] | None = None,
    dispatch: DispatchChoice | None = None,
) -> dict[str, Any]:
    """The manifest of a run starting (or, with the `previous` manifest of the checkpoint it
    resumes from, continuing) at `start_step`: the config and data as they are now, and the
    segments of the run so far plus this one (code, environment, layout, the `kernels` the
    expert GEMMs and linears ran, the token `dispatch` between expert-parallel ranks (keys
    dispatcher, transport, overlap and why), steps)."""
    segment = {
        "start_step": start_step,
        "end_step": start_step,
        "started": _now(),
        "completed": None,
        "command": sys.argv,
        "source": source_tree(),
        "environment": environment(device),
        "topology": topology,
        "kernels": kernels or {},
        "dispatch": dataclasses.asdict(dispatch) if dispatch else None,
    }
    earlier = list(previous.get("segments", [])) if previous else []
    return {
        "format": MANIFEST_FORMAT,
        "config": config.to_dict(),
        "seeds": {"train.seed": config.train.seed},
        "data": data_sources(config),
        "segments": [*earlier, segment],
    }


def manifest_at(manifest: dict[str, Any], step: int, *, completed: bool = False) -> dict[str, Any]:
    """The manifest with its current segment reaching `step` (and closed, if `completed`)."""
    segment = {**manifest["segments"][-1], "end_step": step}
    if completed:
        segment["completed"] = _now()
    return {**manifest, "segments": [*manifest["segments"][:-1], segment]}


def write_manifest(run_dir: Path, manifest: dict[str, Any]) -> None:
    """Write RUN_DIR/manifest.json whole (a new file renamed over the old one)."""
    path = run_dir / MANIFEST_FILE
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(manifest, indent=1, default=_jsonable) + "\n")
    partial.replace(path)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.integer | np.floating):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
