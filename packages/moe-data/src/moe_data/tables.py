"""Parquet files and saved Hugging Face datasets (arrow streams): one document per row."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from moe_data.errors import DataError
from moe_data.inputs import InputFile
from moe_data.pieces import BATCH_DOCUMENTS, Piece, TextBatch


def pyarrow_module() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as e:
        raise DataError(
            "reading .parquet files and Hugging Face datasets needs pyarrow: "
            "pip install 'moestack-train[data]' (or 'moestack-data[formats]' without the trainer)"
        ) from e
    return pyarrow


def _string_column_index(schema: Any, source: InputFile, field: str) -> int:
    pa = pyarrow_module()
    index = schema.get_field_index(field)
    if index < 0:
        names = ", ".join(schema.names[:8])
        raise DataError(
            f"{source.path} has no column {field!r} (its columns: {names}); choose the text "
            "column with --text-field"
        )
    kind = schema.field(index).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(
            f"{source.path}: column {field!r} holds {kind}, not strings; choose the text column "
            "with --text-field"
        )
    return index


def parquet_row_groups(source: InputFile, field: str) -> list[tuple[int, int]]:
    """(rows, bytes of the text column) per row group; checks the file and the column."""
    pa = pyarrow_module()
    try:
        metadata = pa.parquet.ParquetFile(source.path).metadata
        _string_column_index(metadata.schema.to_arrow_schema(), source, field)
        groups = []
        for i in range(metadata.num_row_groups):
            group = metadata.row_group(i)
            size = sum(
                group.column(j).total_compressed_size
                for j in range(group.num_columns)
                if group.column(j).path_in_schema == field
            )
            groups.append((group.num_rows, size))
    except pa.ArrowException as e:
        raise DataError(f"{source.path} is not a readable parquet file ({e})") from e
    return groups


def arrow_record_batches(source: InputFile, field: str) -> list[tuple[int, int]]:
    """(rows, bytes of the text column) per record batch of a saved dataset's arrow file."""
    pa = pyarrow_module()
    try:
        with pa.memory_map(str(source.path)) as mapped:
            reader = pa.ipc.open_stream(mapped)
            index = _string_column_index(reader.schema, source, field)
            return [(batch.num_rows, batch.column(index).nbytes) for batch in reader]
    except pa.ArrowException as e:
        raise DataError(f"{source.path} is not a readable arrow stream ({e})") from e


def _column_texts(column: Any, source: InputFile, field: str, first_row: int) -> list[str]:
    texts = column.to_pylist()
    if column.null_count:
        row = first_row + texts.index(None)
        raise DataError(
            f"{source.path}: row {row} (counting from 0) has no {field!r} text (null); drop "
            "such rows or choose another column with --text-field"
        )
    return texts


def read_parquet(source: InputFile, piece: Piece, text_field: str) -> Iterator[TextBatch]:
    """The `text_field` column of `piece`'s row groups, a batch of rows at a time."""
    pa = pyarrow_module()
    try:
        parquet = pa.parquet.ParquetFile(source.path)
        groups = list(range(piece.start, piece.stop))
        rows_total = sum(parquet.metadata.row_group(i).num_rows for i in groups)
        batches = parquet.iter_batches(
            batch_size=BATCH_DOCUMENTS, row_groups=groups, columns=[text_field], use_threads=False
        )
        yield from _row_batches(batches, 0, source, piece, text_field, rows_total)
    except pa.ArrowException as e:
        raise DataError(f"{source.path} is not a readable parquet file ({e})") from e


def read_arrow(source: InputFile, piece: Piece, text_field: str) -> Iterator[TextBatch]:
    """The `text_field` column of `piece`'s record batches of a saved dataset's arrow file."""
    pa = pyarrow_module()
    try:
        with pa.memory_map(str(source.path)) as mapped:
            reader = pa.ipc.open_stream(mapped)
            index = _string_column_index(reader.schema, source, text_field)
            # Memory-mapped: skipping and holding batches reads no data.
            wanted = [b for number, b in enumerate(reader) if piece.start <= number < piece.stop]
            rows_total = sum(batch.num_rows for batch in wanted)
            yield from _row_batches(wanted, index, source, piece, text_field, rows_total)
    except pa.ArrowException as e:
        raise DataError(f"{source.path} is not a readable arrow stream ({e})") from e


def _row_batches(
    batches: Any, index: int, source: InputFile, piece: Piece, field: str, rows_total: int
) -> Iterator[TextBatch]:
    row = piece.first_row
    reported = 0
    for batch in batches:
        texts = _column_texts(batch.column(index), source, field, row)
        row += len(texts)
        done = piece.size * (row - piece.first_row) // max(rows_total, 1)
        yield TextBatch(texts, [True] * len(texts), done - reported)
        reported = done
