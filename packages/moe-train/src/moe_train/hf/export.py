"""`moe-train export`: a checkpoint as a directory `transformers` loads with no project code.

Writes config.json (its `eos_token_id` the end-of-text id), generation_config.json (its
`eos_token_id` every id that ends generation, `moe_train.end_tokens`: with a chat template,
the end-of-turn token too), sharded safetensors in the hub layout (one tensor per expert and
projection) with model.safetensors.index.json, and tokenizer.json with
tokenizer_config.json: the run's own tokenizer.json, or the byte tokenizer rebuilt as one
(`moe_train.hf.tokenizer`); data that is only pre-tokenized arrays gives no tokenizer files.
Also README.md, a model card generated from the checkpoint (`moe_train.hf.model_card`).
Everything is written to a scratch directory beside `out` and moved into place at the end,
so a refused or failed export leaves no `out`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from moe_checkpoint import (
    CheckpointError,
    SliceRequest,
    checkpoint_summary,
    load_slices,
    read_trainer_state,
    resolve_checkpoint,
)
from moe_data import give_umask_mode
from moe_plan.config import Config, config_from_dict
from moe_train.end_tokens import checkpoint_end_ids, generation_eos, tokenizer_end_of_turn
from moe_train.errors import MoeTrainError
from moe_train.hf.architectures import Architecture, ExportError, choose_architecture
from moe_train.hf.model_card import model_card
from moe_train.hf.output_dir import written_whole
from moe_train.hf.tensor_map import HFTensor
from moe_train.hf.tokenizer import write_tokenizer
from moe_train.run_paths import checkpoint_root
from moe_train.run_tokenizer import tokenizer_of_run

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""`--dtype` choices."""
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class ExportResult:
    out: Path
    """The directory written."""
    checkpoint: Path
    """The checkpoint exported (resolved from a checkpoints root if one was given)."""
    architecture: str
    """The transformers class, e.g. ``Qwen3MoeForCausalLM``."""
    files: list[str]
    """Names of the files written."""
    notes: list[str] = field(default_factory=list)
    """What was not written, and why (e.g. no tokenizer files)."""


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise MoeTrainError(
            "export needs the 'transformers' library: pip install 'moestack-train[hf]' "
            "(or pip install transformers)"
        ) from e
    return transformers


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    *,
    dtype: str = "float32",
    name: str | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> ExportResult:
    """Write `checkpoint` (or the newest under a checkpoints root) to `out` as a transformers
    model directory whose model card is titled `name` (default: the run's name); an
    ExportError (before anything is written) when no architecture transformers has computes
    exactly the same logits."""
    out = Path(out)
    _check_export_args(out, dtype, name)
    ckpt, trainer_state, config, stored, biases = _read_checkpoint(checkpoint)
    architecture = choose_architecture(config, any(bool(b.any()) for b in biases))
    transformers = _transformers()
    with_tokenizer, tokenizer_file, eos_id, notes = tokenizer_of_run(config)
    end_of_turn = None
    if tokenizer_file is not None:
        end_of_turn, why_none = tokenizer_end_of_turn(tokenizer_file)
        if why_none is not None:
            notes.append(f"generation_config.json names no end-of-turn token: {why_none}")
    generation_end = checkpoint_end_ids(trainer_state, eos_id, end_of_turn)
    depth = config.model.mtp_depth
    if depth:
        notes.append(
            f"the {depth} multi-token-prediction module(s) (model.mtp_depth={depth}) are left "
            f"out: {architecture.name} has no place for them, and the rest loads without them"
        )

    with written_whole(out, "export") as scratch:
        _write_weights(ckpt, stored, architecture, scratch, EXPORT_DTYPES[dtype], max_shard_bytes)
        _write_configs(transformers, architecture, dtype, eos_id, generation_end, scratch)
        if with_tokenizer:
            write_tokenizer(transformers, tokenizer_file, eos_id, scratch)
        title = run_name(config, ckpt) if name is None else name.strip()
        card = model_card(trainer_state, config, architecture.name, name=title)
        (scratch / "README.md").write_text(card)
    files = sorted(p.name for p in out.iterdir())
    return ExportResult(out, ckpt, architecture.name, files, notes)


def _check_export_args(out: Path, dtype: str, name: str | None) -> None:
    """Raise ExportError for a dtype, card name or output directory export cannot take."""
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"--dtype={dtype} must be one of {', '.join(EXPORT_DTYPES)}")
    if name is not None and (not name.strip() or len(name.splitlines()) != 1):
        raise ExportError(f"--name={name!r} must be a non-empty name on one line")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} already exists and is not an empty directory")


def _read_checkpoint(
    checkpoint: str | Path,
) -> tuple[Path, dict[str, Any], Config, dict[str, tuple[int, ...]], list[Tensor]]:
    """The checkpoint directory, its trainer state and config, its tensors' shapes and its
    routers' selection biases; a CheckpointError becomes a MoeTrainError."""
    try:
        ckpt = resolve_checkpoint(checkpoint)
        trainer_state = read_trainer_state(ckpt)
        config = config_from_dict(trainer_state["config"])
        stored = {
            name: tuple(t["shape"])
            for name, t in checkpoint_summary(ckpt, verify=False)["tensors"].items()
        }
        bias_names = [n for n in stored if n.endswith(".ffn.router.expert_bias")]
        biases = load_slices(ckpt, [SliceRequest.whole(n, stored[n]) for n in bias_names])
    except CheckpointError as e:
        raise MoeTrainError(str(e)) from e
    return ckpt, trainer_state, config, stored, biases


def _write_configs(
    transformers: Any,
    architecture: Architecture,
    dtype: str,
    eos_id: int | None,
    generation_end: list[int],
    scratch: Path,
) -> None:
    """Write config.json and generation_config.json for `architecture` into `scratch`."""
    hf_config = getattr(transformers, architecture.config_class)(
        **architecture.config_kwargs, eos_token_id=eos_id, bos_token_id=None, pad_token_id=None
    )
    hf_config.architectures = [architecture.name]
    hf_config.dtype = dtype
    hf_config.save_pretrained(scratch)
    transformers.GenerationConfig(
        eos_token_id=generation_eos(generation_end), pad_token_id=eos_id, do_sample=False
    ).save_pretrained(scratch)


def run_name(config: Config, ckpt: Path) -> str:
    """The name of the run directory checkpoint `ckpt` comes from: the last component of its
    train.run_dir, with the numbered suffix a taken one got when `ckpt` is still in that run
    directory's checkpoints folder."""
    configured = Path(config.train.run_dir).name or "model"
    folder = ckpt.resolve().parent
    if config.checkpoint.dir or checkpoint_root(config, folder.parent) != folder:
        return configured
    actual = folder.parent.name
    return actual if re.fullmatch(re.escape(configured) + r"(\.\d+)?", actual) else configured


def _write_weights(
    ckpt: Path,
    stored: dict[str, tuple[int, ...]],
    architecture: Architecture,
    directory: Path,
    dtype: torch.dtype,
    max_shard_bytes: int,
) -> None:
    """Shards of at most `max_shard_bytes` (a larger single tensor gets a shard of its own),
    reading one checkpoint tensor at a time."""
    from safetensors.torch import save_file

    def nbytes(t: HFTensor) -> int:
        element = 4 if t.keep_fp32 else torch.empty(0, dtype=dtype).element_size()
        return element * int(torch.Size(t.shape).numel())

    shards: list[list[HFTensor]] = [[]]
    size = 0
    for t in architecture.tensors:
        if shards[-1] and size + nbytes(t) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes(t)

    # The one source tensor (or expert row) read last: consecutive tensors cut from it reuse it.
    cached: tuple[tuple[str, int | None], Tensor] | None = None
    weight_map: dict[str, str] = {}
    total = 0
    for number, shard in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, Tensor] = {}
        for t in shard:
            if t.source is None:
                value = torch.zeros(t.shape)
            else:
                key = (t.source, t.row)
                if cached is None or cached[0] != key:
                    cached = (key, _read(ckpt, stored, t.source, t.row))
                value = t.take(cached[1])
            if tuple(value.shape) != t.shape:
                raise MoeTrainError(
                    f"{ckpt}: {t.source} gives {t.name} of shape {tuple(value.shape)}, "
                    f"expected {t.shape}"
                )
            tensors[t.name] = value.to(torch.float32 if t.keep_fp32 else dtype).contiguous()
            weight_map[t.name] = file
            total += nbytes(t)
        save_file(tensors, directory / file, metadata={"format": "pt"})
        give_umask_mode(directory / file)  # safetensors writes its files for the owner alone
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def _read(ckpt: Path, stored: dict[str, tuple[int, ...]], name: str, row: int | None) -> Tensor:
    """Checkpoint tensor `name`, or only its row `row` (one expert)."""
    if name not in stored:
        raise MoeTrainError(f"{ckpt} holds no tensor {name!r}")
    shape = stored[name]
    if row is None:
        request = SliceRequest.whole(name, shape)
    else:
        request = SliceRequest.rows(name, shape, row, row + 1)
    try:
        (tensor,) = load_slices(ckpt, [request])
    except CheckpointError as e:
        raise MoeTrainError(str(e)) from e
    return tensor if row is None else tensor[0]
