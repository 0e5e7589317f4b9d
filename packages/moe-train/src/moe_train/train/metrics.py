"""The metrics file (RUN_DIR/metrics.jsonl)."""

import json
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends one JSON object per logged step to a file, flushed as it goes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
