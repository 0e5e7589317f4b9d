"""Who owns what: the pieces each rank passes, and the checked plan every rank derives.

Every rank describes its pieces as small tuples, the tuples of all ranks are gathered, and
every rank runs the same pure `plan_save` on the same gathered list. So every rank reaches the
same verdict (the same error, or the same file layout) without further communication.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import NamedTuple

from torch import Tensor

from moe_checkpoint.errors import CheckpointError
from moe_checkpoint.format import (
    FileLayout,
    TensorSpec,
    check_category,
    dtype_code,
    dtype_from_code,
    plan_files,
    stored_dtype,
)

Categories = Mapping[str, str] | Callable[[str], str]
"""The category (file-name prefix, e.g. ``model`` or ``optim``) of each tensor name."""


@dataclass(frozen=True)
class OwnedSlice:
    """Elements ``[flat_start, flat_start + data.numel())`` of the row-major flattening of the
    global tensor `name` of shape `global_shape`, held by this rank in `data` (any shape)."""

    name: str
    global_shape: tuple[int, ...]
    flat_start: int
    data: Tensor

    @classmethod
    def whole(cls, name: str, data: Tensor) -> OwnedSlice:
        """The whole tensor `name` is `data`."""
        return cls(name, tuple(data.shape), 0, data)

    @classmethod
    def rows(
        cls, name: str, global_shape: Sequence[int], row_start: int, data: Tensor
    ) -> OwnedSlice:
        """`data` holds rows ``row_start, row_start + 1, ...`` (along dim 0) of tensor `name`."""
        row_numel = prod(global_shape[1:])
        return cls(name, tuple(global_shape), row_start * row_numel, data)


class PieceInfo(NamedTuple):
    """What a rank tells the others about one of its slices (small and picklable)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    category: str
    flat_start: int
    numel: int


class Owner(NamedTuple):
    flat_start: int
    numel: int
    rank: int


@dataclass(frozen=True)
class SavePlan:
    """The checked layout of one save: tensors, files, and who owns which elements."""

    tensors: dict[str, TensorSpec]
    files: list[FileLayout]
    file_of: dict[str, int]
    """Tensor name -> index into `files`."""
    owners: dict[str, list[Owner]]
    """Tensor name -> its owned ranges, sorted by start."""
    world_size: int
    chunk_bytes: int
    """Each tensor's bytes are checksummed in chunks of this size."""

    def data_owners(self, file_index: int) -> set[int]:
        """The ranks that write data into a file."""
        return {
            owner.rank
            for name in self.files[file_index].byte_ranges
            for owner in self.owners[name]
            if owner.numel > 0
        }

    def hasher(self, file_index: int) -> int:
        """The rank that computes a file's checksums: its only writer, else
        ``index % world``."""
        writers = self.data_owners(file_index)
        return writers.pop() if len(writers) == 1 else file_index % self.world_size


def describe_slices(slices: Sequence[OwnedSlice], categories: Categories) -> list[PieceInfo]:
    """Check this rank's slices locally and describe them for the others."""
    pieces = []
    for piece in slices:
        if not isinstance(piece, OwnedSlice):
            raise CheckpointError(f"expected OwnedSlice, got {type(piece).__name__}")
        name = piece.name
        shape = tuple(int(n) for n in piece.global_shape)
        if any(n < 0 for n in shape):
            raise CheckpointError(f"tensor {name!r}: global_shape {list(shape)} is negative")
        try:
            category = categories(name) if callable(categories) else categories[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} has no category") from None
        numel = piece.data.numel()
        if piece.flat_start < 0 or piece.flat_start + numel > prod(shape):
            raise CheckpointError(
                f"tensor {name!r}: owned range [{piece.flat_start}, {piece.flat_start + numel}) "
                f"lies outside its {prod(shape)} elements (global_shape {list(shape)})"
            )
        dtype = dtype_code(stored_dtype(piece.data.dtype))
        pieces.append(
            PieceInfo(
                name, shape, dtype, check_category(category, name), int(piece.flat_start), numel
            )
        )
    return pieces


def plan_save(
    pieces_by_rank: Sequence[Sequence[PieceInfo]], max_file_bytes: int, chunk_bytes: int
) -> SavePlan:
    """Check that the ranks agree on every tensor and own each exactly once; lay out files."""
    tensors: dict[str, TensorSpec] = {}
    owners: dict[str, list[Owner]] = {}
    first_rank: dict[str, int] = {}
    for rank, pieces in enumerate(pieces_by_rank):
        for piece in pieces:
            spec = TensorSpec(piece.name, piece.shape, dtype_from_code(piece.dtype), piece.category)
            known = tensors.setdefault(piece.name, spec)
            first_rank.setdefault(piece.name, rank)
            if known != spec:
                raise CheckpointError(
                    f"tensor {piece.name!r}: rank {first_rank[piece.name]} declares "
                    f"{_describe(known)} but rank {rank} declares {_describe(spec)}"
                )
            owners.setdefault(piece.name, []).append(Owner(piece.flat_start, piece.numel, rank))
    for name, ranges in owners.items():
        ranges.sort()
        _check_exact_cover(name, ranges, tensors[name].numel)
    files = plan_files(list(tensors.values()), max_file_bytes)
    file_of = {name: i for i, layout in enumerate(files) for name in layout.byte_ranges}
    return SavePlan(tensors, files, file_of, owners, len(pieces_by_rank), chunk_bytes)


def _describe(spec: TensorSpec) -> str:
    return f"shape {list(spec.shape)} {dtype_code(spec.dtype)} category {spec.category!r}"


def _check_exact_cover(name: str, ranges: list[Owner], numel: int) -> None:
    covered_to = 0
    previous: Owner | None = None
    for owner in ranges:
        if owner.numel == 0:
            continue
        if owner.flat_start < covered_to:
            assert previous is not None
            raise CheckpointError(
                f"tensor {name!r}: ownership overlaps: rank {previous.rank} owns "
                f"[{previous.flat_start}, {previous.flat_start + previous.numel}) and rank "
                f"{owner.rank} owns [{owner.flat_start}, {owner.flat_start + owner.numel}) "
                f"of {numel} elements"
            )
        if owner.flat_start > covered_to:
            raise CheckpointError(
                f"tensor {name!r}: elements [{covered_to}, {owner.flat_start}) of {numel} "
                "are owned by no rank"
            )
        covered_to = owner.flat_start + owner.numel
        previous = owner
    if covered_to < numel:
        raise CheckpointError(
            f"tensor {name!r}: elements [{covered_to}, {numel}) of {numel} are owned by no rank"
        )
