"""The training data's config: data.* and the weighted sources of data.mixture."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_data import split_dtype_suffix
from moe_plan.config.checks import _positive
from moe_plan.errors import ConfigError, DataError


@dataclass(kw_only=True)
class MixtureSourceConfig:
    paths: list[str] = field(default_factory=list)
    """The source's data, in the forms of data.paths; its windows are shuffled together."""
    weight: float | None = None
    """The source's share of the training tokens, relative to the other sources' weights
    (they are divided by their sum, so 0.7 and 0.3 or 7 and 3 mix alike)."""
    name: str | None = None
    """Its label in metrics.jsonl and checkpoints; null means its paths joined by '+'."""

    @property
    def label(self) -> str:
        """`name`, or the paths joined by '+'."""
        return self.name if self.name is not None else "+".join(self.paths)

    def validate(self, path: str) -> None:
        _check_paths(self.paths, path, "give the source's data paths")
        if self.weight is None:
            raise ConfigError(
                f"{path}.weight is missing; give the source's share of tokens, e.g. 0.3"
            )
        if not self.weight > 0 or self.weight == float("inf"):
            raise ConfigError(f"{path}.weight={self.weight} must be a positive number")
        if self.name is not None and not self.name:
            raise ConfigError(f"{path}.name is empty; give a label or null")


@dataclass(kw_only=True)
class DataConfig:
    paths: list[str] = field(default_factory=lambda: ["builtin:stdlib"])
    """Directories written by prepare-data, .npy token arrays, headerless token files named
    with their dtype (`path.npy:uint32`; also uint16, int32, int64: raw little-endian ids, as
    OLMo-core's and dolma's tooling write them), or builtin:stdlib (no download). With
    data.mixture, every path of its sources (filled in; leave it out)."""
    mixture: list[MixtureSourceConfig] = field(default_factory=list)
    """Sources mixed by weight (`[{paths: [...], weight: 0.7}, ...]`): each step takes that
    share of its sequences from each source; empty means data.paths shuffled as one."""
    seq_len: int = 256
    """Tokens per training sequence."""
    global_batch_size: int = 16
    """Sequences per optimizer step, over all ranks."""
    micro_batch_size: int = 8
    """Sequences per forward/backward pass; steps accumulate global/micro of them."""
    cache_dir: str | None = None
    """Where built-in data is tokenised on first use; null means ~/.cache/moe-stack."""
    prefetch: bool = True
    """Read the next step's sequences in a background thread while this step trains (each
    rank reads only those it trains on); false reads them at the start of the step."""
    document_masking: bool = False
    """Keep attention inside each document of a packed sequence (documents end at the data's
    end-of-document id, which prepare-data records): each document is trained on as if it
    ran alone, with memory linear in the sequence length (no S x S mask)."""
    label_mask: bool = False
    """Train only on the tokens the data's label mask marks (an assistant's replies: see
    `prepare-data --format chat`); every data path must have a mask, and so must eval.paths.
    The step's loss is the mean over the marked target tokens of the whole global batch.
    false trains on every token, mask or not. With it, sequences are packed from whole
    documents (conversations), padded with untrained end-of-document ids; add
    data.document_masking so that each attends only to itself."""
    split_long_examples: bool = False
    """With data.label_mask: cut a document longer than data.seq_len + 1 tokens into
    sequence-sized pieces; false skips it (the run's banner says how many were)."""

    def validate(self, path: str) -> None:
        if self.mixture:
            self._validate_mixture(path)
        _check_paths(self.paths, path, "give at least one data path")
        _positive(self, path, "seq_len", "global_batch_size", "micro_batch_size")
        if self.split_long_examples and not self.label_mask:
            raise ConfigError(
                f"{path}.split_long_examples=true applies to packed documents, which need "
                f"{path}.label_mask=true; set it or leave split_long_examples false"
            )
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"{path}.micro_batch_size={self.micro_batch_size} must divide "
                f"{path}.global_batch_size={self.global_batch_size}"
            )

    def validate_end_of_document(self, eos_id: int | None, path: str = "data") -> None:
        """The rules that need the opened data: `eos_id` is its end-of-document id, if any."""
        if self.document_masking and eos_id is None:
            raise DataError(
                f"{path}.document_masking=true needs documents that end at an end-of-document "
                f"id, but {path}.paths {', '.join(self.paths)} declare none; prepare the data "
                f"with moe-train prepare-data (it records the id) or set "
                f"{path}.document_masking=false"
            )

    def _validate_mixture(self, path: str) -> None:
        """Check the sources, and fill data.paths with their paths in order."""
        for index, source in enumerate(self.mixture):
            source.validate(f"{path}.mixture[{index}]")
        labels = [source.label for source in self.mixture]
        repeated = sorted({label for label in labels if labels.count(label) > 1})
        if repeated:
            raise ConfigError(
                f"{path}.mixture names the source {repeated[0]!r} twice; give each a unique name"
            )
        every_path = [entry for source in self.mixture for entry in source.paths]
        shared = sorted({entry for entry in every_path if every_path.count(entry) > 1})
        if shared:
            raise ConfigError(
                f"{path}.mixture lists {shared[0]!r} in more than one source; list each path once"
            )
        if self.paths not in (DataConfig().paths, [], every_path):
            raise ConfigError(
                f"{path}.paths={self.paths} and {path}.mixture are both set; with a mixture, "
                f"list every path in its sources and leave {path}.paths out"
            )
        self.paths = every_path


def _check_paths(paths: list[str], path: str, what_to_give: str) -> None:
    """ConfigError for an empty `paths` (saying `what_to_give`) or an entry whose dtype suffix
    is not one a token file can have."""
    if not paths:
        raise ConfigError(f"{path}.paths is empty; {what_to_give}")
    for index, entry in enumerate(paths):
        try:
            split_dtype_suffix(entry)
        except ValueError as e:
            raise ConfigError(f"{path}.paths[{index}]={entry!r}: {e}") from e
